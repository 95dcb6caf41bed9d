"""Consumer features: single active consumer, consumer priorities, exclusivity, cancel notifications."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aio_pika
import aio_pika.abc
import aiormq.exceptions
import pika
import pytest
from pamqp import commands

from compat_tests.util import BlockingChannel, Names, channel_error, drain, wait_until

pytestmark = pytest.mark.timeout(30)

Delivery = tuple[int, bytes, bool]  # delivery tag, body, redelivered


def _collector(store: list[Delivery]) -> Callable[..., None]:
    def on_message(ch: BlockingChannel, method: pika.spec.Basic.Deliver, props: pika.BasicProperties, body: bytes):
        store.append((method.delivery_tag, body, method.redelivered))

    return on_message


async def _ignore(message: aio_pika.abc.AbstractIncomingMessage) -> None:
    return None


# ----------------------------------------------------- single active consumer
def test_single_active_consumer_takes_over_after_cancel(
    connection: pika.BlockingConnection, names: Names
) -> None:
    ch1 = connection.channel()
    ch2 = connection.channel()
    queue = names.queue()
    ch1.queue_declare(queue, arguments={"x-single-active-consumer": True})
    first: list[bytes] = []
    second: list[bytes] = []

    def on_first(ch: BlockingChannel, method: pika.spec.Basic.Deliver, props: pika.BasicProperties, body: bytes):
        first.append(body)
        ch.basic_ack(method.delivery_tag)

    tag1 = ch1.basic_consume(queue, on_first)
    ch2.basic_consume(queue, lambda ch, m, p, body: second.append(body), auto_ack=True)
    assert ch1.queue_declare(queue, passive=True).method.consumer_count == 2
    for i in range(5):
        ch1.basic_publish("", queue, f"m{i}".encode())
    assert wait_until(connection, lambda: len(first) == 5)
    drain(connection, 0.2)
    assert first == [f"m{i}".encode() for i in range(5)]
    assert second == []
    # NB: RabbitMQ 3.10 only hands over on cancel when the active consumer holds
    # no unacked messages (otherwise it waits for its channel to close), so the
    # first consumer acks everything before it cancels.
    ch1.basic_cancel(tag1)
    for i in range(5, 10):
        ch1.basic_publish("", queue, f"m{i}".encode())
    assert wait_until(connection, lambda: len(second) == 5)
    drain(connection, 0.1)
    assert second == [f"m{i}".encode() for i in range(5, 10)]
    assert len(first) == 5


async def test_single_active_consumer_failover_aio_pika(amqp_url: str, names: Names) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        ch1 = await connection.channel()
        ch2 = await connection.channel()
        await ch1.set_qos(prefetch_count=3)
        name = names.queue()
        q1 = await ch1.declare_queue(name, arguments={"x-single-active-consumer": True})
        q2 = await ch2.get_queue(name, ensure=False)
        first: list[aio_pika.abc.AbstractIncomingMessage] = []
        second: list[aio_pika.abc.AbstractIncomingMessage] = []

        async def on_first(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            first.append(message)

        async def on_second(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            second.append(message)
            await message.ack()

        await q1.consume(on_first)
        await q2.consume(on_second)
        for i in range(6):
            await ch2.default_exchange.publish(aio_pika.Message(f"s{i}".encode()), routing_key=name)
        for _ in range(100):
            if len(first) == 3:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        assert [m.body for m in first] == [b"s0", b"s1", b"s2"]
        assert second == []
        # the active consumer's channel goes away: its unacked messages and the rest go to the other
        await ch1.close()
        for _ in range(250):
            if len(second) == 6:
                break
            await asyncio.sleep(0.02)
        assert sorted(m.body for m in second) == [f"s{i}".encode() for i in range(6)]
        assert {m.body for m in second if m.redelivered} == {b"s0", b"s1", b"s2"}
    finally:
        await connection.close()


# -------------------------------------------------------- consumer priority
def test_consumer_priority_high_gets_messages_while_it_has_credit(
    connection: pika.BlockingConnection, names: Names
) -> None:
    low_ch = connection.channel()
    high_ch = connection.channel()
    queue = names.queue()
    low_ch.queue_declare(queue)
    low_ch.basic_qos(prefetch_count=100)
    high_ch.basic_qos(prefetch_count=3)
    low: list[Delivery] = []
    high: list[Delivery] = []
    low_ch.basic_consume(queue, _collector(low), arguments={"x-priority": 1})
    high_ch.basic_consume(queue, _collector(high), arguments={"x-priority": 10})
    for i in range(10):
        low_ch.basic_publish("", queue, f"p{i}".encode())
    assert wait_until(connection, lambda: len(low) + len(high) == 10)
    assert [body for _t, body, _r in high] == [b"p0", b"p1", b"p2"]
    assert [body for _t, body, _r in low] == [f"p{i}".encode() for i in range(3, 10)]
    # once the high priority consumer has credit again, it is preferred again
    for tag, _body, _r in high:
        high_ch.basic_ack(tag)
    for tag, _body, _r in low:
        low_ch.basic_ack(tag)
    drain(connection, 0.1)
    low.clear()
    high.clear()
    for i in range(2):
        low_ch.basic_publish("", queue, f"q{i}".encode())
    assert wait_until(connection, lambda: len(high) == 2)
    drain(connection, 0.1)
    assert low == []
    for tag, _body, _r in high:
        high_ch.basic_ack(tag)


def test_consumer_priority_auto_ack_takes_everything(connection: pika.BlockingConnection, names: Names) -> None:
    ch = connection.channel()
    queue = names.queue()
    ch.queue_declare(queue)
    low: list[Delivery] = []
    high: list[Delivery] = []
    ch.basic_consume(queue, _collector(low), auto_ack=True, arguments={"x-priority": -5})
    ch.basic_consume(queue, _collector(high), auto_ack=True, arguments={"x-priority": 5})
    for i in range(10):
        ch.basic_publish("", queue, f"a{i}".encode())
    assert wait_until(connection, lambda: len(high) == 10)
    drain(connection, 0.1)
    assert low == []


async def test_consumer_priority_aio_pika(amqp_url: str, names: Names) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        low_ch = await connection.channel()
        high_ch = await connection.channel()
        await high_ch.set_qos(prefetch_count=2)
        name = names.queue()
        low_q = await low_ch.declare_queue(name)
        high_q = await high_ch.get_queue(name, ensure=False)
        low: list[bytes] = []
        high: list[bytes] = []

        async def on_low(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            low.append(message.body)

        async def on_high(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            high.append(message.body)

        await low_q.consume(on_low, arguments={"x-priority": 0})
        await high_q.consume(on_high, arguments={"x-priority": 7})
        for i in range(5):
            await low_ch.default_exchange.publish(aio_pika.Message(f"c{i}".encode()), routing_key=name)
        for _ in range(250):
            if len(low) + len(high) == 5:
                break
            await asyncio.sleep(0.02)
        assert high == [b"c0", b"c1"]
        assert low == [b"c2", b"c3", b"c4"]
    finally:
        await connection.close()


# ------------------------------------------------------- exclusive consumer
def test_exclusive_consumer_refuses_others(connection: pika.BlockingConnection, names: Names) -> None:
    ch1 = connection.channel()
    queue = names.queue()
    ch1.queue_declare(queue)
    ch1.basic_consume(queue, lambda *a: None, exclusive=True)
    ch2 = connection.channel()
    with channel_error(403, "exclusive"):
        ch2.basic_consume(queue, lambda *a: None)
    # also from the very same channel
    with channel_error(403):
        ch1.basic_consume(queue, lambda *a: None)


def test_exclusive_consume_refused_when_queue_has_consumers(
    connection: pika.BlockingConnection, names: Names
) -> None:
    ch1 = connection.channel()
    queue = names.queue()
    ch1.queue_declare(queue)
    tag = ch1.basic_consume(queue, lambda *a: None)
    ch2 = connection.channel()
    with channel_error(403):
        ch2.basic_consume(queue, lambda *a: None, exclusive=True)
    # once the other consumer is gone, exclusive access is granted
    ch1.basic_cancel(tag)
    ch3 = connection.channel()
    ch3.basic_consume(queue, lambda *a: None, exclusive=True)


async def test_exclusive_consumer_aio_pika(amqp_url: str, names: Names) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        ch1 = await connection.channel()
        q1 = await ch1.declare_queue(names.queue())
        await q1.consume(_ignore, exclusive=True)
        ch2 = await connection.channel()
        q2 = await ch2.get_queue(q1.name, ensure=False)
        with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
            await q2.consume(_ignore)
    finally:
        await connection.close()


# ------------------------------------------------ cancel notification
async def test_consumer_cancel_notification_on_queue_delete_aio_pika(amqp_url: str, names: Names) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        ch = await connection.channel()
        queue = await ch.declare_queue(names.queue())
        cancelled: asyncio.Future[commands.Basic.Cancel] = asyncio.get_running_loop().create_future()

        def on_cancel(frame: commands.Basic.Cancel) -> None:
            if not cancelled.done():
                cancelled.set_result(frame)

        underlay = await ch.get_underlay_channel()
        underlay.on_consumer_cancel_callbacks.add(on_cancel)
        tag = await queue.consume(_ignore)
        other = await connection.channel()
        await other.queue_delete(queue.name)
        frame = await asyncio.wait_for(cancelled, 5)
        assert frame.consumer_tag == tag
        assert tag not in underlay.consumers  # type: ignore[attr-defined]
        # the channel itself stays usable
        again = await ch.declare_queue(exclusive=True)
        assert again.name
    finally:
        await connection.close()


def test_consumer_cancel_notification_on_queue_delete_pika(connect: Callable[..., pika.BlockingConnection],
                                                           names: Names) -> None:
    conn = connect()
    ch = conn.channel()
    queue = names.queue()
    ch.queue_declare(queue)
    cancels: list[str] = []
    ch.add_on_cancel_callback(lambda method_frame: cancels.append(method_frame.method.consumer_tag))
    tag = ch.basic_consume(queue, lambda *a: None)
    connect().channel().queue_delete(queue)
    assert wait_until(conn, lambda: cancels == [tag])
    assert ch.is_open
