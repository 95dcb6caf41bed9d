"""Queue length limits (x-max-length, x-max-length-bytes, x-overflow) and argument validation."""

from __future__ import annotations

import os
import time
from typing import Any

import aio_pika
import aiormq.exceptions
import pika
import pika.exceptions
import pytest
from pamqp import commands

from compat_tests.util import BlockingChannel, Names, channel_error, sync

pytestmark = pytest.mark.timeout(30)


def _get_bodies(ch: BlockingChannel, queue: str) -> list[bytes]:
    bodies: list[bytes] = []
    while True:
        method, _props, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            return bodies
        bodies.append(body)


def _count(ch: BlockingChannel, queue: str) -> int:
    return ch.queue_declare(queue, passive=True).method.message_count


def _wait_count(ch: BlockingChannel, queue: str, expected: int, timeout: float = 3.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        count = _count(ch, queue)
        if count == expected or time.monotonic() > deadline:
            return count
        time.sleep(0.02)


# ------------------------------------------------------------- drop-head
def test_max_length_drop_head_keeps_newest(channel: BlockingChannel, names: Names) -> None:
    queue = names.queue()
    channel.queue_declare(queue, arguments={"x-max-length": 3})
    for i in range(6):
        channel.basic_publish("", queue, f"m{i}".encode())
    sync(channel)
    assert _count(channel, queue) == 3
    assert _get_bodies(channel, queue) == [b"m3", b"m4", b"m5"]


def test_max_length_zero_keeps_nothing(channel: BlockingChannel, names: Names) -> None:
    queue = names.queue()
    channel.queue_declare(queue, arguments={"x-max-length": 0})
    channel.basic_publish("", queue, b"gone")
    sync(channel)
    assert _get_bodies(channel, queue) == []


def test_max_length_counts_ready_not_unacked(channel: BlockingChannel, names: Names) -> None:
    queue = names.queue()
    channel.queue_declare(queue, arguments={"x-max-length": 2})
    channel.basic_publish("", queue, b"a")
    method, _props, _body = channel.basic_get(queue, auto_ack=False)
    assert method is not None
    channel.basic_publish("", queue, b"b")
    channel.basic_publish("", queue, b"c")
    sync(channel)
    assert _count(channel, queue) == 2
    channel.basic_ack(method.delivery_tag)
    assert _get_bodies(channel, queue) == [b"b", b"c"]


def test_max_length_bytes_drop_head(channel: BlockingChannel, names: Names) -> None:
    queue = names.queue()
    channel.queue_declare(queue, arguments={"x-max-length-bytes": 10})
    for i in range(5):
        channel.basic_publish("", queue, f"b{i:03d}".encode())  # 4 bytes each
    sync(channel)
    assert _get_bodies(channel, queue) == [b"b003", b"b004"]
    channel.basic_publish("", queue, b"x" * 11)  # larger than the limit on its own
    channel.basic_publish("", queue, b"y" * 10)
    sync(channel)
    assert _get_bodies(channel, queue) == [b"y" * 10]


async def test_max_length_aio_pika(amqp_url: str, names: Names) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        ch = await connection.channel()
        queue = await ch.declare_queue(names.queue(), arguments={"x-max-length": 2})
        for i in range(5):
            await ch.default_exchange.publish(aio_pika.Message(f"a{i}".encode()), routing_key=queue.name)
        declared = await ch.declare_queue(queue.name, passive=True)
        assert declared.declaration_result.message_count == 2
        bodies = []
        while (message := await queue.get(fail=False, no_ack=True)) is not None:
            bodies.append(message.body)
        assert bodies == [b"a3", b"a4"]
    finally:
        await connection.close()


# ------------------------------------------------------- reject-publish
def test_reject_publish_nacks_with_confirms(channel: BlockingChannel, names: Names) -> None:
    queue = names.queue()
    channel.queue_declare(queue, arguments={"x-max-length": 2, "x-overflow": "reject-publish"})
    channel.confirm_delivery()
    channel.basic_publish("", queue, b"one")
    channel.basic_publish("", queue, b"two")
    with pytest.raises(pika.exceptions.NackError):
        channel.basic_publish("", queue, b"three")
    assert _count(channel, queue) == 2
    # room again after one is taken
    method, _props, body = channel.basic_get(queue, auto_ack=True)
    assert body == b"one"
    channel.basic_publish("", queue, b"four")
    assert _get_bodies(channel, queue) == [b"two", b"four"]


def test_reject_publish_without_confirms_drops_silently(channel: BlockingChannel, names: Names) -> None:
    queue = names.queue()
    channel.queue_declare(queue, arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
    channel.basic_publish("", queue, b"kept")
    channel.basic_publish("", queue, b"refused")
    sync(channel)
    assert _get_bodies(channel, queue) == [b"kept"]


def test_reject_publish_max_length_bytes(channel: BlockingChannel, names: Names) -> None:
    queue = names.queue()
    channel.queue_declare(queue, arguments={"x-max-length-bytes": 8, "x-overflow": "reject-publish"})
    channel.confirm_delivery()
    channel.basic_publish("", queue, b"1234")
    channel.basic_publish("", queue, b"5678")
    with pytest.raises(pika.exceptions.NackError):
        channel.basic_publish("", queue, b"9")
    assert _get_bodies(channel, queue) == [b"1234", b"5678"]


def test_reject_publish_one_full_queue_nacks_even_if_another_accepts(channel: BlockingChannel, names: Names) -> None:
    fanout = names.exchange()
    channel.exchange_declare(fanout, "fanout")
    full = names.queue()
    roomy = names.queue()
    channel.queue_declare(full, arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
    channel.queue_declare(roomy)
    channel.queue_bind(full, fanout)
    channel.queue_bind(roomy, fanout)
    channel.confirm_delivery()
    channel.basic_publish(fanout, "", b"first")
    with pytest.raises(pika.exceptions.NackError):
        channel.basic_publish(fanout, "", b"second")
    assert _get_bodies(channel, full) == [b"first"]
    assert _get_bodies(channel, roomy) == [b"first", b"second"]


async def test_reject_publish_aio_pika(amqp_url: str, names: Names) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        ch = await connection.channel(publisher_confirms=True)
        queue = await ch.declare_queue(
            names.queue(), arguments={"x-max-length": 1, "x-overflow": "reject-publish"}
        )
        confirm = await ch.default_exchange.publish(aio_pika.Message(b"in"), routing_key=queue.name)
        assert isinstance(confirm, commands.Basic.Ack)
        refused: object
        try:
            refused = await ch.default_exchange.publish(aio_pika.Message(b"out"), routing_key=queue.name)
        except aiormq.exceptions.DeliveryError as exc:
            refused = exc.frame
        assert isinstance(refused, commands.Basic.Nack)
        message = await queue.get(timeout=5, no_ack=True)
        assert message is not None and message.body == b"in"
        assert await queue.get(fail=False) is None
    finally:
        await connection.close()


def test_reject_publish_dlx(channel: BlockingChannel, names: Names) -> None:
    dlq = names.queue("compat.dlq")
    channel.queue_declare(dlq)
    queue = names.queue()
    channel.queue_declare(
        queue,
        arguments={
            "x-max-length": 1,
            "x-overflow": "reject-publish-dlx",
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": dlq,
        },
    )
    channel.confirm_delivery()
    channel.basic_publish("", queue, b"kept")
    with pytest.raises(pika.exceptions.NackError):
        channel.basic_publish("", queue, b"refused")
    assert _wait_count(channel, dlq, 1) == 1
    _method, props, body = channel.basic_get(dlq, auto_ack=True)
    assert body == b"refused"
    death = props.headers["x-death"][0]
    assert death["reason"] == "maxlen"
    assert death["queue"] == queue
    assert death["count"] == 1
    assert _get_bodies(channel, queue) == [b"kept"]


def test_drop_head_with_dlx_dead_letters_oldest(channel: BlockingChannel, names: Names) -> None:
    dlq = names.queue("compat.dlq")
    channel.queue_declare(dlq)
    queue = names.queue()
    channel.queue_declare(
        queue, arguments={"x-max-length": 1, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq}
    )
    channel.basic_publish("", queue, b"old")
    channel.basic_publish("", queue, b"new")
    assert _wait_count(channel, dlq, 1) == 1
    assert _get_bodies(channel, dlq) == [b"old"]
    assert _get_bodies(channel, queue) == [b"new"]


# ------------------------------------------------------ argument checks
INVALID_ARGUMENTS: list[tuple[str, Any]] = [
    ("x-max-length", "abc"),
    ("x-max-length", -1),
    ("x-max-length-bytes", "abc"),
    ("x-max-length-bytes", -5),
    ("x-message-ttl", "abc"),
    ("x-message-ttl", -1),
    ("x-expires", 0),
    ("x-expires", "abc"),
    ("x-overflow", "bogus"),
    ("x-overflow", 1),
    ("x-max-priority", "abc"),
    ("x-max-priority", -1),
    ("x-max-priority", 256),
    ("x-dead-letter-exchange", 1),
    ("x-dead-letter-routing-key", "no-dlx"),
    ("x-single-active-consumer", "yes"),
]


@pytest.mark.parametrize(("key", "value"), INVALID_ARGUMENTS, ids=[f"{k}={v!r}" for k, v in INVALID_ARGUMENTS])
def test_invalid_queue_argument_refused(channel: BlockingChannel, names: Names, key: str, value: Any) -> None:
    queue = names.queue()
    with channel_error(406, key):
        channel.queue_declare(queue, arguments={key: value})


async def test_invalid_queue_argument_aio_pika(amqp_url: str, names: Names) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        ch = await connection.channel()
        with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed):
            await ch.declare_queue(names.queue(), arguments={"x-max-length": "abc"})
    finally:
        await connection.close()


@pytest.mark.skipif(
    bool(os.environ.get("LEVERET_TEST_AMQP_URL")),
    reason="RabbitMQ ignores unknown x- queue arguments; Leveret deliberately refuses them (406) "
    "instead of silently dropping semantics it does not implement",
)
def test_unknown_x_argument_refused(channel: BlockingChannel, names: Names) -> None:
    queue = names.queue()
    with channel_error(406, "x-bogus-feature"):
        channel.queue_declare(queue, arguments={"x-bogus-feature": 1})


def test_non_x_argument_accepted(channel: BlockingChannel, names: Names) -> None:
    """Arguments without the x- prefix carry no meaning and are kept, on both brokers."""
    queue = names.queue()
    channel.queue_declare(queue, arguments={"my-app-tag": "v1"})
    channel.queue_declare(queue, arguments={"my-app-tag": "v1"})
