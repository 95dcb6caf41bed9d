"""A node whose wall clock is stepped (+1 day, then back) while it runs, as an NTP step does.

The node runs under libfaketime (bench/chaos_clock.py: only the wall clock
moves, never the monotonic one, as in a real step). Message TTLs must measure
real elapsed time: a step forward must not expire every message at once (as
RabbitMQ does: it compares expiries with the OS wall clock), a step back must not
hold expired messages for the size of the step; heartbeats keep the connection.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest

from bench import chaos_clock
from bench.chaos_check import log_time
from harness.node import NodeProcess

DAY = 86400.0

pytestmark = pytest.mark.skipif(not chaos_clock.available(),
                                reason=f"{chaos_clock.LIBFAKETIME} missing (Debian package faketime)")


@pytest.fixture
def faked(tmp_path: Path) -> Iterator[tuple[NodeProcess, chaos_clock.FakeClock]]:
    node = NodeProcess(tmp_path / "data", tmp_path / "logs")
    clock = chaos_clock.FakeClock(tmp_path / "faketime")
    node.extra_env = clock.env()
    try:
        node.start()
        yield node, clock
    finally:
        node.cleanup()


def _count(ch: pika.adapters.blocking_connection.BlockingChannel, queue: str) -> int:
    return int(ch.queue_declare(queue, passive=True).method.message_count)


def _opened_at(node: NodeProcess) -> list[float]:
    """When the node says it opened each connection (its faked wall clock)."""
    out = []
    for line in node.stderr_path.read_text(errors="replace").splitlines():
        if '"connection opened"' in line:
            out.append(log_time(json.loads(line)["ts"]))
    return out


def test_wall_clock_steps_neither_expire_nor_hold_messages(
        faked: tuple[NodeProcess, chaos_clock.FakeClock]) -> None:
    node, clock = faked
    conn = pika.BlockingConnection(pika.URLParameters(node.url + "?heartbeat=2"))
    try:
        ch = conn.channel()
        ch.queue_declare("long", arguments={"x-message-ttl": 60_000})
        ch.queue_declare("short", arguments={"x-message-ttl": 1_000})
        for i in range(10):
            ch.basic_publish("", "long", f"m{i}".encode())

        clock.step(DAY)
        conn.sleep(chaos_clock.CACHE_S + 0.5)
        pika.BlockingConnection(pika.URLParameters(node.url)).close()
        # The step took effect in the node's Python: it stamps the new connection a day ahead.
        assert any(t > time.time() + DAY - 60 for t in _opened_at(node)), _opened_at(node)

        # A day forward: messages with a minute to live are not expired (basic.get checks expiry first).
        got = ch.basic_get("long", auto_ack=True)
        assert got[0] is not None, "the 60 s TTL messages expired on a step of the wall clock"
        assert _count(ch, "long") == 9
        # ... and a one-second TTL still fires after about a second.
        for i in range(5):
            ch.basic_publish("", "short", f"s{i}".encode())
        conn.sleep(2.5)
        assert _count(ch, "short") == 0

        # A day back: messages given three seconds to live while the clock was ahead
        # still expire about three seconds later, not a day later.
        ch.queue_declare("mid", arguments={"x-message-ttl": 3_000})
        for i in range(5):
            ch.basic_publish("", "mid", f"b{i}".encode())
        clock.step(0.0)
        conn.sleep(3.0 + chaos_clock.CACHE_S + 1.0)
        assert _count(ch, "mid") == 0, "a step back held three-second TTL messages"
        assert ch.basic_get("mid", auto_ack=True)[0] is None
        assert _count(ch, "long") == 9
        # Heartbeats every 2 s on the node's monotonic clock: the connection lived through both steps.
        assert conn.is_open
    finally:
        if conn.is_open:
            conn.close()
