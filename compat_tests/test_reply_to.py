"""Direct reply-to (amq.rabbitmq.reply-to): RPC without a reply queue."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aio_pika
import aio_pika.abc
import aiormq.exceptions
import pika
import pika.exceptions
import pytest

from compat_tests.util import BlockingChannel, Names, channel_error, sync, wait_until

pytestmark = pytest.mark.timeout(30)

REPLY_TO = "amq.rabbitmq.reply-to"

Reply = tuple[pika.spec.Basic.Deliver, pika.BasicProperties, bytes]


def _serve_one(ch: BlockingChannel, queue: str, transform: Callable[[bytes], bytes]) -> pika.BasicProperties:
    """Act as the RPC server: take one request and answer to its reply_to."""
    for _ in range(200):
        method, props, body = ch.basic_get(queue, auto_ack=True)
        if method is not None:
            break
        sync(ch)
    else:
        raise AssertionError("no request arrived")
    ch.basic_publish("", props.reply_to, transform(body), pika.BasicProperties(correlation_id=props.correlation_id))
    return props


def test_direct_reply_to_rpc_pika(
    connect: Callable[..., pika.BlockingConnection], names: Names
) -> None:
    client = connect()
    cch = client.channel()
    server_ch = connect().channel()
    queue = names.queue("compat.rpc")
    server_ch.queue_declare(queue)
    replies: list[Reply] = []
    tag = cch.basic_consume(REPLY_TO, lambda c, m, p, b: replies.append((m, p, b)), auto_ack=True)
    for i in range(3):
        cch.basic_publish("", queue, f"req{i}".encode(),
                          pika.BasicProperties(reply_to=REPLY_TO, correlation_id=f"corr-{i}"))
        props = _serve_one(server_ch, queue, lambda b: b.upper())
        # the server sees the address rewritten to a per-channel one
        assert props.reply_to.startswith(REPLY_TO + ".")
        assert len(props.reply_to) > len(REPLY_TO) + 1
        assert props.correlation_id == f"corr-{i}"
        assert wait_until(client, lambda: len(replies) == i + 1)  # noqa: B023 (called right here)
    assert [(p.correlation_id, b) for _m, p, b in replies] == [(f"corr-{i}", f"REQ{i}".encode()) for i in range(3)]
    method, _props, _body = replies[0]
    assert method.consumer_tag == tag
    assert method.exchange == ""
    assert method.routing_key.startswith(REPLY_TO + ".")


def test_reply_address_is_stable_per_channel(connect: Callable[..., pika.BlockingConnection], names: Names) -> None:
    client = connect()
    cch = client.channel()
    server_ch = connect().channel()
    queue = names.queue("compat.rpc")
    server_ch.queue_declare(queue)
    cch.basic_consume(REPLY_TO, lambda *a: None, auto_ack=True)
    seen = []
    for i in range(2):
        cch.basic_publish("", queue, b"r", pika.BasicProperties(reply_to=REPLY_TO, correlation_id=str(i)))
        seen.append(_serve_one(server_ch, queue, lambda b: b).reply_to)
    assert seen[0] == seen[1]


def test_reply_to_consumer_must_be_no_ack(channel: BlockingChannel) -> None:
    with channel_error(406):
        channel.basic_consume(REPLY_TO, lambda *a: None, auto_ack=False)


def test_reply_to_consumer_only_once_per_channel(channel: BlockingChannel) -> None:
    channel.basic_consume(REPLY_TO, lambda *a: None, auto_ack=True)
    with channel_error(406):
        channel.basic_consume(REPLY_TO, lambda *a: None, auto_ack=True)


def test_publish_with_reply_to_without_consumer_refused(channel: BlockingChannel, names: Names) -> None:
    queue = names.queue("compat.rpc")
    channel.queue_declare(queue)
    with channel_error(406):
        channel.basic_publish("", queue, b"who answers?", pika.BasicProperties(reply_to=REPLY_TO))
        sync(channel)


def test_publish_with_reply_to_after_cancel_refused(channel: BlockingChannel, names: Names) -> None:
    queue = names.queue("compat.rpc")
    channel.queue_declare(queue)
    tag = channel.basic_consume(REPLY_TO, lambda *a: None, auto_ack=True)
    channel.basic_cancel(tag)
    with channel_error(406):
        channel.basic_publish("", queue, b"too late", pika.BasicProperties(reply_to=REPLY_TO))
        sync(channel)


def test_reply_to_closed_channel_is_unroutable(
    connect: Callable[..., pika.BlockingConnection], names: Names
) -> None:
    client = connect()
    cch = client.channel()
    server_ch = connect().channel()
    queue = names.queue("compat.rpc")
    server_ch.queue_declare(queue)
    cch.basic_consume(REPLY_TO, lambda *a: None, auto_ack=True)
    cch.basic_publish("", queue, b"req", pika.BasicProperties(reply_to=REPLY_TO))
    for _ in range(200):
        method, props, _body = server_ch.basic_get(queue, auto_ack=True)
        if method is not None:
            break
    assert method is not None
    client.close()
    server_ch.confirm_delivery()
    with pytest.raises(pika.exceptions.UnroutableError):
        server_ch.basic_publish("", props.reply_to, b"nobody", mandatory=True)
    with pytest.raises(pika.exceptions.UnroutableError):
        server_ch.basic_publish("", REPLY_TO + ".not-a-real-address", b"nobody", mandatory=True)


async def test_direct_reply_to_rpc_aio_pika(amqp_url: str, names: Names) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        server_ch = await connection.channel()
        requests = await server_ch.declare_queue(names.queue("compat.rpc"))

        async def serve(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            async with message.process():
                assert message.reply_to is not None and message.reply_to.startswith(REPLY_TO + ".")
                await server_ch.default_exchange.publish(
                    aio_pika.Message(b"pong:" + message.body, correlation_id=message.correlation_id),
                    routing_key=message.reply_to,
                )

        await requests.consume(serve)

        client_ch = await connection.channel()
        reply_queue = await client_ch.get_queue(REPLY_TO, ensure=False)
        loop = asyncio.get_running_loop()
        pending: dict[str, asyncio.Future[bytes]] = {}

        async def on_reply(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            assert message.correlation_id is not None
            pending.pop(message.correlation_id).set_result(message.body)

        await reply_queue.consume(on_reply, no_ack=True)
        futures = []
        for i in range(3):
            pending[f"c{i}"] = future = loop.create_future()
            futures.append(future)
            await client_ch.default_exchange.publish(
                aio_pika.Message(f"ping{i}".encode(), reply_to=REPLY_TO, correlation_id=f"c{i}"),
                routing_key=requests.name,
            )
        results = await asyncio.wait_for(asyncio.gather(*futures), 5)
        assert results == [b"pong:ping0", b"pong:ping1", b"pong:ping2"]
    finally:
        await connection.close()


async def test_reply_to_manual_ack_refused_aio_pika(amqp_url: str) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        ch = await connection.channel()
        queue = await ch.get_queue(REPLY_TO, ensure=False)

        async def ignore(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            return None

        with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed):
            await queue.consume(ignore, no_ack=False)
    finally:
        await connection.close()
