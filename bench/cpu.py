"""Who used the CPUs during a run: the broker, this client, or something else.

The broker and the client share a small machine, so another busy process
silently skews every figure; recording the split makes such runs visible.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from bench.memory import PROC, descendants, pid_listening_on
from bench.target import Target

TICK = os.sysconf("SC_CLK_TCK")


def _machine_busy_ticks() -> int:
    fields = [int(x) for x in (PROC / "stat").read_text().split("\n", 1)[0].split()[1:]]
    # user nice system idle iowait irq softirq steal ...: everything but idle and iowait.
    return sum(fields) - fields[3] - fields[4]


def _proc_ticks(pid: int) -> int:
    try:
        rest = (PROC / str(pid) / "stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0
    return int(rest[11]) + int(rest[12])  # utime + stime


def _tree_ticks(pid: int) -> int:
    return sum(_proc_ticks(p) for p in descendants(pid))


def broker_pid_of(target: Target) -> int | None:
    """The broker's PID from --pid, else whoever listens on the URL's port (None if unknown)."""
    if target.pid and target.pid != "auto":
        return int(target.pid)
    return pid_listening_on(target.url.port)


@dataclass(frozen=True)
class CpuSplit:
    broker: float | None  # CPUs (CPU-seconds per second); None when the broker PID is unknown
    client: float
    other: float | None


class CpuWatch:
    """Call :meth:`start` and :meth:`stop` around the measured window."""

    def __init__(self, broker_pid: int | None) -> None:
        self.broker_pid = broker_pid
        self._start = self._sample()

    def start(self) -> None:
        self._start = self._sample()

    def _sample(self) -> tuple[float, int, int, int]:
        broker = _tree_ticks(self.broker_pid) if self.broker_pid else 0
        # This process plus its live worker processes.
        return time.monotonic(), _machine_busy_ticks(), broker, _tree_ticks(os.getpid())

    def stop_dict(self) -> dict[str, float | None]:
        split = self.stop()
        return {"broker": split.broker, "client": split.client, "other": split.other}

    def stop(self) -> CpuSplit:
        t0, busy0, broker0, own0 = self._start
        t1, busy1, broker1, own1 = self._sample()
        per_s = 1.0 / ((t1 - t0) * TICK)
        client = (own1 - own0) * per_s
        if not self.broker_pid:
            return CpuSplit(None, round(client, 2), None)
        broker = (broker1 - broker0) * per_s
        other = max(0.0, (busy1 - busy0) * per_s - broker - client)
        return CpuSplit(round(broker, 2), round(client, 2), round(other, 2))
