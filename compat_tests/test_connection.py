"""Connection-level behaviour: handshake, auth, vhosts, tuning, heartbeats, framing."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import amqp
import amqp.exceptions
import amqp.sasl
import kombu
import pika
import pika.exceptions
import pytest
from pamqp import commands
from pamqp.header import ContentHeader
from pamqp.heartbeat import Heartbeat

from compat_tests.raw_amqp import PROTOCOL_HEADER, ConnectionClosedError, RawAMQP, raw_frame
from compat_tests.util import channel_error, drain

pytestmark = pytest.mark.timeout(30)

Connect = Callable[..., pika.BlockingConnection]
RawFactory = Callable[[], RawAMQP]

EXPECTED_CAPABILITIES = (
    "publisher_confirms",
    "basic.nack",
    "consumer_cancel_notify",
    "exchange_exchange_bindings",
    "per_consumer_qos",
    "authentication_failure_close",
)


def _url(host: str, port: int, user: str = "guest", password: str = "guest", vhost: str = "%2F") -> str:
    return f"amqp://{user}:{password}@{host}:{port}/{vhost}"


def _assert_broker_alive(host: str, port: int) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(_url(host, port)))
    try:
        ch = conn.channel()
        ok = ch.queue_declare("", exclusive=True)
        assert ok.method.queue
    finally:
        conn.close()


def _read_close(client: RawAMQP, timeout: float = 5.0) -> commands.Connection.Close | None:
    """Read until connection.close arrives (answer close-ok, return it) or EOF (None)."""
    try:
        while True:
            _ch, value = client.read_frame(timeout)
            if isinstance(value, commands.Connection.Close):
                break
    except ConnectionClosedError:
        return None
    try:
        client.send(commands.Connection.CloseOk())
    except OSError:
        pass
    return value


# --------------------------------------------------------------- handshakes
def test_pika_plain_handshake(connect: Connect) -> None:
    conn = connect()
    assert conn.is_open
    ch = conn.channel()
    assert ch.is_open
    ok = ch.queue_declare("", exclusive=True)
    assert ok.method.queue.startswith("amq.gen-")
    conn.close()
    assert conn.is_closed


def test_server_properties(connection: pika.BlockingConnection) -> None:
    props = connection._impl.server_properties
    assert isinstance(props.get("product"), str | bytes) and props["product"]
    assert isinstance(props.get("version"), str | bytes) and props["version"]
    caps = props.get("capabilities")
    assert isinstance(caps, dict)
    for cap in EXPECTED_CAPABILITIES:
        assert caps.get(cap) is True, f"capability {cap} missing: {caps}"


def test_connection_start_and_tune(raw: RawFactory) -> None:
    client = raw()
    client.handshake()
    start = client.start
    assert start is not None and client.tune is not None
    assert (start.version_major, start.version_minor) == (0, 9)
    mechanisms = start.mechanisms.split()
    assert "PLAIN" in mechanisms and "AMQPLAIN" in mechanisms
    assert "en_US" in start.locales.split()
    # RabbitMQ defaults: frame_max 128 KiB, heartbeat 60 s, channel_max 2047.
    assert client.tune.frame_max == 131072
    assert client.tune.heartbeat == 60
    assert 0 < client.tune.channel_max <= 65535


def test_pyamqp_default_login_is_amqplain(amqp_host: str, amqp_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # py-amqp offers GSSAPI (fail-soft), EXTERNAL, AMQPLAIN, PLAIN and uses the
    # first one the server lists in connection.start -> AMQPLAIN.
    used: list[bytes] = []
    for cls in (amqp.sasl.AMQPLAIN, amqp.sasl.PLAIN):
        original = cls.start

        def start(self: amqp.sasl.SASL, connection: amqp.Connection, _orig: Any = original) -> bytes:
            used.append(self.mechanism)
            return _orig(self, connection)

        monkeypatch.setattr(cls, "start", start)
    conn = amqp.Connection(f"{amqp_host}:{amqp_port}", userid="guest", password="guest")
    conn.connect()
    try:
        assert b"AMQPLAIN" in conn.mechanisms and b"PLAIN" in conn.mechanisms
        assert used == [b"AMQPLAIN"]
        ch = conn.channel()
        queue, _count, _consumers = ch.queue_declare("", exclusive=True)
        assert queue.startswith("amq.gen-")
    finally:
        conn.close()


@pytest.mark.parametrize("method", ["AMQPLAIN", "PLAIN"])
def test_pyamqp_explicit_login_method(amqp_host: str, amqp_port: int, method: str) -> None:
    conn = amqp.Connection(f"{amqp_host}:{amqp_port}", login_method=method)
    conn.connect()
    try:
        assert conn.connected
        ch = conn.channel()
        ch.basic_qos(0, 10, False)
    finally:
        conn.close()


def test_pyamqp_amqplain_wrong_password(amqp_host: str, amqp_port: int) -> None:
    conn = amqp.Connection(f"{amqp_host}:{amqp_port}", password="definitely-wrong")
    with pytest.raises(amqp.exceptions.AccessRefused) as info:
        conn.connect()
    assert info.value.reply_code == 403
    assert "ACCESS_REFUSED" in info.value.reply_text


def test_kombu_handshake(amqp_url: str) -> None:
    with kombu.Connection(amqp_url) as conn:
        conn.connect()
        assert conn.connected
        assert conn.connection.server_properties["capabilities"]["publisher_confirms"] is True
        ch = conn.default_channel
        queue, _count, _consumers = ch.queue_declare("", exclusive=True)
        assert queue.startswith("amq.gen-")


# ------------------------------------------------------------ auth & vhosts
@pytest.mark.parametrize(("user", "password"), [("guest", "wrong"), ("no-such-user", "guest")])
def test_wrong_credentials_refused(amqp_host: str, amqp_port: int, user: str, password: str) -> None:
    params = pika.URLParameters(_url(amqp_host, amqp_port, user, password))
    params.connection_attempts = 1
    with pytest.raises(pika.exceptions.AMQPConnectionError) as info:
        pika.BlockingConnection(params)
    assert isinstance(info.value, pika.exceptions.ProbableAuthenticationError)
    assert "403" in str(info.value)
    assert "ACCESS_REFUSED" in str(info.value)
    _assert_broker_alive(amqp_host, amqp_port)


def test_wrong_password_raw_close(raw: RawFactory) -> None:
    client = raw()
    client.send_raw(PROTOCOL_HEADER)
    client.expect(commands.Connection.Start)
    client.send(
        commands.Connection.StartOk(
            client_properties={"capabilities": {"authentication_failure_close": True}},
            mechanism="PLAIN",
            response="\0guest\0wrong",
        )
    )
    close = client.expect(commands.Connection.Close)
    assert close.reply_code == 403
    assert close.reply_text.startswith("ACCESS_REFUSED")


def test_unknown_vhost_refused(amqp_host: str, amqp_port: int) -> None:
    params = pika.URLParameters(_url(amqp_host, amqp_port, vhost="no-such-vhost"))
    params.connection_attempts = 1
    with pytest.raises(pika.exceptions.AMQPConnectionError) as info:
        pika.BlockingConnection(params)
    assert isinstance(info.value, pika.exceptions.ProbableAccessDeniedError)
    assert "530" in str(info.value)
    assert "NOT_ALLOWED" in str(info.value)
    assert "no-such-vhost" in str(info.value)


def test_unknown_vhost_raw(raw: RawFactory) -> None:
    client = raw()
    client.negotiate()
    client.send(commands.Connection.Open(virtual_host="no-such-vhost"))
    close = _read_close(client)
    assert close is not None
    assert close.reply_code == 530
    assert close.reply_text.startswith("NOT_ALLOWED")
    assert (close.class_id, close.method_id) == (10, 40)  # connection.open


def test_unknown_vhost_pyamqp(amqp_host: str, amqp_port: int) -> None:
    conn = amqp.Connection(f"{amqp_host}:{amqp_port}", virtual_host="no-such-vhost")
    with pytest.raises(amqp.exceptions.NotAllowed) as info:
        conn.connect()
    assert info.value.reply_code == 530
    assert "NOT_ALLOWED" in info.value.reply_text


# --------------------------------------------------------------- heartbeats
def test_pika_heartbeat_keeps_idle_connection_alive(connect: Connect) -> None:
    conn = connect(heartbeat=2)
    assert conn._impl.params.heartbeat == 2
    ch = conn.channel()
    drain(conn, 5.0)
    assert conn.is_open and ch.is_open
    ok = ch.queue_declare("", exclusive=True)
    assert ok.method.queue


def test_server_sends_heartbeats(raw: RawFactory) -> None:
    client = raw()
    client.handshake(heartbeat=1)
    seen = 0
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        try:
            _ch, value = client.read_frame(timeout=max(0.05, deadline - time.monotonic()))
        except TimeoutError:
            break
        if isinstance(value, Heartbeat):
            seen += 1
            client.send(Heartbeat())
    assert seen >= 2
    client.open_channel(1)


def test_silent_client_disconnected_after_missed_heartbeats(raw: RawFactory) -> None:
    client = raw()
    client.handshake(heartbeat=1)
    start = time.monotonic()
    assert client.wait_closed(timeout=10), "server kept a silent connection with heartbeat=1"
    assert time.monotonic() - start >= 1.0


def test_no_heartbeats_when_disabled(raw: RawFactory) -> None:
    client = raw()
    client.handshake(heartbeat=0)
    with pytest.raises(TimeoutError):
        client.read_frame(timeout=1.5)
    client.open_channel(1)


# ----------------------------------------------------------------- channels
def test_many_channels_on_one_connection(connection: pika.BlockingConnection) -> None:
    channels = [connection.channel() for _ in range(200)]
    numbers = {ch.channel_number for ch in channels}
    assert len(numbers) == 200
    queue = channels[0].queue_declare("", exclusive=True).method.queue
    for ch in channels:
        ch.basic_publish("", queue, str(ch.channel_number).encode())
    for ch in channels[1:]:
        ch.close()
    ok = channels[0].queue_declare(queue, passive=True)
    assert ok.method.message_count == 200
    assert connection.is_open


def test_channel_error_keeps_connection_and_other_channels(
    connection: pika.BlockingConnection, unique: Callable[[str], str]
) -> None:
    good = connection.channel()
    bad = connection.channel()
    with channel_error(404, "NOT_FOUND - no queue"):
        bad.queue_declare(unique("compat.missing"), passive=True)
    assert bad.is_closed
    assert connection.is_open and good.is_open
    assert good.queue_declare("", exclusive=True).method.queue
    again = connection.channel()
    assert again.queue_declare("", exclusive=True).method.queue


def test_channel_close_and_reopen(connection: pika.BlockingConnection) -> None:
    for _ in range(20):
        ch = connection.channel()
        ch.basic_qos(prefetch_count=5)
        ch.close()
    assert connection.is_open


def test_double_channel_open_is_channel_error(raw: RawFactory) -> None:
    client = raw()
    client.handshake()
    client.open_channel(1)
    client.send(commands.Channel.Open(), 1)
    close = _read_close(client)
    assert close is not None
    assert close.reply_code == 504
    assert close.reply_text.startswith("CHANNEL_ERROR")


def test_method_on_unopened_channel_is_channel_error(raw: RawFactory) -> None:
    client = raw()
    client.handshake()
    client.send(commands.Queue.Declare(queue="", exclusive=True), 3)
    close = _read_close(client)
    assert close is not None
    assert close.reply_code == 504
    assert close.reply_text.startswith("CHANNEL_ERROR")


def test_channel_close_handshake_raw(raw: RawFactory) -> None:
    client = raw()
    client.handshake()
    client.open_channel(1)
    ok = client.rpc(commands.Channel.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0))
    assert isinstance(ok, commands.Channel.CloseOk)
    client.open_channel(1)  # the number can be reused
    assert isinstance(client.rpc(commands.Basic.Qos(prefetch_count=1)), commands.Basic.QosOk)


# ------------------------------------------------------------ wire framing
@pytest.mark.parametrize(
    "header",
    [
        b"AMQP\x00\x00\x08\x00",  # 0-8
        b"AMQP\x00\x00\x0a\x00",  # 0-10
        b"AMQP\x00\x01\x00\x00",  # 1.0
        b"AMQX\x00\x00\x09\x01",
        b"GET / HTTP/1.1\r\n\r\n",
    ],
)
def test_wrong_protocol_header(raw: RawFactory, amqp_host: str, amqp_port: int, header: bytes) -> None:
    client = raw()
    client.send_raw(header)
    reply = b""
    deadline = time.monotonic() + 5
    while len(reply) < 8 and time.monotonic() < deadline:
        chunk = client.recv_raw(timeout=5)
        if not chunk:
            break
        reply += chunk
    assert reply == PROTOCOL_HEADER
    assert client.wait_closed(timeout=5)
    _assert_broker_alive(amqp_host, amqp_port)


def test_garbage_after_handshake_closes_only_that_connection(raw: RawFactory, connect: Connect) -> None:
    bystander = connect()
    bystander_ch = bystander.channel()
    queue = bystander_ch.queue_declare("", exclusive=True).method.queue

    client = raw()
    client.handshake()
    client.open_channel(1)
    client.send_raw(b"\x00garbage that is not an AMQP frame at all\xff" * 4)
    close = _read_close(client)
    if close is not None:  # RabbitMQ: 501 FRAME_ERROR, then drops the socket
        assert close.reply_code == 501
        assert close.reply_text.startswith("FRAME_ERROR")
    assert client.wait_closed(timeout=5)

    bystander_ch.basic_publish("", queue, b"still alive")
    method, _props, body = bystander_ch.basic_get(queue, auto_ack=True)
    assert method is not None and body == b"still alive"


def test_frame_larger_than_frame_max(raw: RawFactory) -> None:
    client = raw()
    client.handshake(frame_max=4096)
    assert client.frame_max == 4096
    client.open_channel(1)
    client.send(commands.Basic.Publish(exchange="", routing_key="nowhere"), 1)
    client.send(ContentHeader(0, 10000), 1)
    client.send_raw(raw_frame(3, 1, b"a" * 10000))
    close = _read_close(client)
    assert close is not None
    assert close.reply_code == 501
    assert close.reply_text.startswith("FRAME_ERROR")
    assert client.wait_closed(timeout=5)


def test_oversized_method_frame(raw: RawFactory) -> None:
    client = raw()
    client.handshake(frame_max=4096)
    client.open_channel(1)
    # queue.declare (50, 10) padded far past frame_max
    client.send_raw(raw_frame(1, 1, b"\x00\x32\x00\x0a" + b"\x00" * 8000))
    close = _read_close(client)
    assert close is not None
    assert close.reply_code == 501


def test_bad_frame_end_marker(raw: RawFactory) -> None:
    client = raw()
    client.handshake()
    client.open_channel(1)
    client.send_raw(raw_frame(1, 1, b"\x00\x3c\x00\x0a" + b"\x00" * 7, end=0x00))
    close = _read_close(client)
    assert close is not None
    assert close.reply_code == 501
    assert close.reply_text.startswith("FRAME_ERROR")


def test_unknown_frame_type(raw: RawFactory) -> None:
    client = raw()
    client.handshake()
    client.open_channel(1)
    client.send_raw(raw_frame(9, 1, b"abc"))
    close = _read_close(client)
    assert close is not None
    assert close.reply_code == 501
    assert close.reply_text.startswith("FRAME_ERROR")


# ------------------------------------------------------------------ closing
def test_client_close_is_clean(connect: Connect, amqp_host: str, amqp_port: int) -> None:
    conn = connect()
    ch = conn.channel()
    ch.queue_declare("", exclusive=True)
    conn.close()
    assert conn.is_closed
    _assert_broker_alive(amqp_host, amqp_port)


def test_connection_close_handshake_raw(raw: RawFactory) -> None:
    client = raw()
    client.handshake()
    client.open_channel(1)
    reply = client.rpc(
        commands.Connection.Close(reply_code=200, reply_text="Normal shutdown", class_id=0, method_id=0),
        channel=0,
    )
    assert isinstance(reply, commands.Connection.CloseOk)


def test_abrupt_disconnects_do_not_hurt_server(amqp_host: str, amqp_port: int) -> None:
    for stage in range(4):
        sock = socket.create_connection((amqp_host, amqp_port), timeout=5)
        if stage >= 1:
            sock.sendall(PROTOCOL_HEADER)
        if stage >= 2:
            sock.recv(4096)
        if stage >= 3:
            sock.sendall(raw_frame(1, 0, b"\x00\x0a\x00\x0b")[:9])  # half a frame
        sock.close()
    client = RawAMQP(amqp_host, amqp_port)
    try:
        client.handshake()
        client.open_channel(1)
        client.publish(1, b"x" * 300000, routing_key="nowhere")
        client.close_socket()  # drop while the server may still be reading
    finally:
        client.close_socket()
    _assert_broker_alive(amqp_host, amqp_port)
