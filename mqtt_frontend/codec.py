"""MQTT packets: the fixed header, the remaining length, v5 properties, and each packet kind.

Parsing is strict: anything the spec calls malformed raises ``MalformedPacket``
(v5 reason 0x81) and anything it calls a protocol error ``ProtocolError``
(0x82); the connection closes on either. Nothing here keeps state between
packets except what the caller passes in (the protocol level).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

# Packet types (the high nibble of the first byte).
CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, PINGREQ, PINGRESP, DISCONNECT, AUTH = 8, 9, 10, 11, 12, 13, 14, 15
NAMES = {1: "CONNECT", 2: "CONNACK", 3: "PUBLISH", 4: "PUBACK", 5: "PUBREC", 6: "PUBREL", 7: "PUBCOMP",
         8: "SUBSCRIBE", 9: "SUBACK", 10: "UNSUBSCRIBE", 11: "UNSUBACK", 12: "PINGREQ", 13: "PINGRESP",
         14: "DISCONNECT", 15: "AUTH"}
# The flags the spec fixes for every type but PUBLISH (MQTT-2.2.2-1).
FIXED_FLAGS = {1: 0, 2: 0, 4: 0, 5: 0, 6: 2, 7: 0, 8: 2, 9: 0, 10: 2, 11: 0, 12: 0, 13: 0, 14: 0, 15: 0}

MAX_REMAINING = 268_435_455  # four bytes of variable byte integer
V311, V5 = 4, 5

# v5 reason codes used here.
SUCCESS = 0x00
GRANTED_QOS_1 = 0x01
DISCONNECT_WITH_WILL = 0x04
NO_SUBSCRIPTION_EXISTED = 0x11
UNSPECIFIED_ERROR = 0x80
MALFORMED = 0x81
PROTOCOL_ERROR = 0x82
IMPLEMENTATION_SPECIFIC = 0x83
UNSUPPORTED_VERSION = 0x84
CLIENT_ID_NOT_VALID = 0x85
BAD_CREDENTIALS = 0x86
NOT_AUTHORIZED = 0x87
SERVER_UNAVAILABLE = 0x88
SERVER_BUSY = 0x89
SERVER_SHUTTING_DOWN = 0x8B
KEEP_ALIVE_TIMEOUT = 0x8D
SESSION_TAKEN_OVER = 0x8E
TOPIC_FILTER_INVALID = 0x8F
TOPIC_NAME_INVALID = 0x90
PACKET_ID_NOT_FOUND = 0x92
RECEIVE_MAXIMUM_EXCEEDED = 0x93
TOPIC_ALIAS_INVALID = 0x94
PACKET_TOO_LARGE = 0x95
QUOTA_EXCEEDED = 0x97
ADMINISTRATIVE_ACTION = 0x98
PAYLOAD_FORMAT_INVALID = 0x99
QOS_NOT_SUPPORTED = 0x9B
SHARED_SUBSCRIPTIONS_NOT_SUPPORTED = 0x9E
SUBSCRIPTION_IDS_NOT_SUPPORTED = 0xA1
WILDCARDS_NOT_SUPPORTED = 0xA2
# MQTT 3.1.1 CONNACK return codes, by the v5 reason that stands for them.
V311_CONNACK = {SUCCESS: 0, UNSUPPORTED_VERSION: 1, CLIENT_ID_NOT_VALID: 2, SERVER_UNAVAILABLE: 3,
                BAD_CREDENTIALS: 4, NOT_AUTHORIZED: 5}


class PacketError(Exception):
    """A packet the connection must close for; ``reason`` is the v5 reason code it closes with."""

    reason = PROTOCOL_ERROR

    def __init__(self, text: str, reason: int | None = None) -> None:
        super().__init__(text)
        self.text = text
        if reason is not None:
            self.reason = reason


class MalformedPacket(PacketError):
    reason = MALFORMED


class ProtocolError(PacketError):
    reason = PROTOCOL_ERROR


# --------------------------------------------------------------- primitives
def encode_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def decode_remaining(buf: bytes | bytearray, pos: int) -> tuple[int, int] | None:
    """(remaining length, where the variable header starts), or None if the length is not all here yet."""
    value = 0
    shift = 0
    for i in range(4):
        if pos + i >= len(buf):
            return None
        byte = buf[pos + i]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos + i + 1
        shift += 7
    raise MalformedPacket("remaining length longer than four bytes (over 268,435,455)")


_u16 = struct.Struct(">H")
_u32 = struct.Struct(">I")


class Reader:
    """Reads one packet's bytes; running past its end is a malformed packet."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes, pos: int = 0) -> None:
        self.data = data
        self.pos = pos

    def left(self) -> int:
        return len(self.data) - self.pos

    def _need(self, n: int) -> None:
        if self.pos + n > len(self.data):
            raise MalformedPacket("packet shorter than its fields")

    def byte(self) -> int:
        self._need(1)
        b = self.data[self.pos]
        self.pos += 1
        return b

    def u16(self) -> int:
        self._need(2)
        (v,) = _u16.unpack_from(self.data, self.pos)
        self.pos += 2
        return int(v)

    def u32(self) -> int:
        self._need(4)
        (v,) = _u32.unpack_from(self.data, self.pos)
        self.pos += 4
        return int(v)

    def varint(self) -> int:
        got = decode_remaining(self.data, self.pos)
        if got is None:
            raise MalformedPacket("variable byte integer runs past the packet")
        value, self.pos = got
        return value

    def binary(self) -> bytes:
        n = self.u16()
        self._need(n)
        raw = self.data[self.pos:self.pos + n]
        self.pos += n
        return bytes(raw)

    def utf8(self) -> str:
        return decode_utf8(self.binary())

    def rest(self) -> bytes:
        raw = self.data[self.pos:]
        self.pos = len(self.data)
        return bytes(raw)


def decode_utf8(raw: bytes) -> str:
    """An MQTT UTF-8 string: well-formed, no U+0000, no surrogates (MQTT-1.5.4-1/2)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedPacket(f"string is not valid UTF-8: {exc.reason}") from exc
    if "\x00" in text:
        raise MalformedPacket("string contains U+0000")
    return text


def utf8(text: str) -> bytes:
    raw = text.encode("utf-8")
    return _u16.pack(len(raw)) + raw


def binary(raw: bytes) -> bytes:
    return _u16.pack(len(raw)) + raw


# --------------------------------------------------------------- properties
# id -> (name, kind); kinds: byte, u16, u32, varint, utf8, binary, pair.
PROPERTIES: dict[int, tuple[str, str]] = {
    0x01: ("payload_format", "byte"), 0x02: ("message_expiry", "u32"), 0x03: ("content_type", "utf8"),
    0x08: ("response_topic", "utf8"), 0x09: ("correlation_data", "binary"),
    0x0B: ("subscription_id", "varint"), 0x11: ("session_expiry", "u32"),
    0x12: ("assigned_client_id", "utf8"), 0x13: ("server_keep_alive", "u16"),
    0x15: ("auth_method", "utf8"), 0x16: ("auth_data", "binary"), 0x17: ("request_problem_info", "byte"),
    0x18: ("will_delay", "u32"), 0x19: ("request_response_info", "byte"), 0x1A: ("response_info", "utf8"),
    0x1C: ("server_reference", "utf8"), 0x1F: ("reason_string", "utf8"), 0x21: ("receive_maximum", "u16"),
    0x22: ("topic_alias_maximum", "u16"), 0x23: ("topic_alias", "u16"), 0x24: ("maximum_qos", "byte"),
    0x25: ("retain_available", "byte"), 0x26: ("user_property", "pair"),
    0x27: ("maximum_packet_size", "u32"), 0x28: ("wildcard_available", "byte"),
    0x29: ("subscription_ids_available", "byte"), 0x2A: ("shared_available", "byte"),
}
BY_NAME = {name: (pid, kind) for pid, (name, kind) in PROPERTIES.items()}
# Properties that may appear more than once (kept as lists).
REPEATABLE = frozenset({"user_property", "subscription_id"})


def read_properties(r: Reader) -> dict[str, Any]:
    length = r.varint()
    if length > r.left():
        raise MalformedPacket("properties run past the packet")
    end = r.pos + length
    props: dict[str, Any] = {}
    while r.pos < end:
        pid = r.varint()
        spec = PROPERTIES.get(pid)
        if spec is None:
            raise MalformedPacket(f"unknown property identifier 0x{pid:02x}")
        name, kind = spec
        value: Any
        if kind == "byte":
            value = r.byte()
        elif kind == "u16":
            value = r.u16()
        elif kind == "u32":
            value = r.u32()
        elif kind == "varint":
            value = r.varint()
        elif kind == "utf8":
            value = r.utf8()
        elif kind == "binary":
            value = r.binary()
        else:
            value = (r.utf8(), r.utf8())
        if name in REPEATABLE:
            props.setdefault(name, []).append(value)
        elif name in props:
            raise ProtocolError(f"property {name} given twice")
        else:
            props[name] = value
    if r.pos != end:
        raise MalformedPacket("properties length does not match their contents")
    return props


def encode_properties(props: dict[str, Any]) -> bytes:
    out = bytearray()
    for name, value in props.items():
        if value is None:
            continue
        pid, kind = BY_NAME[name]
        for v in (value if name in REPEATABLE else (value,)):
            out += encode_varint(pid)
            if kind == "byte":
                out.append(v)
            elif kind == "u16":
                out += _u16.pack(v)
            elif kind == "u32":
                out += _u32.pack(v)
            elif kind == "varint":
                out += encode_varint(v)
            elif kind == "utf8":
                out += utf8(v)
            elif kind == "binary":
                out += binary(v)
            else:
                out += utf8(v[0]) + utf8(v[1])
    return encode_varint(len(out)) + bytes(out)


# ----------------------------------------------------------------- packets
@dataclass
class Will:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    properties: dict[str, Any] = field(default_factory=dict)


@dataclass
class Connect:
    protocol_name: str
    level: int
    clean: bool
    keep_alive: int
    client_id: str
    username: str | None
    password: bytes | None
    will: Will | None
    properties: dict[str, Any] = field(default_factory=dict)


@dataclass
class Publish:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    dup: bool
    packet_id: int = 0
    properties: dict[str, Any] = field(default_factory=dict)


@dataclass
class Subscription:
    filter: str
    qos: int
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0


@dataclass
class Subscribe:
    packet_id: int
    subscriptions: list[Subscription]
    properties: dict[str, Any] = field(default_factory=dict)


@dataclass
class Unsubscribe:
    packet_id: int
    filters: list[str]
    properties: dict[str, Any] = field(default_factory=dict)


@dataclass
class Ack:
    """PUBACK, PUBREC, PUBREL, PUBCOMP: a packet id, and in v5 a reason code and properties."""

    kind: int
    packet_id: int
    reason: int = SUCCESS
    properties: dict[str, Any] = field(default_factory=dict)


@dataclass
class Disconnect:
    reason: int = SUCCESS
    properties: dict[str, Any] = field(default_factory=dict)


@dataclass
class Simple:
    """PINGREQ, and AUTH (which is refused)."""

    kind: int


Packet = Connect | Publish | Subscribe | Unsubscribe | Ack | Disconnect | Simple


def parse_connect(body: bytes) -> Connect:
    r = Reader(body)
    name = r.utf8()
    level = r.byte()
    if name not in ("MQTT", "MQIsdp"):
        raise ProtocolError(f"protocol name {name!r} is not MQTT")
    flags = r.byte()
    if flags & 0x01:
        raise MalformedPacket("CONNECT reserved flag set")
    keep_alive = r.u16()
    props = read_properties(r) if level == V5 else {}
    client_id = r.utf8()
    will = None
    will_qos = (flags >> 3) & 0x03
    if flags & 0x04:
        will_props = read_properties(r) if level == V5 else {}
        will_topic = r.utf8()
        will_payload = r.binary()
        if will_qos == 3:
            raise MalformedPacket("will QoS 3")
        will = Will(will_topic, will_payload, will_qos, bool(flags & 0x20), will_props)
    elif will_qos or flags & 0x20:
        raise MalformedPacket("will QoS or retain set without a will")
    username = r.utf8() if flags & 0x80 else None
    if flags & 0x40:
        password: bytes | None = r.binary()
    else:
        password = None
    if level != V5 and password is not None and username is None:
        raise MalformedPacket("password without a user name")
    if r.left():
        raise MalformedPacket("bytes after the CONNECT payload")
    return Connect(name, level, bool(flags & 0x02), keep_alive, client_id, username, password, will, props)


def parse_publish(flags: int, body: bytes, v5: bool) -> Publish:
    """PUBLISH, the hot path: sliced by hand (a Reader costs a third more per publish)."""
    qos = (flags >> 1) & 0x03
    if qos == 3:
        raise MalformedPacket("PUBLISH with QoS 3")
    dup = bool(flags & 0x08)
    if dup and qos == 0:
        raise MalformedPacket("PUBLISH with DUP set at QoS 0")
    if len(body) < 2:
        raise MalformedPacket("packet shorter than its fields")
    end = 2 + ((body[0] << 8) | body[1])
    if end > len(body):
        raise MalformedPacket("packet shorter than its fields")
    topic = decode_utf8(body[2:end])
    packet_id = 0
    if qos:
        if end + 2 > len(body):
            raise MalformedPacket("packet shorter than its fields")
        packet_id = (body[end] << 8) | body[end + 1]
        end += 2
        if packet_id == 0:
            raise MalformedPacket("PUBLISH with packet identifier 0")
    if v5:
        r = Reader(body, end)
        props = read_properties(r)
        end = r.pos
    else:
        props = {}
    return Publish(topic, body[end:], qos, bool(flags & 0x01), dup, packet_id, props)


def parse(kind: int, flags: int, body: bytes, level: int) -> Packet:
    """One packet after CONNECT (``level``: the protocol level CONNECT negotiated)."""
    v5 = level == V5
    if kind == PUBLISH:
        return parse_publish(flags, body, v5)
    expected = FIXED_FLAGS.get(kind)
    if expected is None or flags != expected:
        raise MalformedPacket(f"{NAMES.get(kind, kind)} with invalid fixed header flags {flags:#x}")
    if kind in (PUBACK, PUBREC, PUBREL, PUBCOMP):
        r = Reader(body)
        packet_id = r.u16()
        reason = SUCCESS
        ack_props: dict[str, Any] = {}
        if v5 and r.left():
            reason = r.byte()
            if r.left():
                ack_props = read_properties(r)
        if r.left():
            raise MalformedPacket(f"bytes after the {NAMES[kind]} fields")
        return Ack(kind, packet_id, reason, ack_props)
    if kind == SUBSCRIBE:
        r = Reader(body)
        packet_id = r.u16()
        if packet_id == 0:
            raise MalformedPacket("SUBSCRIBE with packet identifier 0")
        props = read_properties(r) if v5 else {}
        subs = []
        while r.left():
            topic_filter = r.utf8()
            options = r.byte()
            if options & (0xC0 if v5 else 0xFC) or (options & 0x03) == 3 or (options >> 4) & 0x03 == 3:
                raise MalformedPacket("SUBSCRIBE with reserved option bits set")
            subs.append(Subscription(topic_filter, options & 0x03, bool(options & 0x04) and v5,
                                     bool(options & 0x08) and v5, (options >> 4) & 0x03 if v5 else 0))
        if not subs:
            raise ProtocolError("SUBSCRIBE without a topic filter")
        return Subscribe(packet_id, subs, props)
    if kind == UNSUBSCRIBE:
        r = Reader(body)
        packet_id = r.u16()
        if packet_id == 0:
            raise MalformedPacket("UNSUBSCRIBE with packet identifier 0")
        props = read_properties(r) if v5 else {}
        filters = []
        while r.left():
            filters.append(r.utf8())
        if not filters:
            raise ProtocolError("UNSUBSCRIBE without a topic filter")
        return Unsubscribe(packet_id, filters, props)
    if kind == PINGREQ:
        if body:
            raise MalformedPacket("PINGREQ with a body")
        return Simple(kind)
    if kind == DISCONNECT:
        if not v5:
            if body:
                raise MalformedPacket("DISCONNECT with a body")
            return Disconnect()
        r = Reader(body)
        reason = r.byte() if r.left() else SUCCESS
        props = read_properties(r) if r.left() else {}
        if r.left():
            raise MalformedPacket("bytes after the DISCONNECT fields")
        return Disconnect(reason, props)
    if kind == AUTH and v5:
        return Simple(kind)
    if kind == CONNECT:
        raise ProtocolError("a second CONNECT")
    raise ProtocolError(f"{NAMES.get(kind, kind)} is not sent by a client")


# ----------------------------------------------------------------- encoding
def packet(kind: int, flags: int, body: bytes) -> bytes:
    return bytes(((kind << 4) | flags,)) + encode_varint(len(body)) + body


def connack(level: int, session_present: bool, reason: int, props: dict[str, Any] | None = None) -> bytes:
    if level == V5:
        return packet(CONNACK, 0, bytes((int(session_present), reason)) + encode_properties(props or {}))
    code = V311_CONNACK.get(reason, 3 if reason >= 0x80 else 0)
    return packet(CONNACK, 0, bytes((int(session_present and code == 0), code)))


def publish(topic: str, payload: bytes, qos: int, retain: bool, dup: bool, packet_id: int, level: int,
            props: dict[str, Any] | None = None, topic_raw: bytes | None = None) -> bytes:
    head = topic_raw if topic_raw is not None else utf8(topic)
    if qos:
        head += _u16.pack(packet_id)
    if level == V5:
        head += encode_properties(props) if props else b"\x00"
    flags = (0x08 if dup else 0) | (qos << 1) | (0x01 if retain else 0)
    return bytes(((PUBLISH << 4) | flags,)) + encode_varint(len(head) + len(payload)) + head + payload


def ack(kind: int, packet_id: int, level: int, reason: int = SUCCESS, props: dict[str, Any] | None = None) -> bytes:
    body = _u16.pack(packet_id)
    if level == V5 and (reason != SUCCESS or props):
        body += bytes((reason,))
        if props:
            body += encode_properties(props)
    return packet(kind, FIXED_FLAGS[kind], body)


def suback(packet_id: int, codes: list[int], level: int, props: dict[str, Any] | None = None) -> bytes:
    body = _u16.pack(packet_id)
    if level == V5:
        body += encode_properties(props or {})
    else:
        # 3.1.1 knows granted QoS and 0x80 (failure) only.
        codes = [c if c < 0x80 else 0x80 for c in codes]
    return packet(SUBACK, 0, body + bytes(codes))


def unsuback(packet_id: int, codes: list[int], level: int) -> bytes:
    body = _u16.pack(packet_id)
    if level == V5:
        body += b"\x00" + bytes(codes)
    return packet(UNSUBACK, 0, body)


PINGRESP_PACKET = packet(PINGRESP, 0, b"")


def disconnect(reason: int, text: str | None = None) -> bytes:
    props = {"reason_string": text[:200]} if text else {}
    return packet(DISCONNECT, 0, bytes((reason,)) + encode_properties(props))
