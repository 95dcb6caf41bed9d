"""A tiny blocking AMQP 0-9-1 client on top of pamqp, for wire-level tests.

Client libraries refuse to send some things (``immediate=True``, empty
consumer tags, oversized frames, garbage), so the tests that need them talk to
the broker through this helper instead.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

from pamqp import commands, frame, header
from pamqp.base import Frame
from pamqp.body import ContentBody
from pamqp.exceptions import UnmarshalingException
from pamqp.heartbeat import Heartbeat

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"

AnyFrame = Frame | header.ContentHeader | ContentBody | Heartbeat | header.ProtocolHeader


class ConnectionClosedError(Exception):
    """The peer closed the TCP connection."""


def plain_response(user: str, password: str) -> str:
    return f"\0{user}\0{password}"


class RawAMQP:
    """Blocking frame-level AMQP connection used by the wire tests."""

    def __init__(self, host: str, port: int, timeout: float = 5.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = b""
        self.frame_max = 131072
        self.start: commands.Connection.Start | None = None
        self.tune: commands.Connection.Tune | None = None

    # ------------------------------------------------------------ low level
    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, value: AnyFrame, channel: int = 0) -> None:
        self.sock.sendall(frame.marshal(value, channel))

    def recv_raw(self, timeout: float = 5.0) -> bytes:
        """Return whatever bytes arrive next (b'' means the peer closed)."""
        if self.buffer:
            data, self.buffer = self.buffer, b""
            return data
        self.sock.settimeout(timeout)
        return self.sock.recv(65536)

    def read_frame(self, timeout: float = 5.0) -> tuple[int, AnyFrame]:
        """Read one frame; raise ConnectionClosedError on EOF, TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            if len(self.buffer) >= 7:
                try:
                    consumed, channel, value = frame.unmarshal(self.buffer)
                except UnmarshalingException:
                    pass
                else:
                    self.buffer = self.buffer[consumed:]
                    return channel, value
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no complete frame received in time")
            self.sock.settimeout(remaining)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                raise TimeoutError("no complete frame received in time") from None
            except ConnectionResetError as exc:
                raise ConnectionClosedError(str(exc)) from exc
            if not chunk:
                raise ConnectionClosedError("peer closed the connection")
            self.buffer += chunk

    def read_frame_bytes(self, timeout: float = 5.0) -> tuple[int, int, bytes]:
        """Read one frame undecoded: (frame type, channel, payload)."""
        deadline = time.monotonic() + timeout
        while True:
            if len(self.buffer) >= 7:
                frame_type, channel, size = struct.unpack(">BHI", self.buffer[:7])
                if len(self.buffer) >= size + 8:
                    payload = self.buffer[7 : 7 + size]
                    self.buffer = self.buffer[size + 8 :]
                    return frame_type, channel, payload
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no complete frame received in time")
            self.sock.settimeout(remaining)
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionClosedError("peer closed the connection")
            self.buffer += chunk

    def expect(self, kind: type[Any], timeout: float = 5.0, skip_heartbeats: bool = True) -> Any:
        """Read frames until one is returned; it must be of type ``kind``."""
        while True:
            _channel, value = self.read_frame(timeout)
            if skip_heartbeats and isinstance(value, Heartbeat) and kind is not Heartbeat:
                continue
            if not isinstance(value, kind):
                raise AssertionError(f"expected {kind.__name__}, got {value!r}")
            return value

    def wait_closed(self, timeout: float = 5.0) -> bool:
        """Drain input until EOF; return True if the peer closed in time."""
        deadline = time.monotonic() + timeout
        self.buffer = b""
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                return False
            except (ConnectionResetError, BrokenPipeError):
                return True
            if not chunk:
                return True
        return False

    def close_socket(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    # ----------------------------------------------------------- handshake
    def handshake(
        self,
        user: str = "guest",
        password: str = "guest",
        vhost: str = "/",
        frame_max: int = 131072,
        heartbeat: int = 0,
        channel_max: int = 0,
    ) -> None:
        self.negotiate(user, password, frame_max, heartbeat, channel_max)
        self.send(commands.Connection.Open(virtual_host=vhost))
        self.expect(commands.Connection.OpenOk)

    def negotiate(
        self,
        user: str = "guest",
        password: str = "guest",
        frame_max: int = 131072,
        heartbeat: int = 0,
        channel_max: int = 0,
    ) -> None:
        """Protocol header, start/start-ok, tune/tune-ok (no connection.open)."""
        self.send_raw(PROTOCOL_HEADER)
        self.start = self.expect(commands.Connection.Start)
        self.send(
            commands.Connection.StartOk(
                client_properties={
                    "product": "leveret-compat-tests",
                    "capabilities": {
                        "publisher_confirms": True,
                        "consumer_cancel_notify": True,
                        "basic.nack": True,
                        "authentication_failure_close": True,
                    },
                },
                mechanism="PLAIN",
                response=plain_response(user, password),
            )
        )
        self.tune = self.expect(commands.Connection.Tune)
        if self.tune.frame_max:
            frame_max = min(frame_max, self.tune.frame_max)
        self.frame_max = frame_max
        self.send(
            commands.Connection.TuneOk(
                channel_max=channel_max or self.tune.channel_max,
                frame_max=frame_max,
                heartbeat=heartbeat,
            )
        )

    def open_channel(self, channel: int = 1) -> None:
        self.send(commands.Channel.Open(), channel)
        while True:
            ch, value = self.read_frame()
            if not isinstance(value, Heartbeat):
                break
        assert isinstance(value, commands.Channel.OpenOk), value
        assert ch == channel

    def rpc(self, method: Frame, channel: int = 1, timeout: float = 5.0) -> Any:
        """Send a synchronous method and return the next non-heartbeat frame."""
        self.send(method, channel)
        while True:
            _ch, value = self.read_frame(timeout)
            if not isinstance(value, Heartbeat):
                return value

    def publish(
        self,
        channel: int,
        body: bytes,
        exchange: str = "",
        routing_key: str = "",
        mandatory: bool = False,
        immediate: bool = False,
        properties: commands.Basic.Properties | None = None,
    ) -> None:
        parts = [
            frame.marshal(
                commands.Basic.Publish(
                    exchange=exchange,
                    routing_key=routing_key,
                    mandatory=mandatory,
                    immediate=immediate,
                ),
                channel,
            ),
            frame.marshal(header.ContentHeader(0, len(body), properties), channel),
        ]
        chunk = self.frame_max - 8
        for offset in range(0, len(body), chunk):
            parts.append(frame.marshal(ContentBody(body[offset : offset + chunk]), channel))
        self.sock.sendall(b"".join(parts))

    def read_content(self, timeout: float = 5.0) -> tuple[header.ContentHeader, bytes]:
        content_header = self.expect(header.ContentHeader, timeout)
        body = b""
        while len(body) < content_header.body_size:
            body += self.expect(ContentBody, timeout).value
        return content_header, body

    def close(self) -> None:
        """Politely close the connection (connection.close / close-ok)."""
        try:
            self.send(commands.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0))
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                _ch, value = self.read_frame(deadline - time.monotonic())
                if isinstance(value, commands.Connection.CloseOk):
                    break
        except (OSError, ConnectionClosedError, TimeoutError):
            pass
        finally:
            self.close_socket()

    def __enter__(self) -> RawAMQP:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def raw_frame(frame_type: int, channel: int, payload: bytes, end: int = 0xCE) -> bytes:
    """Build an arbitrary frame, e.g. one that violates frame_max."""
    return struct.pack(">BHI", frame_type, channel, len(payload)) + payload + bytes([end])
