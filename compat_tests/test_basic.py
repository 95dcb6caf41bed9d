"""basic.* behaviour: publish, consume, qos, get, ack/nack/reject, recover, returns."""

from __future__ import annotations

import datetime
import decimal
import struct
from collections.abc import Callable
from typing import Any

import pika
import pika.exceptions
import pika.spec
import pytest
from pamqp import commands
from pamqp.body import ContentBody
from pamqp.header import ContentHeader

from compat_tests.raw_amqp import RawAMQP, raw_frame
from compat_tests.util import (
    BlockingChannel,
    Names,
    channel_error,
    connection_error,
    drain,
    run_ioloop,
    sync,
    wait_until,
)

pytestmark = pytest.mark.timeout(30)

Connect = Callable[..., pika.BlockingConnection]
RawFactory = Callable[[], RawAMQP]
Delivery = tuple[pika.spec.Basic.Deliver, pika.spec.BasicProperties, bytes]


def _queue(ch: BlockingChannel) -> str:
    return ch.queue_declare("", exclusive=True).method.queue


def _publish(ch: BlockingChannel, queue: str, count: int, prefix: str = "m") -> list[bytes]:
    bodies = [f"{prefix}{i}".encode() for i in range(count)]
    for body in bodies:
        ch.basic_publish("", queue, body)
    sync(ch)
    return bodies


def _collector(store: list[Delivery]) -> Callable[..., None]:
    def on_message(
        _ch: BlockingChannel, method: pika.spec.Basic.Deliver, props: pika.spec.BasicProperties, body: bytes
    ) -> None:
        store.append((method, props, body))

    return on_message


def _ready(ch: BlockingChannel, queue: str) -> int:
    return ch.queue_declare(queue, passive=True).method.message_count


def _get_all(ch: BlockingChannel, queue: str) -> list[tuple[bytes, bool]]:
    out: list[tuple[bytes, bool]] = []
    while True:
        method, _props, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            return out
        out.append((body, method.redelivered))


# ------------------------------------------------------- publish / consume
def test_publish_consume_blocking(connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    queue = _queue(ch)
    bodies = _publish(ch, queue, 10)
    got: list[Delivery] = []
    tag = ch.basic_consume(queue, _collector(got))
    assert wait_until(connection, lambda: len(got) == 10)
    assert [body for _m, _p, body in got] == bodies
    assert [m.delivery_tag for m, _p, _b in got] == list(range(1, 11))
    for method, _props, _body in got:
        assert method.consumer_tag == tag
        assert method.exchange == ""
        assert method.routing_key == queue
        assert method.redelivered is False
        ch.basic_ack(method.delivery_tag)
    ch.basic_cancel(tag)
    assert _ready(ch, queue) == 0


def test_consume_generator(channel: BlockingChannel) -> None:
    queue = _queue(channel)
    bodies = _publish(channel, queue, 5)
    got = []
    for method, _props, body in channel.consume(queue, inactivity_timeout=5):
        assert method is not None, "timed out waiting for messages"
        got.append(body)
        channel.basic_ack(method.delivery_tag)
        if len(got) == 5:
            break
    channel.cancel()
    assert got == bodies


def test_publish_consume_select_connection(pika_params: pika.URLParameters) -> None:
    count = 25
    received: list[bytes] = []
    state: dict[str, Any] = {}

    def on_open(conn: pika.SelectConnection) -> None:
        conn.channel(on_open_callback=on_channel)

    def on_channel(ch: pika.channel.Channel) -> None:
        state["ch"] = ch
        ch.basic_qos(prefetch_count=5, callback=lambda _f: ch.queue_declare("", exclusive=True, callback=on_declared))

    def on_declared(frame: pika.frame.Method) -> None:
        ch = state["ch"]
        queue = frame.method.queue
        ch.basic_consume(queue, on_message, callback=lambda _f: publish(queue))

    def publish(queue: str) -> None:
        for i in range(count):
            state["ch"].basic_publish("", queue, f"s{i}".encode())

    def on_message(ch: pika.channel.Channel, method: Any, _props: Any, body: bytes) -> None:
        received.append(body)
        ch.basic_ack(method.delivery_tag)
        if len(received) == count:
            state["conn"].close()

    def on_open_error(conn: pika.SelectConnection, err: BaseException) -> None:
        state["error"] = err
        conn.ioloop.stop()

    def on_closed(conn: pika.SelectConnection, reason: BaseException) -> None:
        state["closed"] = reason
        conn.ioloop.stop()

    conn = pika.SelectConnection(
        pika_params,
        on_open_callback=on_open,
        on_open_error_callback=on_open_error,
        on_close_callback=on_closed,
    )
    state["conn"] = conn
    run_ioloop(conn, 15)
    assert "error" not in state
    assert received == [f"s{i}".encode() for i in range(count)]
    assert isinstance(state.get("closed"), pika.exceptions.ConnectionClosedByClient)


def test_fifo_order_many_messages(channel: BlockingChannel) -> None:
    queue = _queue(channel)
    bodies = _publish(channel, queue, 500)
    got: list[bytes] = []
    for method, _props, body in channel.consume(queue, auto_ack=True, inactivity_timeout=5):
        assert method is not None
        got.append(body)
        if len(got) == len(bodies):
            break
    channel.cancel()
    assert got == bodies


def test_publish_to_unknown_queue_via_default_exchange_is_dropped(channel: BlockingChannel, names: Names) -> None:
    channel.basic_publish("", names("compat.nope"), b"lost")
    sync(channel)
    assert channel.is_open


# ---------------------------------------------------------------------- qos
def test_qos_per_consumer(connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    q1, q2 = _queue(ch), _queue(ch)
    _publish(ch, q1, 10)
    _publish(ch, q2, 10)
    ch.basic_qos(prefetch_count=2, global_qos=False)
    got1: list[Delivery] = []
    got2: list[Delivery] = []
    ch.basic_consume(q1, _collector(got1))
    ch.basic_consume(q2, _collector(got2))
    assert wait_until(connection, lambda: len(got1) == 2 and len(got2) == 2)
    drain(connection, 0.3)
    assert (len(got1), len(got2)) == (2, 2)
    ch.basic_ack(got1[0][0].delivery_tag)
    assert wait_until(connection, lambda: len(got1) == 3)
    drain(connection, 0.3)
    assert (len(got1), len(got2)) == (3, 2)


def test_qos_global_is_per_channel(connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    q1, q2 = _queue(ch), _queue(ch)
    _publish(ch, q1, 10)
    _publish(ch, q2, 10)
    ch.basic_qos(prefetch_count=3, global_qos=True)
    got: list[Delivery] = []
    ch.basic_consume(q1, _collector(got))
    ch.basic_consume(q2, _collector(got))
    assert wait_until(connection, lambda: len(got) == 3)
    drain(connection, 0.3)
    assert len(got) == 3
    ch.basic_ack(got[-1][0].delivery_tag, multiple=True)
    assert wait_until(connection, lambda: len(got) == 6)
    drain(connection, 0.3)
    assert len(got) == 6


def _two_queue_prefetch(connection: pika.BlockingConnection, qos_calls: list[tuple[int, bool]]) -> tuple[int, int]:
    ch = connection.channel()
    q1, q2 = _queue(ch), _queue(ch)
    _publish(ch, q1, 10)
    _publish(ch, q2, 10)
    for count, global_qos in qos_calls:
        ch.basic_qos(prefetch_count=count, global_qos=global_qos)
    got1: list[Delivery] = []
    got2: list[Delivery] = []
    ch.basic_consume(q1, _collector(got1))
    ch.basic_consume(q2, _collector(got2))
    wait_until(connection, lambda: len(got1) + len(got2) >= 4, timeout=0.5)
    drain(connection, 0.3)
    return len(got1), len(got2)


def test_qos_per_consumer_then_global_both_apply(connection: pika.BlockingConnection) -> None:
    got1, got2 = _two_queue_prefetch(connection, [(2, False), (3, True)])
    # each consumer capped at 2, the channel at 3
    assert got1 + got2 == 3
    assert got1 <= 2 and got2 <= 2


def test_qos_per_consumer_after_global_lifts_channel_limit(connection: pika.BlockingConnection) -> None:
    # RabbitMQ quirk: basic.qos(global=false) resets the channel-wide
    # (global) prefetch limit, so only the per-consumer limit remains.
    assert _two_queue_prefetch(connection, [(3, True), (2, False)]) == (2, 2)


def test_qos_applies_to_consumers_created_afterwards(connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    q1, q2 = _queue(ch), _queue(ch)
    _publish(ch, q1, 10)
    _publish(ch, q2, 10)
    ch.basic_qos(prefetch_count=2)
    got1: list[Delivery] = []
    ch.basic_consume(q1, _collector(got1))
    ch.basic_qos(prefetch_count=5)
    got2: list[Delivery] = []
    ch.basic_consume(q2, _collector(got2))
    assert wait_until(connection, lambda: len(got1) == 2 and len(got2) == 5)
    drain(connection, 0.3)
    assert (len(got1), len(got2)) == (2, 5)


def test_qos_zero_means_unlimited(connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    queue = _queue(ch)
    _publish(ch, queue, 50)
    ch.basic_qos(prefetch_count=0)
    got: list[Delivery] = []
    ch.basic_consume(queue, _collector(got))
    assert wait_until(connection, lambda: len(got) == 50)


def test_qos_prefetch_size_not_implemented(channel: BlockingChannel) -> None:
    with connection_error(540, "NOT_IMPLEMENTED - prefetch_size!=0"):
        channel.basic_qos(prefetch_size=1000)


def test_nack_requeue_respects_prefetch(connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    queue = _queue(ch)
    _publish(ch, queue, 3)
    ch.basic_qos(prefetch_count=1)
    got: list[Delivery] = []
    ch.basic_consume(queue, _collector(got))
    assert wait_until(connection, lambda: len(got) == 1)
    ch.basic_nack(got[0][0].delivery_tag, requeue=True)
    assert wait_until(connection, lambda: len(got) == 2)
    drain(connection, 0.2)
    assert len(got) == 2
    assert got[1][2] == got[0][2] == b"m0"
    assert got[1][0].redelivered is True


# --------------------------------------------------------------- consumers
def test_round_robin_between_consumers(connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    queue = _queue(ch)
    got_a: list[Delivery] = []
    got_b: list[Delivery] = []
    ch.basic_consume(queue, _collector(got_a), auto_ack=True)
    ch.basic_consume(queue, _collector(got_b), auto_ack=True)
    bodies = _publish(ch, queue, 10)
    assert wait_until(connection, lambda: len(got_a) + len(got_b) == 10)
    assert len(got_a) == 5 and len(got_b) == 5
    assert sorted(b for _m, _p, b in got_a + got_b) == sorted(bodies)
    # strictly alternating
    a_bodies = {b for _m, _p, b in got_a}
    assert a_bodies in ({b"m0", b"m2", b"m4", b"m6", b"m8"}, {b"m1", b"m3", b"m5", b"m7", b"m9"})


def test_round_robin_across_channels_with_prefetch(connect: Connect) -> None:
    conn = connect()
    ch_a, ch_b = conn.channel(), conn.channel()
    queue = _queue(ch_a)
    got_a: list[Delivery] = []
    got_b: list[Delivery] = []
    for ch, store in ((ch_a, got_a), (ch_b, got_b)):
        ch.basic_qos(prefetch_count=1)
        ch.basic_consume(queue, _collector(store))
    _publish(ch_a, queue, 6)
    assert wait_until(conn, lambda: len(got_a) == 1 and len(got_b) == 1)
    drain(conn, 0.2)
    assert len(got_a) == 1 and len(got_b) == 1
    for ch, store in ((ch_a, got_a), (ch_b, got_b)):
        ch.basic_ack(store[-1][0].delivery_tag)
    assert wait_until(conn, lambda: len(got_a) == 2 and len(got_b) == 2)


def test_no_ack_consume(connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    queue = _queue(ch)
    _publish(ch, queue, 5)
    got: list[Delivery] = []
    ch.basic_qos(prefetch_count=1)  # ignored for no-ack consumers
    ch.basic_consume(queue, _collector(got), auto_ack=True)
    assert wait_until(connection, lambda: len(got) == 5)
    ch.close()
    # closing the channel does not bring no-ack messages back
    assert _ready(connection.channel(), queue) == 0


def test_exclusive_consumer(connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    queue = _queue(ch)
    ch.basic_consume(queue, lambda *a: None, exclusive=True)
    with channel_error(403, f"ACCESS_REFUSED - queue '{queue}' in vhost '/' in exclusive use"):
        connection.channel().basic_consume(queue, lambda *a: None)


def test_exclusive_consume_refused_when_queue_has_consumers(connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    queue = _queue(ch)
    ch.basic_consume(queue, lambda *a: None)
    with channel_error(403, "in exclusive use"):
        connection.channel().basic_consume(queue, lambda *a: None, exclusive=True)


def test_exclusive_consumer_released_on_cancel(connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    queue = _queue(ch)
    tag = ch.basic_consume(queue, lambda *a: None, exclusive=True)
    ch.basic_cancel(tag)
    other = connection.channel()
    other.basic_consume(queue, lambda *a: None)
    assert other.queue_declare(queue, passive=True).method.consumer_count == 1


def test_consume_missing_queue(channel: BlockingChannel, names: Names) -> None:
    name = names("compat.nope")
    with channel_error(404, f"NOT_FOUND - no queue '{name}' in vhost '/'"):
        channel.basic_consume(name, lambda *a: None)


def test_server_generated_consumer_tag(raw: RawFactory) -> None:
    client = raw()
    client.handshake()
    client.open_channel(1)
    queue = client.rpc(commands.Queue.Declare(queue="", exclusive=True)).queue
    ok = client.rpc(commands.Basic.Consume(queue=queue, consumer_tag=""))
    assert isinstance(ok, commands.Basic.ConsumeOk)
    assert ok.consumer_tag is not None and ok.consumer_tag.startswith("amq.ctag-")
    other = client.rpc(commands.Basic.Consume(queue=queue, consumer_tag=""))
    assert other.consumer_tag.startswith("amq.ctag-") and other.consumer_tag != ok.consumer_tag
    client.publish(1, b"hello", routing_key=queue)
    deliver = client.expect(commands.Basic.Deliver)
    assert deliver.consumer_tag in (ok.consumer_tag, other.consumer_tag)
    _header, body = client.read_content()
    assert body == b"hello"
    cancel_ok = client.rpc(commands.Basic.Cancel(consumer_tag=ok.consumer_tag))
    assert isinstance(cancel_ok, commands.Basic.CancelOk)
    assert cancel_ok.consumer_tag == ok.consumer_tag


def test_duplicate_consumer_tag_is_connection_error(raw: RawFactory) -> None:
    client = raw()
    client.handshake()
    client.open_channel(1)
    queue = client.rpc(commands.Queue.Declare(queue="", exclusive=True)).queue
    client.rpc(commands.Basic.Consume(queue=queue, consumer_tag="same"))
    close = client.rpc(commands.Basic.Consume(queue=queue, consumer_tag="same"))
    assert isinstance(close, commands.Connection.Close)
    assert close.reply_code == 530
    assert close.reply_text == "NOT_ALLOWED - attempt to reuse consumer tag 'same'"


def test_cancel_unknown_consumer_tag_is_ok(raw: RawFactory) -> None:
    client = raw()
    client.handshake()
    client.open_channel(1)
    ok = client.rpc(commands.Basic.Cancel(consumer_tag="never-existed"))
    assert isinstance(ok, commands.Basic.CancelOk)
    assert ok.consumer_tag == "never-existed"


def test_client_cancel_stops_deliveries(connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    queue = _queue(ch)
    got: list[Delivery] = []
    tag = ch.basic_consume(queue, _collector(got), auto_ack=True)
    _publish(ch, queue, 2, "before")
    assert wait_until(connection, lambda: len(got) == 2)
    ch.basic_cancel(tag)
    _publish(ch, queue, 3, "after")
    drain(connection, 0.2)
    assert len(got) == 2
    ok = ch.queue_declare(queue, passive=True)
    assert ok.method.message_count == 3
    assert ok.method.consumer_count == 0


def test_cancel_returns_unacked_to_caller_not_queue(connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    queue = _queue(ch)
    _publish(ch, queue, 2)
    got: list[Delivery] = []
    tag = ch.basic_consume(queue, _collector(got))
    assert wait_until(connection, lambda: len(got) == 2)
    ch.basic_cancel(tag)
    # after cancel the deliveries are still unacked and can be acked
    assert _ready(ch, queue) == 0
    ch.basic_ack(got[-1][0].delivery_tag, multiple=True)
    sync(ch)
    assert ch.is_open


def test_server_cancel_when_queue_deleted(connection: pika.BlockingConnection, names: Names) -> None:
    queue = names.queue()
    ch = connection.channel()
    ch.queue_declare(queue)
    cancels: list[Any] = []
    ch.add_on_cancel_callback(cancels.append)
    tag = ch.basic_consume(queue, lambda *a: None)
    connection.channel().queue_delete(queue)
    assert wait_until(connection, lambda: len(cancels) == 1)
    frame = cancels[0]
    method = getattr(frame, "method", frame)
    assert isinstance(method, pika.spec.Basic.Cancel)
    assert method.consumer_tag == tag
    assert ch.is_open


def test_server_cancel_raw(raw: RawFactory, names: Names) -> None:
    queue = names.queue()
    client = raw()
    client.handshake()
    client.open_channel(1)
    client.open_channel(2)
    client.rpc(commands.Queue.Declare(queue=queue))
    client.rpc(commands.Basic.Consume(queue=queue, consumer_tag="ctag-x"))
    client.send(commands.Queue.Delete(queue=queue), 2)
    seen: dict[int, Any] = {}
    while len(seen) < 2:
        ch, value = client.read_frame()
        seen[ch] = value
    assert isinstance(seen[1], commands.Basic.Cancel)
    assert seen[1].consumer_tag == "ctag-x"
    assert isinstance(seen[2], commands.Queue.DeleteOk)


# -------------------------------------------------------------------- get
def test_basic_get(channel: BlockingChannel) -> None:
    queue = _queue(channel)
    method, props, body = channel.basic_get(queue)
    assert method is None and props is None and body is None
    _publish(channel, queue, 3)
    method, _props, body = channel.basic_get(queue)
    assert isinstance(method, pika.spec.Basic.GetOk)
    assert body == b"m0"
    assert method.message_count == 2
    assert method.redelivered is False
    assert method.exchange == "" and method.routing_key == queue
    assert method.delivery_tag == 1
    channel.basic_ack(method.delivery_tag)
    method, _props, body = channel.basic_get(queue, auto_ack=True)
    assert body == b"m1" and method.message_count == 1 and method.delivery_tag == 2
    method, _props, body = channel.basic_get(queue, auto_ack=True)
    assert body == b"m2" and method.message_count == 0
    assert channel.basic_get(queue)[0] is None


def test_basic_get_empty_raw(raw: RawFactory) -> None:
    client = raw()
    client.handshake()
    client.open_channel(1)
    queue = client.rpc(commands.Queue.Declare(queue="", exclusive=True)).queue
    empty = client.rpc(commands.Basic.Get(queue=queue))
    assert isinstance(empty, commands.Basic.GetEmpty)


def test_basic_get_missing_queue(channel: BlockingChannel, names: Names) -> None:
    with channel_error(404, "NOT_FOUND - no queue"):
        channel.basic_get(names("compat.nope"))


# ------------------------------------------------------ ack / nack / reject
def test_ack_multiple(connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    queue = _queue(ch)
    _publish(ch, queue, 5)
    tags = [ch.basic_get(queue)[0].delivery_tag for _ in range(5)]
    assert tags == [1, 2, 3, 4, 5]
    ch.basic_ack(3, multiple=True)
    ch.basic_ack(5)
    sync(ch)
    ch.close()  # only tag 4 is still unacked -> requeued
    assert _get_all(connection.channel(), queue) == [(b"m3", True)]


def test_nack_multiple_requeue_keeps_order(connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    queue = _queue(ch)
    bodies = _publish(ch, queue, 5)
    got: list[Delivery] = []
    ch.basic_consume(queue, _collector(got))
    assert wait_until(connection, lambda: len(got) == 5)
    ch.basic_nack(got[-1][0].delivery_tag, multiple=True, requeue=True)
    assert wait_until(connection, lambda: len(got) == 10)
    redelivered = got[5:]
    assert [b for _m, _p, b in redelivered] == bodies
    assert all(m.redelivered for m, _p, _b in redelivered)
    assert [m.delivery_tag for m, _p, _b in redelivered] == list(range(6, 11))
    ch.basic_ack(0, multiple=True)  # tag 0 + multiple acks everything
    sync(ch)
    ch.close()
    assert _ready(connection.channel(), queue) == 0


def test_nack_without_requeue_drops(connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    queue = _queue(ch)
    _publish(ch, queue, 3)
    method = ch.basic_get(queue)[0]
    ch.basic_nack(method.delivery_tag, requeue=False)
    sync(ch)
    assert _ready(ch, queue) == 2


def test_reject(connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    queue = _queue(ch)
    _publish(ch, queue, 2)
    first = ch.basic_get(queue)[0]
    ch.basic_reject(first.delivery_tag, requeue=False)
    second = ch.basic_get(queue)[0]
    ch.basic_reject(second.delivery_tag, requeue=True)
    sync(ch)
    assert _get_all(ch, queue) == [(b"m1", True)]


def test_requeued_message_keeps_its_position(connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    queue = _queue(ch)
    _publish(ch, queue, 5)
    getter = connection.channel()
    m0 = getter.basic_get(queue)[0]
    m1 = getter.basic_get(queue)[0]
    getter.basic_get(queue)  # m2, stays unacked
    getter.basic_ack(m1.delivery_tag)
    getter.basic_reject(m0.delivery_tag, requeue=True)
    getter.close()  # requeues m2
    assert _get_all(ch, queue) == [(b"m0", True), (b"m2", True), (b"m3", False), (b"m4", False)]


@pytest.mark.parametrize("operation", ["ack", "ack-multiple", "nack", "reject"])
def test_unknown_delivery_tag(channel: BlockingChannel, operation: str) -> None:
    with channel_error(406, "PRECONDITION_FAILED - unknown delivery tag 42"):
        if operation == "ack":
            channel.basic_ack(42)
        elif operation == "ack-multiple":
            channel.basic_ack(42, multiple=True)
        elif operation == "nack":
            channel.basic_nack(42)
        else:
            channel.basic_reject(42)
        sync(channel)


def test_double_ack_is_unknown_tag(channel: BlockingChannel) -> None:
    queue = _queue(channel)
    _publish(channel, queue, 1)
    method = channel.basic_get(queue)[0]
    channel.basic_ack(method.delivery_tag)
    with channel_error(406, f"PRECONDITION_FAILED - unknown delivery tag {method.delivery_tag}"):
        channel.basic_ack(method.delivery_tag)
        sync(channel)


def test_delivery_tags_are_per_channel(connection: pika.BlockingConnection) -> None:
    ch1, ch2 = connection.channel(), connection.channel()
    queue = _queue(ch1)
    _publish(ch1, queue, 4)
    assert ch1.basic_get(queue)[0].delivery_tag == 1
    assert ch2.basic_get(queue)[0].delivery_tag == 1
    assert ch1.basic_get(queue)[0].delivery_tag == 2
    assert ch2.basic_get(queue)[0].delivery_tag == 2
    with channel_error(406, "unknown delivery tag 3"):
        ch1.basic_ack(3)
        sync(ch1)


def test_unacked_requeued_on_channel_close(connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    queue = _queue(ch)
    bodies = _publish(ch, queue, 3)
    consumer = connection.channel()
    got: list[Delivery] = []
    consumer.basic_consume(queue, _collector(got))
    assert wait_until(connection, lambda: len(got) == 3)
    consumer.close()
    assert _get_all(ch, queue) == [(b, True) for b in bodies]


def test_unacked_requeued_on_connection_close(connect: Connect, names: Names) -> None:
    owner = connect()
    ch = owner.channel()
    queue = names.queue()
    ch.queue_declare(queue)
    bodies = _publish(ch, queue, 3)
    other = connect()
    other_ch = other.channel()
    for _ in range(3):
        assert other_ch.basic_get(queue)[0] is not None
    assert _ready(ch, queue) == 0
    other.close()
    assert wait_until(owner, lambda: _ready(ch, queue) == 3)
    assert _get_all(ch, queue) == [(b, True) for b in bodies]


def test_recover_requeue(connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    queue = _queue(ch)
    bodies = _publish(ch, queue, 3)
    got: list[Delivery] = []
    ch.basic_consume(queue, _collector(got))
    assert wait_until(connection, lambda: len(got) == 3)
    ch.basic_recover(requeue=True)
    assert wait_until(connection, lambda: len(got) == 6)
    assert [b for _m, _p, b in got[3:]] == bodies
    assert all(m.redelivered for m, _p, _b in got[3:])
    with channel_error(406, "unknown delivery tag 1"):
        ch.basic_ack(1)  # old tags are gone after recover
        sync(ch)


def test_recover_without_requeue_not_implemented(channel: BlockingChannel) -> None:
    with connection_error(540, "NOT_IMPLEMENTED - requeue=false"):
        channel.basic_recover(requeue=False)


# ----------------------------------------------------------- bodies / props
@pytest.mark.parametrize(
    "size",
    [0, 1, 131072 - 8 - 1, 131072 - 8, 131072 - 8 + 1, 1024 * 1024, 5 * 1024 * 1024],
    ids=["empty", "1B", "frame-1", "frame", "frame+1", "1MiB", "5MiB"],
)
def test_body_sizes(connection: pika.BlockingConnection, size: int) -> None:
    ch = connection.channel()
    queue = _queue(ch)
    body = (bytes(range(256)) * (size // 256 + 1))[:size]
    ch.basic_publish("", queue, body)
    got: list[Delivery] = []
    ch.basic_consume(queue, _collector(got), auto_ack=True)
    assert wait_until(connection, lambda: len(got) == 1, timeout=20)
    assert len(got[0][2]) == size
    assert got[0][2] == body
    # and through basic.get on a queue without consumers
    queue2 = _queue(ch)
    ch.basic_publish("", queue2, body)
    sync(ch)
    method, _props, fetched = ch.basic_get(queue2, auto_ack=True)
    assert method is not None
    assert fetched == body


def test_properties_round_trip(channel: BlockingChannel) -> None:
    queue = _queue(channel)
    headers: dict[str, Any] = {
        "str": "hello",
        "unicode": "héllo ✓",
        "empty": "",
        "int": 42,
        "negative": -7,
        "big": 2**40,
        "true": True,
        "false": False,
        "none": None,
        "bytes": b"\x00\x01\xff",
        "decimal": decimal.Decimal("3.14"),
        "timestamp": datetime.datetime(2024, 1, 2, 3, 4, 5, tzinfo=datetime.UTC),
        "list": [1, "two", True, [3, [4]], {"k": "v"}],
        "empty_list": [],
        "nested": {"a": {"b": {"c": 1, "d": ["x"]}}, "flag": False},
        "empty_table": {},
    }
    props = pika.BasicProperties(
        content_type="application/json",
        content_encoding="utf-8",
        headers=headers,
        delivery_mode=2,
        priority=5,
        correlation_id="corr-1",
        reply_to="reply.queue",
        expiration="60000",
        message_id="msg-1",
        timestamp=1700000000,
        type="my.type",
        user_id="guest",
        app_id="compat-tests",
        cluster_id="cluster-x",
    )
    channel.basic_publish("", queue, b"{}", props)
    method, got, body = channel.basic_get(queue, auto_ack=True)
    assert method is not None and body == b"{}"
    for name in (
        "content_type",
        "content_encoding",
        "delivery_mode",
        "priority",
        "correlation_id",
        "reply_to",
        "expiration",
        "message_id",
        "timestamp",
        "type",
        "user_id",
        "app_id",
        "cluster_id",
    ):
        assert getattr(got, name) == getattr(props, name), name
    assert got.headers == headers


def test_no_properties_round_trip(channel: BlockingChannel) -> None:
    queue = _queue(channel)
    channel.basic_publish("", queue, b"bare")
    _method, props, _body = channel.basic_get(queue, auto_ack=True)
    for name in ("content_type", "headers", "delivery_mode", "priority", "correlation_id", "timestamp"):
        assert getattr(props, name) is None, name


def _field(kind: str, payload: bytes) -> bytes:
    return kind.encode() + payload


# RabbitMQ's field-table type letters (see its 0-9-1 errata)
RABBIT_FIELDS = [
    ("b", struct.pack(">b", -5)),
    ("s", struct.pack(">h", -300)),
    ("I", struct.pack(">i", -70000)),
    ("l", struct.pack(">q", -(2**40))),
    ("f", struct.pack(">f", 1.5)),
    ("d", struct.pack(">d", 2.25)),
    ("D", struct.pack(">BI", 2, 314)),
    ("S", struct.pack(">I", 3) + b"abc"),
    ("T", struct.pack(">Q", 1700000000)),
    ("V", b""),
    ("x", struct.pack(">I", 2) + b"\x00\xff"),
    ("t", b"\x01"),
    ("F", struct.pack(">I", 8) + b"\x01kS" + struct.pack(">I", 1) + b"v"),
    ("A", struct.pack(">I", 7) + b"b\x01" + b"t\x00" + b"V" + b"b\x02"),
]
# types that only exist in the 0-9-1 spec grammar (not used by RabbitMQ clients)
SPEC_ONLY_FIELDS = [
    ("B", struct.pack(">B", 250)),
    ("u", struct.pack(">H", 60000)),
    ("i", struct.pack(">I", 3000000000)),
    ("L", struct.pack(">Q", 2**63)),
]


@pytest.mark.parametrize("fields", [RABBIT_FIELDS, SPEC_ONLY_FIELDS], ids=["rabbit-types", "spec-only-types"])
def test_content_header_passed_through_byte_for_byte(raw: RawFactory, fields: list[tuple[str, bytes]]) -> None:
    client = raw()
    client.handshake()
    client.open_channel(1)
    queue = client.rpc(commands.Queue.Declare(queue="", exclusive=True)).queue
    table = b"".join(bytes([len("k" + k)]) + ("k" + k).encode() + _field(k, v) for k, v in fields)
    # property flags: headers (bit 13) + correlation-id (bit 10)
    properties = struct.pack(">H", 0x2000 | 0x0400) + struct.pack(">I", len(table)) + table + b"\x03abc"
    header = struct.pack(">HHQ", 60, 0, 3) + properties
    client.send(commands.Basic.Publish(exchange="", routing_key=queue), 1)
    client.send_raw(raw_frame(2, 1, header) + raw_frame(3, 1, b"xyz"))
    client.send(commands.Basic.Get(queue=queue, no_ack=True), 1)
    frame_type, _ch, payload = client.read_frame_bytes()
    assert frame_type == 1 and payload[:4] == struct.pack(">HH", 60, 71)  # basic.get-ok
    frame_type, _ch, payload = client.read_frame_bytes()
    assert frame_type == 2
    assert payload == header
    frame_type, _ch, payload = client.read_frame_bytes()
    assert (frame_type, payload) == (3, b"xyz")


def test_user_id_must_match(channel: BlockingChannel) -> None:
    queue = _queue(channel)
    channel.basic_publish("", queue, b"ok", pika.BasicProperties(user_id="guest"))
    assert channel.basic_get(queue, auto_ack=True)[1].user_id == "guest"
    with channel_error(406, "PRECONDITION_FAILED - user_id property set to 'bob' but authenticated user was 'guest'"):
        channel.basic_publish("", queue, b"spoofed", pika.BasicProperties(user_id="bob"))
        sync(channel)


# --------------------------------------------------- mandatory / immediate
def test_mandatory_unroutable_is_returned(connection: pika.BlockingConnection, names: Names) -> None:
    ch = connection.channel()
    returns: list[tuple[Any, Any, bytes]] = []
    ch.add_on_return_callback(lambda _ch, method, props, body: returns.append((method, props, body)))
    exchange = names.exchange()
    ch.exchange_declare(exchange, "direct")
    ch.basic_publish(exchange, "nobody", b"bounce", pika.BasicProperties(message_id="r1"), mandatory=True)
    ch.basic_publish(exchange, "nobody", b"silently dropped", mandatory=False)
    assert wait_until(connection, lambda: len(returns) == 1)
    drain(connection, 0.2)
    assert len(returns) == 1
    method, props, body = returns[0]
    assert isinstance(method, pika.spec.Basic.Return)
    assert method.reply_code == 312
    assert method.reply_text == "NO_ROUTE"
    assert method.exchange == exchange
    assert method.routing_key == "nobody"
    assert props.message_id == "r1"
    assert body == b"bounce"


def test_mandatory_routable_is_not_returned(connection: pika.BlockingConnection) -> None:
    ch = connection.channel()
    queue = _queue(ch)
    returns: list[Any] = []
    ch.add_on_return_callback(lambda *args: returns.append(args))
    ch.basic_publish("", queue, b"ok", mandatory=True)
    drain(connection, 0.2)
    assert returns == []
    assert _ready(ch, queue) == 1


def test_return_arrives_before_confirm(raw: RawFactory, names: Names) -> None:
    client = raw()
    client.handshake()
    client.open_channel(1)
    assert isinstance(client.rpc(commands.Confirm.Select()), commands.Confirm.SelectOk)
    body = b"r" * 300000  # several body frames
    client.publish(1, body, exchange="amq.direct", routing_key=names("compat.nobody"), mandatory=True)
    returned = client.expect(commands.Basic.Return)
    assert returned.reply_code == 312 and returned.reply_text == "NO_ROUTE"
    assert returned.exchange == "amq.direct"
    _header, content = client.read_content()
    assert content == body
    ack = client.expect(commands.Basic.Ack)
    assert ack.delivery_tag == 1


def test_immediate_not_implemented(raw: RawFactory) -> None:
    client = raw()
    client.handshake()
    client.open_channel(1)
    queue = client.rpc(commands.Queue.Declare(queue="", exclusive=True)).queue
    client.publish(1, b"now!", routing_key=queue, immediate=True)
    close = client.expect(commands.Connection.Close)
    assert close.reply_code == 540
    assert close.reply_text == "NOT_IMPLEMENTED - immediate=true"
    assert (close.class_id, close.method_id) == (60, 40)
    client.send(commands.Connection.CloseOk())
    assert client.wait_closed(timeout=5)


@pytest.mark.parametrize("case", ["header-without-method", "body-without-method", "method-instead-of-header"])
def test_unexpected_content_frames(raw: RawFactory, case: str) -> None:
    client = raw()
    client.handshake()
    client.open_channel(1)
    if case == "header-without-method":
        client.send(ContentHeader(0, 3), 1)
    elif case == "body-without-method":
        client.send(ContentBody(b"abc"), 1)
    else:
        client.send(commands.Basic.Publish(exchange="", routing_key="x"), 1)
        client.send(commands.Basic.Qos(prefetch_count=1), 1)
    close = client.expect(commands.Connection.Close)
    assert close.reply_code == 505
    assert close.reply_text.startswith("UNEXPECTED_FRAME")
