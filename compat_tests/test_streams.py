"""Stream queues over AMQP with pika, as RabbitMQ serves them (docs/STREAMS.md).

Declaration rules, offsets of every kind in ``x-stream-offset``, the offset
header on each delivery, credit-only acks, retention by size and age, and
consumer groups (``x-stream-consumer-group``) that resume after a reconnect
and share the work one active member at a time.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from typing import Any

import pika
import pika.exceptions
import pytest
from pika.adapters.blocking_connection import BlockingChannel

from compat_tests.util import Names, channel_error, connection_error, drain, wait_until

Connect = Callable[..., pika.BlockingConnection]
# Against another broker (LEVERET_TEST_AMQP_URL): consumer groups are a Leveret extension, and
# RabbitMQ applies retention per segment file (never to the segment being written), not per message.
EXTERNAL = bool(os.environ.get("LEVERET_TEST_AMQP_URL"))
leveret_only = pytest.mark.skipif(EXTERNAL, reason="Leveret behaviour: consumer groups, per-message retention")


def message_count(ch: BlockingChannel, queue: str) -> int | None:
    """The stream's length from queue.declare-ok; None on RabbitMQ, which reports it from lagging metrics."""
    n = ch.queue_declare(queue, passive=True).method.message_count
    return None if EXTERNAL else n
STREAM = {"x-queue-type": "stream"}


def declare_stream(ch: BlockingChannel, name: str, **args: Any) -> None:
    ch.queue_declare(name, durable=True, arguments={**STREAM, **args})


def publish(ch: BlockingChannel, queue: str, bodies: list[bytes], headers: dict[str, Any] | None = None) -> None:
    ch.confirm_delivery()
    for body in bodies:
        ch.basic_publish("", queue, body, pika.BasicProperties(headers=headers))


class Reader:
    """A stream consumer that records (offset header, body) and acks as told."""

    def __init__(self, ch: BlockingChannel, queue: str, prefetch: int = 100, auto_settle: bool = True,
                 **arguments: Any) -> None:
        self.ch = ch
        self.got: list[tuple[int, bytes]] = []
        self.tags: list[int] = []
        self.auto_settle = auto_settle
        ch.basic_qos(prefetch_count=prefetch)
        self.tag = ch.basic_consume(queue, self._on_message, arguments=arguments or None)

    def _on_message(self, ch: BlockingChannel, method: Any, props: pika.BasicProperties, body: bytes) -> None:
        headers = props.headers or {}
        self.got.append((headers["x-stream-offset"], body))
        self.tags.append(method.delivery_tag)
        if self.auto_settle:
            ch.basic_ack(method.delivery_tag)

    def wait(self, n: int, timeout: float = 5.0) -> list[tuple[int, bytes]]:
        assert wait_until(self.ch.connection, lambda: len(self.got) >= n, timeout), (
            f"expected {n} deliveries, got {len(self.got)}: {self.got[:5]}"
        )
        return self.got

    def offsets(self) -> list[int]:
        return [o for o, _ in self.got]


def bodies(n: int, prefix: str = "m") -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(n)]


# -- declaration ---------------------------------------------------------------------------------
def test_declare_stream_reports_its_messages(channel: BlockingChannel, names: Names) -> None:
    q = names.queue()
    declare_stream(channel, q, **{"x-max-age": "7D", "x-max-length-bytes": 10_000_000,
                                  "x-stream-max-segment-size-bytes": 500_000})
    publish(channel, q, bodies(3))
    assert message_count(channel, q) in (3, None)
    # Equivalent redeclare is fine; a different type is not.
    declare_stream(channel, q, **{"x-max-age": "7D", "x-max-length-bytes": 10_000_000,
                                  "x-stream-max-segment-size-bytes": 500_000})
    with channel_error(406, "inequivalent arg"):
        channel.queue_declare(q, durable=True)


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"durable": False}, "non-durable"),
        ({"durable": True, "exclusive": True}, "exclusive"),
        ({"durable": True, "auto_delete": True}, "auto-delete"),
    ],
)
def test_stream_must_be_durable_and_shared(connect: Connect, names: Names, kwargs: dict[str, bool],
                                           text: str) -> None:
    ch = connect().channel()
    with channel_error(406, text):
        ch.queue_declare(names.queue(), arguments=STREAM, **kwargs)


@pytest.mark.parametrize(
    "args",
    [{"x-message-ttl": 1000}, {"x-max-length": 10}, {"x-dead-letter-exchange": "dlx"}, {"x-max-age": "7days"},
     {"x-max-age": 5}, {"x-max-length-bytes": -1}],
)
def test_stream_refuses_arguments_it_cannot_honour(connect: Connect, names: Names, args: dict[str, Any]) -> None:
    ch = connect().channel()
    with channel_error(406):
        declare_stream(ch, names.queue(), **args)


# -- consuming: RabbitMQ's rules ----------------------------------------------------------------------
def test_consume_needs_prefetch(connect: Connect, names: Names) -> None:
    ch = connect().channel()
    q = names.queue()
    declare_stream(ch, q)
    with channel_error(406, "consumer prefetch count is not set"):
        ch.basic_consume(q, lambda *a: None)


def test_no_ack_consume_and_basic_get_are_not_implemented(connect: Connect, names: Names) -> None:
    ch = connect().channel()
    q = names.queue()
    declare_stream(ch, q)
    ch.basic_qos(prefetch_count=10)
    with connection_error(540, "automatic acknowledgement not supported"):
        ch.basic_consume(q, lambda *a: None, auto_ack=True)
    ch = connect().channel()
    with connection_error(540, "basic.get not supported"):
        ch.basic_get(q)


@pytest.mark.skipif(EXTERNAL, reason="RabbitMQ 3.10 answers a bad x-stream-offset with 541; 4.x with 406")
def test_bad_offset_argument_is_refused(connect: Connect, names: Names) -> None:
    ch = connect().channel()
    q = names.queue()
    declare_stream(ch, q)
    ch.basic_qos(prefetch_count=10)
    with channel_error(406, "x-stream-offset"):
        ch.basic_consume(q, lambda *a: None, arguments={"x-stream-offset": "yesterday"})


# -- offsets ----------------------------------------------------------------------------------------------
def test_read_from_first_is_repeatable_and_carries_offsets(connect: Connect, names: Names) -> None:
    conn = connect()
    ch = conn.channel()
    q = names.queue()
    declare_stream(ch, q)
    publish(ch, q, bodies(10), headers={"app": "x"})
    first = Reader(ch, q, **{"x-stream-offset": "first"})
    assert first.wait(10) == [(i, f"m{i}".encode()) for i in range(10)]
    # Reading does not consume: a second reader sees the same log, and so does the first later.
    ch2 = conn.channel()
    again = Reader(ch2, q, **{"x-stream-offset": "first"})
    assert again.wait(10) == first.got
    assert message_count(ch, q) in (10, None)


@pytest.mark.parametrize(
    ("offset", "expected"),
    [(0, list(range(6))), (4, [4, 5]), (6, []), ("last", [5]), ("next", []), ("first", list(range(6)))],
)
def test_offset_kinds(connect: Connect, names: Names, offset: Any, expected: list[int]) -> None:
    conn = connect()
    ch = conn.channel()
    q = names.queue()
    declare_stream(ch, q)
    publish(ch, q, bodies(6))
    r = Reader(ch, q, **{"x-stream-offset": offset})
    drain(conn, 0.3)
    assert r.offsets() == expected
    # Whatever the start, a reader follows the log as it grows.
    publish(ch, q, [b"later"])
    r.wait(len(expected) + 1)
    assert r.got[-1] == (6, b"later")


def test_offset_past_the_end_waits_for_it(connect: Connect, names: Names) -> None:
    """As RabbitMQ: a reader at offset 8 of a 6-message stream gets nothing until offset 8 exists."""
    conn = connect()
    ch = conn.channel()
    q = names.queue()
    declare_stream(ch, q)
    publish(ch, q, bodies(6))
    r = Reader(ch, q, **{"x-stream-offset": 8})
    publish(ch, q, [b"six", b"seven"])
    drain(conn, 0.5)
    assert r.got == []
    publish(ch, q, [b"eight"])
    r.wait(1)
    assert r.got == [(8, b"eight")]


def test_timestamp_and_interval_offsets(connect: Connect, names: Names) -> None:
    conn = connect()
    ch = conn.channel()
    q = names.queue()
    declare_stream(ch, q)
    publish(ch, q, bodies(3, "old"))
    time.sleep(1.1)  # AMQP timestamps have a resolution of one second
    cut = datetime.datetime.now(tz=datetime.UTC)
    time.sleep(0.1)
    publish(ch, q, bodies(2, "new"))
    r = Reader(ch, q, **{"x-stream-offset": cut})
    r.wait(2)
    drain(conn, 0.2)
    assert [b for _, b in r.got] == [b"new0", b"new1"]
    recent = Reader(conn.channel(), q, **{"x-stream-offset": "1h"})
    recent.wait(5)
    assert recent.offsets() == [0, 1, 2, 3, 4]


def test_offset_header_joins_publisher_headers(connect: Connect, names: Names) -> None:
    conn = connect()
    ch = conn.channel()
    q = names.queue()
    declare_stream(ch, q)
    ch.basic_publish("", q, b"a", pika.BasicProperties(content_type="text/plain", content_encoding="utf-8",
                                                       headers={"k": "v"}, message_id="id-1", delivery_mode=2))
    ch.basic_publish("", q, b"b", pika.BasicProperties(content_type="text/plain", message_id="id-2"))
    seen: list[pika.BasicProperties] = []
    ch.basic_qos(prefetch_count=10)
    ch.basic_consume(q, lambda c, m, p, b: seen.append(p), arguments={"x-stream-offset": "first"})
    assert wait_until(conn, lambda: len(seen) == 2)
    assert seen[0].headers == {"k": "v", "x-stream-offset": 0}
    assert (seen[0].content_type, seen[0].content_encoding, seen[0].message_id) == ("text/plain", "utf-8", "id-1")
    assert seen[1].headers == {"x-stream-offset": 1}
    assert (seen[1].content_type, seen[1].message_id) == ("text/plain", "id-2")


def test_acks_move_credit_not_data(connect: Connect, names: Names) -> None:
    conn = connect()
    ch = conn.channel()
    q = names.queue()
    declare_stream(ch, q)
    publish(ch, q, bodies(5))
    r = Reader(ch, q, prefetch=2, auto_settle=False, **{"x-stream-offset": "first"})
    drain(conn, 0.3)
    assert r.offsets() == [0, 1]
    ch.basic_ack(r.tags[0])
    r.wait(3)
    drain(conn, 0.2)
    assert r.offsets() == [0, 1, 2]
    ch.basic_ack(r.tags[2], multiple=True)
    r.wait(5)
    drain(conn, 0.2)
    assert r.offsets() == [0, 1, 2, 3, 4]
    assert message_count(ch, q) in (5, None)


@pytest.mark.skipif(EXTERNAL, reason="RabbitMQ 3.10 closes the connection with 540; later versions settle")
def test_nack_and_reject_only_return_credit(connect: Connect, names: Names) -> None:
    conn = connect()
    ch = conn.channel()
    q = names.queue()
    declare_stream(ch, q)
    publish(ch, q, bodies(5))
    r = Reader(ch, q, prefetch=2, auto_settle=False, **{"x-stream-offset": "first"})
    r.wait(2)
    # A nack with requeue cannot put a message back into a log: it just returns credit.
    ch.basic_nack(r.tags[1], requeue=True)
    r.wait(3)
    ch.basic_reject(r.tags[2], requeue=False)
    ch.basic_nack(r.tags[0], multiple=True, requeue=True)
    r.wait(5)
    drain(conn, 0.2)
    assert r.offsets() == [0, 1, 2, 3, 4]
    assert message_count(ch, q) == 5


# -- retention ---------------------------------------------------------------------------------------------
@leveret_only
def test_retention_by_size_keeps_the_newest(connect: Connect, names: Names) -> None:
    conn = connect()
    ch = conn.channel()
    q = names.queue()
    declare_stream(ch, q, **{"x-max-length-bytes": 1000})
    publish(ch, q, [bytes([65 + i % 26]) * 100 for i in range(25)])
    assert message_count(ch, q) == 10
    r = Reader(ch, q, **{"x-stream-offset": "first"})
    r.wait(10)
    drain(conn, 0.2)
    assert r.offsets() == list(range(15, 25))
    # An offset that retention removed starts at the oldest message kept.
    r2 = Reader(conn.channel(), q, **{"x-stream-offset": 3})
    r2.wait(10)
    assert r2.offsets()[0] == 15


@leveret_only
def test_retention_by_age(connect: Connect, names: Names) -> None:
    conn = connect()
    ch = conn.channel()
    q = names.queue()
    declare_stream(ch, q, **{"x-max-age": "1s"})
    publish(ch, q, bodies(4, "old"))
    drain(conn, 1.4)
    assert message_count(ch, q) == 0
    publish(ch, q, [b"fresh"])
    r = Reader(ch, q, **{"x-stream-offset": "first"})
    r.wait(1)
    drain(conn, 0.2)
    assert r.got == [(4, b"fresh")]


# -- consumer groups ------------------------------------------------------------------------------------------
GROUP = "x-stream-consumer-group"


@leveret_only
def test_group_resumes_after_reconnect(connect: Connect, names: Names) -> None:
    conn = connect()
    ch = conn.channel()
    q = names.queue()
    declare_stream(ch, q)
    publish(ch, q, bodies(8))
    r = Reader(ch, q, prefetch=5, auto_settle=False, **{GROUP: "billing", "x-stream-offset": "first"})
    r.wait(5)
    # Offsets 0, 1 and 3 acked: the group has processed up to 1 (3 waits for 2).
    for tag in (r.tags[0], r.tags[1], r.tags[3]):
        ch.basic_ack(tag)
    drain(conn, 0.3)
    conn.close()
    conn2 = connect()
    back = Reader(conn2.channel(), q, **{GROUP: "billing", "x-stream-offset": "first"})
    back.wait(6)
    drain(conn2, 0.2)
    assert back.offsets() == [2, 3, 4, 5, 6, 7]
    conn2.close()
    # Everything acked now: a third session starts at the end, another group starts where it asks.
    conn3 = connect()
    ch3 = conn3.channel()
    done = Reader(ch3, q, **{GROUP: "billing", "x-stream-offset": "first"})
    other = Reader(conn3.channel(), q, **{GROUP: "audit", "x-stream-offset": 6})
    other.wait(2)
    drain(conn3, 0.2)
    assert done.got == []
    assert other.offsets() == [6, 7]


@leveret_only
def test_group_members_stand_by_and_take_over(connect: Connect, names: Names) -> None:
    conn = connect()
    ch = conn.channel()
    q = names.queue()
    declare_stream(ch, q)
    a = Reader(conn.channel(), q, prefetch=3, auto_settle=False, **{GROUP: "g", "x-stream-offset": "first"})
    b = Reader(conn.channel(), q, prefetch=3, **{GROUP: "g", "x-stream-offset": "first"})
    publish(ch, q, bodies(6))
    a.wait(3)
    drain(conn, 0.3)
    assert a.offsets() == [0, 1, 2]
    assert b.got == []  # standing by
    a.ch.basic_ack(a.tags[0])
    a.wait(4)
    a.ch.close()  # 1, 2, 3 unacked: they go to the member that takes over
    b.wait(5)
    drain(conn, 0.2)
    assert b.offsets() == [1, 2, 3, 4, 5]
