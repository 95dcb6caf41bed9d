"""AMQP transactions (tx.select / tx.commit / tx.rollback)."""

from __future__ import annotations

from collections.abc import Callable

import aio_pika
import aiormq.exceptions
import pika
import pytest

from compat_tests.util import BlockingChannel, Names, channel_error

pytestmark = pytest.mark.timeout(30)


def _count(ch: BlockingChannel, queue: str) -> int:
    return ch.queue_declare(queue, passive=True).method.message_count


def _get_bodies(ch: BlockingChannel, queue: str) -> list[bytes]:
    bodies: list[bytes] = []
    while True:
        method, _props, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            return bodies
        bodies.append(body)


def test_publishes_visible_only_after_commit(
    connect: Callable[..., pika.BlockingConnection], names: Names
) -> None:
    tx_ch = connect().channel()
    observer = connect().channel()
    queue = names.queue()
    observer.queue_declare(queue)
    tx_ch.tx_select()
    for i in range(3):
        tx_ch.basic_publish("", queue, f"t{i}".encode())
    # a synchronous round trip on the tx channel: the broker has seen the publishes
    tx_ch.queue_declare(queue, passive=True)
    assert _count(observer, queue) == 0
    tx_ch.tx_commit()
    assert _count(observer, queue) == 3
    # the channel stays transactional: the next batch waits for the next commit
    tx_ch.basic_publish("", queue, b"t3")
    tx_ch.queue_declare(queue, passive=True)
    assert _count(observer, queue) == 3
    tx_ch.tx_commit()
    assert _get_bodies(observer, queue) == [b"t0", b"t1", b"t2", b"t3"]


def test_rollback_discards_publishes(connect: Callable[..., pika.BlockingConnection], names: Names) -> None:
    tx_ch = connect().channel()
    queue = names.queue()
    tx_ch.queue_declare(queue)
    tx_ch.tx_select()
    tx_ch.basic_publish("", queue, b"discarded-1")
    tx_ch.basic_publish("", queue, b"discarded-2")
    tx_ch.tx_rollback()
    tx_ch.basic_publish("", queue, b"kept")
    tx_ch.tx_commit()
    assert _get_bodies(connect().channel(), queue) == [b"kept"]


def test_uncommitted_publishes_lost_when_channel_closes(
    connect: Callable[..., pika.BlockingConnection], names: Names
) -> None:
    conn = connect()
    tx_ch = conn.channel()
    queue = names.queue()
    tx_ch.queue_declare(queue)
    tx_ch.tx_select()
    tx_ch.basic_publish("", queue, b"never")
    tx_ch.close()
    assert _count(conn.channel(), queue) == 0


def test_acks_take_effect_on_commit(connect: Callable[..., pika.BlockingConnection], names: Names) -> None:
    conn = connect()
    setup = conn.channel()
    queue = names.queue()
    setup.queue_declare(queue)
    for i in range(3):
        setup.basic_publish("", queue, f"a{i}".encode())
    tx_ch = conn.channel()
    tx_ch.tx_select()
    tags = []
    for _ in range(3):
        method, _props, _body = tx_ch.basic_get(queue, auto_ack=False)
        tags.append(method.delivery_tag)
    tx_ch.basic_ack(tags[0])
    tx_ch.basic_ack(tags[2])
    tx_ch.tx_commit()
    tx_ch.close()  # only the one never acked comes back
    assert _get_bodies(setup, queue) == [b"a1"]


def test_rollback_leaves_acks_undone(connect: Callable[..., pika.BlockingConnection], names: Names) -> None:
    conn = connect()
    setup = conn.channel()
    queue = names.queue()
    setup.queue_declare(queue)
    for i in range(2):
        setup.basic_publish("", queue, f"r{i}".encode())
    tx_ch = conn.channel()
    tx_ch.tx_select()
    method, _props, _body = tx_ch.basic_get(queue, auto_ack=False)
    tx_ch.basic_get(queue, auto_ack=False)
    tx_ch.basic_ack(method.delivery_tag, multiple=True)
    tx_ch.basic_ack(method.delivery_tag + 1)
    tx_ch.tx_rollback()
    assert _count(setup, queue) == 0  # still unacked, not back in the queue
    tx_ch.close()
    redelivered = []
    for _ in range(2):
        method, _props, body = setup.basic_get(queue, auto_ack=True)
        assert method is not None and method.redelivered
        redelivered.append(body)
    assert redelivered == [b"r0", b"r1"]


def test_reject_requeue_in_tx_applies_on_commit(
    connect: Callable[..., pika.BlockingConnection], names: Names
) -> None:
    conn = connect()
    setup = conn.channel()
    queue = names.queue()
    setup.queue_declare(queue)
    setup.basic_publish("", queue, b"bounce")
    tx_ch = conn.channel()
    tx_ch.tx_select()
    method, _props, _body = tx_ch.basic_get(queue, auto_ack=False)
    tx_ch.basic_reject(method.delivery_tag, requeue=True)
    tx_ch.queue_declare(queue, passive=True)
    assert _count(setup, queue) == 0
    tx_ch.tx_commit()
    assert _count(setup, queue) == 1


def test_commit_on_non_tx_channel_refused(channel: BlockingChannel) -> None:
    with channel_error(406, "not transactional"):
        channel.tx_commit()


def test_rollback_on_non_tx_channel_refused(channel: BlockingChannel) -> None:
    with channel_error(406, "not transactional"):
        channel.tx_rollback()


def test_confirm_select_after_tx_select_refused(channel: BlockingChannel) -> None:
    channel.tx_select()
    with channel_error(406):
        channel.confirm_delivery()


def test_tx_select_after_confirm_select_refused(channel: BlockingChannel) -> None:
    channel.confirm_delivery()
    with channel_error(406):
        channel.tx_select()


def test_tx_select_twice_is_fine(channel: BlockingChannel) -> None:
    channel.tx_select()
    channel.tx_select()
    channel.tx_commit()


async def test_transaction_aio_pika(amqp_url: str, names: Names) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        ch = await connection.channel(publisher_confirms=False)
        observer = await connection.channel()
        queue = await observer.declare_queue(names.queue())
        tx = ch.transaction()
        await tx.select()
        await ch.default_exchange.publish(aio_pika.Message(b"aio-1"), routing_key=queue.name)
        await tx.rollback()
        await tx.select()
        await ch.default_exchange.publish(aio_pika.Message(b"aio-2"), routing_key=queue.name)
        declared = await observer.declare_queue(queue.name, passive=True)
        assert declared.declaration_result.message_count == 0
        await tx.commit()
        declared = await observer.declare_queue(queue.name, passive=True)
        assert declared.declaration_result.message_count == 1
        message = await queue.get(no_ack=True)
        assert message is not None and message.body == b"aio-2"
    finally:
        await connection.close()


async def test_transaction_context_manager_aio_pika(amqp_url: str, names: Names) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        ch = await connection.channel(publisher_confirms=False)
        queue = await ch.declare_queue(names.queue())
        async with ch.transaction():
            for i in range(3):
                await ch.default_exchange.publish(aio_pika.Message(f"cm{i}".encode()), routing_key=queue.name)
        declared = await ch.declare_queue(queue.name, passive=True)
        assert declared.declaration_result.message_count == 3
    finally:
        await connection.close()


async def test_confirm_channel_cannot_use_tx_aio_pika(amqp_url: str) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        ch = await connection.channel(publisher_confirms=True)
        underlay = await ch.get_underlay_channel()
        with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed):
            await underlay.tx_select()
    finally:
        await connection.close()
