"""Priority queues (x-max-priority)."""

from __future__ import annotations

import aio_pika
import pika
import pytest

from compat_tests.util import BlockingChannel, Names, sync

pytestmark = pytest.mark.timeout(30)


def _get_all(ch: BlockingChannel, queue: str) -> list[tuple[bytes, int | None]]:
    got: list[tuple[bytes, int | None]] = []
    while True:
        method, props, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            return got
        got.append((body, props.priority))


def _publish(ch: BlockingChannel, queue: str, items: list[tuple[str, int | None]]) -> None:
    for body, priority in items:
        ch.basic_publish("", queue, body.encode(), pika.BasicProperties(priority=priority))
    sync(ch)


def test_higher_priority_first_fifo_within(channel: BlockingChannel, names: Names) -> None:
    queue = names.queue()
    channel.queue_declare(queue, arguments={"x-max-priority": 10})
    items = [("p1-a", 1), ("p5-a", 5), ("none-a", None), ("p1-b", 1), ("p9-a", 9), ("p5-b", 5),
             ("p0-a", 0), ("p9-b", 9), ("none-b", None), ("p5-c", 5)]
    _publish(channel, queue, items)
    assert channel.queue_declare(queue, passive=True).method.message_count == len(items)
    got = [body.decode() for body, _priority in _get_all(channel, queue)]
    # no priority property counts as priority 0
    assert got == ["p9-a", "p9-b", "p5-a", "p5-b", "p5-c", "p1-a", "p1-b", "none-a", "p0-a", "none-b"]


def test_priority_above_max_is_capped(channel: BlockingChannel, names: Names) -> None:
    queue = names.queue()
    channel.queue_declare(queue, arguments={"x-max-priority": 5})
    _publish(channel, queue, [("p3", 3), ("p5", 5), ("p200", 200), ("p6", 6), ("p4", 4), ("p5-b", 5)])
    got = _get_all(channel, queue)
    # 200 and 6 count as 5: FIFO with the other 5s; the property itself is untouched
    assert got == [(b"p5", 5), (b"p200", 200), (b"p6", 6), (b"p5-b", 5), (b"p4", 4), (b"p3", 3)]


def test_priority_ignored_without_max_priority(channel: BlockingChannel, names: Names) -> None:
    queue = names.queue()
    channel.queue_declare(queue)
    _publish(channel, queue, [("a", 1), ("b", 9), ("c", 5)])
    assert [body for body, _p in _get_all(channel, queue)] == [b"a", b"b", b"c"]


def test_requeued_message_keeps_its_priority(channel: BlockingChannel, names: Names) -> None:
    queue = names.queue()
    channel.queue_declare(queue, arguments={"x-max-priority": 10})
    _publish(channel, queue, [("low", 1), ("high", 8)])
    method, _props, body = channel.basic_get(queue, auto_ack=False)
    assert body == b"high"
    _publish(channel, queue, [("mid", 4)])
    channel.basic_nack(method.delivery_tag, requeue=True)
    sync(channel)
    assert [body for body, _p in _get_all(channel, queue)] == [b"high", b"mid", b"low"]


async def test_priority_consume_aio_pika(amqp_url: str, names: Names) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        ch = await connection.channel()
        await ch.set_qos(prefetch_count=1)
        queue = await ch.declare_queue(names.queue(), arguments={"x-max-priority": 3})
        for body, priority in [("a0", 0), ("b2", 2), ("c3", 3), ("d1", 1), ("e3", 3), ("f7", 7)]:
            await ch.default_exchange.publish(aio_pika.Message(body.encode(), priority=priority), queue.name)
        got: list[str] = []
        async with queue.iterator() as messages:
            async for message in messages:
                got.append(message.body.decode())
                await message.ack()
                if len(got) == 6:
                    break
        assert got == ["c3", "e3", "f7", "b2", "d1", "a0"]
    finally:
        await connection.close()
