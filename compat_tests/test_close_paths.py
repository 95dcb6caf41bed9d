"""Close paths on the wire: crossing closes and the lingering close, against a real node.

These are what a widely used client library's own integration tests trip
over: a channel closed by both peers at once must not kill the connection,
and a client that closes while its last frames are still in flight must get
its close-ok, not a reset.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import pytest
from pamqp import commands, frame, header
from pamqp.body import ContentBody

from compat_tests.raw_amqp import ConnectionClosedError, RawAMQP

pytestmark = pytest.mark.timeout(60)

RawFactory = Callable[[], RawAMQP]


def _channel_close(text: str = "bye") -> commands.Channel.Close:
    return commands.Channel.Close(reply_code=200, reply_text=text, class_id=0, method_id=0)


def _connection_close() -> commands.Connection.Close:
    return commands.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0)


def _publishes(channel: int, count: int, size: int, routing_key: str) -> bytes:
    body = b"x" * size
    one = (
        frame.marshal(commands.Basic.Publish(exchange="", routing_key=routing_key), channel)
        + frame.marshal(header.ContentHeader(0, len(body), commands.Basic.Properties()), channel)
        + frame.marshal(ContentBody(body), channel)
    )
    return one * count


def _read_until_eof(client: RawAMQP, timeout: float = 10.0) -> list[tuple[int, object]]:
    """Every frame until the node closes; a reset fails the test (that is the bug)."""
    frames: list[tuple[int, object]] = []
    deadline = time.monotonic() + timeout
    while True:
        try:
            frames.append(client.read_frame(max(0.1, deadline - time.monotonic())))
        except ConnectionClosedError as exc:
            assert "reset" not in str(exc).lower(), f"connection reset instead of a clean close: {exc}"
            return frames


def test_crossing_channel_close_keeps_other_channels(raw: RawFactory) -> None:
    client = raw()
    client.handshake()
    client.open_channel(1)
    client.open_channel(2)
    queue = client.rpc(commands.Queue.Declare(queue="", exclusive=True), channel=2).queue
    # The failing publish and the client's own close leave in one segment, so
    # the node's channel.close 404 crosses the client's channel.close.
    client.send_raw(
        frame.marshal(commands.Basic.Publish(exchange="no-such-exchange", routing_key="k"), 1)
        + frame.marshal(header.ContentHeader(0, 1, commands.Basic.Properties()), 1)
        + frame.marshal(ContentBody(b"x"), 1)
        + frame.marshal(_channel_close(), 1)
    )
    ch, close = client.read_frame()
    assert ch == 1 and isinstance(close, commands.Channel.Close) and close.reply_code == 404, close
    ch, close_ok = client.read_frame()
    assert ch == 1 and isinstance(close_ok, commands.Channel.CloseOk), close_ok
    # The client answers the node's close too, and (as a pipelining client
    # would) sends a late publish on the dead channel: both are discarded.
    client.send(commands.Channel.CloseOk(), 1)
    client.publish(1, b"late", routing_key=queue)
    # Channel 2, on the same connection, keeps working.
    client.publish(2, b"kept", routing_key=queue)
    get_ok = client.rpc(commands.Basic.Get(queue=queue, no_ack=True), channel=2)
    assert isinstance(get_ok, commands.Basic.GetOk), get_ok
    _hdr, body = client.read_content()
    assert body == b"kept"
    # And channel 1 opens again as a fresh channel.
    client.open_channel(1)
    assert isinstance(client.rpc(commands.Queue.Declare(queue=queue, passive=True), channel=1),
                      commands.Queue.DeclareOk)
    client.close()


def test_burst_then_close_without_waiting_gets_close_ok(raw: RawFactory) -> None:
    client = raw()
    client.handshake()
    client.open_channel(1)
    queue = client.rpc(commands.Queue.Declare(queue="", exclusive=True), channel=1).queue
    # 4 MiB of publishes then connection.close in one write, no waiting.
    client.send_raw(_publishes(1, 2000, 2048, queue) + frame.marshal(_connection_close(), 0))
    frames = _read_until_eof(client)
    assert any(isinstance(v, commands.Connection.CloseOk) for _, v in frames), frames


def test_amqplib_style_close_overtakes_buffered_publishes(raw: RawFactory) -> None:
    """amqplib's callback API: connection.close goes out directly while the
    channel's publishes are still buffered, so they arrive after the close."""
    client = raw()
    client.handshake()
    client.open_channel(1)
    client.send(_connection_close())
    burst = _publishes(1, 2000, 2048, "amqplib-style")
    try:
        client.send_raw(burst)
    except (BrokenPipeError, ConnectionResetError) as exc:
        pytest.fail(f"the node reset the connection while the client was still writing: {exc!r}")
    frames = _read_until_eof(client)
    assert [type(v) for _, v in frames] == [commands.Connection.CloseOk], frames


def test_refused_handshake_lingers(raw: RawFactory) -> None:
    """A refused login still reaches the client as connection.close 403, then a clean EOF."""
    client = raw()
    client.send_raw(b"AMQP\x00\x00\x09\x01")
    client.expect(commands.Connection.Start)
    client.send(commands.Connection.StartOk(
        client_properties={"capabilities": {"authentication_failure_close": True}},
        mechanism="PLAIN", response="\0guest\0wrong"))
    # More bytes already on their way when the node refuses.
    client.send_raw(b"\x01\x00\x00" + b"\x00" * 64 * 1024)
    frames = _read_until_eof(client)
    closes = [v for _, v in frames if isinstance(v, commands.Connection.Close)]
    assert closes and closes[0].reply_code == 403, frames


def test_linger_ends_at_the_timeout_for_a_peer_that_never_closes(raw: RawFactory) -> None:
    client = raw()
    client.handshake()
    client.send(_connection_close())
    client.expect(commands.Connection.CloseOk)
    # The node half-closed: EOF for reading, but it keeps our socket open
    # (reading) until we close or its linger timeout (3 s) passes.
    started = time.monotonic()
    assert client.wait_closed(timeout=10.0)
    client.sock.settimeout(10.0)
    with pytest.raises((ConnectionResetError, BrokenPipeError, socket.timeout, OSError)):
        # Keep writing past the timeout: the node aborts the socket eventually.
        while time.monotonic() - started < 9:
            client.sock.sendall(b"\x00" * 4096)
            time.sleep(0.05)
    assert time.monotonic() - started < 9


def test_exclusive_queue_goes_at_close_ok_not_after_the_linger(raw: RawFactory) -> None:
    """The linger keeps only the socket: what the connection held is released at once."""
    first = raw()
    first.handshake()
    first.open_channel(1)
    name = f"linger-exclusive-{time.monotonic_ns()}"
    first.rpc(commands.Queue.Declare(queue=name, exclusive=True), channel=1)
    first.send(_connection_close())
    first.expect(commands.Connection.CloseOk)
    # ``first`` keeps its socket open (the node lingers); the name is free already.
    second = raw()
    second.handshake()
    second.open_channel(1)
    ok = second.rpc(commands.Queue.Declare(queue=name, exclusive=True), channel=1)
    assert isinstance(ok, commands.Queue.DeclareOk), ok
    second.close()
