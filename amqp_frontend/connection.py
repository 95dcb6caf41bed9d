"""The AMQP 0-9-1 connection as a sans-IO state machine.

``receive_data(bytes)`` consumes what the socket read; ``data_to_send()``
returns what to write; ``tick(now)`` drives heartbeats and time-outs;
``should_close`` says when the transport must be closed after the last
write. Nothing here touches a socket or a clock of its own, so it is tested
by feeding bytes (tests/test_connection_sm.py).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pamqp import commands
from pamqp.base import Frame as Method

from amqp_frontend import codec
from amqp_frontend.channel import Channel
from core.engine import flow
from core.engine.broker import Broker, User
from core.engine.vhost import VirtualHost
from core.model import fieldtable
from core.model.errors import (
    AccessRefused,
    BrokerError,
    ChannelError,
    CommandInvalid,
    FrameError,
    InternalError,
    NotAllowed,
    SyntaxError_,
    UnexpectedFrame,
)

log = logging.getLogger("leveret.amqp")

# Reply codes that close only the channel; every other error closes the connection.
CHANNEL_ERROR_CODES = frozenset({311, 312, 313, 403, 404, 405, 406})
FRAME_MIN_SIZE = 4096
CONNECTION_CLOSE_ID = b"\x00\x0a\x00\x32"
CONNECTION_CLOSE_OK_ID = b"\x00\x0a\x00\x33"
# Units of input (a whole small publish, or one frame) handled per receive_data call;
# the rest waits one loop turn (``input_pending``) so that one connection's burst
# cannot keep the loop from every other connection. uvloop hands over reads of up to
# 256 KiB: ~850 publishes of 256 B, ~10 ms of work at 10-15 µs each (bench.inprocess);
# 200 is ~2-3 ms. Counted in units, not bytes: a byte budget (64 KiB) also split the
# 128 KiB body frames of 1 MiB messages one per turn and halved persistent_1mib
# (266 -> 135 MiB/s), though a big frame costs little more CPU than a small one.
READ_BUDGET = 200
# Entering/leaving flow is logged at most this often per connection (a flooding
# publisher enters flow tens of times a second).
FLOW_LOG_INTERVAL = 10.0


@dataclass
class ServerSettings:
    channel_max: int = 2047
    frame_max: int = 131072
    heartbeat: int = 60
    max_message_size: int = 128 * 1024 * 1024
    handshake_timeout: float = 10.0
    close_timeout: float = 3.0
    # After the last close frame goes out the server half-closes and keeps
    # reading (discarding) this long for the peer to close its side, so bytes
    # still in flight from the client do not turn our close into a reset.
    linger_timeout: float = 3.0
    # Stop handing messages to this connection's consumers past this many
    # bytes waiting to be written; resumed once the socket drains.
    write_high_water: int = 4 * 1024 * 1024
    # Bytes of message bodies a connection may hold unfinished, all its channels together
    # (0: max_message_size, so one message of the largest size always fits).
    max_partial_body_bytes: int = 0
    product: str = "Leveret"
    version: str = "0.1.0"
    server_properties_extra: dict[str, Any] = field(default_factory=dict)


class State(enum.Enum):
    AWAIT_HEADER = "await-header"
    AWAIT_START_OK = "await-start-ok"
    AWAIT_TUNE_OK = "await-tune-ok"
    AWAIT_OPEN = "await-open"
    OPEN = "open"
    CLOSING = "closing"  # we sent connection.close, waiting for close-ok
    CLOSED = "closed"


CAPABILITIES = {
    "publisher_confirms": True,
    "exchange_exchange_bindings": True,
    "basic.nack": True,
    "consumer_cancel_notify": True,
    "connection.blocked": True,
    "consumer_priorities": True,
    "authentication_failure_close": True,
    "per_consumer_qos": True,
    "direct_reply_to": True,
}


class Connection:
    def __init__(
        self,
        broker: Broker,
        settings: ServerSettings | None = None,
        peer: tuple[str, int] | None = None,
        now: float | None = None,
        peer_identity: str | None = None,
    ) -> None:
        self.broker = broker
        self.settings = settings or ServerSettings()
        self.peer = peer
        # The user name of a client certificate the TLS layer verified: enables SASL EXTERNAL.
        self.peer_identity = peer_identity
        self.node_id = broker.node_id
        self.state = State.AWAIT_HEADER
        self.should_close = False
        self._buf = bytearray()
        self._out: list[bytes | memoryview] = []
        self.out_bytes = 0
        self.transport_paused = False
        self.channels: dict[int, Channel] = {}
        # Channels whose close crossed ours (both peers sent channel.close): the
        # client may still send our close a close-ok, or frames it wrote before
        # it saw our close. They are discarded until it opens the number again.
        self._crossed: set[int] = set()
        self._lost = False  # connection_lost ran
        self.user: User | None = None
        self.username = ""
        self.vhost: VirtualHost | None = None
        self.client_properties: dict[str, Any] = {}
        self.channel_max = self.settings.channel_max
        self.frame_max = self.settings.frame_max
        self.heartbeat = 0
        # Tests drive time by passing ``now``; then every internal stamp uses it too.
        self._manual_clock = now is not None
        t = time.monotonic() if now is None else now
        self._now = t
        self.opened_at = t
        self.last_received = t
        self.last_sent = t
        self.closing_since = 0.0
        self._confirm_dirty: dict[int, Channel] = {}
        self._in_receive = False
        # Set by the I/O layer: called when output appears outside receive_data
        # (a delivery caused by another connection's publish).
        self.on_output: Callable[[], None] = _noop
        self._output_signalled = False
        self.close_reason = ""
        self.has_published = False
        # Bodies received on this connection's channels and not yet complete (Channel.content_body).
        self.partial_bytes = 0
        self.max_partial_bytes = self.settings.max_partial_body_bytes or self.settings.max_message_size
        self.blocked = False  # reading paused by the memory alarm
        # Flow control (core/engine/flow.py): queues this connection published to that are
        # behind their consumers; while any holds it, no input is processed or read.
        self._held_by: dict[int, flow.QueueFlow] = {}
        self._flow_since = 0.0
        self._flow_done = 0.0  # seconds in flow, periods that ended
        self.flow_count = 0  # times this connection entered flow
        self.auth_mechanism = ""  # the SASL mechanism the client logged in with (management API)
        self._flow_logged = -FLOW_LOG_INTERVAL
        # Set by the I/O layer: buffered input may be handled now (call receive_data(b"") soon,
        # not from inside this call): the last queue holding this connection caught up, or a
        # suspended method finished with more than READ_BUDGET units of input waiting.
        self.on_input_ready: Callable[[], None] = _noop
        # More whole frames are buffered than one receive_data handles (READ_BUDGET).
        self.input_pending = False
        # Cluster mode: a method waiting for etcd or a queue's owner. Input is
        # not processed meanwhile, so every channel's methods keep their order.
        self.suspended = 0
        self.run_async: Callable[[Awaitable[Any], Callable[[Any, BaseException | None], None]], None] | None = None

    def held_bytes(self) -> int:
        """Memory this connection holds for messages: its input not yet parsed, output not yet
        handed to the transport, and content bodies partly received (the memory alarm counts them)."""
        return len(self._buf) + self.out_bytes + self.partial_bytes

    # ------------------------------------------------------------ output
    @property
    def write_blocked(self) -> bool:
        return self.transport_paused or self.out_bytes > self.settings.write_high_water

    def write(self, data: bytes | memoryview) -> None:
        self._out.append(data)
        self.out_bytes += len(data)
        if not self._output_signalled:
            self._output_signalled = True
            if not self._in_receive:
                self.on_output()

    def write_content(self, channel: int, props: bytes, body: bytes) -> None:
        frames = (
            codec.content_pieces(channel, props, body, self.frame_max)
            if len(body) > codec.LARGE_BODY
            else codec.content_frames(channel, props, body, self.frame_max)
        )
        for f in frames:
            self.write(f)

    def send_method(self, channel: int, method: Method) -> None:
        self.write(codec.encode_method(channel, method))

    def data_to_send(self) -> bytes:
        self.flush_confirms()  # confirms that became due outside receive_data (store commits)
        self._output_signalled = False
        if not self._out:
            return b""
        out = self._out
        data = b"".join(out) if len(out) > 1 or not isinstance(out[0], bytes) else out[0]
        self._out = []
        self.out_bytes = 0
        self.last_sent = self._now if self._manual_clock else time.monotonic()
        return data

    def set_transport_paused(self, paused: bool) -> None:
        """The I/O layer's write buffer crossed its high (True) or low (False) mark."""
        self.transport_paused = paused
        if not paused:
            self.resume_deliveries()

    def resume_deliveries(self) -> None:
        if self.write_blocked:
            return
        for ch in list(self.channels.values()):
            if not ch.closing:
                ch.resume()

    def confirm_pending(self, channel: Channel) -> None:
        self._confirm_dirty[channel.number] = channel
        if not self._in_receive and not self._output_signalled:
            self._output_signalled = True
            self.on_output()

    def flush_confirms(self) -> None:
        if self._confirm_dirty:
            dirty = self._confirm_dirty
            self._confirm_dirty = {}
            for ch in dirty.values():
                ch.flush_confirms()

    # -------------------------------------------------------------- flow
    @property
    def in_flow(self) -> bool:
        """Held back by flow control: a queue it publishes to is behind its consumers."""
        return bool(self._held_by)

    @property
    def flow_state(self) -> str:
        """As RabbitMQ's connection ``state``: 'blocked' (memory alarm), 'flow', or 'running'."""
        if self.blocked:
            return "blocked"
        if self._held_by:
            return "flow"
        return "running"

    @property
    def flow_seconds(self) -> float:
        """Cumulative seconds this connection spent held in flow (the current period included)."""
        if self._held_by:
            return self._flow_done + max(0.0, self._clock() - self._flow_since)
        return self._flow_done

    @property
    def wants_read(self) -> bool:
        """Should the I/O layer read the socket? Not while held, nor while input is buffered, nor
        while the transport cannot take our output (a client that does not read what it asks for)."""
        return not self._held_by and not self.input_pending and not self.transport_paused

    def hold(self, gate: flow.QueueFlow) -> None:
        if not self._held_by:
            now = self._clock()
            self._flow_since = now
            self.flow_count += 1
            if now - self._flow_logged >= FLOW_LOG_INTERVAL:
                log.info(
                    "connection in flow: a queue it publishes to is behind its consumers",
                    extra={"peer": self._peer_text(), "queue": gate.qch.queue.name,
                           "ready": len(gate.qch.ready), "times": self.flow_count,
                           "flow_seconds": round(self._flow_done, 3)},
                )
                self._flow_logged = now
        self._held_by[id(gate)] = gate

    def release(self, gate: flow.QueueFlow) -> None:
        if self._held_by.pop(id(gate), None) is None or self._held_by:
            return
        now = self._clock()
        period = max(0.0, now - self._flow_since)
        self._flow_done += period
        if period >= 1.0:
            log.info("connection left flow", extra={"peer": self._peer_text(), "seconds": round(period, 3)})
        self.on_input_ready()

    def _clock(self) -> float:
        return self._now if self._manual_clock else time.monotonic()

    def client_capability(self, name: str) -> bool:
        caps = self.client_properties.get("capabilities")
        return isinstance(caps, dict) and bool(caps.get(name))

    # ------------------------------------------------------------- input
    def receive_data(self, data: bytes, now: float | None = None) -> None:
        if self.state is State.CLOSED or self.should_close:
            return
        if now is not None:
            self._now = now
        elif not self._manual_clock:
            self._now = time.monotonic()
        if data:
            self.last_received = self._now
        self._in_receive = True
        self.input_pending = False
        previous = flow.swap(self)
        try:
            self._buf += data
            self._process()
        except BrokerError as exc:
            self.close_with_error(exc)
        except Exception:
            # A bug of ours must cost this connection only, never the node.
            log.exception("internal error handling client data", extra={"peer": self._peer_text()})
            self.close_with_error(InternalError("internal error; see the broker log"))
        finally:
            flow.swap(previous)
            self._in_receive = False
            self.flush_confirms()

    def _process(self) -> None:
        buf = self._buf
        if self.state is State.AWAIT_HEADER:
            if len(buf) < 8:
                if buf and not codec.PROTOCOL_HEADER.startswith(bytes(buf[:8])):
                    self._bad_header()
                return
            if bytes(buf[:8]) != codec.PROTOCOL_HEADER:
                self._bad_header()
                return
            del buf[:8]
            self._send_start()
        pos = 0
        n = len(buf)
        unpack = codec.frame_head.unpack_from
        frame_max = self.frame_max
        held = self._held_by
        budget = READ_BUDGET
        high_water = self.settings.write_high_water
        try:
            while n - pos >= 8 and not self.should_close and not self.suspended:
                if held or not budget or self.out_bytes > high_water or self.transport_paused:
                    # Held by flow control (the I/O layer resumes us), or this turn's share
                    # of the loop is used up, or our output is over its high-water mark: the
                    # rest waits, buffered. Every method's output counts, not only deliveries:
                    # 150 basic.get + reject pairs for a 4 MiB message (6,000 bytes in) made
                    # 600 MiB of output for a client that never read it. The I/O layer goes
                    # on once the transport drains (resume_writing).
                    self.input_pending = not held
                    break
                budget -= 1
                ftype, channel, size = unpack(buf, pos)
                if size + 8 > frame_max:
                    raise FrameError(f"frame size {size + 8} exceeds negotiated frame_max {frame_max}")
                end = pos + 7 + size
                if end >= n:
                    break
                if buf[end] != codec.FRAME_END:
                    raise FrameError(f"invalid frame end marker 0x{buf[end]:02x}")
                if ftype == 1 and buf[pos + 7 : pos + 11] == codec.BASIC_PUBLISH_ID:
                    done = self._whole_publish(buf, pos, end, n, channel)
                    if done:
                        pos = done
                        continue
                if size > 4096:
                    # One copy, not two (a bytearray slice, then bytes of it).
                    with memoryview(buf) as view:
                        payload = view[pos + 7 : end].tobytes()
                else:
                    payload = bytes(buf[pos + 7 : end])
                pos = end + 1
                self._frame(ftype, channel, payload)
                frame_max = self.frame_max
        except FrameError:
            # Framing is lost: nothing after this point can be parsed, so drop it
            # all; the next bytes should be the client's close-ok to our close.
            pos = len(buf)
            raise
        finally:
            del buf[:pos]

    def _whole_publish(self, buf: bytearray, pos: int, end: int, n: int, number: int) -> int:
        """Publish a message whose method, header and single body frame are all buffered.

        The hot path: one call per message instead of three trips through the
        frame state machine. Returns the position after the message, or 0 to
        let the general path handle (and report) anything unusual.
        """
        ch = self.channels.get(number)
        if ch is None or ch.closing or ch.publishing is not None or self.state is not State.OPEN:
            return 0
        hpos = end + 1
        if n - hpos < 22:
            return 0
        unpack = codec.frame_head.unpack_from
        htype, hch, hsize = unpack(buf, hpos)
        hend = hpos + 7 + hsize
        frame_max = self.frame_max
        if htype != 2 or hch != number or hsize < 14 or hend >= n or buf[hend] != codec.FRAME_END:
            return 0
        class_id, _weight, body_size = codec.header_payload.unpack_from(buf, hpos + 7)
        if class_id != 60 or hsize + 8 > frame_max or body_size > self.settings.max_message_size:
            return 0  # the general path reports these
        if body_size == 0:
            body = b""
            after = hend + 1
        else:
            bpos = hend + 1
            if n - bpos < 8:
                return 0
            btype, bch, bsize = unpack(buf, bpos)
            bend = bpos + 7 + bsize
            if (btype != 3 or bch != number or bsize != body_size or bend >= n or buf[bend] != codec.FRAME_END
                    or bsize + 8 > frame_max):
                return 0
            body = bytes(buf[bpos + 7 : bend])
            after = bend + 1
        try:
            exchange, rk, mandatory, immediate = codec.decode_publish(buf, pos + 7, end)
        except (IndexError, ValueError):  # UnicodeDecodeError, TrailingBytes
            return 0
        self._guard(ch, 60, 40, ch.publish, exchange, rk, mandatory, immediate, bytes(buf[hpos + 19 : hend]), body)
        return after

    def suspend(self, ch: Channel, class_id: int, method_id: int, op: Awaitable[Any],
                then: Callable[[Any], None]) -> None:
        """Finish a method once ``op`` (cluster metadata, a remote queue) completes.

        Nothing after this method is processed until then, so replies keep
        the order of the requests. ``then`` gets ``op``'s result; an error of
        ``op`` is handled as if the method itself had raised it.
        """
        if self.run_async is None:
            raise InternalError("asynchronous operation without an event loop")
        self.suspended += 1

        def done(result: Any, error: BaseException | None) -> None:
            self.suspended -= 1
            if self.state is State.CLOSED or self.should_close:
                return
            self._in_receive = True
            try:
                if error is None:
                    self._guard(ch, class_id, method_id, then, result)
                elif isinstance(error, BrokerError):
                    self._guard(ch, class_id, method_id, _raise, error)
                else:
                    log.error("cluster operation failed", exc_info=error, extra={"peer": self._peer_text()})
                    self._guard(ch, class_id, method_id, _raise, InternalError(f"cluster operation failed: {error}"))
            except BrokerError as exc:
                self.close_with_error(exc)
            except Exception:
                log.exception("internal error finishing a method", extra={"peer": self._peer_text()})
                self.close_with_error(InternalError("internal error; see the broker log"))
            finally:
                self._in_receive = False
            if not self.suspended and self._buf:
                self.receive_data(b"")
                if self.input_pending:
                    self.on_input_ready()
            else:
                self.flush_confirms()
            self.on_output()

        self.run_async(op, done)

    def _bad_header(self) -> None:
        # The spec: answer a header we do not speak with the one we do, then close.
        self.write(codec.PROTOCOL_HEADER)
        self.should_close = True
        self.state = State.CLOSED
        self.close_reason = "bad protocol header"

    # ------------------------------------------------------------ frames
    def _frame(self, ftype: int, number: int, payload: bytes) -> None:
        if self.state is State.CLOSING:
            method_id = payload[:4] if ftype == codec.FRAME_METHOD and number == 0 else b""
            if method_id in (CONNECTION_CLOSE_OK_ID, CONNECTION_CLOSE_ID):
                if method_id == CONNECTION_CLOSE_ID:  # a close crossing ours: answer it
                    self.send_method(0, commands.Connection.CloseOk())
                self._closed("closed by server")
            return
        if ftype == codec.FRAME_METHOD:
            if number == 0:
                self._connection_method(payload)
                return
            if self.state is not State.OPEN:
                raise ChannelError(f"channel {number} used before the connection was opened")
            ch = self.channels.get(number)
            if ch is None and number in self._crossed and payload[:4] != codec.CHANNEL_OPEN_ID:
                return  # written before the client saw our channel.close: discarded
            if payload[:4] == codec.BASIC_PUBLISH_ID:
                # Hot path: publish without pamqp.
                if ch is None:
                    raise ChannelError(f"expected 'channel.open' on channel {number}")
                if ch.closing:
                    return
                if ch.publishing is not None:
                    raise UnexpectedFrame(
                        f"expected content header for class 60, got a method frame on channel {number}"
                    )
                try:
                    exchange, rk, mandatory, immediate = codec.decode_publish(payload)
                except codec.TrailingBytes as exc:
                    raise FrameError(str(exc)) from exc
                except (IndexError, UnicodeDecodeError) as exc:
                    raise SyntaxError_(f"basic.publish does not decode: {exc}") from exc
                self._guard(ch, 60, 40, ch.begin_publish, exchange, rk, mandatory, immediate)
                return
            if payload[:4] == codec.BASIC_ACK_ID and ch is not None and not ch.closing and ch.publishing is None:
                try:
                    tag, multiple = codec.decode_ack(payload)
                except codec.TrailingBytes as exc:
                    raise FrameError(str(exc)) from exc
                except Exception as exc:  # struct.error: truncated arguments
                    raise SyntaxError_(f"basic.ack does not decode: {exc}") from exc
                self._guard(ch, 60, 80, ch.ack, tag, multiple)
                return
            self._channel_method(number, ch, payload)
        elif ftype == codec.FRAME_HEADER:
            ch = self._content_channel(number)
            if ch is None:
                return
            if not ch.awaiting_header:
                raise UnexpectedFrame(f"content header on channel {number} where a method frame was expected")
            self._guard(ch, 60, 40, ch.content_header, payload)
        elif ftype == codec.FRAME_BODY:
            ch = self._content_channel(number)
            if ch is None:
                return
            if ch.publishing is None or ch.awaiting_header:
                raise UnexpectedFrame(f"content body on channel {number} where it was not expected")
            self._guard(ch, 60, 40, ch.content_body, payload)
        elif ftype == codec.FRAME_HEARTBEAT:
            if number != 0:
                raise FrameError(f"heartbeat frame on channel {number}; heartbeats belong on channel 0")
        else:
            raise FrameError(f"unknown frame type {ftype}")

    def _content_channel(self, number: int) -> Channel | None:
        if number == 0 or self.state is not State.OPEN:
            raise UnexpectedFrame(f"content frame on channel {number} outside an open channel")
        ch = self.channels.get(number)
        if ch is None:
            if number in self._crossed:
                return None  # content the client sent before it saw our channel.close
            raise ChannelError(f"expected 'channel.open' on channel {number}")
        if ch.closing:
            return None
        return ch

    def _guard(self, ch: Channel, class_id: int, method_id: int, fn: Callable[..., None], *args: Any) -> None:
        """Run a channel operation; a channel-level refusal closes only that channel."""
        try:
            fn(*args)
        except BrokerError as exc:
            if exc.code in CHANNEL_ERROR_CODES:
                self._close_channel(ch, exc, class_id, method_id)
            else:
                exc.class_id = class_id  # type: ignore[attr-defined]
                exc.method_id = method_id  # type: ignore[attr-defined]
                raise

    def _decode(self, payload: bytes) -> Method:
        try:
            return codec.decode_method(payload)
        except codec.TrailingBytes as exc:
            raise FrameError(str(exc)) from exc  # RabbitMQ: 501, the connection closes
        except codec.DecodeError as exc:
            text = str(exc)
            if text.startswith("unknown method"):
                raise CommandInvalid(text) from exc
            raise SyntaxError_(text) from exc

    def _channel_method(self, number: int, ch: Channel | None, payload: bytes) -> None:
        method = self._decode(payload)
        try:
            self._channel_method_decoded(number, ch, method)
        except BrokerError as exc:
            if not hasattr(exc, "class_id"):
                exc.class_id, exc.method_id = method.index >> 16, method.index & 0xFFFF  # type: ignore[attr-defined]
            raise

    def _channel_method_decoded(self, number: int, ch: Channel | None, method: Method) -> None:
        class_id, method_id = method.index >> 16, method.index & 0xFFFF
        if ch is not None and ch.closing and not isinstance(method, (commands.Channel.Close, commands.Channel.CloseOk)):
            return  # everything but close/close-ok is dropped after we closed the channel
        if isinstance(method, commands.Channel.Open):
            if ch is not None:
                raise ChannelError(f"second 'channel.open' seen on channel {number}")
            if len(self.channels) >= self.channel_max:
                # RabbitMQ limits how many channels are open, not their numbers.
                raise NotAllowed(
                    f"number of channels opened ({len(self.channels)}) has reached the negotiated "
                    f"channel_max ({self.channel_max})"
                )
            user = self.broker.users.get(self.username)
            if user is not None and user.limits:
                self.broker.limits.check_channel(self.username, user.limits)  # max-channels (530)
            self._crossed.discard(number)
            self.channels[number] = Channel(self, number)
            self.broker.stats.channels_opened += 1
            self.send_method(number, commands.Channel.OpenOk())
            return
        if ch is None:
            raise ChannelError(f"expected 'channel.open' on channel {number}")
        if isinstance(method, commands.Channel.CloseOk):
            if ch.closing:
                del self.channels[number]
                self.broker.stats.channels_closed += 1
            return
        if isinstance(method, commands.Channel.Close):
            if ch.closing:
                # Crossing closes: ours is in flight. Answer theirs (RabbitMQ does
                # too) and take it as the close-ok to ours; what else the client
                # sends on this number until it reopens it predates our close.
                self._crossed.add(number)
            ch.release()
            del self.channels[number]
            self.broker.stats.channels_closed += 1
            self.send_method(number, commands.Channel.CloseOk())
            return
        if ch.closing:
            return  # everything but close/close-ok is dropped after we closed it
        if ch.publishing is not None:
            raise UnexpectedFrame(
                f"expected content header for class 60, got {method.name} on channel {number}"
            )
        self._guard(ch, class_id, method_id, ch.handle, method)

    def fail_channel(self, ch: Channel, exc: BrokerError, class_id: int, method_id: int) -> None:
        """A channel error found outside receive_data (a store failure after the fact)."""
        if ch.closing or self.channels.get(ch.number) is not ch:
            return
        self._close_channel(ch, exc, class_id, method_id)

    def _close_channel(self, ch: Channel, exc: BrokerError, class_id: int, method_id: int) -> None:
        log.info(
            "channel closed by server",
            extra={"peer": self._peer_text(), "channel": ch.number, "code": exc.code, "reason": exc.text},
        )
        ch.flush_confirms()
        ch.release()
        self.send_method(
            ch.number,
            commands.Channel.Close(
                reply_code=exc.code, reply_text=short_text(exc.reply_text), class_id=class_id, method_id=method_id
            ),
        )

    # ---------------------------------------------------- connection class
    def _send_start(self) -> None:
        props: dict[str, Any] = {
            "product": self.settings.product,
            "version": self.settings.version,
            "platform": "Python",
            "copyright": "Leveret authors",
            "information": "AMQP 0-9-1 broker; see https://www.rabbitmq.com/amqp-0-9-1-reference.html",
            "cluster_name": self.node_id,
            "capabilities": dict(CAPABILITIES),
        }
        props.update(self.settings.server_properties_extra)
        self.send_method(
            0,
            commands.Connection.Start(
                version_major=0,
                version_minor=9,
                server_properties=props,
                mechanisms="PLAIN AMQPLAIN EXTERNAL" if self.peer_identity else "PLAIN AMQPLAIN",
                locales="en_US",
            ),
        )
        self.state = State.AWAIT_START_OK

    def _connection_method(self, payload: bytes) -> None:
        method = self._decode(payload)
        try:
            self._connection_method_decoded(method)
        except BrokerError as exc:
            if not hasattr(exc, "class_id"):
                exc.class_id, exc.method_id = method.index >> 16, method.index & 0xFFFF  # type: ignore[attr-defined]
            raise

    def _connection_method_decoded(self, method: Method) -> None:
        state = self.state
        if isinstance(method, commands.Connection.Close):
            self.send_method(0, commands.Connection.CloseOk())
            self._closed("closed by client")
            return
        if isinstance(method, commands.Connection.CloseOk):
            self._closed("close-ok without close")
            return
        if state is State.AWAIT_START_OK and isinstance(method, commands.Connection.StartOk):
            self._start_ok(method)
        elif state is State.AWAIT_TUNE_OK and isinstance(method, commands.Connection.TuneOk):
            self._tune_ok(method)
        elif state is State.AWAIT_OPEN and isinstance(method, commands.Connection.Open):
            assert self.user is not None
            name = method.virtual_host
            if name in self.broker.vhosts:
                # RabbitMQ 3.10.8's order (checked): the limits before the vhost access check.
                user = self.broker.users.get(self.username, self.user)
                self.broker.limits.check_connection(self.username, user.limits, name,
                                                    self.broker.vhost_limits.get(name, {}))
            vhost = self.broker.open_vhost(self.user, name)
            self.vhost = vhost
            self.broker.limits.opened(self, self.username, vhost.name)
            self.state = State.OPEN
            self.send_method(0, commands.Connection.OpenOk())
            log.info(
                "connection opened",
                extra={"peer": self._peer_text(), "user": self.username, "vhost": self.vhost.name,
                       "client": str(self.client_properties.get("product", ""))},
            )
        elif state is State.OPEN and isinstance(method, commands.Connection.UpdateSecret):
            # As RabbitMQ 3.10 does for password users: accepted; it changes nothing for PLAIN logins.
            log.info("connection.update-secret", extra={"peer": self._peer_text(), "reason": method.reason})
            self.send_method(0, commands.Connection.UpdateSecretOk())
        else:
            raise CommandInvalid(f"{method.name} is not expected on channel 0 in state {state.value}")

    def _start_ok(self, m: commands.Connection.StartOk) -> None:
        self.client_properties = dict(m.client_properties or {})
        mechanism = m.mechanism
        self.auth_mechanism = mechanism
        response = m.response if isinstance(m.response, bytes) else str(m.response).encode("utf-8", "surrogateescape")
        host = self.peer[0] if self.peer else None
        try:
            if mechanism == "EXTERNAL" and self.peer_identity:
                self.user = self.broker.authenticate_external(self.peer_identity, host)
            else:
                username, password = _credentials(mechanism, response)
                if self.run_async is not None:
                    # The check waits for the address's turn and delay, then runs the KDF in
                    # the broker's threads (Broker.login): never on the event loop. Nothing
                    # else this client sends is processed meanwhile (suspended).
                    self.suspended += 1
                    self.run_async(self.broker.login(username, password, host),
                                   lambda user, error: self._login_done(mechanism, user, error))
                    return
                self.user = self.broker.authenticate(username, password, host)  # sans-IO tests
        except AccessRefused as exc:
            self._login_refused(mechanism, exc)
            return
        self._logged_in()

    def _login_done(self, mechanism: str, user: Any, error: BaseException | None) -> None:
        self.suspended -= 1
        if self.state is State.CLOSED or self.should_close:
            return
        self._in_receive = True
        try:
            if isinstance(error, AccessRefused):
                self._login_refused(mechanism, error, throttled=True)
            elif error is not None:
                log.error("login failed", exc_info=error, extra={"peer": self._peer_text()})
                self.close_with_error(InternalError("internal error; see the broker log"))
            else:
                self.user = user
                self._logged_in()
        finally:
            self._in_receive = False
        if not self.suspended and self._buf and not self.should_close:
            self.receive_data(b"")
            if self.input_pending:
                self.on_input_ready()
        self.on_output()

    def _login_refused(self, mechanism: str, exc: AccessRefused, throttled: bool = False) -> None:
        log.warning(
            "login refused", extra={"peer": self._peer_text(), "mechanism": mechanism, "reason": exc.text}
        )
        if mechanism not in ("PLAIN", "AMQPLAIN", "EXTERNAL") or (mechanism == "EXTERNAL"
                                                                   and not self.peer_identity):
            offered = "PLAIN, AMQPLAIN or EXTERNAL" if self.peer_identity else "PLAIN or AMQPLAIN"
            exc = AccessRefused(f"unsupported authentication mechanism '{mechanism}'; use {offered}")
        elif "localhost" not in exc.text:
            exc = AccessRefused(
                f"Login was refused using authentication mechanism {mechanism}. "
                "For details see the broker logfile."
            )
        # A guesser waits longer for each answer (core/engine/login_throttle.py): Broker.login
        # waited before the check; a refusal without one (a bad mechanism, the sans-IO path)
        # waits here. The state stays AWAIT_START_OK, so nothing else it sends is processed.
        delay = 0.0 if throttled else self.broker.login_throttle.delay(self.peer[0] if self.peer else None)
        refusal = exc
        if delay > 0:
            self.suspended += 1

            def later() -> None:
                self.suspended -= 1
                self._refuse_login(refusal)

            self.broker.scheduler.call_later(delay, later)
        else:
            self._refuse_login(refusal)

    def _logged_in(self) -> None:
        assert self.user is not None
        self.username = self.user.name
        s = self.settings
        self.state = State.AWAIT_TUNE_OK
        self.send_method(
            0, commands.Connection.Tune(channel_max=s.channel_max, frame_max=s.frame_max, heartbeat=s.heartbeat)
        )

    def _refuse_login(self, exc: AccessRefused) -> None:
        if self.state is State.CLOSED or self.should_close:
            return
        if self.client_capability("authentication_failure_close"):
            self.close_with_error(exc)
        else:
            self._closed("authentication failed")
        self.on_output()

    def _tune_ok(self, m: commands.Connection.TuneOk) -> None:
        s = self.settings
        for name, value, server, minimum in (
            ("frame_max", m.frame_max, s.frame_max, FRAME_MIN_SIZE),
            ("channel_max", m.channel_max, s.channel_max, 0),
        ):
            if value != 0 and value < minimum:
                raise NotAllowed(f"negotiated {name} = {value} is lower than the minimum allowed value ({minimum})")
            if server != 0 and (value == 0 or value > server):
                raise NotAllowed(f"negotiated {name} = {value} is higher than the maximum allowed value ({server})")
        self.frame_max = m.frame_max
        self.channel_max = m.channel_max or 65535
        self.heartbeat = m.heartbeat
        self.state = State.AWAIT_OPEN

    # ----------------------------------------------------------- closing
    def close_with_error(self, exc: BrokerError) -> None:
        """Close the whole connection with ``exc``'s reply code (a connection error)."""
        if self.state in (State.CLOSING, State.CLOSED):
            return
        log.warning(
            "connection closed by server",
            extra={"peer": self._peer_text(), "code": exc.code, "reason": exc.text},
        )
        text = short_text(exc.reply_text)
        self._send_close(exc.code, text, getattr(exc, "class_id", 0), getattr(exc, "method_id", 0))
        self.close_reason = exc.reply_text
        if self.vhost is None:
            # Before open (bad login, failed tune): nothing to wait for.
            self.should_close = True

    def close(self, code: int = 320, text: str = "CONNECTION_FORCED - broker forced connection closure") -> None:
        """Server-initiated clean close (shutdown)."""
        if self.state in (State.CLOSING, State.CLOSED):
            return
        if self.state is not State.OPEN:
            self._closed("shutdown")
            return
        self._send_close(code, text, 0, 0)

    def _send_close(self, code: int, text: str, class_id: int, method_id: int) -> None:
        """Release every channel (requeueing what they hold) and wait for close-ok."""
        for ch in list(self.channels.values()):
            ch.release()
        self.send_method(
            0, commands.Connection.Close(reply_code=code, reply_text=text, class_id=class_id, method_id=method_id)
        )
        self.state = State.CLOSING
        self.closing_since = self._now if self._manual_clock else time.monotonic()

    def _closed(self, reason: str) -> None:
        self.state = State.CLOSED
        self.should_close = True
        self.close_reason = self.close_reason or reason

    def connection_lost(self) -> None:
        """The transport is gone: requeue what this connection held, drop its exclusive queues.

        Once only: the server calls it when its lingering close starts and
        again when the socket is finally gone.
        """
        if self._lost:
            return
        self._lost = True
        self.state = State.CLOSED
        self.should_close = True
        for gate in self._held_by.values():
            gate.forget(self)
        if self._held_by:
            self._flow_done += max(0.0, self._clock() - self._flow_since)
            self._held_by.clear()
        for ch in list(self.channels.values()):
            ch.release()
        self.broker.stats.channels_closed += len(self.channels)
        self.channels.clear()
        if self.vhost is not None:
            self.broker.limits.closed(self, self.username, self.vhost.name)
            self.vhost.drop_exclusive_queues(self)
        log.info("connection closed", extra={"peer": self._peer_text(), "reason": self.close_reason or "socket closed"})

    # ------------------------------------------------------------- timers
    def tick(self, now: float) -> None:
        """Heartbeats and time-outs; the I/O layer calls this every second or so."""
        self._now = now
        if self.state is State.CLOSED:
            return
        if self.state in (State.AWAIT_HEADER, State.AWAIT_START_OK, State.AWAIT_TUNE_OK, State.AWAIT_OPEN):
            if now - self.opened_at > self.settings.handshake_timeout:
                self.close_reason = "handshake timeout"
                self._closed("handshake timeout")
            return
        if self.state is State.CLOSING:
            if now - self.closing_since > self.settings.close_timeout:
                self._closed("no close-ok from client")
            return
        hb = self.heartbeat
        if hb <= 0:
            return
        if self._held_by or self.blocked or self.transport_paused:
            # We are not reading this client: its silence is ours, not a dead peer.
            self.last_received = now
        if now - self.last_received > 2 * hb:
            self.close_reason = f"missed heartbeats from client, timeout: {hb}s"
            log.warning("missed heartbeats", extra={"peer": self._peer_text(), "timeout": hb})
            self._closed(self.close_reason)
            return
        if now - self.last_sent >= hb / 2 and not self._out:
            self.write(codec.HEARTBEAT_FRAME)

    def _peer_text(self) -> str:
        return f"{self.peer[0]}:{self.peer[1]}" if self.peer else "-"


def short_text(text: str) -> str:
    """``text`` cut to a shortstr's 255 bytes of UTF-8 (not characters), on a character boundary.

    A reply text quoting a client's non-ASCII name can be under 255 characters
    and over 255 bytes; pamqp then refuses to encode the close (the fuzzer
    found it as an internal error).
    """
    raw = text.encode("utf-8")
    if len(raw) <= 255:
        return text
    return raw[:255].decode("utf-8", "ignore")


def _raise(exc: BaseException) -> None:
    raise exc


def _noop() -> None:
    pass


def _credentials(mechanism: str, response: bytes) -> tuple[str, str]:
    if mechanism == "PLAIN":
        parts = response.split(b"\x00")
        if len(parts) != 3:
            raise AccessRefused("malformed PLAIN response")
        return parts[1].decode("utf-8", "replace"), parts[2].decode("utf-8", "replace")
    if mechanism == "AMQPLAIN":
        # A field table without its length prefix (what py-amqp and others send).
        try:
            table, _ = fieldtable.decode_table(len(response).to_bytes(4, "big") + response)
        except (fieldtable.FieldTableError, ValueError, OverflowError, OSError, RecursionError) as exc:
            # Timestamps out of range (OverflowError, OSError) and deep nesting
            # are malformed responses too, not errors of ours.
            raise AccessRefused(f"malformed AMQPLAIN response: {exc}") from exc
        login, password = table.get("LOGIN", ""), table.get("PASSWORD", "")
        return (
            login.decode() if isinstance(login, (bytes, bytearray)) else str(login),
            password.decode() if isinstance(password, (bytes, bytearray)) else str(password),
        )
    raise AccessRefused(f"unsupported authentication mechanism '{mechanism}'")
