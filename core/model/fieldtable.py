"""AMQP field tables (RabbitMQ's errata of 0-9-1), decoded and encoded.

The core owns the canonical message format (message properties are stored and
forwarded in their AMQP encoding), so it needs this codec itself rather than
borrowing the front end's. Type tags follow RabbitMQ, which is what every
client speaks: t b B s u I i l f d D S A T F V x.
"""

from __future__ import annotations

import datetime
import decimal
import struct
from typing import Any

FieldTable = dict[str, Any]

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


class FieldTableError(ValueError):
    """A table that does not decode: bad type tag or truncated data."""


def _long_string(raw: bytes) -> str | bytes:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


def decode_value(data: bytes, pos: int) -> tuple[Any, int]:
    """Decode one tagged value at ``pos``; return it and the next position."""
    try:
        tag = data[pos]
        pos += 1
        if tag == 0x53:  # S long string
            (n,) = _u32.unpack_from(data, pos)
            end = pos + 4 + n
            if end > len(data):
                raise FieldTableError("long string runs past the end of the table")
            return _long_string(bytes(data[pos + 4 : end])), end
        if tag == 0x49:  # I signed 32
            return _i32.unpack_from(data, pos)[0], pos + 4
        if tag == 0x46:  # F nested table
            return decode_table(data, pos)
        if tag == 0x74:  # t boolean
            return data[pos] != 0, pos + 1
        if tag == 0x6C:  # l signed 64
            return _i64.unpack_from(data, pos)[0], pos + 8
        if tag == 0x41:  # A array
            (n,) = _u32.unpack_from(data, pos)
            pos += 4
            end = pos + n
            if end > len(data):
                raise FieldTableError("array runs past the end of the table")
            items = []
            while pos < end:
                value, pos = decode_value(data, pos)
                items.append(value)
            return items, pos
        if tag == 0x62:  # b signed 8
            return _i8.unpack_from(data, pos)[0], pos + 1
        if tag == 0x42:  # B unsigned 8
            return data[pos], pos + 1
        if tag == 0x73:  # s signed 16
            return _i16.unpack_from(data, pos)[0], pos + 2
        if tag == 0x75:  # u unsigned 16
            return _u16.unpack_from(data, pos)[0], pos + 2
        if tag == 0x69:  # i unsigned 32
            return _u32.unpack_from(data, pos)[0], pos + 4
        if tag == 0x66:  # f float
            return _f32.unpack_from(data, pos)[0], pos + 4
        if tag == 0x64:  # d double
            return _f64.unpack_from(data, pos)[0], pos + 8
        if tag == 0x44:  # D decimal: scale octet, signed 32 value
            scale = data[pos]
            (raw,) = _i32.unpack_from(data, pos + 1)
            return decimal.Decimal(raw).scaleb(-scale), pos + 5
        if tag == 0x54:  # T timestamp, seconds
            (secs,) = _u64.unpack_from(data, pos)
            return datetime.datetime.fromtimestamp(secs, tz=datetime.UTC), pos + 8
        if tag == 0x56:  # V void
            return None, pos
        if tag == 0x78:  # x byte array
            (n,) = _u32.unpack_from(data, pos)
            end = pos + 4 + n
            if end > len(data):
                raise FieldTableError("byte array runs past the end of the table")
            return bytearray(data[pos + 4 : end]), end
    except (struct.error, IndexError) as exc:
        raise FieldTableError("field table is truncated") from exc
    raise FieldTableError(f"unknown field type tag {chr(tag)!r}")


def decode_table(data: bytes, pos: int = 0) -> tuple[FieldTable, int]:
    """Decode a length-prefixed table at ``pos``; return it and the next position."""
    try:
        (n,) = _u32.unpack_from(data, pos)
    except struct.error as exc:
        raise FieldTableError("field table is truncated") from exc
    pos += 4
    end = pos + n
    if end > len(data):
        raise FieldTableError("field table runs past the end of the frame")
    table: FieldTable = {}
    while pos < end:
        klen = data[pos]
        key = bytes(data[pos + 1 : pos + 1 + klen]).decode("utf-8", "replace")
        value, pos = decode_value(data, pos + 1 + klen)
        table[key] = value
    if pos != end:
        raise FieldTableError("field table length does not match its content")
    return table, end


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
