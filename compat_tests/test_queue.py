"""Queue declaration, exclusivity, auto-delete, bindings, purge and delete."""

from __future__ import annotations

from collections.abc import Callable

import pika
import pytest

from compat_tests.util import BlockingChannel, Names, channel_error, sync, wait_until

pytestmark = pytest.mark.timeout(30)

Connect = Callable[..., pika.BlockingConnection]

LOCKED = "RESOURCE_LOCKED - cannot obtain exclusive access to locked queue"


def _fill(ch: BlockingChannel, queue: str, count: int) -> None:
    for i in range(count):
        ch.basic_publish("", queue, f"m{i}".encode())
    sync(ch)


def _exists(conn: pika.BlockingConnection, queue: str) -> bool:
    ch = conn.channel()
    try:
        ch.queue_declare(queue, passive=True)
    except pika.exceptions.ChannelClosedByBroker as exc:
        assert exc.reply_code == 404
        return False
    ch.close()
    return True


def test_server_named_queue(channel: BlockingChannel) -> None:
    ok = channel.queue_declare("", exclusive=True)
    assert ok.method.queue.startswith("amq.gen-")
    assert len(ok.method.queue) > len("amq.gen-")
    assert ok.method.message_count == 0
    assert ok.method.consumer_count == 0
    other = channel.queue_declare("", exclusive=True)
    assert other.method.queue != ok.method.queue
    # the generated name is usable like any other
    channel.basic_publish("", ok.method.queue, b"x")
    sync(channel)
    assert channel.queue_declare(ok.method.queue, passive=True).method.message_count == 1


def test_passive_declare(connection: pika.BlockingConnection, names: Names) -> None:
    queue = names.queue()
    ch = connection.channel()
    with channel_error(404, f"NOT_FOUND - no queue '{queue}' in vhost '/'"):
        ch.queue_declare(queue, passive=True)
    assert ch.is_closed
    ch = connection.channel()
    ch.queue_declare(queue)
    _fill(ch, queue, 3)
    ok = ch.queue_declare(queue, passive=True)
    assert ok.method.queue == queue
    assert ok.method.message_count == 3
    # passive declare ignores the other flags and arguments
    ch.queue_declare(queue, passive=True, durable=True, arguments={"x-max-length": 1})


def test_declare_ok_counts(connection: pika.BlockingConnection, names: Names) -> None:
    queue = names.queue()
    ch = connection.channel()
    ok = ch.queue_declare(queue)
    assert (ok.method.message_count, ok.method.consumer_count) == (0, 0)
    _fill(ch, queue, 5)
    ok = ch.queue_declare(queue)
    assert (ok.method.message_count, ok.method.consumer_count) == (5, 0)
    consumer_ch = connection.channel()
    consumer_ch.basic_qos(prefetch_count=1)
    consumer_ch.basic_consume(queue, lambda *args: None)
    consumer_ch.basic_consume(queue, lambda *args: None)
    # prefetch 1 per consumer: two messages go out unacked; message_count
    # counts only ready messages
    assert wait_until(connection, lambda: ch.queue_declare(queue, passive=True).method.message_count == 3)
    ok = ch.queue_declare(queue)
    assert ok.method.consumer_count == 2
    assert ok.method.message_count == 3


def test_durable_queue(connection: pika.BlockingConnection, names: Names) -> None:
    queue = names.queue()
    connection.channel().queue_declare(queue, durable=True)
    connection.channel().queue_declare(queue, durable=True)
    with channel_error(
        406,
        f"PRECONDITION_FAILED - inequivalent arg 'durable' for queue '{queue}' in vhost '/': "
        "received 'false' but current is 'true'",
    ):
        connection.channel().queue_declare(queue, durable=False)


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"auto_delete": True}, "inequivalent arg 'auto_delete'"),
        ({"arguments": {"x-max-length": 10}}, "inequivalent arg 'x-max-length'"),
        ({"arguments": {"x-message-ttl": 1000}}, "inequivalent arg 'x-message-ttl'"),
    ],
)
def test_inequivalent_redeclare(
    connection: pika.BlockingConnection, names: Names, kwargs: dict[str, object], text: str
) -> None:
    queue = names.queue()
    connection.channel().queue_declare(queue)
    with channel_error(406, f"PRECONDITION_FAILED - {text} for queue '{queue}'"):
        connection.channel().queue_declare(queue, **kwargs)  # type: ignore[arg-type]


def test_inequivalent_arguments_value(connection: pika.BlockingConnection, names: Names) -> None:
    queue = names.queue()
    connection.channel().queue_declare(queue, arguments={"x-max-length": 10})
    connection.channel().queue_declare(queue, arguments={"x-max-length": 10})
    with channel_error(406, "inequivalent arg 'x-max-length'"):
        connection.channel().queue_declare(queue, arguments={"x-max-length": 11})


def test_invalid_queue_argument(channel: BlockingChannel, names: Names) -> None:
    with channel_error(406, "PRECONDITION_FAILED - invalid arg 'x-max-length'"):
        channel.queue_declare(names.queue(), arguments={"x-max-length": "ten"})


def test_reserved_amq_prefix(connection: pika.BlockingConnection, names: Names) -> None:
    name = names("amq.compat")
    with channel_error(403, f"ACCESS_REFUSED - queue name '{name}' contains reserved prefix 'amq.*'"):
        connection.channel().queue_declare(name)
    # a passive declare of such a name is simply "not found"
    with channel_error(404, "NOT_FOUND - no queue"):
        connection.channel().queue_declare(name, passive=True)


# ------------------------------------------------------------ exclusivity
def test_exclusive_queue_locked_to_its_connection(connect: Connect, names: Names) -> None:
    queue = names.queue()
    owner = connect()
    owner.channel().queue_declare(queue, exclusive=True)
    other = connect()
    for attempt in ("declare", "declare-exclusive", "passive", "consume", "get", "purge", "delete", "bind"):
        ch = other.channel()
        with channel_error(405, LOCKED):
            if attempt == "declare":
                ch.queue_declare(queue)
            elif attempt == "declare-exclusive":
                ch.queue_declare(queue, exclusive=True)
            elif attempt == "passive":
                ch.queue_declare(queue, passive=True)
            elif attempt == "consume":
                ch.basic_consume(queue, lambda *args: None)
            elif attempt == "get":
                ch.basic_get(queue)
            elif attempt == "purge":
                ch.queue_purge(queue)
            elif attempt == "delete":
                ch.queue_delete(queue)
            else:
                ch.queue_bind(queue, "amq.fanout")
    # publishing to it from another connection is allowed
    ch = other.channel()
    ch.basic_publish("", queue, b"from elsewhere")
    sync(ch)
    # and the owner (any of its channels) can use it
    owner_ch = owner.channel()
    method, _props, body = owner_ch.basic_get(queue, auto_ack=True)
    assert method is not None and body == b"from elsewhere"


def test_exclusive_flag_must_match_on_owner_connection(connection: pika.BlockingConnection, names: Names) -> None:
    shared = names.queue()
    connection.channel().queue_declare(shared)
    with channel_error(405, LOCKED):
        connection.channel().queue_declare(shared, exclusive=True)


def test_exclusive_queue_deleted_when_connection_closes(connect: Connect, names: Names) -> None:
    queue = names.queue()
    owner = connect()
    owner.channel().queue_declare(queue, exclusive=True)
    observer = connect()
    owner.close()
    assert wait_until(observer, lambda: not _exists(observer, queue), timeout=5)


def test_exclusive_queue_survives_channel_close(connection: pika.BlockingConnection, names: Names) -> None:
    queue = names.queue()
    ch = connection.channel()
    ch.queue_declare(queue, exclusive=True)
    ch.close()
    assert _exists(connection, queue)


# ---------------------------------------------------------------- auto-delete
def test_auto_delete_queue(connection: pika.BlockingConnection, names: Names) -> None:
    queue = names.queue()
    ch = connection.channel()
    ch.queue_declare(queue, auto_delete=True)
    assert _exists(connection, queue)  # no consumer ever: stays
    tag1 = ch.basic_consume(queue, lambda *args: None)
    tag2 = ch.basic_consume(queue, lambda *args: None)
    ch.basic_cancel(tag1)
    assert _exists(connection, queue)
    ch.basic_cancel(tag2)
    assert wait_until(connection, lambda: not _exists(connection, queue), timeout=5)


def test_auto_delete_queue_deleted_when_consumer_channel_closes(
    connection: pika.BlockingConnection, names: Names
) -> None:
    queue = names.queue()
    ch = connection.channel()
    ch.queue_declare(queue, auto_delete=True)
    ch.basic_consume(queue, lambda *args: None)
    ch.close()
    assert wait_until(connection, lambda: not _exists(connection, queue), timeout=5)


# ------------------------------------------------------------------ bindings
def test_bind_and_unbind(channel: BlockingChannel, names: Names) -> None:
    exchange = names.exchange()
    channel.exchange_declare(exchange, "direct")
    queue = channel.queue_declare("", exclusive=True).method.queue
    channel.queue_bind(queue, exchange, "k")
    channel.basic_publish(exchange, "k", b"1")
    channel.queue_unbind(queue, exchange, "k")
    channel.basic_publish(exchange, "k", b"2")
    sync(channel)
    assert channel.queue_declare(queue, passive=True).method.message_count == 1


def test_bind_with_empty_queue_name_uses_last_declared(channel: BlockingChannel) -> None:
    queue = channel.queue_declare("", exclusive=True).method.queue
    channel.queue_bind("", "amq.direct", queue)
    channel.basic_publish("amq.direct", queue, b"x")
    sync(channel)
    assert channel.queue_declare(queue, passive=True).method.message_count == 1


def test_deleted_queue_loses_bindings(connection: pika.BlockingConnection, names: Names) -> None:
    queue = names.queue()
    ch = connection.channel()
    ch.queue_declare(queue)
    ch.queue_bind(queue, "amq.direct", queue)
    ch.queue_delete(queue)
    ch.queue_declare(queue)
    ch.basic_publish("amq.direct", queue, b"x")
    sync(ch)
    assert ch.queue_declare(queue, passive=True).method.message_count == 0


# ---------------------------------------------------------- purge & delete
def test_purge(connection: pika.BlockingConnection, names: Names) -> None:
    queue = names.queue()
    ch = connection.channel()
    ch.queue_declare(queue)
    _fill(ch, queue, 7)
    assert ch.queue_purge(queue).method.message_count == 7
    assert ch.queue_purge(queue).method.message_count == 0
    assert ch.queue_declare(queue, passive=True).method.message_count == 0
    with channel_error(404, "NOT_FOUND - no queue"):
        connection.channel().queue_purge(names("compat.nope"))


def test_purge_keeps_unacked(connection: pika.BlockingConnection, names: Names) -> None:
    queue = names.queue()
    ch = connection.channel()
    ch.queue_declare(queue)
    _fill(ch, queue, 3)
    method, _props, _body = ch.basic_get(queue)
    assert method is not None
    assert ch.queue_purge(queue).method.message_count == 2
    ch.basic_nack(method.delivery_tag, requeue=True)
    sync(ch)
    assert ch.queue_declare(queue, passive=True).method.message_count == 1


def test_delete_returns_message_count(connection: pika.BlockingConnection, names: Names) -> None:
    queue = names.queue()
    ch = connection.channel()
    ch.queue_declare(queue)
    _fill(ch, queue, 4)
    assert ch.queue_delete(queue).method.message_count == 4
    assert not _exists(connection, queue)


def test_delete_missing_queue_is_ok(channel: BlockingChannel, names: Names) -> None:
    # RabbitMQ 3.x: queue.delete is idempotent
    ok = channel.queue_delete(names("compat.nope"))
    assert ok.method.message_count == 0


def test_delete_if_empty(connection: pika.BlockingConnection, names: Names) -> None:
    queue = names.queue()
    ch = connection.channel()
    ch.queue_declare(queue)
    _fill(ch, queue, 1)
    with channel_error(406, f"PRECONDITION_FAILED - queue '{queue}' in vhost '/' not empty"):
        connection.channel().queue_delete(queue, if_empty=True)
    ch.queue_purge(queue)
    ch.queue_delete(queue, if_empty=True)
    assert not _exists(connection, queue)


def test_delete_if_unused(connection: pika.BlockingConnection, names: Names) -> None:
    queue = names.queue()
    ch = connection.channel()
    ch.queue_declare(queue)
    tag = ch.basic_consume(queue, lambda *args: None)
    with channel_error(406, f"PRECONDITION_FAILED - queue '{queue}' in vhost '/' in use"):
        connection.channel().queue_delete(queue, if_unused=True)
    ch.basic_cancel(tag)
    ch.queue_delete(queue, if_unused=True)
    assert not _exists(connection, queue)
