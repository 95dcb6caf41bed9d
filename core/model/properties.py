"""Message properties kept in their AMQP basic-class encoding.

A message's properties are stored, forwarded and delivered as the bytes the
publisher sent (flags + property list), so the hot path never re-encodes
them. ``scan`` pulls out only the few fields the broker acts on; ``decode`` /
``encode`` give the whole set for the slower paths (headers exchange, dead
lettering, the native API).
"""

from __future__ import annotations

import struct
from typing import Any

from core.model.errors import SyntaxError_
from core.model.fieldtable import FieldTableError, check_table, decode_table, encode_table

_u16 = struct.Struct(">H")
_u64 = struct.Struct(">Q")

# (flag bit, name, kind) in wire order.
FIELDS: tuple[tuple[int, str, str], ...] = (
    (0x8000, "content_type", "shortstr"),
    (0x4000, "content_encoding", "shortstr"),
    (0x2000, "headers", "table"),
    (0x1000, "delivery_mode", "octet"),
    (0x0800, "priority", "octet"),
    (0x0400, "correlation_id", "shortstr"),
    (0x0200, "reply_to", "shortstr"),
    (0x0100, "expiration", "shortstr"),
    (0x0080, "message_id", "shortstr"),
    (0x0040, "timestamp", "timestamp"),
    (0x0020, "type", "shortstr"),
    (0x0010, "user_id", "shortstr"),
    (0x0008, "app_id", "shortstr"),
    (0x0004, "cluster_id", "shortstr"),
)

EMPTY = b"\x00\x00"


class PropertiesError(SyntaxError_, ValueError):
    """Properties that do not decode (502 SYNTAX_ERROR), or do not encode."""


class PropertySummary:
    """What the broker itself needs from a message's properties."""

    __slots__ = ("delivery_mode", "priority", "expiration", "user_id", "headers_at", "reply_to_direct")

    def __init__(self) -> None:
        self.delivery_mode = 0
        self.priority = 0
        self.expiration: str | None = None
        self.user_id: str | None = None
        # Offset of the headers table in the raw bytes, decoded only on demand.
        self.headers_at = -1
        # reply_to is amq.rabbitmq.reply-to: the front end rewrites it (direct reply-to).
        self.reply_to_direct = False


_NO_PROPERTIES = PropertySummary()


_present_cache: dict[int, tuple[tuple[int, str, str], ...]] = {}


def _present(flags: int) -> tuple[tuple[int, str, str], ...]:
    """The fields a flags word announces, in wire order (cached: few distinct words occur)."""
    fields = _present_cache.get(flags)
    if fields is None:
        fields = _present_cache[flags] = tuple(f for f in FIELDS if flags & f[0])
    return fields


def scan(raw: bytes) -> PropertySummary:
    """Read delivery mode, priority, expiration, user-id and where headers are.

    Hand-written because it runs once per published message: pamqp's full
    decode costs several microseconds that most messages do not need. Only the
    fields present are visited.
    """
    if raw == EMPTY:
        return _NO_PROPERTIES
    try:
        (flags,) = _u16.unpack_from(raw, 0)
        if flags & 1:
            raise PropertiesError("property flags continuation is not used by the basic class")
        pos = 2
        out = PropertySummary()
        for _bit, name, kind in _present(flags):
            if kind == "shortstr":
                n = raw[pos]
                if name == "expiration":
                    out.expiration = raw[pos + 1 : pos + 1 + n].decode("utf-8", "replace")
                elif name == "user_id":
                    out.user_id = raw[pos + 1 : pos + 1 + n].decode("utf-8", "replace")
                elif name == "reply_to" and n == 21 and raw[pos + 1 : pos + 22] == b"amq.rabbitmq.reply-to":
                    out.reply_to_direct = True
                pos += 1 + n
            elif kind == "octet":
                if name == "delivery_mode":
                    out.delivery_mode = raw[pos]
                else:
                    out.priority = raw[pos]
                pos += 1
            elif kind == "table":
                out.headers_at = pos
                pos += 4 + int.from_bytes(raw[pos : pos + 4], "big")
            else:  # timestamp
                pos += 8
        if pos > len(raw):
            raise PropertiesError("content header properties are truncated")
        return out
    except (IndexError, struct.error) as exc:
        raise PropertiesError("content header properties are truncated") from exc



_scanned: dict[bytes, PropertySummary] = {}


def scan_cached(raw: bytes) -> PropertySummary:
    """``scan``, remembered by encoding: for messages read back from a store (paging, streams), where
    most messages of a queue carry the same few property encodings. At most 4096 are kept."""
    summary = _scanned.get(raw)
    if summary is None:
        if len(_scanned) > 4096:
            _scanned.clear()
        summary = _scanned[raw] = scan(raw)
    return summary

def check(raw: bytes, summary: PropertySummary) -> None:
    """Refuse properties whose headers table does not decode (``scan`` checked the rest).

    Run once when a message is accepted (core/engine/publish.py), so nothing
    later (routing, dead-lettering, expiry, the stores, consumers) meets
    malformed bytes. Without headers it costs one comparison.
    """
    if summary.headers_at >= 0:
        try:
            check_table(raw, summary.headers_at)
        except FieldTableError as exc:
            raise PropertiesError(f"headers do not decode: {exc.text}") from exc


def headers_of(raw: bytes, summary: PropertySummary) -> dict[str, Any]:
    if summary.headers_at < 0:
        return {}
    try:
        return decode_table(raw, summary.headers_at)[0]
    except FieldTableError as exc:
        raise PropertiesError(str(exc)) from exc


def decode(raw: bytes) -> dict[str, Any]:
    """All properties as a dict of the names in ``FIELDS``."""
    out: dict[str, Any] = {}
    try:
        (flags,) = _u16.unpack_from(raw, 0)
        pos = 2
        for bit, name, kind in FIELDS:
            if not flags & bit:
                continue
            if kind == "shortstr":
                n = raw[pos]
                if pos + 1 + n > len(raw):
                    raise IndexError(f"{name} runs past the end of the properties")
                out[name] = raw[pos + 1 : pos + 1 + n].decode("utf-8", "replace")
                pos += 1 + n
            elif kind == "octet":
                out[name] = raw[pos]
                pos += 1
            elif kind == "table":
                out[name], pos = decode_table(raw, pos)
            else:
                (out[name],) = _u64.unpack_from(raw, pos)
                pos += 8
    except (IndexError, struct.error, FieldTableError) as exc:
        raise PropertiesError(f"content header properties do not decode: {exc}") from exc
    return out


def encode(props: dict[str, Any]) -> bytes:
    """Encode a dict of properties (names as in ``FIELDS``; timestamp in seconds)."""
    flags = 0
    parts: list[bytes] = []
    for bit, name, kind in FIELDS:
        value = props.get(name)
        if value is None:
            continue
        flags |= bit
        if kind == "shortstr":
            raw = str(value).encode("utf-8")
            if len(raw) > 255:
                raise PropertiesError(f"property {name} is longer than 255 bytes")
            parts.append(bytes((len(raw),)) + raw)
        elif kind == "octet":
            parts.append(bytes((int(value) & 0xFF,)))
        elif kind == "table":
            parts.append(encode_table(value))
        else:
            try:
                parts.append(_u64.pack(int(value)))
            except struct.error as exc:
                raise PropertiesError(f"property {name} {value} does not fit in 64 bits") from exc
    return _u16.pack(flags) + b"".join(parts)


def with_headers(raw: bytes, headers: dict[str, Any]) -> bytes:
    """The same properties with the headers table replaced."""
    props = decode(raw)
    props["headers"] = headers
    return encode(props)
