"""Hand-written AMQP 0-9-1 fast path: Basic.Publish encoding and delivery scanning.

pamqp is correct but costs tens of microseconds per frame; at ~100k msg/s
that alone would saturate a core and make the client the bottleneck.  The
hot frames (Basic.Publish + header + body going out; Basic.Deliver + header
+ body, Basic.Ack/Nack coming in) are therefore encoded and scanned here with
``struct`` directly.  Everything else is handed back raw so the connection can
decode it with pamqp.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

FRAME_METHOD = 1
FRAME_HEADER = 2
FRAME_BODY = 3
FRAME_HEARTBEAT = 8
FRAME_END = 0xCE
FRAME_END_BYTE = b"\xce"
# type(1) + channel(2) + size(4) before the payload, frame-end(1) after it.
FRAME_OVERHEAD = 8

HEARTBEAT_FRAME = b"\x08\x00\x00\x00\x00\x00\x00\xce"

# (class_id << 16) | method_id, compared as one big-endian uint32.
BASIC_PUBLISH = (60 << 16) | 40
BASIC_DELIVER = (60 << 16) | 60
BASIC_ACK = (60 << 16) | 80
BASIC_NACK = (60 << 16) | 120
QUEUE_BIND = (50 << 16) | 20
QUEUE_UNBIND = (50 << 16) | 50

# Basic property flag for delivery-mode (4th property, counted from bit 15).
_FLAG_DELIVERY_MODE = 0x1000

_FRAME_HDR = struct.Struct(">BHI")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_ACK_ARGS = struct.Struct(">QB")  # delivery-tag, bit field
_CONTENT_HDR = struct.Struct(">HHQH")  # class, weight, body-size, property flags


class FrameError(Exception):
    """The peer sent bytes that are not a well-formed AMQP frame."""


def _shortstr(value: str) -> bytes:
    raw = value.encode()
    if len(raw) > 255:
        raise ValueError(f"shortstr longer than 255 bytes: {value!r}")
    return bytes((len(raw),)) + raw


def _frame(frame_type: int, channel: int, payload: bytes) -> bytes:
    return _FRAME_HDR.pack(frame_type, channel, len(payload)) + payload + FRAME_END_BYTE


def encode_publish(
    channel: int,
    exchange: str,
    routing_key: str,
    body: bytes,
    *,
    delivery_mode: int | None = None,
    frame_max: int = 131072,
) -> bytes:
    """Return the Basic.Publish method, content header and body frames for one message.

    Only ``delivery_mode`` is supported as a property: it is all the scenarios
    need, and a fixed layout keeps the encoder trivially auditable.
    """
    method = _U32.pack(BASIC_PUBLISH) + b"\x00\x00" + _shortstr(exchange) + _shortstr(routing_key) + b"\x00"
    if delivery_mode is None:
        props = _CONTENT_HDR.pack(60, 0, len(body), 0)
    else:
        props = _CONTENT_HDR.pack(60, 0, len(body), _FLAG_DELIVERY_MODE) + bytes((delivery_mode,))
    parts = [_frame(FRAME_METHOD, channel, method), _frame(FRAME_HEADER, channel, props)]
    chunk = frame_max - FRAME_OVERHEAD
    for start in range(0, len(body), chunk):
        parts.append(_frame(FRAME_BODY, channel, body[start : start + chunk]))
    return b"".join(parts)


def encode_queue_bind(channel: int, queue: str, exchange: str, routing_key: str, *, unbind: bool = False) -> bytes:
    """Return a Queue.Bind (or Queue.Unbind) method frame with no arguments; bench.scenarios.bindings sends
    100,000 of them, which pamqp would take seconds of client CPU to build."""
    names = _shortstr(queue) + _shortstr(exchange) + _shortstr(routing_key)
    if unbind:  # Queue.Unbind has no no-wait bit
        return _frame(FRAME_METHOD, channel, _U32.pack(QUEUE_UNBIND) + b"\x00\x00" + names + b"\x00\x00\x00\x00")
    return _frame(FRAME_METHOD, channel, _U32.pack(QUEUE_BIND) + b"\x00\x00" + names + b"\x00\x00\x00\x00\x00")


def encode_basic_ack(channel: int, delivery_tag: int, *, multiple: bool) -> bytes:
    """Return a Basic.Ack method frame (consumer side)."""
    return _frame(FRAME_METHOD, channel, _U32.pack(BASIC_ACK) + _ACK_ARGS.pack(delivery_tag, 1 if multiple else 0))


@dataclass
class ConfirmTracker:
    """Counts publisher confirms exactly, whether the broker acks singly or with ``multiple``."""

    upto: int = 0  # every tag <= upto is confirmed
    singles: set[int] = field(default_factory=set)  # confirmed tags > upto
    nacked: int = 0

    @property
    def confirmed(self) -> int:
        return self.upto + len(self.singles)

    def confirm(self, tag: int, multiple: bool) -> None:
        if multiple:
            if tag > self.upto:
                self.upto = tag
                if self.singles:
                    self.singles = {t for t in self.singles if t > tag}
        elif tag > self.upto:
            self.singles.add(tag)


class FrameScanner:
    """Incrementally walks a byte stream of AMQP frames.

    Deliveries, their headers/bodies and publisher confirms are handled
    inline; any other frame is returned raw (full frame bytes) from
    :meth:`feed` so the caller can unmarshal it with pamqp.

    Deliveries are counted on the Basic.Deliver frame.  Only the position of
    the newest Deliver in a chunk is remembered, and its delivery tag parsed
    once per chunk, because the consumer acks with ``multiple=true``: one
    consumer channel per connection is assumed for ``last_delivery_tag``.
    """

    def __init__(self, *, capture_bodies: bool = False) -> None:
        self.capture_bodies = capture_bodies
        self.deliveries = 0
        self.last_delivery_tag = 0
        self.confirms = ConfirmTracker()
        self.heartbeats = 0
        # Completed message bodies (only when capture_bodies); the owner drains it.
        self.bodies: list[bytes] = []
        self._tail = b""
        self._skip = 0  # bytes of an uncaptured body frame still to discard
        self._body_left = 0
        self._body_parts: list[bytes] = []

    def feed(self, data: bytes) -> list[bytes]:
        """Consume ``data``; return the raw frames that need the slow path."""
        slow: list[bytes] = []
        pos = 0
        if self._skip:
            if len(data) <= self._skip:
                self._skip -= len(data)
                return slow
            # Start past the skipped bytes rather than slicing: no copy of a large read.
            pos, self._skip = self._skip, 0
        elif self._tail:  # never both: a pending skip leaves no tail
            data = self._tail + data
            self._tail = b""
        unpack_hdr = _FRAME_HDR.unpack_from
        unpack_u32 = _U32.unpack_from
        capture = self.capture_bodies
        n = len(data)
        deliveries = 0
        last_deliver = -1
        while n - pos >= 7:
            ftype, _channel, size = unpack_hdr(data, pos)
            end = pos + FRAME_OVERHEAD + size
            if end > n:
                if ftype == FRAME_BODY and not capture:
                    # Not needed: drop what we have and skip the rest unbuffered,
                    # so 1 MiB bodies are never copied into a reassembly buffer.
                    self._skip = end - n
                    pos = n
                break
            if data[end - 1] != FRAME_END:
                raise FrameError(f"bad frame end byte at offset {end - 1}")
            if ftype == FRAME_BODY:
                if capture:
                    self._add_body(data[pos + 7 : end - 1])
            elif ftype == FRAME_METHOD:
                method = unpack_u32(data, pos + 7)[0]
                if method == BASIC_DELIVER:
                    deliveries += 1
                    last_deliver = pos
                elif method == BASIC_ACK or method == BASIC_NACK:
                    tag, bits = _ACK_ARGS.unpack_from(data, pos + 11)
                    self.confirms.confirm(tag, bool(bits & 1))
                    if method == BASIC_NACK:
                        self.confirms.nacked += 1
                else:
                    slow.append(bytes(data[pos:end]))
            elif ftype == FRAME_HEADER:
                if capture:
                    self._start_body(_U64.unpack_from(data, pos + 11)[0])
            elif ftype == FRAME_HEARTBEAT:
                self.heartbeats += 1
            else:
                raise FrameError(f"unknown frame type {ftype}")
            pos = end
        if pos < n:
            self._tail = bytes(data[pos:])
        if deliveries:
            self.deliveries += deliveries
            # Deliver args: consumer-tag(shortstr), delivery-tag(u64), ...
            ctag_len = data[last_deliver + 11]
            self.last_delivery_tag = _U64.unpack_from(data, last_deliver + 12 + ctag_len)[0]
        return slow

    def _start_body(self, size: int) -> None:
        if size == 0:
            self.bodies.append(b"")
        else:
            self._body_left = size
            self._body_parts = []

    def _add_body(self, chunk: bytes) -> None:
        self._body_parts.append(chunk)
        self._body_left -= len(chunk)
        if self._body_left <= 0:
            self.bodies.append(b"".join(self._body_parts))
            self._body_parts = []
