"""The thin asyncio layer: sockets in, bytes to the state machine, bytes out."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pamqp import commands

from amqp_frontend.connection import Connection, ServerSettings, State
from amqp_frontend.tls_accept import TLSListener, peer_identity
from core.engine.alarms import MEMORY
from core.engine.broker import Broker
from core.model.ratelog import RateLimitedLog
from core.model.tasks import run_then

log = logging.getLogger("leveret.amqp")
_refusals = RateLimitedLog(log)


class AMQPProtocol(asyncio.Protocol):
    def __init__(self, server: AMQPServer) -> None:
        self.server = server
        self.conn: Connection | None = None
        self.transport: asyncio.Transport | None = None
        self._flush_scheduled = False
        self._flow_paused = False
        self._reading = True
        self._continue_scheduled = False
        self._loop = asyncio.get_running_loop()
        self._linger: asyncio.TimerHandle | None = None
        self._lingering = False
        self.recv_oct = 0  # bytes read from and written to the socket
        self.send_oct = 0
        # The address while this connection has not logged in (LoginThrottle.handshake_started).
        self._handshaking: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transport is not an asyncio.Transport subclass, so no isinstance check.
        self.transport = tr = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        host = peer[0] if peer else None
        if not self.server.broker.login_throttle.handshake_started(host):
            # Too many connections of this address have not logged in: each holds a socket and
            # buffers, and each is a password guess waiting its turn.
            _refusals.warning(str(host), "connection refused: too many handshakes from this address",
                              limit=self.server.broker.login_throttle.handshakes_per_host)
            tr.abort()  # type: ignore[attr-defined]
            return
        self._handshaking = host
        # On the AMQPS listener: the name in the client certificate TLS verified, for SASL EXTERNAL.
        tls = transport.get_extra_info("ssl_object")
        identity = peer_identity(tls.getpeercert()) if tls is not None else None
        conn = Connection(self.server.broker, self.server.settings, peer=(peer[0], peer[1]) if peer else None,
                          peer_identity=identity)
        conn.on_output = self._schedule_flush
        conn.on_input_ready = self._schedule_continue
        conn.run_async = self._run_async
        self.conn = conn
        tr.set_write_buffer_limits(high=1024 * 1024, low=256 * 1024)  # type: ignore[attr-defined]
        self.server.connections.add(self)
        self.server.broker.stats.connections_opened += 1

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # closed: what the client still sends is read and dropped
        conn = self.conn
        if conn is None:
            return  # refused in connection_made
        self.recv_oct += len(data)  # RabbitMQ's recv_oct/send_oct (the management API's connection view)
        conn.receive_data(data)
        self._after_input(conn)

    def _after_input(self, conn: Connection) -> None:
        if self.server.broker.alarms.raised and conn.has_published and not conn.blocked:
            self.block()
        elif self.server.broker.forward_congested and conn.has_published and not self._flow_paused:
            self.pause_for_flow()
        self._flush()
        if conn.input_pending and not conn.transport_paused:
            # This read held more than one turn's work (READ_BUDGET), or output over the
            # high-water mark that the flush handed to the transport: the rest is handled next
            # turn, after the other connections' input (acks, consumes, heartbeats). While the
            # transport is paused, resume_writing goes on instead.
            self._schedule_continue()
        self._update_reading()

    def _schedule_continue(self) -> None:
        if not self._continue_scheduled:
            self._continue_scheduled = True
            self._loop.call_soon(self._continue_input)

    def _continue_input(self) -> None:
        """Handle input left buffered by the read budget or by flow control, then read again."""
        self._continue_scheduled = False
        conn = self.conn
        if conn is None or self.transport is None or self._lingering:
            return
        conn.receive_data(b"")
        self._after_input(conn)

    def _update_reading(self) -> None:
        """Read the socket unless the memory alarm, forwarding congestion or flow control say not."""
        conn, transport = self.conn, self.transport
        if conn is None or transport is None or self._lingering:
            return  # a lingering close drains whatever comes (_start_linger)
        want = conn.wants_read and not conn.blocked and not self._flow_paused
        if want != self._reading:
            self._reading = want
            if want:
                transport.resume_reading()
            else:
                transport.pause_reading()

    def _run_async(self, op: Awaitable[Any], done: Callable[[Any, BaseException | None], None]) -> None:
        run_then(op, done, self.server.tasks)

    def pause_for_flow(self) -> None:
        """Forwarded publishes pile up at a slow owner: stop reading from this publisher for now."""
        if self.transport is not None and not self._flow_paused:
            self._flow_paused = True
            self.server.flow_paused.add(self)
            self._update_reading()

    def resume_for_flow(self) -> None:
        if self.transport is not None and self._flow_paused:
            self._flow_paused = False
            self._update_reading()

    def block(self) -> None:
        """Memory alarm: stop reading from this publisher (RabbitMQ's connection.blocked)."""
        conn, transport = self.conn, self.transport
        if conn is None or transport is None or conn.blocked:
            return
        conn.blocked = True
        if conn.client_capability("connection.blocked"):
            conn.send_method(0, commands.Connection.Blocked(reason="low on memory"))
        self._update_reading()
        self._flush()

    def unblock(self) -> None:
        conn, transport = self.conn, self.transport
        if conn is None or transport is None or not conn.blocked:
            return
        conn.blocked = False
        if conn.client_capability("connection.blocked"):
            conn.send_method(0, commands.Connection.Unblocked())
        self._update_reading()
        self._flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        conn = self.conn
        transport = self.transport
        if conn is None or transport is None or self._lingering:
            return
        if self._handshaking is not None and conn.user is not None:
            self._end_handshake()
        data = conn.data_to_send()
        if data and not transport.is_closing():
            self.send_oct += len(data)
            transport.write(data)
        if conn.should_close:
            self._start_linger(conn, transport)
        elif conn.out_bytes == 0 and not conn.transport_paused:
            # Deliveries stopped at the in-process high mark resume once flushed.
            conn.resume_deliveries()
            if conn.out_bytes:
                self._schedule_flush()

    def _start_linger(self, conn: Connection, transport: asyncio.Transport) -> None:
        """Our last close frame is written: half-close, then drain until the peer closes.

        Closing a socket with unread input sends a reset, which can overtake the
        close-ok we just wrote; a client that wrote a burst and then
        connection.close without waiting (amqplib's callback API does) would
        see EPIPE/ECONNRESET instead of its close-ok. RabbitMQ lingers too.
        """
        self._lingering = True
        conn.connection_lost()  # unacked messages and exclusive queues go now, not after the linger
        if transport.is_closing():
            return
        if transport.can_write_eof():
            transport.write_eof()
        # Drain even a publisher paused by flow control or the memory alarm.
        transport.resume_reading()
        self._linger = self._loop.call_later(self.server.settings.linger_timeout, transport.abort)

    def eof_received(self) -> bool | None:
        return None  # the peer closed its side: close ours (ends a linger too)

    def pause_writing(self) -> None:
        if self.conn is not None:
            self.conn.set_transport_paused(True)
            if not self._lingering:
                self._update_reading()  # no more input while the client does not take our output

    def resume_writing(self) -> None:
        if self.conn is not None:
            self.conn.set_transport_paused(False)
            self._schedule_flush()
            # Input left while our output was over the high-water mark, and reading itself.
            self._schedule_continue()

    def _end_handshake(self) -> None:
        self.server.broker.login_throttle.handshake_ended(self._handshaking)
        self._handshaking = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.conn is None:
            return  # refused in connection_made: never counted
        if self._handshaking is not None:
            self._end_handshake()
        self.server.connections.discard(self)
        self.server.broker.stats.connections_closed += 1
        if self.conn is not None:
            self.conn.connection_lost()
        self.transport = None
        if self._linger is not None:
            self._linger.cancel()

    def tick(self, now: float) -> None:
        conn = self.conn
        if conn is None:
            return
        if not self._reading and not self._lingering and self.transport is not None and _peer_gone(self.transport):
            # Not reading (memory alarm, flow, output held): a peer that left would go unnoticed
            # and its connection (a partial body, buffers) held for ever.
            log.info("peer of a paused connection is gone", extra={"peer": conn._peer_text()})
            self.transport.abort()
            return
        conn.tick(now)
        self._flush()


# Linux TCP states (include/net/tcp_states.h): the peer sent FIN, or the connection was reset.
_TCP_CLOSE, _TCP_CLOSE_WAIT = 7, 8


def _peer_gone(transport: asyncio.BaseTransport) -> bool:
    """Has the peer closed or reset a connection we are not reading? Its unread input (a publisher
    blocked mid-body) hides the EOF from a read, so ask the kernel for the TCP state."""
    sock = transport.get_extra_info("socket")
    tcp_info = getattr(socket, "TCP_INFO", None)
    if sock is None or tcp_info is None:
        return False
    try:
        state = sock.getsockopt(socket.IPPROTO_TCP, tcp_info, 8)[0]
    except OSError:
        return True
    return state in (_TCP_CLOSE, _TCP_CLOSE_WAIT)


class AMQPServer:
    def __init__(self, broker: Broker, settings: ServerSettings | None = None) -> None:
        self.broker = broker
        self.settings = settings or ServerSettings()
        self.connections: set[AMQPProtocol] = set()
        self.tasks: set[asyncio.Task[Any]] = set()  # the connections' asynchronous steps, held until they end
        self._server: asyncio.base_events.Server | None = None
        self._tls: TLSListener | None = None
        self._ticker: asyncio.Task[None] | None = None
        self.flow_paused: set[AMQPProtocol] = set()
        broker.flow_listeners.append(self._flow_changed)
        broker.on_user_deleted.append(self._user_deleted)

    def _user_deleted(self, name: str) -> None:
        """A deleted user's connections close with 320 CONNECTION_FORCED, as RabbitMQ."""
        for proto in list(self.connections):
            conn = proto.conn
            if conn is not None and conn.user is not None and conn.username == name:
                log.info("closing a deleted user's connection", extra={"user": name})
                conn.close(320, f"CONNECTION_FORCED - user '{name}' is deleted")
                proto._flush()

    def _flow_changed(self, congested: bool) -> None:
        if congested:
            return  # publishers pause as they next send
        paused, self.flow_paused = self.flow_paused, set()
        for proto in paused:
            proto.resume_for_flow()

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: AMQPProtocol(self), host, port, reuse_address=True, backlog=1024
        )
        self._ticker = asyncio.create_task(self._tick_forever())
        log.info("amqp listening", extra={"host": host, "port": port})

    async def start_tls(self, host: str, port: int, context: ssl.SSLContext) -> None:
        """The AMQPS listener: the same protocol behind a TLS handshake (amqp_frontend/tls_accept.py)."""
        self._tls = TLSListener(context, lambda: AMQPProtocol(self))
        await self._tls.start(host, port)
        log.info("amqps listening", extra={"host": host, "port": self._tls.port})

    @property
    def tls_port(self) -> int:
        assert self._tls is not None
        return self._tls.port

    def held_bytes(self) -> int:
        """What every AMQP connection holds (connection.held_bytes) plus the transports' write buffers."""
        held = 0
        for proto in list(self.connections):
            if proto.conn is not None:
                held += proto.conn.held_bytes()
            if proto.transport is not None:
                held += proto.transport.get_write_buffer_size()
        return held

    def set_memory_alarm(self, active: bool) -> None:
        self.set_alarm(MEMORY, active)

    def set_alarm(self, kind: str, active: bool) -> None:
        """Raise or clear a resource alarm (memory, disk); publishers are blocked while any is raised."""
        if (kind in self.broker.alarms.raised) == active:
            return
        log.warning(f"{kind} alarm " + ("set" if active else "cleared"))
        if not self.broker.alarms.set(kind, active):
            return  # another alarm still blocks publishers (or none did)
        log.warning("blocking publishers" if active else "unblocking publishers")
        for proto in list(self.connections):
            if active and proto.conn is not None and proto.conn.has_published:
                proto.block()
            elif not active:
                proto.unblock()

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for proto in list(self.connections):
                try:
                    proto.tick(now)
                except Exception:  # one connection's bug must not stop everyone's heartbeats
                    log.exception("tick failed")

    async def stop(self, grace: float = 2.0) -> None:
        """Stop accepting, close every connection with 320, wait briefly for close-ok."""
        if self._server is not None:
            self._server.close()
        if self._tls is not None:
            await self._tls.close()
        for proto in list(self.connections):
            if proto.conn is not None:
                proto.conn.close()
                proto._flush()
        deadline = time.monotonic() + grace
        while self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            for proto in list(self.connections):
                if proto.conn is not None and proto.conn.state is State.CLOSED:
                    if proto.transport is not None:
                        proto.transport.close()
        for proto in list(self.connections):
            if proto.transport is not None:
                proto.transport.abort()
        if self._ticker is not None:
            self._ticker.cancel()
        if self._server is not None:
            await self._server.wait_closed()
