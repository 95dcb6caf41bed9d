"""The chaos suite's full-disk scenario: one node on the embedded store (SQLite) runs out of room.

No root is needed for a small filesystem: the node's file-size limit
(RLIMIT_FSIZE, set on the running process with prlimit) stands for the disk.
A write past it fails with EFBIG (Python ignores SIGXFSZ), as a write to a
full disk fails with ENOSPC, and the store sees an I/O error either way. The
node's log file (its stderr) is under the same limit, as on a real full disk.

The scenario: confirmed publishes of 4 KiB persistent messages until the
store refuses them (nacks, or the connection closed) or the data written passes
three times the limit; the limit is lifted (space freed); publishing must
confirm again; every confirmed message must then be consumed, and the node
must not have exited. If it did exit, it is started again without a limit and
the confirmed messages must still be there.
"""

from __future__ import annotations

import contextlib
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import pika
import pika.exceptions

from harness.node import NodeProcess

BODY = 4096
QUEUE = "chaos-disk"
FILL_TIMEOUT = 60.0


@dataclass
class DiskResult:
    limit_bytes: int
    confirmed: set[int] = field(default_factory=set)
    refused: int = 0  # nacked or lost with the connection while the disk was full
    first_refusal_after: int = 0  # confirmed messages before the first refusal
    confirmed_after_freed: int = 0
    delivered: set[int] = field(default_factory=set)
    node_exited: str = ""
    violations: list[str] = field(default_factory=list)
    log_lines_at_full: int = 0


def _connect(node: NodeProcess) -> pika.adapters.blocking_connection.BlockingChannel:
    conn = pika.BlockingConnection(pika.URLParameters(node.url + "?heartbeat=0&blocked_connection_timeout=10"))
    ch = conn.channel()
    ch.confirm_delivery()
    return ch


def _publish(ch: pika.adapters.blocking_connection.BlockingChannel, seq: int) -> None:
    ch.basic_publish("", QUEUE, str(seq).encode().ljust(BODY, b"."),
                     pika.BasicProperties(delivery_mode=2, message_id=str(seq)), mandatory=True)


def run_disk(workdir: Path, limit_mb: float = 16.0) -> DiskResult:
    limit = int(limit_mb * 1024 * 1024)
    res = DiskResult(limit)
    node = NodeProcess(workdir / "data", workdir / "logs")
    node.start()
    try:
        resource.prlimit(node.pid, resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))  # soft: liftable
        ch = _connect(node)
        ch.queue_declare(QUEUE, durable=True)
        seq = 0
        deadline = time.monotonic() + FILL_TIMEOUT
        # Fill: until refusals (a few in a row) or well past the limit.
        streak = 0
        while time.monotonic() < deadline and streak < 5 and seq * BODY < 3 * limit:
            seq += 1
            try:
                _publish(ch, seq)
                res.confirmed.add(seq)
                streak = 0
            except (pika.exceptions.NackError, pika.exceptions.UnroutableError):
                res.refused += 1
                streak += 1
            except pika.exceptions.AMQPError:
                res.refused += 1
                streak += 1
                if not node.running():
                    break
                with contextlib.suppress(pika.exceptions.AMQPError):
                    ch = _connect(node)
            if res.refused == 1 and not res.first_refusal_after:
                res.first_refusal_after = len(res.confirmed)
        res.log_lines_at_full = len(node.stderr_tail(10**9).splitlines())
        if not node.running():
            res.node_exited = f"exited with {node.proc.returncode if node.proc else '?'}: {node.stderr_tail(800)}"
            node.start()  # no limit this time
        else:
            resource.prlimit(node.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        # Freed: publishing must confirm again (a reconnect allowed).
        deadline = time.monotonic() + 30
        while res.confirmed_after_freed < 100 and time.monotonic() < deadline:
            seq += 1
            try:
                _publish(ch, seq)
                res.confirmed.add(seq)
                res.confirmed_after_freed += 1
            except pika.exceptions.AMQPError:
                time.sleep(0.2)
                with contextlib.suppress(pika.exceptions.AMQPError):
                    ch = _connect(node)
        if res.confirmed_after_freed < 100:
            res.violations.append(f"only {res.confirmed_after_freed} publishes confirmed within 30 s of the space "
                                  "being freed")
        # Drain.
        with contextlib.suppress(pika.exceptions.AMQPError):
            ch.connection.close()
        ch = _connect(node)
        while True:
            method, _props, body = ch.basic_get(QUEUE, auto_ack=True)
            if method is None:
                break
            res.delivered.add(int(body.split(b".", 1)[0]))
        lost = sorted(res.confirmed - res.delivered)
        if lost:
            res.violations.append(f"{len(lost)} confirmed messages lost, e.g. seq {lost[:5]}")
        if res.node_exited:
            res.violations.append(f"node exited at full disk: {res.node_exited}")
        if not node.running():
            res.violations.append("node not running at the end")
        ch.connection.close()
    finally:
        node.cleanup()
    return res


def report_lines(res: DiskResult) -> list[str]:
    return [
        f"- full disk (single node, SQLite, a {res.limit_bytes / 1048576:g} MiB file-size limit): "
        f"{res.first_refusal_after} confirmed before the first refusal, {res.refused} publishes refused while full, "
        f"{res.confirmed_after_freed} confirmed after the space was freed, {len(res.delivered)} delivered "
        f"of {len(res.confirmed)} confirmed ({len(res.delivered - res.confirmed)} of them refused yet delivered); "
        f"node {'exited: ' + res.node_exited[:200] if res.node_exited else 'stayed up'}; "
        f"violations {len(res.violations)}",
        *(f"  - disk: {v}" for v in res.violations),
    ]
