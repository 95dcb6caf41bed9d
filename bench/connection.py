"""Minimal asyncio AMQP 0-9-1 client connection built for throughput.

Control traffic (handshake, declares, consume, confirm.select, close) goes
through pamqp; deliveries and confirms are scanned by :mod:`bench.codec`,
and publishes are written as pre-encoded byte blocks by the caller.  A
connection is an ``asyncio.Protocol`` rather than a stream pair because
``data_received`` hands us whole socket reads with no extra copies or tasks.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import cast

from pamqp import commands, frame
from pamqp.base import Frame
from pamqp.header import ProtocolHeader

from bench.codec import HEARTBEAT_FRAME, FrameError, FrameScanner, encode_basic_ack
from bench.target import BrokerUrl

# RabbitMQ's default; large enough that 1 MiB bodies need only 8 frames.
PREFERRED_FRAME_MAX = 131072
CLIENT_PROPERTIES: dict[str, object] = {
    "product": "leveret-bench",
    "capabilities": {"publisher_confirms": True, "basic.nack": True, "consumer_cancel_notify": True},
}

# Reads shorter than this count as "small" for read_interval.
SMALL_READ = 64 * 1024

BodiesCallback = Callable[[list[bytes], int], None]


class AmqpError(Exception):
    """The broker closed the channel/connection, or the connection broke."""


class Connection(asyncio.Protocol):
    def __init__(self, *, capture_bodies: bool = False) -> None:
        self.scanner = FrameScanner(capture_bodies=capture_bodies)
        self.transport: asyncio.Transport | None = None
        self.frame_max = PREFERRED_FRAME_MAX
        self.error: BaseException | None = None
        # Consumer-side auto-ack: ack with multiple=true once this many deliveries are unacked.
        self.ack_every = 0
        self.ack_channel = 1
        self.on_bodies: BodiesCallback | None = None
        # Throughput consumers pause this many seconds after a small read: a consumer
        # that reads every few messages spends ~1/3 more CPU in syscalls, CPU the
        # broker needs on a shared 2-core box.  0 reads as soon as data arrives (latency).
        self.read_interval = 0.0
        self.unsolicited: list[tuple[int, Frame]] = []
        self._acked = 0
        self._closing = False
        self._waiters: dict[int, deque[asyncio.Future[Frame]]] = {}
        self._paused = False
        self._drain: asyncio.Future[None] | None = None
        self._confirm_target = 0
        self._confirm_waiter: asyncio.Future[None] | None = None
        self._heartbeats_seen = 0

    # -- opening / closing -------------------------------------------------

    @classmethod
    async def open(cls, url: BrokerUrl, *, timeout: float = 10.0, capture_bodies: bool = False) -> Connection:
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(
            loop.create_connection(lambda: cls(capture_bodies=capture_bodies), url.host, url.port,
                                   ssl=url.ssl_context(), server_hostname=url.host if url.tls else None), timeout
        )
        try:
            await asyncio.wait_for(conn._handshake(url), timeout)
        except BaseException:
            conn.abort()
            raise
        return conn

    async def _handshake(self, url: BrokerUrl) -> None:
        start = self._expect(0)
        self.write(ProtocolHeader().marshal())
        await start
        tune_fut = self._expect(0)
        self.send(
            0,
            commands.Connection.StartOk(
                client_properties=CLIENT_PROPERTIES,  # type: ignore[arg-type]
                mechanism="PLAIN",
                response=f"\0{url.user}\0{url.password}",
            ),
        )
        tune = await tune_fut
        assert isinstance(tune, commands.Connection.Tune), tune
        if tune.frame_max:
            self.frame_max = min(tune.frame_max, PREFERRED_FRAME_MAX)
        # heartbeat=0: scenarios are short and a missed heartbeat under full
        # load would kill the run for a reason unrelated to broker speed.
        channel_max = tune.channel_max or 2047
        self.send(0, commands.Connection.TuneOk(channel_max=channel_max, frame_max=self.frame_max, heartbeat=0))
        await self.rpc(0, commands.Connection.Open(virtual_host=url.vhost))

    async def close(self, timeout: float = 3.0) -> None:
        """Close politely (Connection.Close / CloseOk), falling back to abort."""
        if self.transport is None or self.transport.is_closing():
            return
        try:
            bye = commands.Connection.Close(reply_code=200, reply_text="bench done", class_id=0, method_id=0)
            fut = self._expect(0)
            self.send(0, bye)
            self._closing = True  # no acks/heartbeats after our Close
            await asyncio.wait_for(fut, timeout)
        except (TimeoutError, AmqpError, ConnectionError):
            pass
        finally:
            self._closing = True
            self.abort()

    def abort(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    @property
    def is_open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing() and self.error is None

    # -- asyncio.Protocol ----------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports don't subclass asyncio.Transport, so cast rather than assert.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # Latency scenario: never let Nagle hold back a lone publish or ack.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Big batched writes: let up to 1 MiB sit in the transport before pausing us.
        self.transport.set_write_buffer_limits(high=1 << 20, low=256 << 10)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(AmqpError(f"connection lost: {exc}") if exc else AmqpError("connection closed"))

    def _resume_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def data_received(self, data: bytes) -> None:
        recv_ns = time.perf_counter_ns()
        # Big reads mean data is arriving fast (1 MiB bodies): pausing then would let
        # the socket buffer fill and throttle the broker, so only small reads pause.
        if self.read_interval and len(data) < SMALL_READ and self.transport is not None:
            self.transport.pause_reading()
            asyncio.get_running_loop().call_later(self.read_interval, self._resume_reading)
        scanner = self.scanner
        try:
            slow = scanner.feed(data)
        except FrameError as exc:
            self._fail(AmqpError(str(exc)))
            self.abort()
            return
        for raw in slow:
            self._dispatch(raw)
        # Once Connection.Close is sent or received only Close/CloseOk may follow.
        if self._closing or self.transport is None or self.transport.is_closing():
            return
        if self.ack_every and scanner.deliveries - self._acked >= self.ack_every:
            self.write(encode_basic_ack(self.ack_channel, scanner.last_delivery_tag, multiple=True))
            self._acked = scanner.deliveries
        if scanner.bodies:
            bodies, scanner.bodies = scanner.bodies, []
            if self.on_bodies is not None:
                self.on_bodies(bodies, recv_ns)
        if scanner.heartbeats != self._heartbeats_seen:
            self._heartbeats_seen = scanner.heartbeats
            self.write(HEARTBEAT_FRAME)
        waiter = self._confirm_waiter
        if waiter is not None and scanner.confirms.confirmed >= self._confirm_target and not waiter.done():
            waiter.set_result(None)

    # -- sending -------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            raise self.error or AmqpError("connection is closed")
        self.transport.write(data)

    def send(self, channel: int, method: Frame) -> None:
        self.write(frame.marshal(method, channel))

    async def drain(self) -> None:
        """Wait while the transport's write buffer is above its high-water mark."""
        if self.error is not None:
            raise self.error
        if self._paused:
            self._drain = asyncio.get_running_loop().create_future()
            await self._drain

    async def rpc(self, channel: int, method: Frame, timeout: float = 15.0) -> Frame:
        """Send a synchronous method and return the broker's reply."""
        fut = self._expect(channel)
        self.send(channel, method)
        reply = await asyncio.wait_for(fut, timeout)
        if method.valid_responses and reply.name not in method.valid_responses:
            raise AmqpError(f"{method.name}: unexpected reply {reply.name}")
        return reply

    def request_raw(self, channel: int, frames: bytes, count: int) -> list[asyncio.Future[Frame]]:
        """Write ``count`` encoded synchronous methods at once without waiting; their replies' futures, in order."""
        futures = [self._expect(channel) for _ in range(count)]
        self.write(frames)
        return futures

    async def wait_confirmed(self, target: int, timeout: float | None = None) -> None:
        """Wait until at least ``target`` publishes have been confirmed (acked or nacked)."""
        while self.scanner.confirms.confirmed < target:
            if self.error is not None:
                raise self.error
            self._confirm_target = target
            self._confirm_waiter = asyncio.get_running_loop().create_future()
            await asyncio.wait_for(self._confirm_waiter, timeout)

    # -- slow path -------------------------------------------------------------

    def _expect(self, channel: int) -> asyncio.Future[Frame]:
        if self.error is not None:
            raise self.error
        fut: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(channel, deque()).append(fut)
        return fut

    def _dispatch(self, raw: bytes) -> None:
        _, channel, value = frame.unmarshal(raw)
        if isinstance(value, commands.Connection.Close):
            self._closing = True
            self.send(0, commands.Connection.CloseOk())
            self._fail(AmqpError(f"broker closed connection: {value.reply_code} {value.reply_text}"))
            return
        if isinstance(value, commands.Channel.Close):
            self.send(channel, commands.Channel.CloseOk())
            err = AmqpError(f"broker closed channel {channel}: {value.reply_code} {value.reply_text}")
            for fut in self._waiters.pop(channel, deque()):
                if not fut.done():
                    fut.set_exception(err)
            self.unsolicited.append((channel, value))
            return
        waiters = self._waiters.get(channel)
        # Replies arrive in request order per channel, so FIFO matching is exact.
        if waiters and isinstance(value, Frame) and value.name != "Basic.Cancel":
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(value)
        elif isinstance(value, Frame):
            self.unsolicited.append((channel, value))

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        for waiters in self._waiters.values():
            for fut in waiters:
                if not fut.done():
                    fut.set_exception(exc)
        self._waiters.clear()
        for waiter in (self._drain, self._confirm_waiter):
            if waiter is not None and not waiter.done():
                waiter.set_exception(exc)
