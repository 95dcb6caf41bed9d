"""Resource alarms: the alarm set and its wait (core/engine/alarms.py), the disk limit (leveret/node/resources.py)."""

from __future__ import annotations

import asyncio

import pytest

from core.engine.alarms import DISK, MEMORY, Alarms
from core.engine.paging import MESSAGE_BYTES
from harness.brokers import local_broker
from leveret.node.resources import memory_use, parse_disk_free_limit


async def test_wait_clear_returns_once_every_alarm_is_cleared() -> None:
    alarms = Alarms()
    changes: list[bool] = []
    alarms.listeners.append(changes.append)
    await asyncio.wait_for(alarms.wait_clear(), 0.1)  # none raised: at once
    assert alarms.set(MEMORY, True) and not alarms.set(DISK, True)  # the second changes nothing for publishers
    waiter = asyncio.ensure_future(alarms.wait_clear())
    await asyncio.sleep(0.01)
    assert not alarms.set(MEMORY, False)  # disk still blocks
    await asyncio.sleep(0.01)
    assert not waiter.done()
    assert alarms.set(DISK, False)
    await asyncio.wait_for(waiter, 0.5)
    assert changes == [True, False]


@pytest.mark.parametrize(("text", "expected"), [
    ("50MB", 50_000_000), ("2GiB", 2 * 1024**3), ("1000000", 1_000_000), ("512kB", 512_000), ("3M", 3 * 1024**2),
    ("mem_relative:1.5", 3_000), ("{mem_relative, 0.5}", 1_000),
])
def test_disk_free_limit_as_rabbitmq_writes_it(text: str, expected: int) -> None:
    assert parse_disk_free_limit(text, total_memory=2_000) == expected


@pytest.mark.parametrize("text", ["plenty", "10 parsecs", "-5MB", ""])
def test_bad_disk_free_limits_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="disk-free-limit"):
        parse_disk_free_limit(text, total_memory=2_000)


async def test_memory_use_counts_the_index_of_every_message_held() -> None:
    from core.model import properties
    from core.model.message import Message

    broker = local_broker()
    vh = broker.vhosts["/"]
    q = vh.declare_queue("q", owner=None)
    props = properties.encode({})
    for _ in range(10):
        q.enqueue(Message("", "q", props, bytes(1000)))
    use = memory_use(broker, None)
    assert use.bodies == 10_000 and use.index == 10 * MESSAGE_BYTES and use.partial_and_buffers == 0


def test_a_connection_holds_its_partial_bodies_and_unparsed_input() -> None:
    """What the memory alarm reads from an AMQP connection (amqp_frontend/connection.py held_bytes)."""
    from pamqp import commands, frame
    from pamqp.body import ContentBody
    from pamqp.header import ContentHeader

    from tests.amqp_client import connected

    client = connected(channels=(1, 2))
    client.read()
    assert client.conn.held_bytes() == 0
    announced = 128 * 1024 * 1024
    for ch in (1, 2):
        client.send(ch, commands.Basic.Publish(exchange="", routing_key="nowhere"),
                    ContentHeader(0, announced, commands.Basic.Properties()))
        client.send(ch, *[ContentBody(bytes(100_000)) for _ in range(5)])
    assert client.conn.held_bytes() == 2 * 500_000  # two channels, 500 kB each so far
    partial_frame = frame.marshal(ContentBody(bytes(50_000)), 1)[:20_000]
    client.send_raw(partial_frame)  # an incomplete frame waits in the input buffer
    assert client.conn.held_bytes() == 2 * 500_000 + 20_000
