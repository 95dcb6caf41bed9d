"""Publisher confirms with pika (blocking and select), aio-pika and raw frames."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aio_pika
import pika
import pika.exceptions
import pytest
from pamqp import commands

from compat_tests.raw_amqp import RawAMQP
from compat_tests.util import BlockingChannel, Names, channel_error, run_ioloop

pytestmark = pytest.mark.timeout(30)

RawFactory = Callable[[], RawAMQP]


def _confirmed_tags(acks: list[tuple[int, bool]], published: int, strict: bool = True) -> list[int]:
    """Expand (delivery_tag, multiple) confirms into the sorted confirmed tags.

    ``strict``: confirms must arrive in increasing tag order.  RabbitMQ only
    guarantees that when every message takes the same path; an unroutable
    message is confirmed at once, possibly before earlier routed ones.
    A tag must never be confirmed twice.
    """
    confirmed: set[int] = set()
    last = 0
    for tag, multiple in acks:
        if strict:
            assert tag > last, f"confirm tags must increase: {acks}"
        last = tag
        assert 1 <= tag <= published
        if multiple:
            newly = {t for t in range(1, tag + 1) if t not in confirmed}
            assert newly, f"multiple-ack {tag} confirmed nothing new: {acks}"
            confirmed |= newly
        else:
            assert tag not in confirmed, f"tag {tag} confirmed twice: {acks}"
            confirmed.add(tag)
    return sorted(confirmed)


def test_blocking_confirm_publish_succeeds(channel: BlockingChannel) -> None:
    channel.confirm_delivery()
    queue = channel.queue_declare("", exclusive=True).method.queue
    for i in range(10):
        channel.basic_publish("", queue, f"c{i}".encode(), pika.BasicProperties(delivery_mode=2))
    assert channel.queue_declare(queue, passive=True).method.message_count == 10


def test_blocking_confirm_unroutable_mandatory_raises(channel: BlockingChannel, names: Names) -> None:
    channel.confirm_delivery()
    with pytest.raises(pika.exceptions.UnroutableError) as info:
        channel.basic_publish("amq.direct", names("compat.nobody"), b"bounce", mandatory=True)
    assert len(info.value.messages) == 1
    returned = info.value.messages[0]
    assert returned.method.reply_code == 312
    assert returned.method.reply_text == "NO_ROUTE"
    assert returned.body == b"bounce"
    # without mandatory an unroutable message is simply confirmed
    channel.basic_publish("amq.direct", names("compat.nobody"), b"dropped")
    assert channel.is_open


def test_blocking_confirm_to_missing_exchange(channel: BlockingChannel, names: Names) -> None:
    channel.confirm_delivery()
    with channel_error(404, "NOT_FOUND - no exchange"):
        channel.basic_publish(names("compat.nope"), "rk", b"x")


def test_confirm_and_tx_are_exclusive(connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    ch.confirm_delivery()
    with channel_error(406, "PRECONDITION_FAILED - cannot switch from confirm to tx mode"):
        ch.tx_select()
    ch = connection.channel()
    ch.tx_select()
    with channel_error(406, "PRECONDITION_FAILED - cannot switch from tx to confirm mode"):
        ch.confirm_delivery()


def _collect_confirms(client: RawAMQP, count: int, strict: bool) -> tuple[list[int], int]:
    acks: list[tuple[int, bool]] = []
    confirmed: list[int] = []
    returns = 0
    while len(confirmed) < count:
        _ch, value = client.read_frame()
        if isinstance(value, commands.Basic.Ack):
            acks.append((value.delivery_tag, value.multiple))
            confirmed = _confirmed_tags(acks, count, strict)
        elif isinstance(value, commands.Basic.Return):
            returns += 1
            client.read_content()
        else:
            raise AssertionError(f"unexpected frame {value!r}")
    return confirmed, returns


def test_raw_confirm_delivery_tags_increase(raw: RawFactory) -> None:
    client = raw()
    client.handshake()
    client.open_channel(1)
    client.open_channel(2)
    queue = client.rpc(commands.Queue.Declare(queue="", exclusive=True)).queue
    assert isinstance(client.rpc(commands.Confirm.Select()), commands.Confirm.SelectOk)
    count = 100
    for i in range(count):
        client.publish(1, f"m{i}".encode(), routing_key=queue)
    confirmed, returns = _collect_confirms(client, count, strict=True)
    assert confirmed == list(range(1, count + 1))
    assert returns == 0
    # another channel has its own counter starting at 1; nowait select
    client.send(commands.Confirm.Select(nowait=True), 2)
    client.publish(2, b"other", routing_key=queue)
    ack = client.expect(commands.Basic.Ack)
    assert ack.delivery_tag == 1
    # and channel 1 continues where it was
    client.publish(1, b"more", routing_key=queue)
    ack = client.expect(commands.Basic.Ack)
    assert ack.delivery_tag == count + 1


def test_raw_confirms_mixed_routing(raw: RawFactory, names: Names) -> None:
    client = raw()
    client.handshake()
    client.open_channel(1)
    queue = client.rpc(commands.Queue.Declare(queue="", exclusive=True)).queue
    assert isinstance(client.rpc(commands.Confirm.Select()), commands.Confirm.SelectOk)
    count = 50
    for i in range(count):
        if i % 10 == 3:  # mandatory + unroutable: basic.return then ack
            client.publish(1, b"r", exchange="amq.direct", routing_key=names("compat.nobody"), mandatory=True)
        elif i % 10 == 7:  # unroutable: just acked
            client.publish(1, b"u", exchange="amq.direct", routing_key=names("compat.nobody"))
        else:
            client.publish(1, f"m{i}".encode(), routing_key=queue)
    confirmed, returns = _collect_confirms(client, count, strict=False)
    assert confirmed == list(range(1, count + 1))
    assert returns == 5


def test_select_connection_confirms(pika_params: pika.URLParameters) -> None:
    count = 30
    state: dict[str, Any] = {"acks": [], "nacks": 0}

    def on_open(conn: pika.SelectConnection) -> None:
        conn.channel(on_open_callback=on_channel)

    def on_channel(ch: pika.channel.Channel) -> None:
        state["ch"] = ch
        ch.confirm_delivery(on_confirm, callback=lambda _f: ch.queue_declare("", exclusive=True, callback=on_queue))

    def on_queue(frame: pika.frame.Method) -> None:
        for i in range(count):
            state["ch"].basic_publish("", frame.method.queue, f"s{i}".encode())

    def on_confirm(frame: pika.frame.Method) -> None:
        method = frame.method
        if isinstance(method, pika.spec.Basic.Nack):
            state["nacks"] += 1
        else:
            state["acks"].append((method.delivery_tag, method.multiple))
        if state["acks"] and state["acks"][-1][0] == count:
            state["conn"].close()

    def on_closed(conn: pika.SelectConnection, _reason: BaseException) -> None:
        conn.ioloop.stop()

    conn = pika.SelectConnection(
        pika_params,
        on_open_callback=on_open,
        on_open_error_callback=lambda c, _e: c.ioloop.stop(),
        on_close_callback=on_closed,
    )
    state["conn"] = conn
    run_ioloop(conn, 15)
    assert state["nacks"] == 0
    assert _confirmed_tags(state["acks"], count) == list(range(1, count + 1))


@pytest.mark.asyncio
async def test_aio_pika_publisher_confirms(amqp_url: str) -> None:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        queue = await channel.declare_queue(exclusive=True)
        confirmation = await channel.default_exchange.publish(aio_pika.Message(b"confirmed"), routing_key=queue.name)
        assert isinstance(confirmation, commands.Basic.Ack)
        confirmations = [
            await channel.default_exchange.publish(aio_pika.Message(f"m{i}".encode()), routing_key=queue.name)
            for i in range(5)
        ]
        acks = [c for c in confirmations if isinstance(c, commands.Basic.Ack)]
        assert len(acks) == len(confirmations)
        assert [c.delivery_tag for c in acks] == [2, 3, 4, 5, 6]
        declared = await channel.declare_queue(queue.name, passive=True)
        assert declared.declaration_result.message_count == 6


@pytest.mark.asyncio
async def test_aio_pika_unroutable_mandatory_is_returned(amqp_url: str, names: Names) -> None:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        with pytest.raises(aio_pika.exceptions.DeliveryError) as info:
            await channel.default_exchange.publish(
                aio_pika.Message(b"nobody home"), routing_key=names("compat.nobody"), mandatory=True
            )
        frame = info.value.frame
        assert isinstance(frame, commands.Basic.Return)
        assert frame.reply_code == 312


def test_confirm_acks_after_queue_has_message(connection: pika.BlockingConnection) -> None:
    # Once the confirm arrives the message must be visible in the queue.
    ch = connection.channel()
    ch.confirm_delivery()
    queue = ch.queue_declare("", exclusive=True).method.queue
    other = connection.channel()
    for i in range(20):
        ch.basic_publish("", queue, f"v{i}".encode())
        method, _props, body = other.basic_get(queue, auto_ack=True)
        assert method is not None and body == f"v{i}".encode()
