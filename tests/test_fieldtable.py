"""core.model.fieldtable against pamqp's codec: every type tag, interop both ways, malformed input."""

from __future__ import annotations

import datetime
import decimal
import struct
from typing import Any

import pytest
from pamqp import decode as pdecode
from pamqp import encode as pencode

from core.model.fieldtable import FieldTableError, decode_table, decode_value, encode_table, encode_value

UTC = datetime.UTC


def table_bytes(*entries: tuple[str, bytes]) -> bytes:
    """A length-prefixed table from (key, tagged value bytes) pairs built by hand."""
    body = b"".join(bytes((len(k),)) + k.encode() + v for k, v in entries)
    return struct.pack(">I", len(body)) + body


def longstr(raw: bytes) -> bytes:
    return struct.pack(">I", len(raw)) + raw


# Every tag RabbitMQ uses, hand-encoded, with the value it must decode to.
TAGGED: list[tuple[str, bytes, Any]] = [
    ("t", b"t\x01", True),
    ("t0", b"t\x00", False),
    ("b", b"b" + struct.pack(">b", -5), -5),
    ("B", b"B" + struct.pack(">B", 250), 250),
    ("s", b"s" + struct.pack(">h", -30000), -30000),
    ("u", b"u" + struct.pack(">H", 65000), 65000),
    ("I", b"I" + struct.pack(">i", -2_000_000_000), -2_000_000_000),
    ("i", b"i" + struct.pack(">I", 4_000_000_000), 4_000_000_000),
    ("l", b"l" + struct.pack(">q", -(2**62)), -(2**62)),
    ("f", b"f" + struct.pack(">f", 1.5), 1.5),
    ("d", b"d" + struct.pack(">d", 2.25), 2.25),
    ("D", b"D" + struct.pack(">Bi", 2, 12345), decimal.Decimal("123.45")),
    ("S", b"S" + longstr("grüße".encode()), "grüße"),
    ("A", b"A" + longstr(b"I" + struct.pack(">i", 1) + b"S" + longstr(b"two") + b"t\x01"), [1, "two", True]),
    ("T", b"T" + struct.pack(">Q", 1_700_000_000), datetime.datetime.fromtimestamp(1_700_000_000, tz=UTC)),
    ("F", b"F" + table_bytes(("k", b"S" + longstr(b"v")), ("n", b"B\x07")), {"k": "v", "n": 7}),
    ("V", b"V", None),
    ("x", b"x" + longstr(b"\x00\xff\x10"), bytearray(b"\x00\xff\x10")),
]


@pytest.mark.parametrize("key, raw, expected", TAGGED, ids=[t[0] for t in TAGGED])
def test_decode_every_tag_like_pamqp(key: str, raw: bytes, expected: Any) -> None:
    data = table_bytes((key, raw))
    ours, end = decode_table(data)
    assert end == len(data)
    assert ours == {key: expected}
    assert type(ours[key]) is type(expected)
    _, theirs = pdecode.field_table(data)
    assert ours == theirs


@pytest.mark.parametrize("key, raw, expected", TAGGED, ids=[t[0] for t in TAGGED])
def test_roundtrip_every_tag(key: str, raw: bytes, expected: Any) -> None:
    value, end = decode_value(raw, 0)
    assert end == len(raw)
    again, end = decode_value(encode_value(value), 0)
    assert again == expected
    assert type(again) is type(expected)
    assert decode_table(encode_table({key: value}))[0] == {key: expected}


def test_decode_all_tags_in_one_table_like_pamqp() -> None:
    data = table_bytes(*((k, raw) for k, raw, _ in TAGGED))
    ours, _ = decode_table(data)
    assert ours == {k: v for k, _, v in TAGGED}
    assert ours == pdecode.field_table(data)[1]


RICH: dict[str, Any] = {
    "bool": True,
    "false": False,
    "tiny": -3,
    "short": 1000,
    "ushort": 60000,
    "int": -100000,
    "uint": 3_000_000_000,
    "long": 2**40,
    "neglong": -(2**40),
    "double": 0.5,
    "decimal": decimal.Decimal("3.14"),
    "str": "hello",
    "unicode": "ü→✓",
    "empty": "",
    "ts": datetime.datetime(2024, 5, 6, 7, 8, 9, tzinfo=UTC),
    "nested": {"a": {"b": [1, "x", {"c": None}]}},
    "array": [1, 2, [3, "four"], {}],
    "void": None,
    "bytes": bytearray(b"\x01\x02\xfe"),
    "emptytable": {},
    "emptyarray": [],
}


def test_pamqp_encoded_table_decodes_to_same_values() -> None:
    data = pencode.field_table(RICH)
    ours, end = decode_table(data)
    assert end == len(data)
    assert ours == RICH


def test_our_encoding_decodes_in_pamqp() -> None:
    data = encode_table(RICH)
    consumed, theirs = pdecode.field_table(data)
    assert consumed == len(data)
    assert theirs == RICH
    assert decode_table(data)[0] == RICH


def test_float_as_pamqp_sends_it() -> None:
    # pamqp encodes Python floats as 32-bit 'f'; we send 64-bit 'd'. Both decode.
    assert decode_table(pencode.field_table({"f": 0.25}))[0] == {"f": 0.25}
    assert pdecode.field_table(encode_table({"f": 0.1}))[1] == {"f": 0.1}


def test_integer_encoding_widths() -> None:
    assert encode_value(5) == b"I\x00\x00\x00\x05"
    assert encode_value(2**31 - 1)[:1] == b"I"
    assert encode_value(-(2**31))[:1] == b"I"
    assert encode_value(2**31)[:1] == b"l"
    assert encode_value(-(2**63)) == b"l" + struct.pack(">q", -(2**63))
    assert encode_value(True) == b"t\x01"  # bool is not encoded as an integer
    with pytest.raises(FieldTableError):
        encode_value(2**63)


def test_negative_decimal_roundtrip() -> None:
    for text in ("-1.25", "-0.001", "0", "100", "1E+2", "7.000"):
        value = decimal.Decimal(text)
        assert decode_value(encode_value(value), 0)[0] == value


def test_naive_datetime_is_utc() -> None:
    naive = datetime.datetime(2020, 1, 2, 3, 4, 5)
    decoded = decode_value(encode_value(naive), 0)[0]
    assert decoded == naive.replace(tzinfo=UTC)


def test_bytes_and_non_utf8_strings() -> None:
    # bytes go out as long strings; a long string that is not UTF-8 comes back as bytes.
    assert encode_value(b"raw") == b"S\x00\x00\x00\x03raw"
    assert decode_value(b"S" + longstr(b"\xff\xfe"), 0)[0] == b"\xff\xfe"
    assert pdecode.field_table(table_bytes(("k", b"S" + longstr(b"\xff"))))[1] == {"k": b"\xff"}


def test_empty_table() -> None:
    assert encode_table({}) == b"\x00\x00\x00\x00"
    assert encode_table(None) == b"\x00\x00\x00\x00"
    assert decode_table(b"\x00\x00\x00\x00") == ({}, 4)


def test_decode_at_offset_and_trailing_data() -> None:
    data = b"junk" + encode_table({"a": 1}) + b"more"
    table, end = decode_table(data, 4)
    assert table == {"a": 1}
    assert data[end:] == b"more"


def test_key_order_is_kept() -> None:
    table = {"z": 1, "a": 2, "m": 3}
    assert list(decode_table(encode_table(table))[0]) == ["z", "a", "m"]


def test_encode_refuses_bad_input() -> None:
    with pytest.raises(FieldTableError):
        encode_table({"k" * 256: 1})
    with pytest.raises(FieldTableError):
        encode_value(object())
    with pytest.raises(FieldTableError):
        encode_value({1, 2})


@pytest.mark.parametrize(
    "value",
    [decimal.Decimal("12345678901.5"), decimal.Decimal("1E-300"), decimal.Decimal("NaN"),
     datetime.datetime(1960, 1, 1, tzinfo=UTC)],
    ids=["mantissa", "scale", "nan", "pre-epoch"],
)
def test_encode_unrepresentable_raises_fieldtableerror(value: Any) -> None:
    with pytest.raises(FieldTableError):
        encode_value(value)


# --------------------------------------------------------------------- malformed


def test_every_truncation_raises() -> None:
    data = encode_table(RICH)
    for cut in range(len(data)):
        with pytest.raises(FieldTableError):
            decode_table(data[:cut])


@pytest.mark.parametrize("key, raw, expected", TAGGED, ids=[t[0] for t in TAGGED])
def test_truncated_value_raises(key: str, raw: bytes, expected: Any) -> None:
    for cut in range(1, len(raw)):
        with pytest.raises(FieldTableError):
            decode_value(raw[:cut], 0)


def test_truncated_value_inside_table_with_consistent_length_raises() -> None:
    # The table's own length is honest, but the value inside claims more than is there.
    for inner in (b"I\x00\x01", b"S\x00\x00\x00\x09abc", b"A\x00\x00\x00\x09I\x00", b"x\x00\x00\x00\x05ab"):
        with pytest.raises(FieldTableError):
            decode_table(table_bytes(("k", inner)))


def test_unknown_tag_raises() -> None:
    with pytest.raises(FieldTableError, match="unknown field type tag"):
        decode_table(table_bytes(("k", b"Z\x00")))


def test_length_mismatch_raises() -> None:
    good = encode_table({"a": 1})
    # Claim one byte more than the content actually uses (and supply it).
    longer = struct.pack(">I", len(good) - 4 + 1) + good[4:] + b"\x00"
    with pytest.raises(FieldTableError):
        decode_table(longer)


def test_table_length_beyond_data_raises() -> None:
    with pytest.raises(FieldTableError):
        decode_table(b"\x00\x00\x10\x00abc")
    with pytest.raises(FieldTableError):
        decode_table(b"\x00\x00")
