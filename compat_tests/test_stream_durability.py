"""Streams across a kill -9 and restart, on both stores: the log, its retention, group offsets.

A stream stores every message (transient ones too, as RabbitMQ does); a
consumer group's committed offset is written by the group committer in
the same FIFO as publishes, so the confirm of a publish made after the acks
proves the offset is stored.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest
from pika.adapters.blocking_connection import BlockingChannel

from compat_tests.test_durability import (  # noqa: F401  (fixtures: a node on each store)
    durability_postgres,
    fresh_database,
    store_args,
)
from harness.node import NodeProcess

pytestmark = pytest.mark.timeout(90)

STREAM = {"x-queue-type": "stream"}
GROUP = "x-stream-consumer-group"


@pytest.fixture
def stream_node(tmp_path: Path, store_args: list[str]) -> Iterator[NodeProcess]:  # noqa: F811
    n = NodeProcess(tmp_path / "data", tmp_path / "logs", store_args)
    try:
        yield n
    finally:
        n.cleanup()


@contextlib.contextmanager
def session(node: NodeProcess) -> Iterator[tuple[pika.BlockingConnection, BlockingChannel]]:
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        yield conn, ch
    finally:
        if conn.is_open:
            with contextlib.suppress(pika.exceptions.AMQPError):
                conn.close()


def read(conn: pika.BlockingConnection, ch: BlockingChannel, queue: str, n: int, ack: int | None = None,
         **arguments: Any) -> list[tuple[int, bytes]]:
    """Consume until ``n`` deliveries (or 5 s), acking the first ``ack`` of them in order."""
    got: list[tuple[int, bytes, int]] = []
    ch.basic_qos(prefetch_count=max(n, 1))
    ch.basic_consume(queue, lambda c, m, p, b: got.append((p.headers["x-stream-offset"], b, m.delivery_tag)),
                     arguments=arguments)
    deadline = time.monotonic() + 5
    while len(got) < n and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    conn.process_data_events(time_limit=0.2)
    for _, _, tag in got[: ack if ack is not None else len(got)]:
        ch.basic_ack(tag)
    return [(o, b) for o, b, _ in got]


def test_stream_log_retention_and_group_offset_survive_kill(stream_node: NodeProcess) -> None:
    node = stream_node
    node.start()
    log, trimmed = f"stream.log.{uuid.uuid4().hex[:8]}", f"stream.trim.{uuid.uuid4().hex[:8]}"
    with session(node) as (conn, ch):
        ch.queue_declare(log, durable=True, arguments=STREAM)
        ch.queue_declare(trimmed, durable=True, arguments={**STREAM, "x-max-length-bytes": 1000})
        for i in range(10):
            mode = 2 if i % 2 else 1  # a stream keeps transient messages too
            ch.basic_publish("", log, b"m%d" % i, pika.BasicProperties(delivery_mode=mode))
        for i in range(30):
            ch.basic_publish("", trimmed, bytes([48 + i % 10]) * 100, pika.BasicProperties(delivery_mode=2))
        reader = conn.channel()
        assert [o for o, _ in read(conn, reader, log, 6, ack=4, **{GROUP: "g", "x-stream-offset": "first"})] == [
            0, 1, 2, 3, 4, 5]
        # Commits are FIFO: once this is confirmed, the acks before it (offset 3) are stored.
        ch.basic_publish("", log, b"barrier", pika.BasicProperties(delivery_mode=2))
    node.kill()
    node.start()
    with session(node) as (conn, ch):
        assert ch.queue_declare(log, passive=True).method.message_count == 11
        assert ch.queue_declare(trimmed, passive=True).method.message_count == 10
        group = read(conn, conn.channel(), log, 7, **{GROUP: "g", "x-stream-offset": "first"})
        assert group == [(i, b"m%d" % i) for i in range(4, 10)] + [(10, b"barrier")]
        kept = read(conn, conn.channel(), trimmed, 10, **{"x-stream-offset": "first"})
        assert [o for o, _ in kept] == list(range(20, 30))
        # Offsets go on from where they were.
        ch.basic_publish("", log, b"after", pika.BasicProperties(delivery_mode=2))
        latest = read(conn, conn.channel(), log, 1, **{"x-stream-offset": "last"})
        assert latest == [(11, b"after")]


def test_reading_past_the_memory_window_from_the_store(tmp_path: Path, store_args: list[str]) -> None:  # noqa: F811
    """With 4 kB of a stream in memory, older offsets are read back from the store, in order, also after kill -9."""
    node = NodeProcess(tmp_path / "data", tmp_path / "logs", [*store_args, "--stream-memory-bytes", "4000"])
    try:
        node.start()
        log = f"stream.paged.{uuid.uuid4().hex[:8]}"
        expected = [(i, b"%04d" % i + b"." * 96) for i in range(300)]
        with session(node) as (conn, ch):
            ch.queue_declare(log, durable=True, arguments=STREAM)
            for _, body in expected:
                ch.basic_publish("", log, body, pika.BasicProperties(delivery_mode=2))
            assert read(conn, conn.channel(), log, 300, **{"x-stream-offset": "first"}) == expected
            assert read(conn, conn.channel(), log, 150, **{"x-stream-offset": 150}) == expected[150:]
        node.kill()
        node.start()
        with session(node) as (conn, ch):
            assert ch.queue_declare(log, passive=True).method.message_count == 300
            assert read(conn, conn.channel(), log, 300, **{"x-stream-offset": "first"}) == expected
    finally:
        node.cleanup()
