"""kombu (py-amqp transport, AMQPLAIN login) compatibility."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import kombu
import kombu.exceptions
import pytest
from kombu.message import Message

from compat_tests.util import Names

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def kconn(amqp_url: str) -> Iterator[kombu.Connection]:
    with kombu.Connection(amqp_url, connect_timeout=5) as conn:
        conn.ensure_connection(max_retries=1)
        yield conn


def _drain(conn: kombu.Connection, until: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        try:
            conn.drain_events(timeout=min(0.2, remaining))
        except TimeoutError:
            pass


def _settle(conn: kombu.Connection, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            conn.drain_events(timeout=0.05)
        except TimeoutError:
            pass


def test_producer_consumer(kconn: kombu.Connection, names: Names) -> None:
    exchange = kombu.Exchange(names.exchange(), type="direct", durable=False)
    queue = kombu.Queue(names.queue(), exchange=exchange, routing_key="tasks", durable=False)
    received: list[tuple[Any, Message]] = []

    def on_message(body: Any, message: Message) -> None:
        received.append((body, message))
        message.ack()

    with kconn.Consumer(queue, callbacks=[on_message]):
        producer = kconn.Producer(exchange=exchange)
        for i in range(5):
            producer.publish(
                {"n": i, "text": "hi"},
                routing_key="tasks",
                serializer="json",
                headers={"attempt": i},
                priority=2,
                declare=[queue],
            )
        _drain(kconn, lambda: len(received) == 5)
    assert [body for body, _m in received] == [{"n": i, "text": "hi"} for i in range(5)]
    message = received[0][1]
    assert message.content_type == "application/json"
    assert message.headers == {"attempt": 0}
    assert message.properties["priority"] == 2
    assert message.delivery_info["routing_key"] == "tasks"
    assert message.delivery_info["exchange"] == exchange.name


def test_topic_routing_with_kombu(kconn: kombu.Connection, names: Names) -> None:
    exchange = kombu.Exchange(names.exchange(), type="topic", durable=False)
    errors = kombu.Queue(names.queue(), exchange=exchange, routing_key="*.error", durable=False)
    everything = kombu.Queue(names.queue(), exchange=exchange, routing_key="#", durable=False)
    channel = kconn.default_channel
    for q in (errors, everything):
        q(channel).declare()
    producer = kconn.Producer(exchange=exchange)
    for key in ("app.error", "app.info", "db.error"):
        producer.publish(key, routing_key=key, serializer="json")
    got: dict[str, list[str]] = {errors.name: [], everything.name: []}
    for q in (errors, everything):
        bound = q(channel)
        while (message := bound.get(no_ack=True)) is not None:
            got[q.name].append(message.decode())
    assert got[errors.name] == ["app.error", "db.error"]
    assert got[everything.name] == ["app.error", "app.info", "db.error"]


def test_simple_queue(kconn: kombu.Connection, names: Names) -> None:
    name = names.queue()
    with kconn.SimpleQueue(name, queue_opts={"durable": False}, exchange_opts={"durable": False}) as sq:
        names.exchanges.append(name)  # SimpleQueue declares an exchange of the same name
        for i in range(3):
            sq.put({"i": i})
        # publishes and the passive declare behind qsize() may use different channels
        deadline = time.monotonic() + 5
        while sq.qsize() != 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sq.qsize() == 3
        got = []
        for _ in range(3):
            message = sq.get(block=True, timeout=5)
            got.append(message.payload)
            message.ack()
        assert got == [{"i": 0}, {"i": 1}, {"i": 2}]
        with pytest.raises(sq.Empty):
            sq.get(block=True, timeout=0.3)
        sq.put("requeue me")
        message = sq.get(block=True, timeout=5)
        message.requeue()
        again = sq.get(block=True, timeout=5)
        assert again.payload == "requeue me"
        assert again.delivery_info["redelivered"] is True
        again.ack()
        sq.clear()


def test_kombu_qos(kconn: kombu.Connection, names: Names) -> None:
    queue = kombu.Queue(names.queue(), routing_key="q", durable=False)
    with kconn.SimpleQueue(queue.name, queue_opts={"durable": False}, exchange_opts={"durable": False}) as sq:
        names.exchanges.append(queue.name)
        for i in range(6):
            sq.put(i)
    held: list[Message] = []
    consumer = kconn.Consumer(
        kombu.Queue(queue.name, durable=False, no_declare=True),
        callbacks=[lambda _body, message: held.append(message)],
        prefetch_count=2,  # kombu sends basic.qos before basic.consume
    )
    consumer.consume()
    try:
        _drain(kconn, lambda: len(held) >= 2)
        _settle(kconn, 0.3)
        assert len(held) == 2
        held[0].ack()
        _drain(kconn, lambda: len(held) >= 3)
        _settle(kconn, 0.3)
        assert len(held) == 3
        assert [m.payload for m in held] == [0, 1, 2]
        consumer.qos(prefetch_count=0)
    finally:
        consumer.cancel()


def test_kombu_confirm_publish(amqp_url: str, names: Names) -> None:
    with kombu.Connection(amqp_url, transport_options={"confirm_publish": True}) as conn:
        queue = kombu.Queue(names.queue(), durable=False)
        producer = conn.Producer()
        for i in range(5):
            producer.publish({"i": i}, routing_key=queue.name, declare=[queue], serializer="json")
        bound = queue(conn.default_channel)
        _name, count, _consumers = bound.queue_declare(passive=True)
        assert count == 5


def test_kombu_channel_error(kconn: kombu.Connection, names: Names) -> None:
    import amqp.exceptions

    channel = kconn.channel()
    with pytest.raises(amqp.exceptions.NotFound) as info:
        channel.queue_declare(names("compat.nope"), passive=True)
    assert info.value.reply_code == 404
    assert "NOT_FOUND - no queue" in info.value.reply_text
    # the connection is still usable
    fresh = kconn.channel()
    name, _count, _consumers = fresh.queue_declare("", exclusive=True)
    assert name.startswith("amq.gen-")
