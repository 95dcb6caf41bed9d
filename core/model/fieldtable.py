"""AMQP field tables (RabbitMQ's errata of 0-9-1), decoded and encoded.

The core owns the canonical message format (message properties are stored and
forwarded in their AMQP encoding), so it needs this codec itself rather than
borrowing the front end's. Type tags follow RabbitMQ, which is what every
client speaks: t b B s u I i l f d D S A T F V x (and the spec grammar's U and L).

Decoding is iterative (an explicit stack of open tables and arrays), so no
input can exhaust Python's stack, and every read is checked against the end
of the table or array that holds it, not only against the end of the data.
Nesting deeper than ``MAX_DEPTH`` is refused. Any malformed input raises
``FieldTableError``, a 502 SYNTAX_ERROR (docs/notes/publish.md).
"""

from __future__ import annotations

import datetime
import decimal
import struct
from typing import Any

from core.model.errors import SyntaxError_

FieldTable = dict[str, Any]

# Tables and arrays open at once, counting the outermost table as 1. Real
# headers nest a few levels (x-death: headers > array > table > array of
# routing keys = 4); 64 leaves room for any application's own structure while
# keeping every accepted value safe for recursive encoders: ours
# (encode_value, used when dead-lettering rewrites headers) and the clients'
# (pika, py-amqp and amqplib decode recursively) each spend a few frames a
# level, far below Python's default limit of 1,000.
MAX_DEPTH = 64

# The largest timestamp a datetime can hold (9999-12-31T23:59:59Z); larger
# ones are refused rather than failing later in whoever decodes them.
MAX_TIMESTAMP = 253402300799

_u8 = struct.Struct(">B")
_i8 = struct.Struct(">b")
_i16 = struct.Struct(">h")
_u16 = struct.Struct(">H")
_i32 = struct.Struct(">i")
_u32 = struct.Struct(">I")
_i64 = struct.Struct(">q")
_u64 = struct.Struct(">Q")
_f32 = struct.Struct(">f")
_f64 = struct.Struct(">d")

# Fixed-size scalars: tag -> (size, decoder of the bytes at pos).
_FIXED: dict[int, tuple[int, struct.Struct | None]] = {
    0x74: (1, None),  # t boolean
    0x62: (1, _i8),  # b signed 8
    0x42: (1, None),  # B unsigned 8
    0x73: (2, _i16),  # s signed 16
    0x75: (2, _u16),  # u unsigned 16
    0x49: (4, _i32),  # I signed 32
    0x69: (4, _u32),  # i unsigned 32
    0x6C: (8, _i64),  # l signed 64
    0x66: (4, _f32),  # f float
    0x64: (8, _f64),  # d double
    0x44: (5, None),  # D decimal: scale octet, signed 32 value
    0x54: (8, _u64),  # T timestamp, seconds
    0x56: (0, None),  # V void
    # Only in the 0-9-1 spec grammar (no RabbitMQ client sends them), accepted
    # because a message carrying them is passed through byte for byte.
    0x55: (2, _i16),  # U signed 16
    0x4C: (8, _i64),  # L signed 64
}
_TABLE, _ARRAY, _LONGSTR, _BYTES = 0x46, 0x41, 0x53, 0x78


class FieldTableError(SyntaxError_, ValueError):
    """A table that does not decode (502 SYNTAX_ERROR), or a value that does not encode."""


def _long_string(raw: bytes) -> str | bytes:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


def _scalar(data: bytes, tag: int, pos: int, limit: int) -> tuple[Any, int]:
    """A value that is not a table or an array, read at ``pos`` (after its tag) within ``limit``."""
    fixed = _FIXED.get(tag)
    if fixed is not None:
        size, codec = fixed
        end = pos + size
        if end > limit:
            raise FieldTableError("field table is truncated")
        if tag == 0x54:
            (secs,) = _u64.unpack_from(data, pos)
            if secs > MAX_TIMESTAMP:
                raise FieldTableError(f"timestamp {secs} is out of range")
            return datetime.datetime.fromtimestamp(secs, tz=datetime.UTC), end
        if codec is not None:
            return codec.unpack_from(data, pos)[0], end
        if tag == 0x74:
            return data[pos] != 0, end
        if tag == 0x42:
            return data[pos], end
        if tag == 0x44:
            scale = data[pos]
            (raw,) = _i32.unpack_from(data, pos + 1)
            try:
                return decimal.Decimal(raw).scaleb(-scale), end
            except (decimal.DecimalException, ValueError) as exc:  # cannot happen in the default context
                raise FieldTableError(f"decimal does not decode: {exc}") from exc
        return None, end  # V void
    if tag == _LONGSTR or tag == _BYTES:
        if pos + 4 > limit:
            raise FieldTableError("field table is truncated")
        (n,) = _u32.unpack_from(data, pos)
        end = pos + 4 + n
        if end > limit:
            what = "long string" if tag == _LONGSTR else "byte array"
            raise FieldTableError(f"{what} runs past the end of its table")
        raw = bytes(data[pos + 4 : end])
        return (_long_string(raw) if tag == _LONGSTR else bytearray(raw)), end
    raise FieldTableError(f"unknown field type tag {chr(tag)!r}")


def _walk(data: bytes, pos: int, first: int | None) -> tuple[Any, int]:
    """Decode a table (``first`` None: at ``pos``, its length first) or one tagged value.

    One loop over an explicit stack of open containers: no input can exhaust
    Python's stack. ``check_table`` applies the same rules without building.
    """
    size = len(data)
    if first is None:
        tag = _TABLE
    else:
        tag = first
        pos += 1
    if tag != _TABLE and tag != _ARRAY:
        return _scalar(data, tag, pos, size)
    if pos + 4 > size:
        raise FieldTableError("field table is truncated")
    end = pos + 4 + _u32.unpack_from(data, pos)[0]
    if end > size:
        what = "field table" if tag == _TABLE else "array"
        raise FieldTableError(f"{what} runs past the end of the frame")
    pos += 4
    root: Any = {} if tag == _TABLE else []
    # (container, is a table, end of its bytes)
    stack: list[tuple[Any, bool, int]] = [(root, tag == _TABLE, end)]
    while stack:
        container, is_table, limit = stack[-1]
        if pos >= limit:
            if pos != limit:  # cannot happen: every read is checked against limit
                raise FieldTableError("field table length does not match its content")
            stack.pop()
            continue
        key = ""
        if is_table:
            klen = data[pos]
            kend = pos + 1 + klen
            if kend >= limit:  # the key, then at least a tag
                raise FieldTableError("field table key runs past the end of its table")
            key = bytes(data[pos + 1 : kend]).decode("utf-8", "replace")
            pos = kend
        tag = data[pos]
        pos += 1
        if tag == _TABLE or tag == _ARRAY:
            if len(stack) >= MAX_DEPTH:
                raise FieldTableError(f"field tables and arrays nest deeper than {MAX_DEPTH}")
            if pos + 4 > limit:
                raise FieldTableError("field table is truncated")
            inner_end = pos + 4 + _u32.unpack_from(data, pos)[0]
            if inner_end > limit:
                what = "nested table" if tag == _TABLE else "array"
                raise FieldTableError(f"{what} runs past the end of its table")
            pos += 4
            value: Any = {} if tag == _TABLE else []
            stack.append((value, tag == _TABLE, inner_end))
        else:
            value, pos = _scalar(data, tag, pos, limit)
        if is_table:
            container[key] = value
        else:
            container.append(value)
    return root, end


def decode_value(data: bytes, pos: int) -> tuple[Any, int]:
    """Decode one tagged value at ``pos``; return it and the next position."""
    if pos >= len(data):
        raise FieldTableError("field table is truncated")
    return _walk(data, pos, data[pos])


def decode_table(data: bytes, pos: int = 0) -> tuple[FieldTable, int]:
    """Decode a length-prefixed table at ``pos``; return it and the next position."""
    table, end = _walk(data, pos, None)
    return table, end


# check_table's view of a tag: a fixed size (0..8), or one of these, or -1 (unknown).
_K_LEN, _K_TABLE, _K_ARRAY, _K_STAMP = 100, 200, 201, 300
_KIND = [-1] * 256
for _tag, (_size, _) in _FIXED.items():
    _KIND[_tag] = _size
_KIND[_LONGSTR] = _KIND[_BYTES] = _K_LEN
_KIND[_TABLE], _KIND[_ARRAY], _KIND[0x54] = _K_TABLE, _K_ARRAY, _K_STAMP


def check_table(data: bytes, pos: int = 0) -> int:
    """Validate the length-prefixed table at ``pos`` without building it; return its end.

    Refuses exactly what ``decode_table`` refuses (tests/test_field_validation.py
    checks that on random and mutated input), with no allocation beyond its
    stack: the publish path runs it on every message that has headers. Its own
    loop: a tag-indexed list and no call per value make it 1.5-6x faster than
    decoding (docs/notes/publish.md).
    """
    size = len(data)
    if pos + 4 > size:
        raise FieldTableError("field table is truncated")
    unpack = _u32.unpack_from
    end = pos + 4 + unpack(data, pos)[0]
    if end > size:
        raise FieldTableError("field table runs past the end of the frame")
    pos += 4
    ends = [end]
    tables = [True]
    limit, is_table = end, True
    kinds = _KIND
    while True:
        if pos >= limit:
            ends.pop()
            tables.pop()
            if not ends:
                return end
            limit, is_table = ends[-1], tables[-1]
            continue
        if is_table:
            pos += 1 + data[pos]
            if pos >= limit:  # the key, then at least a tag
                raise FieldTableError("field table key runs past the end of its table")
        kind = kinds[data[pos]]
        pos += 1
        if kind < _K_LEN:
            if kind < 0:
                raise FieldTableError(f"unknown field type tag {chr(data[pos - 1])!r}")
            pos += kind
            if pos > limit:
                raise FieldTableError("field table is truncated")
        elif kind == _K_LEN:
            if pos + 4 > limit:
                raise FieldTableError("field table is truncated")
            pos += 4 + unpack(data, pos)[0]
            if pos > limit:
                raise FieldTableError("long string or byte array runs past the end of its table")
        elif kind == _K_STAMP:
            if pos + 8 > limit:
                raise FieldTableError("field table is truncated")
            secs = _u64.unpack_from(data, pos)[0]
            if secs > MAX_TIMESTAMP:
                raise FieldTableError(f"timestamp {secs} is out of range")
            pos += 8
        else:
            if len(ends) >= MAX_DEPTH:
                raise FieldTableError(f"field tables and arrays nest deeper than {MAX_DEPTH}")
            if pos + 4 > limit:
                raise FieldTableError("field table is truncated")
            inner = pos + 4 + unpack(data, pos)[0]
            if inner > limit:
                raise FieldTableError("nested table or array runs past the end of its table")
            pos += 4
            limit, is_table = inner, kind == _K_TABLE
            ends.append(limit)
            tables.append(is_table)


def _encode_int(value: int) -> bytes:
    if -(2**31) <= value < 2**31:
        return b"I" + _i32.pack(value)
    if -(2**63) <= value < 2**63:
        return b"l" + _i64.pack(value)
    raise FieldTableError(f"integer {value} does not fit in 64 bits")


def encode_value(value: Any) -> bytes:
    try:
        return _encode_value(value)
    except (struct.error, ValueError, OverflowError, decimal.InvalidOperation) as exc:
        if isinstance(exc, FieldTableError):
            raise
        raise FieldTableError(f"cannot encode {value!r} in a field table: {exc}") from exc


def _encode_value(value: Any) -> bytes:
    if isinstance(value, bool):
        return b"t" + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        return _encode_int(value)
    if isinstance(value, str):
        raw = value.encode("utf-8")
        return b"S" + _u32.pack(len(raw)) + raw
    if isinstance(value, bytearray):
        return b"x" + _u32.pack(len(value)) + bytes(value)
    if isinstance(value, bytes):
        return b"S" + _u32.pack(len(value)) + value
    if isinstance(value, dict):
        return b"F" + encode_table(value)
    if isinstance(value, (list, tuple)):
        inner = b"".join(encode_value(v) for v in value)
        return b"A" + _u32.pack(len(inner)) + inner
    if isinstance(value, float):
        return b"d" + _f64.pack(value)
    if isinstance(value, decimal.Decimal):
        sign, digits, exponent = value.as_tuple()
        scale = -int(exponent) if isinstance(exponent, int) and exponent < 0 else 0
        unscaled = int(value.scaleb(scale))
        return b"D" + _u8.pack(scale) + _i32.pack(unscaled)
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.UTC)
        return b"T" + _u64.pack(int(value.timestamp()))
    if value is None:
        return b"V"
    raise FieldTableError(f"cannot encode {type(value).__name__} in a field table")


def encode_table(table: FieldTable | None) -> bytes:
    """Encode a table with its 4-byte length prefix."""
    if not table:
        return b"\x00\x00\x00\x00"
    parts = []
    for key, value in table.items():
        raw_key = key.encode("utf-8")
        if len(raw_key) > 255:
            raise FieldTableError(f"field table key too long: {key[:40]!r}...")
        parts.append(_u8.pack(len(raw_key)) + raw_key + encode_value(value))
    body = b"".join(parts)
    return _u32.pack(len(body)) + body
