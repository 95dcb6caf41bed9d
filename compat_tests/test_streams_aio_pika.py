"""Stream queues with aio-pika: every kind of x-stream-offset, the offset header, a group resuming."""

from __future__ import annotations

import asyncio
import datetime
import os
from typing import Any

import aio_pika
import aio_pika.abc
import pytest

from compat_tests.util import Names

pytestmark = [pytest.mark.timeout(30), pytest.mark.asyncio]


async def collect(queue: aio_pika.abc.AbstractQueue, n: int, settle_wait: float = 0.2,
                  **arguments: Any) -> list[tuple[int, bytes]]:
    got: list[tuple[int, bytes]] = []
    done = asyncio.Event()

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        got.append((int(message.headers["x-stream-offset"]), message.body))  # type: ignore[arg-type]
        await message.ack()
        if len(got) >= n:
            done.set()

    tag = await queue.consume(on_message, arguments=arguments)
    if n:
        await asyncio.wait_for(done.wait(), 5)
    await asyncio.sleep(settle_wait)
    await queue.cancel(tag)
    return got


async def test_offsets_of_every_kind(amqp_url: str, names: Names) -> None:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.set_qos(prefetch_count=50)
        name = names.queue()
        queue = await channel.declare_queue(name, durable=True, arguments={"x-queue-type": "stream"})
        for i in range(5):
            await channel.default_exchange.publish(aio_pika.Message(b"a%d" % i), routing_key=name)
        await asyncio.sleep(1.1)  # AMQP timestamps count whole seconds
        middle = datetime.datetime.now(tz=datetime.UTC)
        await asyncio.sleep(0.1)
        for i in range(5, 8):
            await channel.default_exchange.publish(aio_pika.Message(b"a%d" % i), routing_key=name)

        assert [o for o, _ in await collect(queue, 8, **{"x-stream-offset": "first"})] == list(range(8))
        assert await collect(queue, 3, **{"x-stream-offset": 5}) == [(5, b"a5"), (6, b"a6"), (7, b"a7")]
        assert await collect(queue, 1, **{"x-stream-offset": "last"}) == [(7, b"a7")]
        assert await collect(queue, 0, **{"x-stream-offset": "next"}) == []
        assert [o for o, _ in await collect(queue, 3, **{"x-stream-offset": middle})] == [5, 6, 7]
        assert len(await collect(queue, 8, **{"x-stream-offset": "10m"})) == 8


@pytest.mark.skipif(bool(os.environ.get("LEVERET_TEST_AMQP_URL")), reason="consumer groups are a Leveret extension")
async def test_group_resumes(amqp_url: str, names: Names) -> None:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.set_qos(prefetch_count=50)
        name = names.queue()
        queue = await channel.declare_queue(name, durable=True, arguments={"x-queue-type": "stream"})
        for i in range(8):
            await channel.default_exchange.publish(aio_pika.Message(b"a%d" % i), routing_key=name)
        # A consumer group reads part of the stream, goes away and comes back where it stopped.
        group = {"x-stream-consumer-group": "aio", "x-stream-offset": "first"}
        partial: list[int] = []
        enough = asyncio.Event()

        async def take_three(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            if len(partial) < 3:
                partial.append(int(message.headers["x-stream-offset"]))  # type: ignore[arg-type]
                await message.ack()
            if len(partial) == 3:
                enough.set()

        tag = await queue.consume(take_three, arguments=group)
        await asyncio.wait_for(enough.wait(), 5)
        await channel.close()
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=50)
        queue = await channel.get_queue(name)
        assert tag
        assert [o for o, _ in await collect(queue, 5, **group)] == [3, 4, 5, 6, 7]
