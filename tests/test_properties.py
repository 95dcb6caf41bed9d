"""core.model.properties (scan / decode / encode) against pamqp's Basic.Properties encoding."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from pamqp import commands

from core.model import properties
from core.model.message import Message

UTC = datetime.UTC
TS = 1_700_000_123

FULL_PAMQP = commands.Basic.Properties(
    content_type="application/json",
    content_encoding="gzip",
    headers={"a": "b", "nested": {"k": "v"}},
    delivery_mode=2,
    priority=7,
    correlation_id="corr-1",
    reply_to="amq.rabbitmq.reply-to",
    expiration="60000",
    message_id="msg-1",
    timestamp=datetime.datetime.fromtimestamp(TS, tz=UTC),
    message_type="order.created",
    user_id="guest",
    app_id="shop",
)

FULL_DICT: dict[str, Any] = {
    "content_type": "application/json",
    "content_encoding": "gzip",
    "headers": {"a": "b", "nested": {"k": "v"}},
    "delivery_mode": 2,
    "priority": 7,
    "correlation_id": "corr-1",
    "reply_to": "amq.rabbitmq.reply-to",
    "expiration": "60000",
    "message_id": "msg-1",
    "timestamp": TS,
    "type": "order.created",
    "user_id": "guest",
    "app_id": "shop",
}


def test_encode_matches_pamqp_marshal() -> None:
    assert properties.encode(FULL_DICT) == FULL_PAMQP.marshal()


@pytest.mark.parametrize("name", [n for _, n, _ in properties.FIELDS if n != "cluster_id"])
def test_encode_single_property_matches_pamqp(name: str) -> None:
    value = FULL_DICT[name]
    pamqp_name = "message_type" if name == "type" else name
    pamqp_value = datetime.datetime.fromtimestamp(value, tz=UTC) if name == "timestamp" else value
    expected = commands.Basic.Properties(**{pamqp_name: pamqp_value}).marshal()
    assert properties.encode({name: value}) == expected
    assert properties.decode(expected) == {name: value}


def test_decode_pamqp_marshal() -> None:
    assert properties.decode(FULL_PAMQP.marshal()) == FULL_DICT


def test_pamqp_reads_our_encoding() -> None:
    raw = properties.encode(FULL_DICT)
    parsed = commands.Basic.Properties()
    (flags,) = (int.from_bytes(raw[:2], "big"),)
    parsed.unmarshal(flags, raw[2:])
    for slot in commands.Basic.Properties.__slots__:
        if slot == "cluster_id":
            continue
        assert getattr(parsed, slot) == getattr(FULL_PAMQP, slot), slot


def test_empty_properties() -> None:
    assert properties.encode({}) == properties.EMPTY == commands.Basic.Properties().marshal()
    assert properties.decode(properties.EMPTY) == {}
    s = properties.scan(properties.EMPTY)
    assert (s.delivery_mode, s.priority, s.expiration, s.user_id, s.headers_at) == (0, 0, None, None, -1)
    assert properties.headers_of(properties.EMPTY, s) == {}


def test_scan_full() -> None:
    raw = FULL_PAMQP.marshal()
    s = properties.scan(raw)
    assert s.delivery_mode == 2
    assert s.priority == 7
    assert s.expiration == "60000"
    assert s.user_id == "guest"
    assert s.headers_at > 0
    assert properties.headers_of(raw, s) == {"a": "b", "nested": {"k": "v"}}


@pytest.mark.parametrize(
    "props",
    [
        commands.Basic.Properties(delivery_mode=1),
        commands.Basic.Properties(user_id="u", app_id="a"),
        commands.Basic.Properties(expiration="5", timestamp=datetime.datetime.fromtimestamp(TS, tz=UTC)),
        commands.Basic.Properties(headers={"x": 1}, priority=0, message_type="t"),
        commands.Basic.Properties(content_type="text/plain", correlation_id="c", reply_to="r"),
    ],
)
def test_scan_agrees_with_pamqp(props: commands.Basic.Properties) -> None:
    raw = props.marshal()
    s = properties.scan(raw)
    assert s.delivery_mode == (props.delivery_mode or 0)
    assert s.priority == (props.priority or 0)
    assert s.expiration == props.expiration
    assert s.user_id == props.user_id
    assert (s.headers_at >= 0) == (props.headers is not None)
    assert properties.headers_of(raw, s) == (props.headers or {})


def test_scan_truncated_raises() -> None:
    raw = FULL_PAMQP.marshal()
    for cut in range(1, len(raw)):
        with pytest.raises(properties.PropertiesError):
            properties.scan(raw[:cut])


def test_decode_truncated_inside_fixed_fields_raises() -> None:
    raw = FULL_PAMQP.marshal()
    for cut in range(1, len(raw) - len("shop")):
        with pytest.raises(properties.PropertiesError):
            properties.decode(raw[:cut])


def test_decode_truncated_last_shortstr_raises() -> None:
    raw = FULL_PAMQP.marshal()
    with pytest.raises(properties.PropertiesError):
        properties.decode(raw[:-2])


def test_bad_headers_table_raises_on_demand() -> None:
    # The table's length is fine for scan, its content is not a table.
    raw = b"\x20\x00" + b"\x00\x00\x00\x02Z\x00"
    s = properties.scan(raw)
    assert s.headers_at == 2
    with pytest.raises(properties.PropertiesError):
        properties.headers_of(raw, s)


def test_encode_rejects_long_shortstr() -> None:
    with pytest.raises(properties.PropertiesError):
        properties.encode({"message_id": "x" * 256})
    assert properties.decode(properties.encode({"message_id": "x" * 255})) == {"message_id": "x" * 255}


def test_with_headers_replaces_only_headers() -> None:
    raw = FULL_PAMQP.marshal()
    new = properties.with_headers(raw, {"x-death": [{"count": 1}]})
    decoded = properties.decode(new)
    assert decoded["headers"] == {"x-death": [{"count": 1}]}
    assert {k: v for k, v in decoded.items() if k != "headers"} == {
        k: v for k, v in FULL_DICT.items() if k != "headers"
    }
    added = properties.with_headers(commands.Basic.Properties(delivery_mode=2).marshal(), {"h": "v"})
    assert properties.decode(added) == {"headers": {"h": "v"}, "delivery_mode": 2}


def test_message_uses_summary() -> None:
    m = Message("x", "rk", FULL_PAMQP.marshal(), b"body")
    assert m.persistent
    assert m.headers == {"a": "b", "nested": {"k": "v"}}
    assert m.size == 4
    assert Message("x", "rk", properties.EMPTY, b"").headers == {}
    assert not Message("x", "rk", properties.EMPTY, b"").persistent
