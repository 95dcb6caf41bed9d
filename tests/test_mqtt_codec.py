"""The MQTT packet codec and the topic mapping (mqtt_frontend/codec.py, mqtt_frontend/topics.py)."""

from __future__ import annotations

import pytest

from harness import mqtt_client as mc
from mqtt_frontend import codec, topics


@pytest.mark.parametrize("n", [0, 1, 127, 128, 16383, 16384, 2_097_151, 2_097_152, codec.MAX_REMAINING])
def test_remaining_length_round_trip(n: int) -> None:
    raw = codec.encode_varint(n)
    assert len(raw) <= 4
    assert codec.decode_remaining(b"\x30" + raw, 1) == (n, 1 + len(raw))


def test_remaining_length_over_four_bytes_is_malformed() -> None:
    with pytest.raises(codec.MalformedPacket):
        codec.decode_remaining(b"\x30\xff\xff\xff\xff\x7f", 1)
    assert codec.decode_remaining(b"\x30\xff\xff", 1) is None  # not all here yet


def test_properties_round_trip() -> None:
    props = {"message_expiry": 30, "content_type": "text/plain", "correlation_data": b"\x00\x01",
             "user_property": [("a", "1"), ("a", "2")], "subscription_id": [3, 70000], "topic_alias": 4}
    raw = codec.encode_properties(props)
    assert codec.read_properties(codec.Reader(raw)) == props


def test_duplicate_property_is_a_protocol_error() -> None:
    raw = codec.encode_varint(6) + b"\x02\x00\x00\x00\x01\x02"
    with pytest.raises(codec.PacketError):
        codec.read_properties(codec.Reader(raw))


def test_connect_parses_will_and_credentials() -> None:
    will = codec.Will("dev/1/status", b"gone", 1, True, {"will_delay": 5})
    raw = mc.connect("dev1", level=5, clean=False, keep_alive=30, will=will, props={"session_expiry": 60})
    c = codec.parse_connect(raw[2:])
    assert (c.client_id, c.level, c.clean, c.keep_alive, c.username, c.password) == (
        "dev1", 5, False, 30, "guest", b"guest")
    assert c.will == will
    assert c.properties == {"session_expiry": 60}


def test_invalid_utf8_topic_is_malformed() -> None:
    with pytest.raises(codec.MalformedPacket):
        codec.parse(codec.PUBLISH, 0, b"\x00\x02\xff\xfe" + b"x", 4)
    with pytest.raises(codec.MalformedPacket):
        codec.parse(codec.PUBLISH, 0, b"\x00\x02a\x00", 4)  # U+0000


def test_wrong_fixed_flags_are_malformed() -> None:
    with pytest.raises(codec.MalformedPacket):
        codec.parse(codec.SUBSCRIBE, 0, b"\x00\x01\x00\x01a\x00", 4)
    with pytest.raises(codec.MalformedPacket):
        codec.parse(codec.PUBLISH, 6, b"\x00\x01a\x00\x01", 4)  # QoS 3


def test_second_connect_is_a_protocol_error() -> None:
    with pytest.raises(codec.ProtocolError):
        codec.parse(codec.CONNECT, 0, b"", 4)


@pytest.mark.parametrize(("topic", "key"), [("a/b/c", "a.b.c"), ("a.b/c", "a/b.c"), ("/x", ".x"), ("a", "a")])
def test_topic_mapping_is_rabbitmqs(topic: str, key: str) -> None:
    assert topics.to_routing_key(topic) == key
    assert topics.to_topic(key) == topic


def test_filter_mapping() -> None:
    assert topics.to_routing_key("a/+/c/#") == "a.*.c.#"


@pytest.mark.parametrize(("f", "t", "ok"), [
    ("a/+/c", "a/b/c", True), ("a/+/c", "a/b/d", False), ("a/#", "a", True), ("a/#", "a/b/c", True),
    ("#", "$SYS/x", False), ("+/x", "$SYS/x", False), ("$SYS/#", "$SYS/x", True), ("+", "a/b", False),
    ("a/+", "a/", True),
])
def test_matching(f: str, t: str, ok: bool) -> None:
    assert topics.matches(f, t) is ok


@pytest.mark.parametrize("bad", ["a/#/b", "a#", "a+/b", ""])
def test_bad_filters(bad: str) -> None:
    with pytest.raises(codec.PacketError):
        topics.check_filter(bad)


def test_shared_filters() -> None:
    assert topics.split_shared("$share/g1/a/b") == ("g1", "a/b")
    assert topics.split_shared("a/b") == (None, "a/b")
    with pytest.raises(codec.PacketError):
        topics.split_shared("$share/g1")
