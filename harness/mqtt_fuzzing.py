"""Seeds and mutations for fuzzing the MQTT front end (tests/test_mqtt_fuzz.py, bench/fuzz_mqtt.py)."""

from __future__ import annotations

import random

from harness import mqtt_client as mc
from mqtt_frontend import codec


def sessions() -> list[list[bytes]]:
    """Valid packet sequences, each starting with its CONNECT (3.1.1 and 5.0)."""
    will = codec.Will("w/t", b"bye", 1, True, {})
    will5 = codec.Will("w/t", b"bye", 1, True, {"will_delay": 1, "user_property": [("a", "b")]})
    props = {"message_expiry": 5, "content_type": "t", "correlation_data": b"\x00\xff",
             "user_property": [("k", "v")], "response_topic": "r/t", "payload_format": 1}
    return [
        [mc.connect("f311", will=will), mc.subscribe(1, ("a/+/c", 1), ("#", 0)),
         mc.publish("a/b/c", b"x", 1, 1, retain=True), mc.publish("a/b/c", b"y"), mc.puback(1),
         mc.unsubscribe(2, "#"), mc.PINGREQ, mc.publish("q2", b"z", 2, 3),
         codec.packet(codec.PUBREL, 2, b"\x00\x03"), mc.DISCONNECT],
        [mc.connect("f5", level=5, clean=False, will=will5, props={"session_expiry": 10, "receive_maximum": 3,
                                                                   "topic_alias_maximum": 2}),
         mc.subscribe(1, ("a/#", 1, 0x04 | 0x08), ("$share/g/b", 0), level=5, props={"subscription_id": [9]}),
         mc.publish("a/1", b"p", 1, 4, level=5, props=props),
         mc.publish("a/2", b"q", 0, level=5, props={"topic_alias": 1}),
         mc.publish("", b"r", 0, level=5, props={"topic_alias": 1}), mc.puback(1),
         mc.unsubscribe(2, "a/#", level=5), mc.PINGREQ,
         codec.packet(codec.DISCONNECT, 0, b"\x04\x05\x11\x00\x00\x00\x00")],
    ]


def mutate(rng: random.Random, packets: list[bytes]) -> bytes:
    """One session's bytes with a few mutations: flipped, inserted, deleted or duplicated bytes,
    a packet dropped or repeated, a remaining length rewritten, or the stream cut short."""
    chosen = list(packets)
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(chosen))
        p = bytearray(chosen[i])
        kind = rng.randrange(8)
        if kind == 0 and p:
            p[rng.randrange(len(p))] ^= 1 << rng.randrange(8)
        elif kind == 1:
            p[rng.randrange(len(p) + 1):0] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        elif kind == 2 and len(p) > 1:
            del p[rng.randrange(1, len(p))]
        elif kind == 3:
            chosen.pop(i) if len(chosen) > 1 else None
            continue
        elif kind == 4:
            chosen.insert(i, bytes(p))
        elif kind == 5 and len(p) > 1:
            p[1:2] = codec.encode_varint(rng.choice((0, 1, 127, 128, 16384, codec.MAX_REMAINING)))
        elif kind == 6 and p:
            p[0] = rng.randrange(256)
        else:
            p = p[:rng.randrange(len(p) + 1)]
        chosen[i] = bytes(p)
    return b"".join(chosen)


def chunks(rng: random.Random, data: bytes) -> list[bytes]:
    """``data`` split where TCP might split it."""
    out = []
    pos = 0
    while pos < len(data):
        n = rng.choice((1, 2, 3, 7, 64, len(data)))
        out.append(data[pos:pos + n])
        pos += n
    return out
