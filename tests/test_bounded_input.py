"""What one connection makes the node hold is bounded (issue #26, items 13 and 14), sans-IO.

13: output counts for every method, not only deliveries: input waits while the output is over
    the high-water mark (150 basic.get + reject pairs for a 4 MiB message made 600 MiB of output).
14: unfinished bodies are checked when basic.publish arrives (write permission; the memory alarm
    through has_published), counted in the connection's memory and bounded per connection.
compat_tests/test_hostile_clients.py measures the same against a node's RSS.
"""

from __future__ import annotations

from pamqp import commands, frame
from pamqp.body import ContentBody
from pamqp.header import ContentHeader

from amqp_frontend.connection import ServerSettings
from core.engine.broker import Permission
from harness.brokers import local_broker
from tests.amqp_client import Client, assemble, connected

MESSAGE = 256 * 1024
HIGH_WATER = 64 * 1024


def _get_reject_pairs(count: int) -> bytes:
    return b"".join(frame.marshal(commands.Basic.Get(queue="big"), 1)
                    + frame.marshal(commands.Basic.Reject(delivery_tag=i + 1, requeue=True), 1)
                    for i in range(count))


def test_input_waits_while_output_is_over_the_high_water_mark() -> None:
    broker = local_broker()
    publisher = connected(broker)
    publisher.declare_queue(1, "big")
    publisher.publish(1, b"m" * MESSAGE, routing_key="big", chunk=65536)
    c = Client(broker, settings=ServerSettings(write_high_water=HIGH_WATER))
    c.handshake()
    c.open_channel(1)
    c.send_raw(_get_reject_pairs(150))  # 6,000 bytes in: 150 x 256 KiB out if nothing stopped it
    assert c.conn.out_bytes <= HIGH_WATER + MESSAGE + 1024, c.conn.out_bytes
    assert c.conn.input_pending and not c.conn.wants_read
    # A client that reads gets every answer: the I/O layer goes on once the output is written.
    gets = 0
    for _ in range(400):
        deliveries, _ = assemble(c.read())
        gets += len(deliveries)
        if not c.conn.input_pending:
            break
        c.send_raw(b"")
    assert gets == 150
    assert broker.vhosts["/"].queues["big"].message_count == 1


def test_a_paused_transport_stops_input_and_reading() -> None:
    c = connected(local_broker())
    c.conn.set_transport_paused(True)  # the socket's buffer is full: the client does not read
    assert not c.conn.wants_read
    c.send_raw(frame.marshal(commands.Queue.Declare(queue="later"), 1))
    assert c.read() == [] and c.conn.input_pending
    c.conn.set_transport_paused(False)
    c.send_raw(b"")  # what resume_writing schedules
    assert isinstance(c.read()[0][1], commands.Queue.DeclareOk)


def _announce(channel: int, size: int, sent: int, exchange: str = "") -> bytes:
    return (frame.marshal(commands.Basic.Publish(exchange=exchange, routing_key="q"), channel)
            + frame.marshal(ContentHeader(0, size, commands.Basic.Properties()), channel)
            + b"".join(frame.marshal(ContentBody(b"p" * min(100 * 1024, sent - at)), channel)
                       for at in range(0, sent, 100 * 1024)))


def test_write_permission_is_checked_before_the_body_arrives() -> None:
    broker = local_broker()
    user = broker.add_user("ro", "pw", vhosts={"/"})
    user.permissions["/"] = Permission(".*", "^$", ".*")
    broker.user_changed("ro")
    c = Client(broker)
    c.handshake(user="ro", password="pw")
    c.open_channel(1)
    c.send_raw(_announce(1, 100 * 1024 * 1024, 64 * 1024))
    closes = [v for _, v in c.read() if isinstance(v, commands.Channel.Close)]
    assert [(x.reply_code, x.class_id, x.method_id) for x in closes] == [(403, 60, 40)], closes
    assert "access to exchange 'amq.default'" in closes[0].reply_text
    assert c.conn.held_bytes() == 0  # the body that followed was dropped, not kept


def test_basic_publish_alone_marks_a_publisher_for_the_memory_alarm() -> None:
    c = connected(local_broker())
    assert not c.conn.has_published
    c.send_raw(frame.marshal(commands.Basic.Publish(exchange="", routing_key="q"), 1))
    assert c.conn.has_published  # the I/O layer blocks it while an alarm is raised


def test_unfinished_bodies_count_and_are_bounded_per_connection() -> None:
    limit = 1024 * 1024
    c = Client(local_broker(), settings=ServerSettings(max_partial_body_bytes=limit))
    c.handshake()
    for ch in (1, 2, 3):
        c.open_channel(ch)
    c.send_raw(_announce(1, limit, 400 * 1024) + _announce(2, limit, 400 * 1024))
    assert c.read() == []
    assert c.conn.partial_bytes == 800 * 1024 and c.conn.held_bytes() >= 800 * 1024
    c.send(1, commands.Channel.Close(reply_code=200, reply_text="", class_id=0, method_id=0))
    assert c.conn.partial_bytes == 400 * 1024  # a closed channel's partial body is let go
    c.send_raw(_announce(3, limit, 700 * 1024))
    closes = [v for _, v in c.read() if isinstance(v, commands.Connection.Close)]
    assert [x.reply_code for x in closes] == [506], closes
    assert "unfinished message bodies on this connection exceed 1048576 bytes" in closes[0].reply_text
    assert c.conn.partial_bytes == 0


def test_one_message_of_the_largest_size_always_fits() -> None:
    size = 512 * 1024
    c = Client(local_broker(), settings=ServerSettings(max_message_size=size))
    c.handshake()
    c.open_channel(1)
    c.declare_queue(1, "q")
    chunk = 100 * 1024
    c.send_raw(_announce(1, size, chunk))
    for _ in range(size // chunk - 1):
        c.send_raw(frame.marshal(ContentBody(b"p" * chunk), 1))
    assert c.conn.partial_bytes == size - size % chunk
    c.send_raw(frame.marshal(ContentBody(b"p" * (size % chunk)), 1))
    assert c.read() == [] and c.conn.partial_bytes == 0
    assert c.conn.broker.vhosts["/"].queues["q"].message_count == 1
