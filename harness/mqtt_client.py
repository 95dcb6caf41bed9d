"""A client's side of MQTT for the state-machine tests: packets a client sends, and what it reads back."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from mqtt_frontend import codec


def connect(client_id: str = "c1", level: int = 4, clean: bool = True, keep_alive: int = 60,
            username: str | None = "guest", password: bytes | None = b"guest", will: codec.Will | None = None,
            props: dict[str, Any] | None = None) -> bytes:
    flags = (0x02 if clean else 0) | (0x80 if username is not None else 0) | (0x40 if password is not None else 0)
    payload = codec.utf8(client_id)
    if will is not None:
        flags |= 0x04 | (will.qos << 3) | (0x20 if will.retain else 0)
        if level == 5:
            payload += codec.encode_properties(will.properties)
        payload += codec.utf8(will.topic) + codec.binary(will.payload)
    if username is not None:
        payload += codec.utf8(username)
    if password is not None:
        payload += codec.binary(password)
    head = codec.utf8("MQTT") + bytes((level, flags)) + struct.pack(">H", keep_alive)
    if level == 5:
        head += codec.encode_properties(props or {})
    return codec.packet(codec.CONNECT, 0, head + payload)


def publish(topic: str, payload: bytes, qos: int = 0, packet_id: int = 0, retain: bool = False, level: int = 4,
            props: dict[str, Any] | None = None, dup: bool = False) -> bytes:
    return codec.publish(topic, payload, qos, retain, dup, packet_id, level, props)


def subscribe(packet_id: int, *filters: tuple[str, int] | tuple[str, int, int], level: int = 4,
              props: dict[str, Any] | None = None) -> bytes:
    body = struct.pack(">H", packet_id)
    if level == 5:
        body += codec.encode_properties(props or {})
    for f in filters:
        options = f[1] | (f[2] if len(f) > 2 else 0)  # type: ignore[misc]
        body += codec.utf8(f[0]) + bytes((options,))
    return codec.packet(codec.SUBSCRIBE, 2, body)


def unsubscribe(packet_id: int, *filters: str, level: int = 4) -> bytes:
    body = struct.pack(">H", packet_id)
    if level == 5:
        body += b"\x00"
    for f in filters:
        body += codec.utf8(f)
    return codec.packet(codec.UNSUBSCRIBE, 2, body)


def puback(packet_id: int) -> bytes:
    return codec.packet(codec.PUBACK, 0, struct.pack(">H", packet_id))


PINGREQ = codec.packet(codec.PINGREQ, 0, b"")
DISCONNECT = codec.packet(codec.DISCONNECT, 0, b"")


@dataclass
class Got:
    kind: int
    flags: int
    body: bytes
    fields: dict[str, Any] = field(default_factory=dict)


def read(data: bytes, level: int = 4) -> list[Got]:
    """Server packets, with the fields the tests look at."""
    out = []
    pos = 0
    while pos < len(data):
        first = data[pos]
        got = codec.decode_remaining(data, pos + 1)
        assert got is not None, "partial packet"
        size, start = got
        body = data[start:start + size]
        pos = start + size
        kind, flags = first >> 4, first & 0x0F
        g = Got(kind, flags, body)
        r = codec.Reader(body)
        if kind == codec.CONNACK:
            g.fields["session_present"] = bool(r.byte())
            g.fields["code"] = r.byte()
            if level == 5:
                g.fields["props"] = codec.read_properties(r)
        elif kind == codec.PUBLISH:
            g.fields["qos"] = (flags >> 1) & 3
            g.fields["retain"] = bool(flags & 1)
            g.fields["dup"] = bool(flags & 8)
            g.fields["topic"] = r.utf8()
            g.fields["packet_id"] = r.u16() if g.fields["qos"] else 0
            g.fields["props"] = codec.read_properties(r) if level == 5 else {}
            g.fields["payload"] = r.rest()
        elif kind in (codec.PUBACK, codec.PUBREC, codec.PUBCOMP, codec.SUBACK, codec.UNSUBACK):
            g.fields["packet_id"] = r.u16()
            if kind in (codec.SUBACK, codec.UNSUBACK):
                if level == 5:
                    codec.read_properties(r)
                g.fields["codes"] = list(r.rest())
            else:
                g.fields["reason"] = r.byte() if r.left() else 0
        elif kind == codec.DISCONNECT:
            g.fields["reason"] = r.byte() if r.left() else 0
            g.fields["props"] = codec.read_properties(r) if r.left() else {}
        out.append(g)
    return out
