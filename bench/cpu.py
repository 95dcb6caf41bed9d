"""Who used the CPUs during a run: the broker, this client, the kernel, or something else.

The broker and the client share a small machine, so another busy process
silently skews every figure; recording the split makes such runs visible.
Kernel work (interrupts, softirq network processing, writeback/journal
threads flushing a broker's files) is reported apart from foreign processes:
persistent scenarios legitimately cause a lot of it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from bench.memory import PROC, descendants, pid_listening_on
from bench.target import Target

TICK = os.sysconf("SC_CLK_TCK")
KTHREADD = 2  # parent of every kernel thread


@dataclass(frozen=True)
class _Sample:
    when: float
    busy: int  # all non-idle ticks on the machine
    irq: int  # interrupt + softirq ticks (not charged to any process)
    broker: int
    client: int
    kthreads: int


def _machine_ticks() -> tuple[int, int]:
    # user nice system idle iowait irq softirq steal [guest guest_nice: already inside user/nice]
    f = [int(x) for x in (PROC / "stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(f) - f[3] - f[4], f[5] + f[6]


def _proc_ticks(pid: int) -> int:
    try:
        rest = (PROC / str(pid) / "stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0
    return int(rest[11]) + int(rest[12])  # utime + stime, all threads


def _tree_ticks(pid: int) -> int:
    return sum(_proc_ticks(p) for p in descendants(pid))


def broker_pid_of(target: Target) -> int | None:
    """The broker's PID from --pid, else whoever listens on the URL's port (None if unknown)."""
    if target.pid and target.pid != "auto":
        return int(target.pid)
    return pid_listening_on(target.url.port)


class CpuWatch:
    """Call :meth:`start` and :meth:`stop_dict` around the measured window."""

    def __init__(self, broker_pid: int | None, client_pids: list[int] | None = None) -> None:
        self.broker_pid = broker_pid
        # The client's worker processes, when this process has other children (a cluster's nodes)
        # that must not count as client: then the client is this process and those trees only.
        self.client_pids = client_pids
        self._start = self._sample()

    def _client_ticks(self) -> int:
        if self.client_pids is None:
            return _tree_ticks(os.getpid())  # this process and its live worker processes
        return _proc_ticks(os.getpid()) + sum(_tree_ticks(p) for p in self.client_pids)

    def _sample(self) -> _Sample:
        busy, irq = _machine_ticks()
        return _Sample(
            when=time.monotonic(),
            busy=busy,
            irq=irq,
            broker=_tree_ticks(self.broker_pid) if self.broker_pid else 0,
            client=self._client_ticks(),
            kthreads=_tree_ticks(KTHREADD),
        )

    def start(self) -> None:
        self._start = self._sample()

    def stop_dict(self) -> dict[str, float | None]:
        """CPUs (CPU-seconds per second) used by broker, client, kernel and other processes.

        broker and other are None when the broker's PID is unknown.
        """
        a, b = self._start, self._sample()
        per_s = 1.0 / ((b.when - a.when) * TICK)
        client = (b.client - a.client) * per_s
        kernel = (b.irq - a.irq + b.kthreads - a.kthreads) * per_s
        out: dict[str, float | None] = {"broker": None, "client": round(client, 2), "kernel": round(kernel, 2),
                                        "other": None}
        if self.broker_pid:
            broker = (b.broker - a.broker) * per_s
            out["broker"] = round(broker, 2)
            out["other"] = round(max(0.0, (b.busy - a.busy) * per_s - broker - client - kernel), 2)
        return out
