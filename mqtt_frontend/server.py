"""The thin asyncio layer of MQTT: sockets in, bytes to the state machine, bytes out (plain and TLS)."""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any

from amqp_frontend.tls_accept import TLSListener, peer_identity
from core.engine.broker import Broker
from core.model.tasks import run_then
from mqtt_frontend import codec
from mqtt_frontend.connection import MqttConnection, MqttSettings, State
from mqtt_frontend.sessions import Sessions

log = logging.getLogger("leveret.mqtt")
LINGER_S = 3.0  # after the last packet, how long a closed connection's input is still read and dropped


class Link:
    """What joins a state machine to its transport: the flushing, reading and tick rules.

    Shared by the TCP protocol below and the WebSocket handler (mqtt_frontend/websocket.py).
    """

    def __init__(self, server: MQTTServer, conn: MqttConnection, write: Callable[[bytes], None],
                 close: Callable[[], None], set_reading: Callable[[bool], None],
                 local: tuple[str, int] | None = None, tls: bool = False, transport: str = "tcp",
                 buffered: Callable[[], int] = lambda: 0) -> None:
        self.server = server
        self.conn = conn
        # What the management API shows of the socket: the listener's address, TLS or not, tcp/websocket.
        self.local = local
        self.tls = tls
        self.transport = transport
        self.buffered = buffered  # bytes written and not yet on the wire (the transport's buffer)
        self._write = write
        self._close = close
        self._set_reading = set_reading
        self._loop = asyncio.get_running_loop()
        self._flush_scheduled = False
        self._continue_scheduled = False
        self._reading = True
        self.closed = False
        conn.on_output = self.schedule_flush
        conn.on_input_ready = self._schedule_continue
        conn.run_async = self._run_async
        server.links.add(self)

    def received(self, data: bytes) -> None:
        if self.closed:
            return
        self.conn.receive_data(data)
        self.after_input()

    def after_input(self) -> None:
        conn = self.conn
        if conn.input_pending:
            self._schedule_continue()
        want = conn.wants_read and not (self.server.broker.alarms.raised and conn.has_published)
        conn.blocked = not want and bool(self.server.broker.alarms.raised)
        if want != self._reading:
            self._reading = want
            self._set_reading(want)
        self.flush()

    def _schedule_continue(self) -> None:
        if not self._continue_scheduled:
            self._continue_scheduled = True
            self._loop.call_soon(self._continue)

    def _continue(self) -> None:
        self._continue_scheduled = False
        if not self.closed:
            self.conn.receive_data(b"")
            self.after_input()

    def schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        self._flush_scheduled = False
        if self.closed:
            return
        conn = self.conn
        data = conn.data_to_send()
        if data:
            self._write(data)
        if conn.should_close:
            self.closed = True
            conn.connection_lost()
            self._close()
        elif conn.out_bytes == 0 and not conn.transport_paused:
            conn.resume_deliveries()
            if conn.out_bytes:
                self.schedule_flush()

    def _run_async(self, op: Awaitable[Any], done: Callable[[Any, BaseException | None], None]) -> None:
        def then(result: Any, exc: BaseException | None) -> None:
            done(result, exc)
            self.after_input()

        run_then(op, then, self.server.tasks)

    def lost(self) -> None:
        self.server.links.discard(self)
        self.closed = True
        self.conn.connection_lost()

    def tick(self, now: float) -> None:
        if not self.closed:
            self.conn.tick(now)
            if not self._reading:
                self.after_input()  # a memory alarm that has cleared since: read again
            else:
                self.flush()


class MQTTProtocol(asyncio.Protocol):
    def __init__(self, server: MQTTServer) -> None:
        self.server = server
        self.link: Link | None = None
        self.transport: asyncio.Transport | None = None
        self._linger: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = tr = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        tls = transport.get_extra_info("ssl_object")
        identity = peer_identity(tls.getpeercert()) if tls is not None else None
        conn = MqttConnection(self.server.broker, self.server.sessions, self.server.settings,
                              peer=(peer[0], peer[1]) if peer else None, peer_identity=identity)
        tr.set_write_buffer_limits(high=1024 * 1024, low=256 * 1024)  # type: ignore[attr-defined]
        local = transport.get_extra_info("sockname")
        self.link = Link(self.server, conn, tr.write, self._close,  # type: ignore[attr-defined]
                         lambda on: tr.resume_reading() if on else tr.pause_reading(),  # type: ignore[attr-defined]
                         local=(local[0], local[1]) if local else None, tls=tls is not None,
                         buffered=tr.get_write_buffer_size)  # type: ignore[attr-defined]
        self.server.broker.stats.connections_opened += 1

    def _close(self) -> None:
        """The last packet is written: half-close, then read (and drop) until the client closes.

        Closing a socket with unread input sends a reset, which can overtake the DISCONNECT or
        CONNACK just written (a client that sent a burst before its bad packet would see
        ECONNRESET instead of the reason code); the AMQP listener lingers the same way.
        """
        tr = self.transport
        if tr is None or tr.is_closing():
            return
        if not tr.can_write_eof():
            tr.close()
            return
        tr.write_eof()
        tr.resume_reading()
        self._linger = asyncio.get_running_loop().call_later(LINGER_S, tr.abort)

    def data_received(self, data: bytes) -> None:
        if self.link is not None:
            self.link.received(data)

    def eof_received(self) -> bool | None:
        return None

    def pause_writing(self) -> None:
        if self.link is not None:
            self.link.conn.set_transport_paused(True)

    def resume_writing(self) -> None:
        if self.link is not None:
            self.link.conn.set_transport_paused(False)
            self.link.schedule_flush()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._linger is not None:
            self._linger.cancel()
        self.server.broker.stats.connections_closed += 1
        if self.link is not None:
            self.link.lost()
        self.transport = None


class MQTTServer:
    def __init__(self, broker: Broker, settings: MqttSettings | None = None) -> None:
        self.broker = broker
        self.settings = settings or MqttSettings()
        self.sessions = Sessions(broker)
        self.links: set[Link] = set()
        self._servers: list[asyncio.base_events.Server] = []
        self._tls: TLSListener | None = None
        self._ticker: asyncio.Task[None] | None = None
        self.tasks: set[asyncio.Task[Any]] = set()  # the links' asynchronous steps, held until they end
        self.port = 0
        self.tls_port = 0
        broker.on_user_deleted.append(self._user_deleted)

    def _user_deleted(self, name: str) -> None:
        for link in list(self.links):
            if link.conn.username == name:
                link.conn.close(codec.NOT_AUTHORIZED, f"user '{name}' is deleted")
                link.flush()

    async def open_retained(self) -> None:
        """The retained messages of the listener's vhost, read back before clients are served."""
        self.sessions.watch_holds()  # the node's coordinator is set by now (the cluster's, in a cluster)
        if self.settings.vhost in self.broker.vhosts:
            opening = self.sessions.retained(self.settings.vhost).opening
            if opening is not None:
                await opening

    def _ensure_ticker(self) -> None:
        if self._ticker is None:
            self._ticker = asyncio.create_task(self._tick_forever())

    async def start(self, host: str, port: int) -> None:
        await self.open_retained()
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: MQTTProtocol(self), host, port, reuse_address=True, backlog=1024)
        self._servers.append(server)
        self.port = int(server.sockets[0].getsockname()[1])
        self._ensure_ticker()
        log.info("mqtt listening", extra={"host": host, "port": self.port})

    async def start_tls(self, host: str, port: int, context: ssl.SSLContext) -> None:
        await self.open_retained()
        self._tls = TLSListener(context, lambda: MQTTProtocol(self))
        await self._tls.start(host, port)
        self.tls_port = self._tls.port
        self._ensure_ticker()
        log.info("mqtts listening", extra={"host": host, "port": self.tls_port})

    def held_bytes(self) -> int:
        """What the memory alarm counts of MQTT: unparsed input, unflushed output, the transports' buffers."""
        return sum(link.conn.held_bytes() + link.buffered() for link in list(self.links))

    def open_links(self) -> list[Link]:
        """Connections past CONNACK (what the management API lists and rabbitmq_connections counts)."""
        return [link for link in list(self.links) if not link.closed and link.conn.state is State.OPEN]

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for link in list(self.links):
                try:
                    link.tick(now)
                except Exception:  # one connection's bug must not stop everyone's keep-alive
                    log.exception("mqtt tick failed")

    async def stop(self) -> None:
        for server in self._servers:
            server.close()
        if self._tls is not None:
            await self._tls.close()
        for link in list(self.links):
            link.conn.close()
            link.flush()
        if self._ticker is not None:
            self._ticker.cancel()
        for server in self._servers:
            await server.wait_closed()
