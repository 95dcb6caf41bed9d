"""aio-pika (aiormq/pamqp) client compatibility."""

from __future__ import annotations

import asyncio
import datetime
import uuid
from collections.abc import AsyncIterator

import aio_pika
import aio_pika.abc
import aiormq.exceptions
import pytest
import pytest_asyncio
from pamqp import commands

from compat_tests.util import Names

pytestmark = [pytest.mark.timeout(30), pytest.mark.asyncio]


@pytest_asyncio.fixture
async def robust(amqp_url: str) -> AsyncIterator[aio_pika.abc.AbstractRobustConnection]:
    connection = await aio_pika.connect_robust(amqp_url, reconnect_interval=0.5)
    try:
        yield connection
    finally:
        await connection.close()


async def test_connect_robust_declare_publish(robust: aio_pika.abc.AbstractRobustConnection, names: Names) -> None:
    assert not robust.is_closed
    channel = await robust.channel(publisher_confirms=True)
    exchange = await channel.declare_exchange(names.exchange(), aio_pika.ExchangeType.TOPIC, auto_delete=True)
    queue = await channel.declare_queue(exclusive=True)
    await queue.bind(exchange, routing_key="logs.#")
    confirmation = await exchange.publish(
        aio_pika.Message(b"hello", content_type="text/plain", delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
        routing_key="logs.app.info",
    )
    assert isinstance(confirmation, commands.Basic.Ack)
    message = await queue.get(timeout=5)
    assert message is not None
    assert message.body == b"hello"
    assert message.content_type == "text/plain"
    assert message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert message.routing_key == "logs.app.info"
    await message.ack()
    assert await queue.get(fail=False) is None
    await queue.unbind(exchange, routing_key="logs.#")
    await exchange.delete()


async def test_consume_iterator(robust: aio_pika.abc.AbstractRobustConnection) -> None:
    channel = await robust.channel()
    queue = await channel.declare_queue(exclusive=True)
    for i in range(5):
        await channel.default_exchange.publish(aio_pika.Message(f"it{i}".encode()), routing_key=queue.name)
    got: list[bytes] = []
    async with queue.iterator() as messages:
        async for message in messages:
            async with message.process():
                got.append(message.body)
            if len(got) == 5:
                break
    assert got == [f"it{i}".encode() for i in range(5)]
    declared = await channel.declare_queue(queue.name, passive=True)
    assert declared.declaration_result.message_count == 0
    assert declared.declaration_result.consumer_count == 0


async def test_consume_callback(robust: aio_pika.abc.AbstractRobustConnection) -> None:
    channel = await robust.channel()
    queue = await channel.declare_queue(exclusive=True)
    got: list[bytes] = []
    done = asyncio.Event()

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        got.append(message.body)
        await message.ack()
        if len(got) == 10:
            done.set()

    tag = await queue.consume(on_message)
    for i in range(10):
        await channel.default_exchange.publish(aio_pika.Message(f"cb{i}".encode()), routing_key=queue.name)
    await asyncio.wait_for(done.wait(), 10)
    assert got == [f"cb{i}".encode() for i in range(10)]
    await queue.cancel(tag)


async def test_rpc_pattern(amqp_url: str, names: Names) -> None:
    rpc_queue_name = names.queue("compat.rpc")
    server = await aio_pika.connect(amqp_url)
    client = await aio_pika.connect(amqp_url)
    async with server, client:
        server_channel = await server.channel()
        await server_channel.set_qos(prefetch_count=1)
        rpc_queue = await server_channel.declare_queue(rpc_queue_name, auto_delete=True)

        async def serve(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            async with message.process():
                assert message.reply_to is not None
                number = int(message.body)
                await server_channel.default_exchange.publish(
                    aio_pika.Message(str(number * number).encode(), correlation_id=message.correlation_id),
                    routing_key=message.reply_to,
                )

        await rpc_queue.consume(serve)

        client_channel = await client.channel()
        callback_queue = await client_channel.declare_queue(exclusive=True)
        pending: dict[str, asyncio.Future[bytes]] = {}

        async def on_response(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            assert message.correlation_id is not None
            pending.pop(message.correlation_id).set_result(message.body)

        await callback_queue.consume(on_response, no_ack=True)

        async def call(number: int) -> int:
            correlation_id = str(uuid.uuid4())
            future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
            pending[correlation_id] = future
            await client_channel.default_exchange.publish(
                aio_pika.Message(str(number).encode(), correlation_id=correlation_id, reply_to=callback_queue.name),
                routing_key=rpc_queue_name,
            )
            return int(await asyncio.wait_for(future, 10))

        results = await asyncio.gather(*(call(n) for n in range(10)))
        assert results == [n * n for n in range(10)]
        assert pending == {}


async def test_qos(robust: aio_pika.abc.AbstractRobustConnection) -> None:
    channel = await robust.channel()
    await channel.set_qos(prefetch_count=2)
    queue = await channel.declare_queue(exclusive=True)
    for i in range(6):
        await channel.default_exchange.publish(aio_pika.Message(f"q{i}".encode()), routing_key=queue.name)
    held: list[aio_pika.abc.AbstractIncomingMessage] = []

    async def hold(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        held.append(message)

    await queue.consume(hold)
    await asyncio.sleep(0.5)
    assert len(held) == 2
    await held[0].ack()
    await asyncio.sleep(0.3)
    assert len(held) == 3
    assert [m.body for m in held] == [b"q0", b"q1", b"q2"]


async def test_reject_requeue_and_nack(robust: aio_pika.abc.AbstractRobustConnection) -> None:
    channel = await robust.channel()
    queue = await channel.declare_queue(exclusive=True)
    await channel.default_exchange.publish(aio_pika.Message(b"again"), routing_key=queue.name)
    first = await queue.get(timeout=5)
    assert first is not None and not first.redelivered
    await first.reject(requeue=True)
    second = await queue.get(timeout=5)
    assert second is not None and second.redelivered and second.body == b"again"
    await second.nack(requeue=False)
    assert await queue.get(fail=False) is None


async def test_message_properties_round_trip(robust: aio_pika.abc.AbstractRobustConnection) -> None:
    channel = await robust.channel()
    queue = await channel.declare_queue(exclusive=True)
    timestamp = datetime.datetime(2024, 5, 6, 7, 8, 9, tzinfo=datetime.UTC)
    headers: dict[str, aio_pika.abc.FieldValue] = {
        "float": 1.25,
        "int": 7,
        "big": 2**45,
        "str": "s",
        "bool": True,
        "list": [1, "a", False],
        "table": {"nested": {"deep": "yes"}},
    }
    await channel.default_exchange.publish(
        aio_pika.Message(
            b"props",
            headers=headers,
            content_type="application/octet-stream",
            content_encoding="gzip",
            priority=3,
            correlation_id="cid",
            reply_to="rq",
            expiration=30,
            message_id="mid",
            timestamp=timestamp,
            type="t",
            user_id="guest",
            app_id="aio",
        ),
        routing_key=queue.name,
    )
    message = await queue.get(timeout=5, no_ack=True)
    assert message is not None
    assert message.headers == headers
    assert message.content_type == "application/octet-stream"
    assert message.content_encoding == "gzip"
    assert message.priority == 3
    assert message.correlation_id == "cid"
    assert message.reply_to == "rq"
    assert message.message_id == "mid"
    assert message.timestamp == timestamp
    assert message.type == "t"
    assert message.user_id == "guest"
    assert message.app_id == "aio"
    assert message.expiration is not None


async def test_channel_errors(robust: aio_pika.abc.AbstractRobustConnection, names: Names) -> None:
    channel = await robust.channel()
    with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity) as info:
        await channel.declare_queue(names("compat.nope"), passive=True)
    assert "NOT_FOUND - no queue" in str(info.value)
    channel = await robust.channel()
    with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
        await channel.declare_queue(names("amq.compat"))
    channel = await robust.channel()
    name = names.queue()
    await channel.declare_queue(name, durable=True)
    with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed) as failed:
        await channel.declare_queue(name, durable=False)
    assert "inequivalent arg 'durable'" in str(failed.value)
    # the connection survives channel errors
    fresh = await robust.channel()
    await fresh.declare_queue(exclusive=True)


async def test_queue_purge_and_delete(robust: aio_pika.abc.AbstractRobustConnection, names: Names) -> None:
    channel = await robust.channel()
    queue = await channel.declare_queue(names.queue())
    for i in range(4):
        await channel.default_exchange.publish(aio_pika.Message(f"p{i}".encode()), routing_key=queue.name)
    purged = await queue.purge()
    assert purged.message_count == 4
    await channel.default_exchange.publish(aio_pika.Message(b"x"), routing_key=queue.name)
    deleted = await queue.delete(if_unused=True, if_empty=False)
    assert deleted.message_count == 1


async def test_robust_connection_recovers_after_connection_error(
    robust: aio_pika.abc.AbstractRobustConnection,
) -> None:
    channel = await robust.channel()
    queue = await channel.declare_queue(exclusive=True)
    reconnected = asyncio.Event()
    robust.reconnect_callbacks.add(lambda *_args: reconnected.set())
    # basic.recover(requeue=false) is a connection-level 540 NOT_IMPLEMENTED
    underlay = await channel.get_underlay_channel()
    with pytest.raises((aiormq.exceptions.AMQPError, ConnectionError)):
        await underlay.basic_recover(requeue=False)
    await asyncio.wait_for(reconnected.wait(), 15)
    # the robust channel and its exclusive queue were re-declared on the new connection
    await channel.default_exchange.publish(aio_pika.Message(b"after"), routing_key=queue.name)
    message = await queue.get(timeout=5)
    assert message is not None and message.body == b"after"
    await message.ack()
