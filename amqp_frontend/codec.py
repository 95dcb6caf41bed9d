"""AMQP 0-9-1 frame encoding and decoding.

pamqp does every method except the per-message ones. Publish, deliver,
get-ok, ack and the content frames are hand-written with ``struct``: they run
once per message and pamqp costs ~16 µs to parse a publish and ~24 µs to build
a delivery (see shared/DEPENDENCIES.md), more than the rest of the broker's
work per message.
"""

from __future__ import annotations

import struct

from pamqp import commands, decode
from pamqp import frame as pamqp_frame
from pamqp.base import Frame as Method
from pamqp.exceptions import UnmarshalingException

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"

FRAME_METHOD = 1
FRAME_HEADER = 2
FRAME_BODY = 3
FRAME_HEARTBEAT = 8
FRAME_END = 0xCE
FRAME_END_BYTE = b"\xce"
FRAME_OVERHEAD = 8  # type(1) channel(2) size(4) ... end(1)

HEARTBEAT_FRAME = b"\x08\x00\x00\x00\x00\x00\x00\xce"

# class_id << 16 | method_id of the methods with a fast path.
BASIC_PUBLISH_ID = b"\x00\x3c\x00\x28"
BASIC_ACK_ID = b"\x00\x3c\x00\x50"
CHANNEL_OPEN_ID = b"\x00\x14\x00\x0a"

frame_head = struct.Struct(">BHI")
_method_head = struct.Struct(">BHIHH")
_u32 = struct.Struct(">I")
_u16 = struct.Struct(">H")
_ack = struct.Struct(">QB")
_deliver_tail = struct.Struct(">QB")
header_payload = struct.Struct(">HHQ")
_header_frame_head = struct.Struct(">BHIHHQ")


# Field tables in method arguments (x-arguments, client properties) may nest
# no deeper than this: the same bound core/model/fieldtable.py puts on message
# headers. Deeper tables are stored and re-encoded recursively elsewhere.
MAX_TABLE_DEPTH = 64


class DecodeError(ValueError):
    """A method frame whose arguments do not decode."""


class TrailingBytes(DecodeError):
    """A method frame with bytes left over after its arguments: RabbitMQ closes with 501 FRAME_ERROR."""


def decode_method(payload: bytes) -> Method:
    """A method frame's payload (class, method, arguments) as a pamqp object."""
    if len(payload) < 4:
        raise DecodeError("method frame shorter than its class and method ids")
    (index,) = _u32.unpack_from(payload, 0)
    cls = commands.INDEX_MAPPING.get(index)
    if cls is None:
        raise DecodeError(f"unknown method {index >> 16}.{index & 0xFFFF}")
    method = cls()
    try:
        left = _unmarshal(method, payload[4:])
    except (struct.error, ValueError, UnicodeDecodeError, UnmarshalingException, IndexError) as exc:
        raise DecodeError(f"cannot decode {method.name}: {exc}") from exc
    except (RecursionError, OverflowError, OSError, TypeError, KeyError, AttributeError) as exc:
        # pamqp on hostile bytes: tables nested past the interpreter's recursion
        # limit, timestamps out of range (OverflowError, OSError EOVERFLOW),
        # malformed values. All are the client's malformed frame.
        raise DecodeError(f"cannot decode {method.name}: {type(exc).__name__}: {exc}") from exc
    if left:
        raise TrailingBytes(f"{method.name} frame has {left} bytes after its arguments")
    for name in _TABLE_ARGUMENTS.get(index, ()):
        if table_depth(getattr(method, name, None)) > MAX_TABLE_DEPTH:
            raise DecodeError(f"cannot decode {method.name}: '{name}' nests deeper than {MAX_TABLE_DEPTH}")
    return method


def _unmarshal(method: Method, data: bytes) -> int:
    """pamqp's ``Frame.unmarshal``, step for step, that also says how many bytes were left over
    (pamqp ignores them; RabbitMQ refuses the frame)."""
    offset, processing_bitset = 0, False
    for argument in method.__slots__:
        data_type = method.amqp_type(argument)
        if processing_bitset and (data_type != "bit" or offset == 8):
            data = data[1:]
            offset = 0
            processing_bitset = False
        consumed, value = decode.by_type(data, data_type, offset)
        if data_type == "bit":
            offset += 1
            processing_bitset = True
            consumed = 0
        setattr(method, argument, value)
        if consumed:
            data = data[consumed:]
    return len(data) - 1 if processing_bitset else len(data)  # the last bits' byte was read, not consumed


# The methods with field-table arguments a client sends, by index.
_TABLE_FIELDS = ("arguments", "client_properties", "server_properties")
_TABLE_ARGUMENTS: dict[int, tuple[str, ...]] = {
    index: names
    for index, cls in commands.INDEX_MAPPING.items()
    if (names := tuple(n for n in getattr(cls, "__slots__", ()) if n in _TABLE_FIELDS))
}


def table_depth(value: object) -> int:
    """How deep tables and arrays nest in ``value`` (0 for a scalar), without recursion."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: object = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        depth += 1
        if depth > deepest:
            deepest = depth
            if deepest > MAX_TABLE_DEPTH:
                return deepest
        stack.extend((child, depth) for child in children)  # type: ignore[attr-defined]
    return deepest


# Replies that carry a client's names. pamqp checks them against the spec's
# domain (``^[a-zA-Z0-9-_.:]*$``, exchange names at most 127 characters) when
# one is built and again when it is encoded; RabbitMQ, and so we, accept any
# UTF-8 name up to 255 bytes. Building queue.declare-ok for a queue named
# "очередь" raised ValueError after the queue existed, and basic.return for a
# publish to an exchange named "ex é" did the same (541s found by
# bench/fuzz.py). The node only ever builds these replies (a client sends none
# of them), so their validation is switched off here, in one place, rather
# than at every call site in the channel.
REPLIES_WITH_CLIENT_NAMES: tuple[type[Method], ...] = (
    commands.Queue.DeclareOk, commands.Basic.Return, commands.Basic.Deliver, commands.Basic.GetOk,
)


def _no_validation(self: Method) -> None:
    pass


for _reply in REPLIES_WITH_CLIENT_NAMES:
    _reply.validate = _no_validation  # type: ignore[method-assign]


def encode_method(channel: int, method: Method) -> bytes:
    return pamqp_frame.marshal(method, channel)


def decode_publish(payload: bytes | bytearray, pos: int = 0, end: int = -1) -> tuple[str, str, bool, bool]:
    """Basic.Publish arguments (exchange, routing key, mandatory, immediate) from the
    method payload starting at ``pos`` (class and method ids included)."""
    if end < 0:
        end = len(payload)
    pos += 6  # class, method, reserved ticket
    n = payload[pos]
    exchange = payload[pos + 1 : pos + 1 + n].decode("utf-8") if n else ""
    pos += 1 + n
    n = payload[pos]
    routing_key = payload[pos + 1 : pos + 1 + n].decode("utf-8")
    pos += 1 + n
    if pos >= end:
        raise IndexError("basic.publish arguments are truncated")
    if pos + 1 != end:
        raise TrailingBytes(f"basic.publish frame has {end - pos - 1} bytes after its arguments")
    bits = payload[pos]
    return exchange, routing_key, bool(bits & 1), bool(bits & 2)


def decode_ack(payload: bytes) -> tuple[int, bool]:
    if len(payload) > 4 + _ack.size:
        raise TrailingBytes(f"basic.ack frame has {len(payload) - 4 - _ack.size} bytes after its arguments")
    tag, bits = _ack.unpack_from(payload, 4)
    return tag, bool(bits & 1)


def _shortstr(value: str) -> bytes:
    raw = value.encode("utf-8")
    return bytes((len(raw),)) + raw


# Bodies above this are written as pieces (frame heads and views of the body)
# rather than copied into new frames: each 1 MiB copy also costs page faults,
# and the copies were most of the time per large message.
LARGE_BODY = 64 * 1024


def content_pieces(channel: int, props: bytes, body: bytes, frame_max: int) -> list[bytes | memoryview]:
    """Header and body frames as buffers to write in order, the body never copied."""
    out: list[bytes | memoryview] = [
        _header_frame_head.pack(FRAME_HEADER, channel, 12 + len(props), 60, 0, len(body)) + props + FRAME_END_BYTE
    ]
    limit = frame_max - FRAME_OVERHEAD
    view = memoryview(body)
    for start in range(0, len(body), limit):
        chunk = view[start : start + limit]
        out.append(frame_head.pack(FRAME_BODY, channel, len(chunk)))
        out.append(chunk)
        out.append(FRAME_END_BYTE)
    return out


def content_frames(channel: int, props: bytes, body: bytes, frame_max: int) -> list[bytes]:
    """The content header and body frames of a message, bodies split by ``frame_max``."""
    out = [
        _header_frame_head.pack(FRAME_HEADER, channel, 12 + len(props), 60, 0, len(body)) + props + FRAME_END_BYTE
    ]
    if not body:
        return out
    limit = frame_max - FRAME_OVERHEAD
    if len(body) <= limit:
        out.append(frame_head.pack(FRAME_BODY, channel, len(body)) + body + FRAME_END_BYTE)
        return out
    view = memoryview(body)
    for start in range(0, len(body), limit):
        chunk = view[start : start + limit]
        out.append(frame_head.pack(FRAME_BODY, channel, len(chunk)) + chunk.tobytes() + FRAME_END_BYTE)
    return out


def deliver_frame(
    channel: int,
    consumer_tag_raw: bytes,
    delivery_tag: int,
    redelivered: bool,
    exchange: str,
    routing_key: str,
) -> bytes:
    """Basic.Deliver; ``consumer_tag_raw`` is the tag already as a shortstr."""
    args = (
        consumer_tag_raw
        + _deliver_tail.pack(delivery_tag, 1 if redelivered else 0)
        + _shortstr(exchange)
        + _shortstr(routing_key)
    )
    return _method_head.pack(FRAME_METHOD, channel, 4 + len(args), 60, 60) + args + FRAME_END_BYTE


def get_ok_frame(
    channel: int, delivery_tag: int, redelivered: bool, exchange: str, routing_key: str, message_count: int
) -> bytes:
    args = (
        _deliver_tail.pack(delivery_tag, 1 if redelivered else 0)
        + _shortstr(exchange)
        + _shortstr(routing_key)
        + _u32.pack(message_count)
    )
    return _method_head.pack(FRAME_METHOD, channel, 4 + len(args), 60, 71) + args + FRAME_END_BYTE


def shortstr(value: str) -> bytes:
    return _shortstr(value)


def delivery(
    channel: int, consumer_tag_raw: bytes, delivery_tag: int, redelivered: bool, route_raw: bytes,
    content: bytes,
) -> bytes:
    """Basic.Deliver plus the message's content frames, as one buffer.

    ``route_raw`` is exchange and routing key already as shortstrs and
    ``content`` the header and body frames for this channel (both cached on the
    message), so a delivery costs one pack and one join.
    """
    return b"".join((
        _method_head.pack(FRAME_METHOD, channel, 13 + len(consumer_tag_raw) + len(route_raw), 60, 60),
        consumer_tag_raw,
        _deliver_tail.pack(delivery_tag, redelivered),
        route_raw,
        FRAME_END_BYTE,
        content,
    ))
