"""The AMQP connection state machine, driven frame by frame without sockets.

Expected reply codes and texts follow RabbitMQ 3.x, which is what every client
library is written against.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from pamqp import commands, encode, frame
from pamqp.body import ContentBody
from pamqp.header import ContentHeader
from pamqp.heartbeat import Heartbeat

from amqp_frontend.connection import ServerSettings
from core.engine.broker import Broker
from harness.brokers import local_broker
from tests.amqp_client import (
    PROTOCOL_HEADER,
    Client,
    Received,
    assemble,
    connected,
    content_frames,
    parse_frames,
    plain,
    publish_bytes,
)

# --------------------------------------------------------------------------- helpers


def of_type(frames: Received, kind: type) -> list[Any]:
    return [value for _, value in frames if isinstance(value, kind)]


def connection_close(frames: Received) -> commands.Connection.Close:
    closes = [(ch, v) for ch, v in frames if isinstance(v, commands.Connection.Close)]
    assert len(closes) == 1, frames
    assert closes[0][0] == 0
    return closes[0][1]


def channel_close(frames: Received, channel: int) -> commands.Channel.Close:
    closes = [v for ch, v in frames if ch == channel and isinstance(v, commands.Channel.Close)]
    assert len(closes) == 1, frames
    assert not of_type(frames, commands.Connection.Close), frames
    return closes[0]


def client_channel_close(text: str = "") -> commands.Channel.Close:
    return commands.Channel.Close(reply_code=200, reply_text=text, class_id=0, method_id=0)


def client_connection_close(text: str = "") -> commands.Connection.Close:
    return commands.Connection.Close(reply_code=200, reply_text=text, class_id=0, method_id=0)


def start_ok(response: str = plain(), mechanism: str = "PLAIN", caps: dict[str, Any] | None = None) -> Any:
    props: dict[str, Any] = {"product": "tests"}
    if caps is not None:
        props["capabilities"] = caps
    return commands.Connection.StartOk(client_properties=props, mechanism=mechanism, response=response)


def to_start_ok(client: Client, start_ok_method: Any) -> Received:
    client.send_raw(PROTOCOL_HEADER)
    assert isinstance(client.read()[0][1], commands.Connection.Start)
    return client.call(0, start_ok_method)


def bodies(deliveries: list[Any]) -> list[bytes]:
    return [d.body for d in deliveries]


@pytest.fixture
def broker() -> Broker:
    return local_broker()


@pytest.fixture
def client(broker: Broker) -> Client:
    return connected(broker, channels=(1,))


# ------------------------------------------------------------------------- handshake


def test_handshake_server_properties_and_tune(broker: Broker) -> None:
    c = Client(broker)
    start, tune = c.handshake()
    assert (start.version_major, start.version_minor) == (0, 9)
    props = start.server_properties
    assert props["product"] == "Leveret"
    assert props["version"]
    caps = props["capabilities"]
    assert isinstance(caps, dict)
    # Everything the suite exercises is claimed ...
    for name in (
        "publisher_confirms",
        "basic.nack",
        "consumer_cancel_notify",
        "exchange_exchange_bindings",
        "authentication_failure_close",
        "per_consumer_qos",
        "connection.blocked",
        "consumer_priorities",
        "direct_reply_to",
    ):
        assert caps.get(name) is True, name
    mechanisms = start.mechanisms.split()
    assert "PLAIN" in mechanisms and "AMQPLAIN" in mechanisms
    assert "en_US" in start.locales.split()
    s = ServerSettings()
    assert (tune.channel_max, tune.frame_max, tune.heartbeat) == (s.channel_max, s.frame_max, s.heartbeat)
    assert not c.conn.should_close


def test_protocol_header_split_over_reads(broker: Broker) -> None:
    c = Client(broker)
    c.send_raw(PROTOCOL_HEADER[:3])
    assert c.read() == []
    c.send_raw(PROTOCOL_HEADER[3:])
    frames = c.read()
    assert isinstance(frames[0][1], commands.Connection.Start)


def test_amqplain_login(broker: Broker) -> None:
    c = Client(broker)
    # AMQPLAIN: a field table without its 4-byte length prefix.
    table = encode.field_table({"LOGIN": "guest", "PASSWORD": "guest"})[4:]
    frames = to_start_ok(c, start_ok(table.decode("latin-1"), mechanism="AMQPLAIN"))
    assert isinstance(frames[0][1], commands.Connection.Tune), frames
    assert not c.conn.should_close


def test_amqplain_wrong_password(broker: Broker) -> None:
    c = Client(broker)
    table = encode.field_table({"LOGIN": "guest", "PASSWORD": "nope"})[4:]
    frames = to_start_ok(
        c, start_ok(table.decode("latin-1"), mechanism="AMQPLAIN", caps={"authentication_failure_close": True})
    )
    close = connection_close(frames)
    assert close.reply_code == 403
    assert close.reply_text.startswith("ACCESS_REFUSED - Login was refused using authentication mechanism AMQPLAIN")
    assert c.conn.should_close


def test_wrong_password_with_authentication_failure_close(broker: Broker) -> None:
    c = Client(broker)
    frames = to_start_ok(c, start_ok(plain("guest", "wrong"), caps={"authentication_failure_close": True}))
    close = connection_close(frames)
    assert close.reply_code == 403
    assert close.reply_text.startswith("ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN")
    assert "wrong" not in close.reply_text
    assert c.conn.should_close


def test_wrong_password_without_capability_just_closes(broker: Broker) -> None:
    c = Client(broker)
    frames = to_start_ok(c, start_ok(plain("guest", "wrong")))
    assert frames == []
    assert c.conn.should_close


def test_unknown_user_refused(broker: Broker) -> None:
    c = Client(broker)
    frames = to_start_ok(c, start_ok(plain("nobody", "guest"), caps={"authentication_failure_close": True}))
    assert connection_close(frames).reply_code == 403


def test_unsupported_mechanism_refused(broker: Broker) -> None:
    c = Client(broker)
    frames = to_start_ok(
        c, start_ok(plain(), mechanism="EXTERNAL", caps={"authentication_failure_close": True})
    )
    assert connection_close(frames).reply_code == 403
    assert c.conn.should_close


def test_guest_from_non_loopback_refused(broker: Broker) -> None:
    c = Client(broker, peer=("10.1.2.3", 50000))
    frames = to_start_ok(c, start_ok(caps={"authentication_failure_close": True}))
    close = connection_close(frames)
    assert close.reply_code == 403
    assert "user 'guest' can only connect via localhost" in close.reply_text
    assert c.conn.should_close


def test_other_user_from_non_loopback_allowed(broker: Broker) -> None:
    broker.add_user("app", "secret", vhosts={"/"})
    c = Client(broker, peer=("10.1.2.3", 50000))
    c.handshake(user="app", password="secret")
    c.open_channel(1)


def test_unknown_vhost_530(broker: Broker) -> None:
    c = Client(broker)
    c.send_raw(PROTOCOL_HEADER)
    c.read()
    tune = c.expect(0, start_ok(), commands.Connection.Tune)
    c.send(0, commands.Connection.TuneOk(channel_max=tune.channel_max, frame_max=tune.frame_max, heartbeat=0))
    close = connection_close(c.call(0, commands.Connection.Open(virtual_host="/nope")))
    assert close.reply_code == 530
    assert close.reply_text == "NOT_ALLOWED - vhost /nope not found"
    assert c.conn.should_close


def test_vhost_without_permission_530(broker: Broker) -> None:
    broker.add_vhost("/other")
    c = Client(broker)
    c.send_raw(PROTOCOL_HEADER)
    c.read()
    tune = c.expect(0, start_ok(), commands.Connection.Tune)
    c.send(0, commands.Connection.TuneOk(channel_max=tune.channel_max, frame_max=tune.frame_max, heartbeat=0))
    close = connection_close(c.call(0, commands.Connection.Open(virtual_host="/other")))
    assert close.reply_code == 530
    assert "access to vhost '/other' refused for user 'guest'" in close.reply_text


@pytest.mark.parametrize("frame_max", [131072 + 1, 1 << 20, 0, 4095])
def test_tune_ok_bad_frame_max_530(broker: Broker, frame_max: int) -> None:
    c = Client(broker)
    c.send_raw(PROTOCOL_HEADER)
    c.read()
    tune = c.expect(0, start_ok(), commands.Connection.Tune)
    frames = c.call(0, commands.Connection.TuneOk(channel_max=tune.channel_max, frame_max=frame_max, heartbeat=0))
    close = connection_close(frames)
    assert close.reply_code == 530
    assert "frame_max" in close.reply_text
    assert c.conn.should_close


def test_tune_ok_smaller_frame_max_accepted(broker: Broker) -> None:
    c = Client(broker)
    c.handshake(frame_max=4096)
    assert c.conn.frame_max == 4096


@pytest.mark.parametrize(
    "header", [b"AMQP\x00\x00\x08\x00", b"AMQP\x01\x01\x00\x0a", b"GET / HTTP/1.1\r\n\r\n", b"\x16\x03\x01\x02\x00"]
)
def test_wrong_protocol_header(broker: Broker, header: bytes) -> None:
    c = Client(broker)
    c.send_raw(header)
    assert c.conn.data_to_send() == b"AMQP\x00\x00\x09\x01"
    assert c.conn.should_close


def test_data_after_wrong_header_is_ignored(broker: Broker) -> None:
    c = Client(broker)
    c.send_raw(b"HELO")
    assert c.conn.data_to_send() == PROTOCOL_HEADER
    c.send_raw(PROTOCOL_HEADER)
    assert c.conn.data_to_send() == b""


def test_method_before_open_refused(broker: Broker) -> None:
    c = Client(broker)
    c.send_raw(PROTOCOL_HEADER)
    c.read()
    frames = c.call(1, commands.Channel.Open())
    assert connection_close(frames).reply_code in (503, 504)
    assert c.conn.should_close


# ---------------------------------------------------------------- framing errors


GARBAGE = [
    b"\xff" * 32,  # type 255, size 0xffffffff: too large
    b"\x09\x00\x00\x00\x00\x00\x00\xce",  # unknown frame type 9
    b"\x01\x00\x01\x00\x00\x00\x04\x00\x14\x00\x0a\x00",  # channel.open with a bad frame end
    b"hello, world! this is not AMQP at all\n",
]


@pytest.mark.parametrize("garbage", GARBAGE)
def test_garbage_after_handshake_closes_connection_only(broker: Broker, client: Client, garbage: bytes) -> None:
    client.send_raw(garbage)
    close = connection_close(client.read())
    assert 500 <= close.reply_code < 600
    assert close.reply_code == 501
    assert close.reply_text.startswith("FRAME_ERROR")
    # The node is fine: a fresh connection on the same broker works end to end.
    other = connected(broker)
    other.declare_queue(1, "after-garbage")
    other.publish(1, b"still alive", routing_key="after-garbage")
    frames = other.call(1, commands.Basic.Get(queue="after-garbage", no_ack=True))
    deliveries, _ = assemble(frames)
    assert bodies(deliveries) == [b"still alive"]


@pytest.mark.parametrize("garbage", [GARBAGE[1]])
def test_close_ok_after_frame_error_closes(client: Client, garbage: bytes) -> None:
    client.send_raw(garbage)
    assert connection_close(client.read()).reply_code == 501
    assert not client.conn.should_close  # waiting for the client's close-ok
    client.send(0, commands.Connection.CloseOk())
    assert client.conn.should_close


@pytest.mark.parametrize("garbage", [GARBAGE[0], GARBAGE[2], GARBAGE[3]])
def test_close_ok_after_unparseable_frame_closes(client: Client, garbage: bytes) -> None:
    client.send_raw(garbage)
    assert connection_close(client.read()).reply_code == 501
    client.send(0, commands.Connection.CloseOk())
    assert client.conn.should_close


def test_frame_larger_than_frame_max_501(broker: Broker) -> None:
    c = Client(broker)
    c.handshake(frame_max=4096)
    c.open_channel(1)
    c.send_raw(frame.marshal(commands.Queue.Declare(queue="q" * 200, arguments={"k": "v" * 5000}), 1))
    close = connection_close(c.read())
    assert close.reply_code == 501
    assert close.reply_text.startswith("FRAME_ERROR")


def test_body_frame_larger_than_frame_max_501_general_path(broker: Broker) -> None:
    c = Client(broker)
    c.handshake(frame_max=4096)
    c.open_channel(1)
    c.declare_queue(1, "q")
    # Header and body in separate reads: the frame-by-frame path.
    c.send(1, commands.Basic.Publish(exchange="", routing_key="q"), ContentHeader(0, 5000, commands.Basic.Properties()))
    c.send(1, ContentBody(b"x" * 5000))
    assert connection_close(c.read()).reply_code == 501
    assert broker.vhosts["/"].queues["q"].message_count == 0


def test_body_frame_larger_than_frame_max_501(broker: Broker) -> None:
    c = Client(broker)
    c.handshake(frame_max=4096)
    c.open_channel(1)
    c.declare_queue(1, "q")
    c.publish(1, b"x" * 5000, routing_key="q")  # method + header + one body frame of 5008 bytes, one read
    close = connection_close(c.read())
    assert close.reply_code == 501
    assert broker.vhosts["/"].queues["q"].message_count == 0


def test_message_larger_than_max_message_size_406_general_path(broker: Broker) -> None:
    c = Client(broker, settings=ServerSettings(max_message_size=1000))
    c.handshake()
    c.open_channel(1)
    c.declare_queue(1, "q")
    c.publish(1, b"x" * 2000, routing_key="q", chunk=1000)
    close = channel_close(c.read(), 1)
    assert close.reply_code == 406
    assert close.reply_text == "PRECONDITION_FAILED - message size 2000 is larger than configured max size 1000"
    assert broker.vhosts["/"].queues["q"].message_count == 0


def test_message_larger_than_max_message_size_406(broker: Broker) -> None:
    c = Client(broker, settings=ServerSettings(max_message_size=1000))
    c.handshake()
    c.open_channel(1)
    c.declare_queue(1, "q")
    c.publish(1, b"x" * 2000, routing_key="q")  # one body frame: the fast path
    close = channel_close(c.read(), 1)
    assert close.reply_code == 406
    assert broker.vhosts["/"].queues["q"].message_count == 0


def test_frame_of_exactly_frame_max_accepted(broker: Broker) -> None:
    c = Client(broker)
    c.handshake(frame_max=4096)
    c.open_channel(1)
    c.declare_queue(1, "q")
    c.publish(1, b"x" * (4096 - 8), routing_key="q")
    assert c.read() == []
    assert broker.vhosts["/"].queues["q"].message_count == 1


def test_bad_frame_end_501(client: Client) -> None:
    raw = bytearray(frame.marshal(commands.Channel.Open(), 2))
    raw[-1] = 0x00
    client.send_raw(bytes(raw))
    close = connection_close(client.read())
    assert close.reply_code == 501
    assert "frame end" in close.reply_text


def test_heartbeat_on_nonzero_channel_501(client: Client) -> None:
    client.send_raw(b"\x08\x00\x01\x00\x00\x00\x00\xce")
    assert connection_close(client.read()).reply_code == 501


def test_frames_split_at_every_byte(broker: Broker) -> None:
    c = connected(broker)
    c.declare_queue(1, "q")
    data = publish_bytes(1, b"payload", routing_key="q")
    for i in range(len(data)):
        c.send_raw(data[i : i + 1])
    assert c.read() == []
    assert broker.vhosts["/"].queues["q"].message_count == 1


def test_unknown_method_503(client: Client) -> None:
    client.send_raw(b"\x01\x00\x01\x00\x00\x00\x04\x00\x63\x00\x01\xce")
    assert connection_close(client.read()).reply_code == 503


def test_content_header_without_publish_505(client: Client) -> None:
    client.send(1, ContentHeader(0, 3, commands.Basic.Properties()))
    assert connection_close(client.read()).reply_code == 505


def test_method_while_expecting_content_505(client: Client) -> None:
    client.send(1, commands.Basic.Publish(exchange="", routing_key="q"), commands.Basic.Qos(prefetch_count=1))
    assert connection_close(client.read()).reply_code == 505


def test_body_larger_than_declared_505(client: Client) -> None:
    client.send(
        1,
        commands.Basic.Publish(exchange="", routing_key="q"),
        ContentHeader(0, 3, commands.Basic.Properties()),
        ContentBody(b"four"),
    )
    assert connection_close(client.read()).reply_code == 505


# ---------------------------------------------------------------------- channels


def test_channel_open_twice_504(client: Client) -> None:
    close = connection_close(client.call(1, commands.Channel.Open()))
    assert close.reply_code == 504
    assert close.reply_text.startswith("CHANNEL_ERROR - second 'channel.open'")


def test_channel_open_twice_names_the_method(client: Client) -> None:
    close = connection_close(client.call(1, commands.Channel.Open()))
    assert (close.class_id, close.method_id) == (20, 10)


def test_method_on_unopened_channel_504(client: Client) -> None:
    close = connection_close(client.call(7, commands.Queue.Declare(queue="q")))
    assert close.reply_code == 504
    assert close.reply_text == "CHANNEL_ERROR - expected 'channel.open' on channel 7"


def test_publish_on_unopened_channel_504(client: Client) -> None:
    client.publish(3, b"x", routing_key="q")
    assert connection_close(client.read()).reply_code == 504


def test_more_channels_than_channel_max_530(broker: Broker) -> None:
    # As RabbitMQ: channel_max bounds how many channels are open, not their numbers
    # (aiormq's own suite opens channel 65535 with channel_max 2047).
    c = Client(broker)
    c.handshake(channel_max=3)
    for number in (1, 500, 65535):
        c.open_channel(number)
    close = connection_close(c.call(7, commands.Channel.Open()))
    assert close.reply_code == 530
    assert "channel_max (3)" in close.reply_text


def test_client_channel_close(broker: Broker, client: Client) -> None:
    client.declare_queue(1, "q")
    client.publish(1, b"m", routing_key="q")
    client.call(1, commands.Basic.Get(queue="q"))
    assert broker.vhosts["/"].queues["q"].message_count == 0
    client.expect(1, client_channel_close("bye"), commands.Channel.CloseOk)
    # The unacked get went back to the queue.
    assert broker.vhosts["/"].queues["q"].message_count == 1
    client.open_channel(1)


def test_channel_error_closes_only_that_channel(broker: Broker) -> None:
    c = connected(broker, channels=(1, 2))
    c.declare_queue(2, "q")
    c.publish(1, b"lost", exchange="no-such-exchange", routing_key="q")
    close = channel_close(c.read(), 1)
    assert close.reply_code == 404
    assert close.reply_text == "NOT_FOUND - no exchange 'no-such-exchange' in vhost '/'"
    assert (close.class_id, close.method_id) == (60, 40)
    assert not c.conn.should_close
    # Until the client's close-ok, everything else on channel 1 is ignored.
    assert c.call(1, commands.Queue.Declare(queue="ignored")) == []
    assert "ignored" not in broker.vhosts["/"].queues
    # Channel 2 keeps working.
    c.publish(2, b"kept", routing_key="q")
    deliveries, _ = assemble(c.call(2, commands.Basic.Get(queue="q", no_ack=True)))
    assert bodies(deliveries) == [b"kept"]
    # Close-ok from the client frees the number; it can be opened again.
    assert c.call(1, commands.Channel.CloseOk()) == []
    c.open_channel(1)
    c.declare_queue(1, "q")


def test_channel_close_crossing_server_close(client: Client) -> None:
    client.publish(1, b"x", exchange="missing")
    channel_close(client.read(), 1)
    client.expect(1, client_channel_close("ok"), commands.Channel.CloseOk)
    client.open_channel(1)


# -------------------------------------------------------------- publish / deliver


def test_publish_and_deliver_across_connections(broker: Broker) -> None:
    a = connected(broker)
    b = connected(broker)
    b.declare_queue(1, "work")
    signalled: list[bool] = []
    b.conn.on_output = lambda: signalled.append(True)
    frames = b.consume(1, "work", tag="ctag-b")
    assert frames[0][1].consumer_tag == "ctag-b"
    props = commands.Basic.Properties(
        content_type="text/plain", headers={"k": "v", "n": 7}, delivery_mode=2, message_id="m-1"
    )
    a.publish(1, b"hello", routing_key="work", properties=props)
    assert a.read() == []
    assert signalled, "the other connection's I/O layer must be told it has output"
    deliveries, others = assemble(b.read())
    assert others == []
    (d,) = deliveries
    assert isinstance(d.method, commands.Basic.Deliver)
    assert d.channel == 1
    assert (d.method.consumer_tag, d.method.delivery_tag, d.method.redelivered) == ("ctag-b", 1, False)
    assert (d.method.exchange, d.method.routing_key) == ("", "work")
    assert d.body == b"hello"
    assert d.properties.content_type == "text/plain"
    assert d.properties.headers == {"k": "v", "n": 7}
    assert d.properties.delivery_mode == 2
    assert d.properties.message_id == "m-1"


def test_large_body_split_by_consumer_frame_max(broker: Broker) -> None:
    a = connected(broker)
    b = Client(broker)
    b.handshake(frame_max=4096)
    b.open_channel(1)
    b.declare_queue(1, "big")
    b.consume(1, "big", no_ack=True)
    body = bytes(range(256)) * 64 + b"tail"  # 16388 bytes
    a.publish(1, body, routing_key="big")
    raw = b.conn.data_to_send()
    assert all(len(f) <= 4096 for f in _raw_frames(raw))
    deliveries, _ = assemble(parse_frames(raw))
    (d,) = deliveries
    assert d.body == body
    assert d.body_frames == -(-len(body) // (4096 - 8))


def _raw_frames(data: bytes) -> list[bytes]:
    out = []
    pos = 0
    while pos < len(data):
        size = int.from_bytes(data[pos + 3 : pos + 7], "big")
        out.append(data[pos : pos + 8 + size])
        pos += 8 + size
    return out


def test_publish_body_split_by_client(broker: Broker, client: Client) -> None:
    client.declare_queue(1, "q")
    body = b"0123456789" * 100
    client.publish(1, body, routing_key="q", chunk=7)
    assert client.read() == []
    deliveries, _ = assemble(client.call(1, commands.Basic.Get(queue="q", no_ack=True)))
    assert bodies(deliveries) == [body]


def test_publish_body_frames_over_several_reads(broker: Broker, client: Client) -> None:
    client.declare_queue(1, "q")
    client.send(1, commands.Basic.Publish(exchange="", routing_key="q"))
    client.send(1, ContentHeader(0, 6, commands.Basic.Properties()))
    client.send(1, ContentBody(b"abc"))
    assert broker.vhosts["/"].queues["q"].message_count == 0
    client.send(1, ContentBody(b"def"))
    deliveries, _ = assemble(client.call(1, commands.Basic.Get(queue="q", no_ack=True)))
    assert bodies(deliveries) == [b"abcdef"]


def test_empty_body(client: Client) -> None:
    client.declare_queue(1, "q")
    client.publish(1, b"", routing_key="q")
    deliveries, _ = assemble(client.call(1, commands.Basic.Get(queue="q", no_ack=True)))
    assert bodies(deliveries) == [b""]
    assert deliveries[0].body_frames == 0


def test_confirms_multiple_ack(client: Client) -> None:
    client.declare_queue(1, "q")
    client.expect(1, commands.Confirm.Select(), commands.Confirm.SelectOk)
    client.send_raw(b"".join(publish_bytes(1, b"m%d" % i, routing_key="q") for i in range(5)))
    acks = of_type(client.read(), commands.Basic.Ack)
    assert len(acks) == 1
    assert (acks[0].delivery_tag, acks[0].multiple) == (5, True)
    client.publish(1, b"one more", routing_key="q")
    (ack,) = of_type(client.read(), commands.Basic.Ack)
    assert (ack.delivery_tag, ack.multiple) == (6, False)


def test_confirms_count_unroutable_publishes(client: Client) -> None:
    client.expect(1, commands.Confirm.Select(), commands.Confirm.SelectOk)
    client.publish(1, b"nowhere", routing_key="no-queue")
    (ack,) = of_type(client.read(), commands.Basic.Ack)
    assert (ack.delivery_tag, ack.multiple) == (1, False)


def test_mandatory_unroutable_returned_before_ack(client: Client) -> None:
    client.expect(1, commands.Confirm.Select(), commands.Confirm.SelectOk)
    props = commands.Basic.Properties(message_id="r1")
    client.publish(1, b"bounce", exchange="amq.direct", routing_key="nobody", properties=props, mandatory=True)
    frames = client.read()
    kinds = [type(v) for _, v in frames]
    assert kinds == [commands.Basic.Return, ContentHeader, ContentBody, commands.Basic.Ack]
    deliveries, others = assemble(frames)
    ret = deliveries[0].method
    assert (ret.reply_code, ret.reply_text) == (312, "NO_ROUTE")
    assert (ret.exchange, ret.routing_key) == ("amq.direct", "nobody")
    assert deliveries[0].body == b"bounce"
    assert deliveries[0].properties.message_id == "r1"
    assert others[0][1].delivery_tag == 1


def test_mandatory_routable_not_returned(client: Client) -> None:
    client.declare_queue(1, "q")
    client.publish(1, b"ok", routing_key="q", mandatory=True)
    assert client.read() == []


def test_immediate_540(client: Client) -> None:
    client.declare_queue(1, "q")
    client.publish(1, b"now", routing_key="q", immediate=True)
    close = connection_close(client.read())
    assert close.reply_code == 540
    assert close.reply_text == "NOT_IMPLEMENTED - immediate=true"
    assert (close.class_id, close.method_id) == (60, 40)
    client.send(0, commands.Connection.CloseOk())
    assert client.conn.should_close


def test_publish_to_internal_exchange_403(client: Client) -> None:
    client.expect(
        1, commands.Exchange.Declare(exchange="inner", exchange_type="fanout", internal=True),
        commands.Exchange.DeclareOk,
    )
    client.publish(1, b"x", exchange="inner")
    assert channel_close(client.read(), 1).reply_code == 403


def test_user_id_mismatch_406(broker: Broker, client: Client) -> None:
    client.declare_queue(1, "q")
    client.publish(1, b"mine", routing_key="q", properties=commands.Basic.Properties(user_id="guest"))
    assert client.read() == []
    client.publish(1, b"forged", routing_key="q", properties=commands.Basic.Properties(user_id="admin"))
    close = channel_close(client.read(), 1)
    assert close.reply_code == 406
    assert close.reply_text == (
        "PRECONDITION_FAILED - user_id property set to 'admin' but authenticated user was 'guest'"
    )
    assert broker.vhosts["/"].queues["q"].message_count == 1


# ------------------------------------------------------------------------ acks


def test_ack_unknown_delivery_tag_406(client: Client) -> None:
    close = channel_close(client.call(1, commands.Basic.Ack(delivery_tag=99)), 1)
    assert close.reply_code == 406
    assert close.reply_text == "PRECONDITION_FAILED - unknown delivery tag 99"
    assert (close.class_id, close.method_id) == (60, 80)


@pytest.mark.parametrize(
    "method",
    [commands.Basic.Nack(delivery_tag=5), commands.Basic.Reject(delivery_tag=5),
     commands.Basic.Ack(delivery_tag=5, multiple=True)],
)
def test_settle_unknown_tag_406(client: Client, method: Any) -> None:
    assert channel_close(client.call(1, method), 1).reply_code == 406


def test_double_ack_406(client: Client) -> None:
    client.declare_queue(1, "q")
    client.publish(1, b"m", routing_key="q")
    client.call(1, commands.Basic.Get(queue="q"))
    assert client.call(1, commands.Basic.Ack(delivery_tag=1)) == []
    assert channel_close(client.call(1, commands.Basic.Ack(delivery_tag=1)), 1).reply_code == 406


def _publish_n(client: Client, queue: str, n: int, channel: int = 1) -> None:
    client.send_raw(b"".join(publish_bytes(channel, b"m%d" % i, routing_key=queue) for i in range(1, n + 1)))


def test_qos_prefetch_limits_deliveries(client: Client) -> None:
    client.declare_queue(1, "q")
    client.expect(1, commands.Basic.Qos(prefetch_count=2), commands.Basic.QosOk)
    client.consume(1, "q", tag="c")
    _publish_n(client, "q", 5)
    deliveries, _ = assemble(client.read())
    assert bodies(deliveries) == [b"m1", b"m2"]
    assert client.read() == []
    client.send(1, commands.Basic.Ack(delivery_tag=1))
    deliveries, _ = assemble(client.read())
    assert bodies(deliveries) == [b"m3"]
    client.send(1, commands.Basic.Ack(delivery_tag=3, multiple=True))
    deliveries, _ = assemble(client.read())
    assert bodies(deliveries) == [b"m4", b"m5"]
    assert [d.method.delivery_tag for d in deliveries] == [4, 5]


def test_qos_applies_when_consuming_a_backlog(client: Client) -> None:
    client.declare_queue(1, "q")
    _publish_n(client, "q", 5)
    client.expect(1, commands.Basic.Qos(prefetch_count=2), commands.Basic.QosOk)
    deliveries, _ = assemble(client.consume(1, "q"))
    assert bodies(deliveries) == [b"m1", b"m2"]


def test_global_qos_shared_by_channel_consumers(client: Client) -> None:
    client.declare_queue(1, "qa")
    client.declare_queue(1, "qb")
    client.expect(1, commands.Basic.Qos(prefetch_count=3, global_=True), commands.Basic.QosOk)
    client.consume(1, "qa", tag="a")
    client.consume(1, "qb", tag="b")
    _publish_n(client, "qa", 3)
    _publish_n(client, "qb", 3)
    deliveries, _ = assemble(client.read())
    assert len(deliveries) == 3
    client.send(1, commands.Basic.Ack(delivery_tag=0, multiple=True))
    deliveries, _ = assemble(client.read())
    assert len(deliveries) == 3


def test_no_ack_consumer_ignores_prefetch(client: Client) -> None:
    client.declare_queue(1, "q")
    client.expect(1, commands.Basic.Qos(prefetch_count=1), commands.Basic.QosOk)
    client.consume(1, "q", no_ack=True)
    _publish_n(client, "q", 4)
    deliveries, _ = assemble(client.read())
    assert len(deliveries) == 4


def test_nack_requeue_redelivers_in_original_order(client: Client) -> None:
    client.declare_queue(1, "q")
    client.consume(1, "q", tag="c")
    _publish_n(client, "q", 3)
    deliveries, _ = assemble(client.read())
    assert [d.method.redelivered for d in deliveries] == [False] * 3
    client.send(1, commands.Basic.Nack(delivery_tag=3, multiple=True, requeue=True))
    deliveries, _ = assemble(client.read())
    assert bodies(deliveries) == [b"m1", b"m2", b"m3"]
    assert [d.method.redelivered for d in deliveries] == [True] * 3
    assert [d.method.delivery_tag for d in deliveries] == [4, 5, 6]


def test_requeue_merges_by_queue_order(broker: Broker, client: Client) -> None:
    client.declare_queue(1, "q")
    _publish_n(client, "q", 4)
    for _ in range(3):
        client.call(1, commands.Basic.Get(queue="q"))  # tags 1..3 hold m1..m3; m4 stays ready
    client.send(1, commands.Basic.Nack(delivery_tag=2, requeue=True))
    client.send(1, commands.Basic.Reject(delivery_tag=1, requeue=True))
    got = []
    for _ in range(3):
        deliveries, _ = assemble(client.call(1, commands.Basic.Get(queue="q", no_ack=True)))
        got.append((deliveries[0].body, deliveries[0].method.redelivered))
    assert got == [(b"m1", True), (b"m2", True), (b"m4", False)]


def test_reject_without_requeue_drops(broker: Broker, client: Client) -> None:
    client.declare_queue(1, "q")
    _publish_n(client, "q", 1)
    client.call(1, commands.Basic.Get(queue="q"))
    assert client.call(1, commands.Basic.Reject(delivery_tag=1, requeue=False)) == []
    assert of_type(client.call(1, commands.Basic.Get(queue="q")), commands.Basic.GetEmpty)
    ok = client.declare_queue(1, "q", passive=True)
    assert ok.message_count == 0
    assert broker.vhosts["/"].queues["q"].default.unacked == 0


def test_basic_get_and_get_empty(client: Client) -> None:
    client.declare_queue(1, "q")
    _publish_n(client, "q", 3)
    counts = []
    for expected in (b"m1", b"m2", b"m3"):
        deliveries, _ = assemble(client.call(1, commands.Basic.Get(queue="q")))
        (d,) = deliveries
        assert isinstance(d.method, commands.Basic.GetOk)
        assert d.body == expected
        counts.append(d.method.message_count)
    assert counts == [2, 1, 0]
    frames = client.call(1, commands.Basic.Get(queue="q"))
    assert len(frames) == 1 and isinstance(frames[0][1], commands.Basic.GetEmpty)
    client.send(1, commands.Basic.Ack(delivery_tag=3, multiple=True))
    assert client.read() == []


def test_basic_get_missing_queue_404(client: Client) -> None:
    close = channel_close(client.call(1, commands.Basic.Get(queue="nope")), 1)
    assert close.reply_code == 404
    assert close.reply_text == "NOT_FOUND - no queue 'nope' in vhost '/'"


def test_recover_redelivers_unacked(client: Client) -> None:
    client.declare_queue(1, "q")
    _publish_n(client, "q", 2)
    client.call(1, commands.Basic.Get(queue="q"))
    client.call(1, commands.Basic.Get(queue="q"))
    frames = client.call(1, commands.Basic.Recover(requeue=True))
    assert of_type(frames, commands.Basic.RecoverOk)
    got = []
    for _ in range(2):
        deliveries, _ = assemble(client.call(1, commands.Basic.Get(queue="q", no_ack=True)))
        got.append((deliveries[0].body, deliveries[0].method.redelivered))
    assert got == [(b"m1", True), (b"m2", True)]
    # The old tags are gone.
    assert channel_close(client.call(1, commands.Basic.Ack(delivery_tag=1)), 1).reply_code == 406


def test_recover_redelivers_to_consumer(client: Client) -> None:
    client.declare_queue(1, "q")
    client.consume(1, "q", tag="c")
    _publish_n(client, "q", 2)
    client.read()
    deliveries, others = assemble(client.call(1, commands.Basic.Recover(requeue=True)))
    assert of_type(others, commands.Basic.RecoverOk)
    assert bodies(deliveries) == [b"m1", b"m2"]
    assert all(d.method.redelivered for d in deliveries)


# ------------------------------------------------------------------ heartbeats


def test_heartbeat_sent_when_idle_and_missed_heartbeats_close() -> None:
    t = 1000.0
    c = Client(local_broker(), now=t)
    c.handshake(heartbeat=1)
    c.tick(t + 0.1)
    assert c.read() == []  # just wrote Open-Ok: nothing due yet
    c.tick(t + 0.6)
    frames = c.read()
    assert len(frames) == 1 and isinstance(frames[0][1], Heartbeat) and frames[0][0] == 0
    assert not c.conn.should_close
    # The client's heartbeat keeps it alive ...
    c.send_raw(frame.marshal(Heartbeat(), 0), now=t + 1.5)
    c.tick(t + 3.0)
    assert not c.conn.should_close
    # ... and more than two intervals of silence ends it.
    c.tick(t + 3.6)
    assert c.conn.should_close


def test_heartbeat_with_the_real_clock() -> None:
    c = Client(local_broker())
    c.handshake(heartbeat=1)
    c.conn.tick(time.monotonic() + 0.6)
    assert of_type(c.read(), Heartbeat)
    c.conn.tick(time.monotonic() + 2.5)
    assert c.conn.should_close


def test_no_heartbeat_when_disabled() -> None:
    c = Client(local_broker())
    c.handshake(heartbeat=0)
    c.conn.tick(time.monotonic() + 1000)
    assert c.read() == []
    assert not c.conn.should_close


def test_no_heartbeat_while_output_pending(client: Client) -> None:
    c = Client(local_broker())
    c.handshake(heartbeat=1)
    c.open_channel(1)
    c.send(1, commands.Queue.Declare(queue="q"))  # reply not read yet
    c.conn.tick(time.monotonic() + 0.6)
    frames = c.read()
    assert not of_type(frames, Heartbeat)


def test_heartbeat_with_injected_clock() -> None:
    c = Client(local_broker(), now=0.0)
    c.handshake(heartbeat=1)
    c.conn.tick(0.6)
    assert of_type(c.read(), Heartbeat)


def test_handshake_timeout() -> None:
    settings = ServerSettings(handshake_timeout=10.0)
    c = Client(local_broker(), settings=settings, now=100.0)
    c.send_raw(PROTOCOL_HEADER, now=100.5)
    c.read()
    c.conn.tick(105.0)
    assert not c.conn.should_close
    c.conn.tick(110.5)
    assert c.conn.should_close


def test_handshake_timeout_without_header() -> None:
    c = Client(local_broker(), now=0.0)
    c.conn.tick(11.0)
    assert c.conn.should_close


def test_open_connection_has_no_handshake_timeout() -> None:
    c = Client(local_broker(), now=time.monotonic())
    c.handshake(heartbeat=0)
    c.conn.tick(time.monotonic() + 60)
    assert not c.conn.should_close


# -------------------------------------------------------------------- closing


def test_client_connection_close(client: Client) -> None:
    frames = client.call(0, client_connection_close("Normal shutdown"))
    assert len(frames) == 1 and isinstance(frames[0][1], commands.Connection.CloseOk)
    assert client.conn.should_close


def test_server_close_waits_for_close_ok(client: Client) -> None:
    client.conn.close()
    close = connection_close(client.read())
    assert close.reply_code == 320
    assert not client.conn.should_close
    client.send(0, commands.Connection.CloseOk())
    assert client.conn.should_close


def test_close_crossing_server_close(client: Client) -> None:
    client.conn.close()
    client.read()
    frames = client.call(0, client_connection_close("bye"))
    assert of_type(frames, commands.Connection.CloseOk)
    assert client.conn.should_close


def test_connection_lost_requeues_unacked_and_drops_exclusive_queues(broker: Broker) -> None:
    a = connected(broker)
    b = connected(broker)
    a.declare_queue(1, "shared")
    a.declare_queue(1, "mine", exclusive=True)
    a.consume(1, "shared", tag="a")
    _publish_n(a, "shared", 3)
    deliveries, _ = assemble(a.read())
    assert len(deliveries) == 3
    a.send(1, commands.Basic.Ack(delivery_tag=1))
    a.conn.connection_lost()
    assert a.conn.should_close
    vhost = broker.vhosts["/"]
    assert "mine" not in vhost.queues
    assert vhost.queues["shared"].consumer_count == 0
    deliveries, _ = assemble(b.consume(1, "shared", tag="b"))
    assert bodies(deliveries) == [b"m2", b"m3"]
    assert all(d.method.redelivered for d in deliveries)
    close = channel_close(b.call(1, commands.Queue.Declare(queue="mine", passive=True)), 1)
    assert close.reply_code == 404


def test_connection_lost_twice_is_harmless(client: Client) -> None:
    client.conn.connection_lost()
    client.conn.connection_lost()
    client.send_raw(b"\x00" * 10)
    assert client.conn.data_to_send() == b""


# -------------------------------------------------------------- declarations


def test_exclusive_queue_from_another_connection_405(broker: Broker) -> None:
    a = connected(broker)
    b = connected(broker, channels=(1, 2, 3, 4))
    a.declare_queue(1, "private", exclusive=True)
    attempts = [
        (1, commands.Queue.Declare(queue="private", exclusive=True)),
        (2, commands.Queue.Declare(queue="private", passive=True)),
        (3, commands.Basic.Consume(queue="private")),
        (4, commands.Basic.Get(queue="private")),
    ]
    for ch, method in attempts:
        close = channel_close(b.call(ch, method), ch)
        assert close.reply_code == 405, method
        assert close.reply_text.startswith(
            "RESOURCE_LOCKED - cannot obtain exclusive access to locked queue 'private' in vhost '/'"
        )
    # The owner is unaffected.
    assert a.declare_queue(1, "private", exclusive=True).queue == "private"


def test_exclusive_consumer_403(broker: Broker) -> None:
    a = connected(broker)
    b = connected(broker)
    a.declare_queue(1, "q")
    a.consume(1, "q", exclusive=True)
    close = channel_close(b.call(1, commands.Basic.Consume(queue="q")), 1)
    assert close.reply_code == 403
    assert "in exclusive use" in close.reply_text


def test_queue_equivalence_406(client: Client) -> None:
    client.declare_queue(1, "q", durable=False)
    close = channel_close(client.call(1, commands.Queue.Declare(queue="q", durable=True)), 1)
    assert close.reply_code == 406
    assert close.reply_text == (
        "PRECONDITION_FAILED - inequivalent arg 'durable' for queue 'q' in vhost '/': "
        "received 'true' but current is 'false'"
    )
    assert (close.class_id, close.method_id) == (50, 10)


def test_exchange_equivalence_406(client: Client) -> None:
    client.expect(1, commands.Exchange.Declare(exchange="x", exchange_type="direct"), commands.Exchange.DeclareOk)
    close = channel_close(client.call(1, commands.Exchange.Declare(exchange="x", exchange_type="fanout")), 1)
    assert close.reply_code == 406
    assert close.reply_text == (
        "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'x' in vhost '/': "
        "received 'fanout' but current is 'direct'"
    )


def test_redeclare_identical_is_fine(client: Client) -> None:
    client.declare_queue(1, "q", durable=True)
    client.declare_queue(1, "q", durable=True)
    client.expect(1, commands.Exchange.Declare(exchange="amq.topic", exchange_type="topic", durable=True),
                  commands.Exchange.DeclareOk)


def test_passive_declare_missing_404(client: Client) -> None:
    close = channel_close(client.call(1, commands.Exchange.Declare(exchange="nope", passive=True)), 1)
    assert close.reply_code == 404
    assert close.reply_text == "NOT_FOUND - no exchange 'nope' in vhost '/'"


@pytest.mark.parametrize(
    "method, text",
    [
        (commands.Exchange.Declare(exchange="amq.mine", exchange_type="direct"),
         "ACCESS_REFUSED - exchange name 'amq.mine' contains reserved prefix 'amq.*'"),
        (commands.Queue.Declare(queue="amq.mine"),
         "ACCESS_REFUSED - queue name 'amq.mine' contains reserved prefix 'amq.*'"),
    ],
)
def test_reserved_amq_prefix_403(client: Client, method: Any, text: str) -> None:
    close = channel_close(client.call(1, method), 1)
    assert close.reply_code == 403
    assert close.reply_text == text


def test_delete_standard_exchange_403(client: Client) -> None:
    close = channel_close(client.call(1, commands.Exchange.Delete(exchange="amq.direct")), 1)
    assert close.reply_code == 403


def test_unknown_exchange_type_503(client: Client) -> None:
    close = connection_close(client.call(1, commands.Exchange.Declare(exchange="x", exchange_type="weird")))
    assert close.reply_code == 503


def test_exchange_delete_if_unused_406(broker: Broker, client: Client) -> None:
    client.expect(1, commands.Exchange.Declare(exchange="x", exchange_type="direct"), commands.Exchange.DeclareOk)
    client.declare_queue(1, "q")
    client.expect(1, commands.Queue.Bind(queue="q", exchange="x", routing_key="k"), commands.Queue.BindOk)
    close = channel_close(client.call(1, commands.Exchange.Delete(exchange="x", if_unused=True)), 1)
    assert close.reply_code == 406
    assert close.reply_text == "PRECONDITION_FAILED - exchange 'x' in vhost '/' in use"
    assert "x" in broker.vhosts["/"].exchanges


def test_queue_delete_if_unused_and_if_empty_406(broker: Broker) -> None:
    c = connected(broker, channels=(1, 2, 3))
    c.declare_queue(1, "q")
    c.consume(1, "q", tag="c")
    close = channel_close(c.call(2, commands.Queue.Delete(queue="q", if_unused=True)), 2)
    assert close.reply_code == 406
    assert close.reply_text == "PRECONDITION_FAILED - queue 'q' in vhost '/' in use"
    c.declare_queue(3, "full")
    _publish_n(c, "full", 2, channel=3)
    close = channel_close(c.call(3, commands.Queue.Delete(queue="full", if_empty=True)), 3)
    assert close.reply_code == 406
    assert close.reply_text == "PRECONDITION_FAILED - queue 'full' in vhost '/' not empty"
    assert {"q", "full"} <= set(broker.vhosts["/"].queues)


def test_queue_delete_reports_message_count(client: Client) -> None:
    client.declare_queue(1, "q")
    _publish_n(client, "q", 3)
    ok = client.expect(1, commands.Queue.Delete(queue="q"), commands.Queue.DeleteOk)
    assert ok.message_count == 3
    # Deleting again is not an error.
    ok = client.expect(1, commands.Queue.Delete(queue="q"), commands.Queue.DeleteOk)
    assert ok.message_count == 0


def test_queue_purge(client: Client) -> None:
    client.declare_queue(1, "q")
    _publish_n(client, "q", 4)
    ok = client.expect(1, commands.Queue.Purge(queue="q"), commands.Queue.PurgeOk)
    assert ok.message_count == 4
    assert client.declare_queue(1, "q").message_count == 0


def test_server_named_queue(broker: Broker, client: Client) -> None:
    ok = client.declare_queue(1, "", exclusive=True)
    assert ok.queue.startswith("amq.gen-")
    assert len(ok.queue) > len("amq.gen-") + 10
    other = client.declare_queue(1, "", exclusive=True)
    assert other.queue != ok.queue
    # An empty queue name means "the last queue declared on this channel".
    client.expect(1, commands.Queue.Bind(queue="", exchange="amq.fanout"), commands.Queue.BindOk)
    client.publish(1, b"fan", exchange="amq.fanout")
    assert broker.vhosts["/"].queues[other.queue].message_count == 1
    assert broker.vhosts["/"].queues[ok.queue].message_count == 0


def test_declare_ok_counts(broker: Broker) -> None:
    a = connected(broker)
    a.declare_queue(1, "q")
    _publish_n(a, "q", 2)
    ok = a.declare_queue(1, "q", passive=True)
    assert (ok.message_count, ok.consumer_count) == (2, 0)
    a.consume(1, "q", tag="c")
    a.read()
    ok = a.declare_queue(1, "q", passive=True)
    assert (ok.message_count, ok.consumer_count) == (0, 1)


def test_unsupported_queue_argument_refused(client: Client) -> None:
    close = channel_close(client.call(1, commands.Queue.Declare(queue="q", arguments={"x-made-up": 1})), 1)
    assert close.reply_code == 406


# --------------------------------------------------------------------- consumers


def test_consumer_tag_reuse_530(client: Client) -> None:
    client.declare_queue(1, "q")
    client.consume(1, "q", tag="same")
    close = connection_close(client.call(1, commands.Basic.Consume(queue="q", consumer_tag="same")))
    assert close.reply_code == 530
    assert close.reply_text == "NOT_ALLOWED - attempt to reuse consumer tag 'same'"
    assert (close.class_id, close.method_id) == (60, 20)


def test_server_generated_consumer_tag(client: Client) -> None:
    client.declare_queue(1, "q")
    frames = client.consume(1, "q")
    assert frames[0][1].consumer_tag.startswith("amq.ctag-")


def test_basic_cancel_stops_deliveries(broker: Broker, client: Client) -> None:
    client.declare_queue(1, "q")
    client.consume(1, "q", tag="c")
    ok = client.expect(1, commands.Basic.Cancel(consumer_tag="c"), commands.Basic.CancelOk)
    assert ok.consumer_tag == "c"
    _publish_n(client, "q", 1)
    assert client.read() == []
    assert broker.vhosts["/"].queues["q"].message_count == 1


def test_round_robin_between_connections(broker: Broker) -> None:
    a = connected(broker)
    b = connected(broker)
    a.declare_queue(1, "q")
    a.consume(1, "q", tag="a", no_ack=True)
    b.consume(1, "q", tag="b", no_ack=True)
    _publish_n(a, "q", 4)
    got_a, _ = assemble(a.read())
    got_b, _ = assemble(b.read())
    assert bodies(got_a) == [b"m1", b"m3"]
    assert bodies(got_b) == [b"m2", b"m4"]


def test_server_cancel_on_queue_delete(broker: Broker) -> None:
    a = connected(broker)
    b = connected(broker)
    a.declare_queue(1, "q")
    a.consume(1, "q", tag="watcher")
    b.expect(1, commands.Queue.Delete(queue="q"), commands.Queue.DeleteOk)
    frames = a.read()
    (cancel,) = of_type(frames, commands.Basic.Cancel)
    assert frames[0][0] == 1
    assert cancel.consumer_tag == "watcher"
    # The tag is free again on that channel.
    a.declare_queue(1, "q")
    a.consume(1, "q", tag="watcher")


def test_no_server_cancel_without_capability(broker: Broker) -> None:
    a = connected(broker, capabilities={})
    b = connected(broker)
    a.declare_queue(1, "q")
    a.consume(1, "q", tag="watcher")
    b.expect(1, commands.Queue.Delete(queue="q"), commands.Queue.DeleteOk)
    assert a.read() == []


def test_auto_delete_queue_goes_with_last_consumer(broker: Broker, client: Client) -> None:
    client.declare_queue(1, "temp", auto_delete=True)
    client.consume(1, "temp", tag="c")
    assert "temp" in broker.vhosts["/"].queues
    client.expect(1, commands.Basic.Cancel(consumer_tag="c"), commands.Basic.CancelOk)
    assert "temp" not in broker.vhosts["/"].queues


def test_channel_close_requeues_to_other_consumer(broker: Broker) -> None:
    c = connected(broker, channels=(1, 2))
    c.declare_queue(1, "q")
    c.expect(1, commands.Basic.Qos(prefetch_count=1), commands.Basic.QosOk)
    c.consume(1, "q", tag="one")
    _publish_n(c, "q", 1)
    c.read()
    c.consume(2, "q", tag="two", no_ack=True)
    deliveries, others = assemble(c.call(1, client_channel_close("")))
    assert of_type(others, commands.Channel.CloseOk)
    assert [(d.channel, d.body, d.method.redelivered) for d in deliveries] == [(2, b"m1", True)]


# ------------------------------------------------------------------ routing via AMQP


def test_exchange_to_exchange_binding(client: Client) -> None:
    for name, kind in (("src", "topic"), ("dst", "fanout")):
        client.expect(1, commands.Exchange.Declare(exchange=name, exchange_type=kind), commands.Exchange.DeclareOk)
    client.expect(1, commands.Exchange.Bind(destination="dst", source="src", routing_key="a.#"),
                  commands.Exchange.BindOk)
    client.declare_queue(1, "q")
    client.expect(1, commands.Queue.Bind(queue="q", exchange="dst"), commands.Queue.BindOk)
    client.publish(1, b"yes", exchange="src", routing_key="a.b")
    client.publish(1, b"no", exchange="src", routing_key="b.a")
    deliveries, _ = assemble(client.call(1, commands.Basic.Get(queue="q", no_ack=True)))
    assert bodies(deliveries) == [b"yes"]
    assert deliveries[0].method.message_count == 0
    client.expect(1, commands.Exchange.Unbind(destination="dst", source="src", routing_key="a.#"),
                  commands.Exchange.UnbindOk)
    client.publish(1, b"gone", exchange="src", routing_key="a.b")
    assert of_type(client.call(1, commands.Basic.Get(queue="q")), commands.Basic.GetEmpty)


def test_headers_exchange_via_amqp(client: Client) -> None:
    client.declare_queue(1, "q")
    client.expect(
        1,
        commands.Queue.Bind(queue="q", exchange="amq.headers", arguments={"x-match": "any", "a": 1, "b": "two"}),
        commands.Queue.BindOk,
    )
    client.publish(1, b"hit", exchange="amq.headers", properties=commands.Basic.Properties(headers={"b": "two"}))
    client.publish(1, b"miss", exchange="amq.headers", properties=commands.Basic.Properties(headers={"b": "one"}))
    client.publish(1, b"none", exchange="amq.headers")
    deliveries, _ = assemble(client.call(1, commands.Basic.Get(queue="q", no_ack=True)))
    assert bodies(deliveries) == [b"hit"]
    assert deliveries[0].method.message_count == 0


def test_bad_x_match_406(client: Client) -> None:
    client.declare_queue(1, "q")
    frames = client.call(1, commands.Queue.Bind(queue="q", exchange="amq.headers", arguments={"x-match": "some"}))
    assert channel_close(frames, 1).reply_code == 406


def test_bind_to_default_exchange_403(client: Client) -> None:
    client.declare_queue(1, "q")
    close = channel_close(client.call(1, commands.Queue.Bind(queue="q", exchange="", routing_key="q")), 1)
    assert close.reply_code == 403


def test_tx_select_ok(client: Client) -> None:
    assert of_type(client.call(1, commands.Tx.Select()), commands.Tx.SelectOk)


def test_publish_after_content_frames_split_across_channels(broker: Broker) -> None:
    c = connected(broker, channels=(1, 2))
    c.declare_queue(1, "q")
    c.send(1, commands.Basic.Publish(exchange="", routing_key="q"), ContentHeader(0, 2, commands.Basic.Properties()))
    c.send_raw(publish_bytes(2, b"two", routing_key="q"))
    c.send(1, ContentBody(b"on"))
    got = []
    for _ in range(2):
        deliveries, _ = assemble(c.call(1, commands.Basic.Get(queue="q", no_ack=True)))
        got.append(deliveries[0].body)
    assert got == [b"two", b"on"]


def test_content_frames_helper_roundtrip() -> None:
    raw = content_frames(1, b"abcdef", chunk=4)
    kinds = [type(v) for _, v in parse_frames(raw)]
    assert kinds == [ContentHeader, ContentBody, ContentBody]


# ----------------------------------------------------------------- more corners


def test_fanout_to_channels_with_different_frame_max(broker: Broker) -> None:
    a = connected(broker, channels=(1, 2))
    b = Client(broker)
    b.handshake(frame_max=4096)
    b.open_channel(5)
    body = bytes(range(256)) * 40  # 10240 bytes
    for name, client, ch in (("qa1", a, 1), ("qa2", a, 2), ("qb", b, 5)):
        client.declare_queue(ch, name)
        client.expect(ch, commands.Queue.Bind(queue=name, exchange="amq.fanout"), commands.Queue.BindOk)
        client.consume(ch, name, tag=name, no_ack=True)
    a.publish(1, body, exchange="amq.fanout", routing_key="rk")
    got_a, _ = assemble(a.read())
    got_b, _ = assemble(b.read())
    assert sorted((d.channel, d.method.consumer_tag) for d in got_a) == [(1, "qa1"), (2, "qa2")]
    assert [(d.channel, d.method.consumer_tag) for d in got_b] == [(5, "qb")]
    for d in got_a + got_b:
        assert d.body == body
        assert (d.method.exchange, d.method.routing_key) == ("amq.fanout", "rk")
    assert [d.body_frames for d in got_b] == [3]
    assert all(d.body_frames == 1 for d in got_a)


def test_publish_after_channel_error_in_same_read_is_dropped(broker: Broker, client: Client) -> None:
    client.declare_queue(1, "q")
    client.expect(1, commands.Confirm.Select(), commands.Confirm.SelectOk)
    client.send_raw(
        publish_bytes(1, b"bad", exchange="missing") + publish_bytes(1, b"good", routing_key="q", chunk=2)
    )
    frames = client.read()
    assert channel_close(frames, 1).reply_code == 404
    assert not of_type(frames, commands.Basic.Ack)
    assert broker.vhosts["/"].queues["q"].message_count == 0


def test_publish_to_amq_default(broker: Broker, client: Client) -> None:
    client.declare_queue(1, "q")
    client.send_raw(publish_bytes(1, b"x", exchange="amq.default", routing_key="q"))
    assert client.read() == []
    assert broker.vhosts["/"].queues["q"].message_count == 1


def test_channel_flow(client: Client) -> None:
    ok = client.expect(1, commands.Channel.Flow(active=True), commands.Channel.FlowOk)
    assert ok.active
    close = connection_close(client.call(1, commands.Channel.Flow(active=False)))
    assert close.reply_code == 540
    assert close.reply_text == "NOT_IMPLEMENTED - active=false"


def test_qos_prefetch_size_not_implemented(client: Client) -> None:
    close = connection_close(client.call(1, commands.Basic.Qos(prefetch_size=1000)))
    assert close.reply_code == 540
    assert close.reply_text == "NOT_IMPLEMENTED - prefetch_size!=0 (1000)"


def test_client_close_then_connection_lost_drops_exclusive(broker: Broker, client: Client) -> None:
    client.declare_queue(1, "excl", exclusive=True)
    client.call(0, client_connection_close("bye"))
    assert client.conn.should_close
    client.conn.connection_lost()
    assert "excl" not in broker.vhosts["/"].queues


def test_closing_channel_drops_auto_delete_queue(broker: Broker, client: Client) -> None:
    client.declare_queue(1, "ad", auto_delete=True)
    client.consume(1, "ad", tag="c")
    client.expect(1, client_channel_close(), commands.Channel.CloseOk)
    assert "ad" not in broker.vhosts["/"].queues


def test_client_heartbeat_frames_are_accepted(client: Client) -> None:
    client.send_raw(frame.marshal(Heartbeat(), 0) * 3)
    assert client.read() == []
    assert not client.conn.should_close


def test_consume_nowait(client: Client) -> None:
    client.declare_queue(1, "q")
    assert client.call(1, commands.Basic.Consume(queue="q", consumer_tag="c", nowait=True, no_ack=True)) == []
    client.publish(1, b"m", routing_key="q")
    deliveries, _ = assemble(client.read())
    assert [d.method.consumer_tag for d in deliveries] == ["c"]


def test_ack_after_queue_deleted(broker: Broker, client: Client) -> None:
    client.declare_queue(1, "q")
    client.consume(1, "q", tag="c")
    client.publish(1, b"m", routing_key="q")
    client.read()
    frames = client.call(1, commands.Queue.Delete(queue="q"))
    assert of_type(frames, commands.Basic.Cancel) and of_type(frames, commands.Queue.DeleteOk)
    assert client.call(1, commands.Basic.Ack(delivery_tag=1)) == []
    assert not client.conn.should_close


def test_malformed_properties_close_connection(client: Client) -> None:
    client.declare_queue(1, "q")
    publish = frame.marshal(commands.Basic.Publish(exchange="", routing_key="q"), 1)
    # A header that claims a content_type but stops before it.
    payload = b"\x00\x3c\x00\x00" + (3).to_bytes(8, "big") + b"\x80\x00"
    header = b"\x02\x00\x01" + len(payload).to_bytes(4, "big") + payload + b"\xce"
    client.send_raw(publish + header + frame.marshal(ContentBody(b"abc"), 1))
    close = connection_close(client.read())
    assert 500 <= close.reply_code < 600


# ------------------------------------------------------------ flow control, clocks


def test_transport_paused_holds_deliveries(broker: Broker) -> None:
    c = connected(broker)
    c.declare_queue(1, "q")
    c.consume(1, "q", tag="t", no_ack=True)
    c.conn.set_transport_paused(True)
    connected(broker).publish(1, b"held", routing_key="q")  # another connection's: this one reads nothing now
    assert c.read() == []
    assert broker.vhosts["/"].queues["q"].message_count == 1
    c.conn.set_transport_paused(False)
    deliveries, _ = assemble(c.read())
    assert bodies(deliveries) == [b"held"]


def test_write_high_water_resumes_after_flush(broker: Broker) -> None:
    publisher = connected(broker)
    publisher.declare_queue(1, "q")
    consumer_ = Client(broker, settings=ServerSettings(write_high_water=200))
    consumer_.handshake()
    consumer_.open_channel(1)
    consumer_.consume(1, "q", tag="t", no_ack=True)
    _publish_n(publisher, "q", 20)
    got: list[bytes] = []
    for _ in range(40):
        deliveries, _ = assemble(consumer_.read())
        got += bodies(deliveries)
        consumer_.conn.resume_deliveries()  # what the I/O layer does once the socket drained
        if len(got) == 20:
            break
    assert got == [b"m%d" % i for i in range(1, 21)]
    assert broker.vhosts["/"].queues["q"].message_count == 0


def test_close_timeout_with_injected_clock() -> None:
    c = Client(local_broker(), now=0.0)
    c.handshake()
    c.conn.close()
    assert connection_close(c.read()).reply_code == 320
    c.tick(2.0)
    assert not c.conn.should_close
    c.tick(3.5)  # ServerSettings.close_timeout is 3 s
    assert c.conn.should_close


def test_heartbeat_timeout_with_injected_clock() -> None:
    c = Client(local_broker(), now=0.0)
    c.handshake(heartbeat=2)
    c.tick(1.0)
    assert of_type(c.read(), Heartbeat)
    c.send_raw(frame.marshal(Heartbeat(), 0), now=3.0)
    c.tick(6.5)
    assert not c.conn.should_close
    c.tick(7.5)
    assert c.conn.should_close


def test_frames_after_a_connection_error_are_ignored(broker: Broker, client: Client) -> None:
    client.send_raw(
        publish_bytes(1, b"x", routing_key="q", immediate=True)
        + frame.marshal(commands.Queue.Declare(queue="after-error"), 1)
    )
    frames = client.read()
    assert [type(v) for _, v in frames] == [commands.Connection.Close]
    assert "after-error" not in broker.vhosts["/"].queues
    client.send(1, commands.Queue.Declare(queue="later"))
    assert client.read() == []
    assert "later" not in broker.vhosts["/"].queues


def test_delivery_tags_restart_on_a_reopened_channel(client: Client) -> None:
    client.declare_queue(1, "q")
    client.consume(1, "q", tag="t")
    client.publish(1, b"a", routing_key="q")
    client.read()
    client.expect(1, client_channel_close(), commands.Channel.CloseOk)
    client.open_channel(1)
    deliveries, _ = assemble(client.consume(1, "q", tag="t"))
    assert [(d.method.delivery_tag, d.method.redelivered, d.body) for d in deliveries] == [(1, True, b"a")]


def test_channel_open_on_closing_channel_is_ignored(client: Client) -> None:
    client.publish(1, b"x", exchange="missing")
    channel_close(client.read(), 1)
    assert client.call(1, commands.Channel.Open()) == []
    assert not client.conn.should_close
    assert client.call(1, commands.Channel.CloseOk()) == []
    client.open_channel(1)
