"""Message TTL (per queue and per message) and queue expiry (x-expires)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aio_pika
import pika
import pika.exceptions
import pytest

from compat_tests.util import BlockingChannel, Names, channel_error, drain, sync, wait_until

pytestmark = pytest.mark.timeout(30)

TTL_MS = 200
PAST_TTL = 0.5  # seconds: comfortably past TTL_MS


def _get_bodies(ch: BlockingChannel, queue: str) -> list[bytes]:
    bodies: list[bytes] = []
    while True:
        method, _props, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            return bodies
        bodies.append(body)


def _count(ch: BlockingChannel, queue: str) -> int:
    return ch.queue_declare(queue, passive=True).method.message_count


# ------------------------------------------------------------ per-queue TTL
def test_queue_ttl_expired_messages_are_never_got(channel: BlockingChannel, names: Names) -> None:
    queue = names.queue()
    channel.queue_declare(queue, arguments={"x-message-ttl": TTL_MS})
    for i in range(3):
        channel.basic_publish("", queue, f"old{i}".encode())
    sync(channel)
    assert _count(channel, queue) == 3
    time.sleep(PAST_TTL)
    channel.basic_publish("", queue, b"fresh")
    assert _get_bodies(channel, queue) == [b"fresh"]


def test_queue_ttl_expired_messages_are_never_consumed(
    connection: pika.BlockingConnection, channel: BlockingChannel, names: Names
) -> None:
    queue = names.queue()
    channel.queue_declare(queue, arguments={"x-message-ttl": TTL_MS})
    channel.basic_publish("", queue, b"stale")
    sync(channel)
    time.sleep(PAST_TTL)
    got: list[bytes] = []
    channel.basic_consume(queue, lambda ch, m, p, b: got.append(b), auto_ack=True)
    channel.basic_publish("", queue, b"live")
    assert wait_until(connection, lambda: got == [b"live"])
    drain(connection, 0.2)
    assert got == [b"live"]


def test_queue_ttl_message_consumed_before_expiry(
    connection: pika.BlockingConnection, channel: BlockingChannel, names: Names
) -> None:
    queue = names.queue()
    channel.queue_declare(queue, arguments={"x-message-ttl": TTL_MS})
    got: list[bytes] = []
    channel.basic_consume(queue, lambda ch, m, p, b: got.append(b), auto_ack=True)
    channel.basic_publish("", queue, b"quick")
    assert wait_until(connection, lambda: got == [b"quick"], timeout=TTL_MS / 1000)
    # got before expiry via basic.get too
    channel.basic_cancel(channel.consumer_tags[0])
    channel.basic_publish("", queue, b"quick-get")
    method, _props, body = channel.basic_get(queue, auto_ack=False)
    assert method is not None and body == b"quick-get"
    # once delivered, an unacked message does not expire: ack works after the TTL
    time.sleep(PAST_TTL)
    channel.basic_ack(method.delivery_tag)
    sync(channel)


def test_queue_ttl_unacked_requeued_after_ttl_expires(
    connect: Callable[..., pika.BlockingConnection], names: Names
) -> None:
    """A message that was delivered within its TTL and requeued later expires then."""
    conn = connect()
    ch = conn.channel()
    queue = names.queue()
    ch.queue_declare(queue, arguments={"x-message-ttl": TTL_MS})
    ch.basic_publish("", queue, b"m")
    method, _props, _body = ch.basic_get(queue, auto_ack=False)
    assert method is not None
    time.sleep(PAST_TTL)
    ch.basic_nack(method.delivery_tag, requeue=True)
    sync(ch)
    assert _get_bodies(ch, queue) == []


async def test_queue_ttl_aio_pika(amqp_url: str, names: Names) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        ch = await connection.channel()
        queue = await ch.declare_queue(names.queue(), arguments={"x-message-ttl": TTL_MS})
        await ch.default_exchange.publish(aio_pika.Message(b"gone"), routing_key=queue.name)
        await asyncio.sleep(PAST_TTL)
        assert await queue.get(fail=False) is None
        await ch.default_exchange.publish(aio_pika.Message(b"kept"), routing_key=queue.name)
        message = await queue.get(timeout=5)
        assert message is not None and message.body == b"kept"
        await message.ack()
    finally:
        await connection.close()


# ---------------------------------------------------------- per-message TTL
def test_message_expiration(channel: BlockingChannel, names: Names) -> None:
    queue = names.queue()
    channel.queue_declare(queue)
    channel.basic_publish("", queue, b"short", pika.BasicProperties(expiration=str(TTL_MS)))
    channel.basic_publish("", queue, b"forever")
    channel.basic_publish("", queue, b"long", pika.BasicProperties(expiration="60000"))
    sync(channel)
    time.sleep(PAST_TTL)
    # The expired message at the head is dropped; the others remain, in order.
    method, props, body = channel.basic_get(queue, auto_ack=True)
    assert method is not None and body == b"forever"
    method, props, body = channel.basic_get(queue, auto_ack=True)
    assert method is not None and body == b"long"
    assert props.expiration == "60000"
    assert channel.basic_get(queue, auto_ack=True)[0] is None


def test_message_expiration_zero_without_consumer_expires(channel: BlockingChannel, names: Names) -> None:
    queue = names.queue()
    channel.queue_declare(queue)
    channel.basic_publish("", queue, b"now-or-never", pika.BasicProperties(expiration="0"))
    sync(channel)
    assert channel.basic_get(queue, auto_ack=True)[0] is None
    assert _count(channel, queue) == 0


def test_message_expiration_zero_with_consumer_delivered(
    connection: pika.BlockingConnection, channel: BlockingChannel, names: Names
) -> None:
    queue = names.queue()
    channel.queue_declare(queue)
    got: list[tuple[bytes, str | None]] = []
    channel.basic_consume(queue, lambda ch, m, p, b: got.append((b, p.expiration)), auto_ack=True)
    channel.basic_publish("", queue, b"now", pika.BasicProperties(expiration="0"))
    assert wait_until(connection, lambda: len(got) == 1)
    assert got == [(b"now", "0")]


def test_queue_ttl_zero_delivers_only_to_waiting_consumer(
    connection: pika.BlockingConnection, channel: BlockingChannel, names: Names
) -> None:
    queue = names.queue()
    channel.queue_declare(queue, arguments={"x-message-ttl": 0})
    channel.basic_publish("", queue, b"nobody-home")
    sync(channel)
    assert _count(channel, queue) == 0
    got: list[bytes] = []
    channel.basic_consume(queue, lambda ch, m, p, b: got.append(b), auto_ack=True)
    channel.basic_publish("", queue, b"taken-at-once")
    assert wait_until(connection, lambda: len(got) == 1)
    assert got == [b"taken-at-once"]


async def test_message_expiration_aio_pika(amqp_url: str, names: Names) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        ch = await connection.channel()
        queue = await ch.declare_queue(names.queue())
        await ch.default_exchange.publish(aio_pika.Message(b"gone", expiration=0.2), routing_key=queue.name)
        await ch.default_exchange.publish(aio_pika.Message(b"kept", expiration=30), routing_key=queue.name)
        await asyncio.sleep(PAST_TTL)
        message = await queue.get(timeout=5)
        assert message is not None and message.body == b"kept"
        assert message.expiration is not None
        await message.ack()
        assert await queue.get(fail=False) is None
    finally:
        await connection.close()


def test_lower_of_queue_and_message_ttl_wins(channel: BlockingChannel, names: Names) -> None:
    long_q = names.queue()
    short_q = names.queue()
    channel.queue_declare(long_q, arguments={"x-message-ttl": 60_000})
    channel.queue_declare(short_q, arguments={"x-message-ttl": TTL_MS})
    # message TTL shorter than the queue's
    channel.basic_publish("", long_q, b"msg-short", pika.BasicProperties(expiration=str(TTL_MS)))
    channel.basic_publish("", long_q, b"queue-short")
    # queue TTL shorter than the message's
    channel.basic_publish("", short_q, b"msg-long", pika.BasicProperties(expiration="60000"))
    sync(channel)
    time.sleep(PAST_TTL)
    assert _get_bodies(channel, long_q) == [b"queue-short"]
    assert _get_bodies(channel, short_q) == []


@pytest.mark.parametrize("expiration", ["abc", "-1", "1.5"])
def test_invalid_expiration_closes_channel(channel: BlockingChannel, names: Names, expiration: str) -> None:
    queue = names.queue()
    channel.queue_declare(queue)
    with channel_error(406):
        channel.basic_publish("", queue, b"bad", pika.BasicProperties(expiration=expiration))
        sync(channel)


# ------------------------------------------------------------- x-expires
def test_unused_queue_expires(
    connect: Callable[..., pika.BlockingConnection], channel: BlockingChannel, names: Names
) -> None:
    queue = names.queue()
    channel.queue_declare(queue, arguments={"x-expires": 300})
    channel.basic_publish("", queue, b"does not keep the queue alive")
    sync(channel)
    assert _count(channel, queue) == 1
    time.sleep(0.9)
    with channel_error(404):
        channel.queue_declare(queue, passive=True)


def test_queue_with_consumer_does_not_expire(
    connect: Callable[..., pika.BlockingConnection], names: Names
) -> None:
    consumer_conn = connect()
    consumer_ch = consumer_conn.channel()
    queue = names.queue()
    consumer_ch.queue_declare(queue, arguments={"x-expires": 300})
    tag = consumer_ch.basic_consume(queue, lambda ch, m, p, b: None, auto_ack=True)
    drain(consumer_conn, 0.9)
    checker = connect().channel()
    assert checker.queue_declare(queue, passive=True).method.consumer_count == 1
    # Once the consumer is gone the countdown starts again.
    consumer_ch.basic_cancel(tag)
    time.sleep(0.9)
    with channel_error(404):
        checker.queue_declare(queue, passive=True)


async def test_queue_expires_aio_pika(amqp_url: str, names: Names) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        ch = await connection.channel()
        name = names.queue()
        await ch.declare_queue(name, arguments={"x-expires": 300})
        await asyncio.sleep(0.9)
        with pytest.raises(aio_pika.exceptions.ChannelNotFoundEntity):
            await ch.declare_queue(name, passive=True)
    finally:
        await connection.close()
