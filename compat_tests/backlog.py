"""A backlog larger than a queue's memory budget: publish with confirms, watch RSS, drain in order.

Shared by compat_tests/test_paging_backlog.py (a bounded count) and bench/backlog.py (the full
count, beside RabbitMQ). Bodies carry their sequence number in their first 8 bytes.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pika

from harness.node import ConfirmingPublisher, ConnectionLost

_SEQ = struct.Struct(">Q")


def seq_body(seq: int, size: int) -> bytes:
    return _SEQ.pack(seq).ljust(size, b"\xab")


def body_seq(body: bytes) -> int:
    return int(_SEQ.unpack_from(body)[0])


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


@dataclass
class PublishRun:
    published: int = 0
    confirmed: int = 0
    seconds: float = 0.0
    longest_wait: float = 0.0  # the longest time the publisher waited for any confirm progress
    blocked: bool = False  # connection.blocked or a closed connection
    close_reason: str | None = None
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, RSS bytes)
    confirmed_seqs: set[int] = field(default_factory=set)

    @property
    def rate(self) -> float:
        return self.confirmed / self.seconds if self.seconds else 0.0


async def publish_backlog(port: int, routing_key: str, count: int, size: int, delivery_mode: int,
                          pid: int | None = None, window: int = 4000, chunk: int = 500,
                          kill_after: int | None = None, kill: Callable[[], None] | None = None,
                          user: str = "guest", password: str = "guest", first: int = 1) -> PublishRun:
    """Publish ``count`` messages with confirms (``window`` outstanding at most), sampling ``pid``'s RSS.

    With ``kill_after``, ``kill()`` is called once that many are confirmed, and publishing goes
    on until the connection drops. Bodies carry sequence numbers from ``first``.
    """
    run = PublishRun()
    pub = ConfirmingPublisher()
    await pub.open("127.0.0.1", port, user, password)
    loop = asyncio.get_running_loop()
    start = loop.time()
    last_progress = start
    settled_before = 0
    next_sample = 0.0
    killed = False
    try:
        while pub.published < count or pub.outstanding:
            now = loop.time()
            if pid is not None and now - start >= next_sample and not killed:
                run.rss.append((now - start, rss_bytes(pid)))
                next_sample += 0.5
            if pub.settled != settled_before:
                settled_before = pub.settled
                run.longest_wait = max(run.longest_wait, now - last_progress)
                last_progress = now
            if kill_after is not None and not killed and pub.settled >= kill_after and kill is not None:
                kill()
                killed = True
            if pub.closed.is_set():
                break
            room = min(window - pub.outstanding, count - pub.published)
            if room <= 0:
                await pub.wait_progress(0.2)
                continue
            for _ in range(min(chunk, room)):
                pub.publish("", routing_key, seq_body(pub.published + first, size), delivery_mode)
            try:
                await pub.flush()
            except ConnectionLost:
                break
            await asyncio.sleep(0)
        run.longest_wait = max(run.longest_wait, loop.time() - last_progress)
        run.seconds = loop.time() - start
    finally:
        run.close_reason = pub.close_reason
        await pub.close()
    run.published = pub.published
    run.confirmed_seqs = {seq + first - 1 for seq in pub.acked()}
    run.confirmed = len(run.confirmed_seqs)
    run.blocked = any("blocked" in a.lower() for a in pub.anomalies)
    return run


@dataclass
class DrainRun:
    seqs: list[int] = field(default_factory=list)
    redelivered: list[bool] = field(default_factory=list)
    seconds: float = 0.0
    rss: list[tuple[float, int]] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return len(self.seqs) / self.seconds if self.seconds else 0.0


def drain(url: str, queue: str, expect: int, pid: int | None = None, prefetch: int = 2000,
          idle: float = 5.0) -> DrainRun:
    """Consume (manual acks, multiple every 500) until ``expect`` arrived or nothing came for ``idle`` s."""
    run = DrainRun()
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=prefetch)
        start = time.monotonic()
        next_sample = 0.0
        last_tag = 0
        for method, _props, body in ch.consume(queue, inactivity_timeout=idle):
            if method is None:
                break
            run.seqs.append(body_seq(body))
            run.redelivered.append(bool(method.redelivered))
            last_tag = method.delivery_tag
            if last_tag % 500 == 0:
                ch.basic_ack(last_tag, multiple=True)
                now = time.monotonic() - start
                if pid is not None and now >= next_sample:
                    run.rss.append((now, rss_bytes(pid)))
                    next_sample += 0.5
            if len(run.seqs) >= expect:
                break
        run.seconds = time.monotonic() - start
        if last_tag % 500:
            ch.basic_ack(last_tag, multiple=True)
        ch.cancel()
    finally:
        conn.close()
    return run
