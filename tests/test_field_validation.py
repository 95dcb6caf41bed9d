"""Field tables and properties from untrusted bytes: only a 502 protocol error, never a crash.

The decoders run on what a client sent (validation at publish) and on what
the store or a peer hands back; whatever the bytes, the only exception they
may raise is FieldTableError / PropertiesError (both SYNTAX_ERROR, 502).
"""

from __future__ import annotations

import datetime
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.engine import publish
from core.model import properties
from core.model.errors import SyntaxError_
from core.model.fieldtable import (
    MAX_DEPTH,
    MAX_TIMESTAMP,
    FieldTableError,
    check_table,
    decode_table,
    decode_value,
    encode_table,
)

UTC = datetime.UTC


def table_of(*entries: tuple[str, bytes]) -> bytes:
    body = b"".join(bytes([len(k)]) + k.encode() + v for k, v in entries)
    return struct.pack(">I", len(body)) + body


def nested_tables(depth: int) -> bytes:
    """A table holding a table ... ``depth`` tables in all (the outermost counts)."""
    data = b"\x00\x00\x00\x00"
    for _ in range(depth - 1):
        data = table_of(("k", b"F" + data))
    return data


def nested_arrays(depth: int) -> bytes:
    inner = b"\x00\x00\x00\x00"  # the innermost array: empty
    for _ in range(depth - 2):
        inner = struct.pack(">I", len(inner) + 1) + b"A" + inner
    return table_of(("k", b"A" + inner))


def depth_of(value: Any) -> int:
    """Tables and arrays open at once at the deepest point (iteratively: the values are deep)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            todo.extend((child, d + 1) for child in (v.values() if isinstance(v, dict) else v))
    return deepest


def both(data: bytes) -> Any:
    """decode_table and check_table agree: the same table end, or both refuse."""
    try:
        table, end = decode_table(data)
    except FieldTableError:
        with pytest.raises(FieldTableError):
            check_table(data)
        raise
    assert check_table(data) == end
    return table


X_DEATH = {
    "x-death": [
        {"count": 3, "reason": "expired", "queue": "work", "exchange": "", "routing-keys": ["work", "other"],
         "time": datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)},
        {"count": 1, "reason": "rejected", "queue": "retry", "exchange": "dlx", "routing-keys": ["work"],
         "time": datetime.datetime(2026, 1, 2, 3, 4, 6, tzinfo=UTC)},
    ],
    "x-first-death-reason": "expired",
    "nested": {"a": {"b": [1, 2, {"c": None}]}},
}


def test_errors_are_syntax_errors_502() -> None:
    assert issubclass(FieldTableError, SyntaxError_) and FieldTableError.code == 502
    assert issubclass(properties.PropertiesError, SyntaxError_) and properties.PropertiesError.code == 502
    assert issubclass(FieldTableError, ValueError)  # callers that caught ValueError still do


def test_real_headers_decode_and_check() -> None:
    data = encode_table(X_DEATH)
    assert both(data) == X_DEATH


def test_nesting_up_to_the_limit_is_accepted_and_beyond_refused() -> None:
    assert depth_of(both(nested_tables(MAX_DEPTH))) == MAX_DEPTH
    assert depth_of(both(nested_arrays(MAX_DEPTH))) == MAX_DEPTH
    for deep in (nested_tables(MAX_DEPTH + 1), nested_arrays(MAX_DEPTH + 1)):
        with pytest.raises(FieldTableError, match="nest deeper"):
            both(deep)


def test_3000_deep_is_refused_without_recursion() -> None:
    # 3,000 levels used to raise RecursionError (issue 13); now a plain 502.
    for deep in (nested_tables(3000), nested_arrays(3000)):
        with pytest.raises(FieldTableError, match="nest deeper"):
            both(deep)


def test_a_value_running_past_its_own_table_is_refused() -> None:
    # The inner table's length is 6, but its string claims 10 bytes: it would
    # read into the outer table's next entry, which is long enough to hold them.
    inner = struct.pack(">I", 6) + b"\x01sS" + struct.pack(">I", 10)[:3]
    filler = b"\x01zS" + struct.pack(">I", 20) + b"x" * 20
    outer_body = b"\x01kF" + inner + filler
    data = struct.pack(">I", len(outer_body)) + outer_body
    with pytest.raises(FieldTableError):
        both(data)
    long_string = table_of(("k", b"S" + struct.pack(">I", 1000) + b"short"))
    with pytest.raises(FieldTableError, match="runs past"):
        both(long_string)
    array_past = table_of(("k", b"A" + struct.pack(">I", 50) + b"I\x00\x00\x00\x01"))
    with pytest.raises(FieldTableError, match="runs past"):
        both(array_past)
    key_past = struct.pack(">I", 3) + b"\x09ab"
    with pytest.raises(FieldTableError, match="key"):
        both(key_past)


def test_unknown_tag_and_out_of_range_timestamp_are_refused() -> None:
    with pytest.raises(FieldTableError, match="unknown field type tag"):
        both(table_of(("k", b"Z\x00")))
    with pytest.raises(FieldTableError, match="timestamp"):
        both(table_of(("k", b"T" + struct.pack(">Q", MAX_TIMESTAMP + 1))))
    assert both(table_of(("k", b"T" + struct.pack(">Q", MAX_TIMESTAMP))))["k"].year == 9999
    with pytest.raises(FieldTableError):
        decode_value(b"", 0)


def test_decimals_at_the_edges_decode() -> None:
    for scale in (0, 9, 255):
        for raw in (-(2**31), 0, 2**31 - 1):
            value = both(table_of(("d", b"D" + bytes([scale]) + struct.pack(">i", raw))))["d"]
            assert value.scaleb(scale) == raw


def test_properties_check_refuses_bad_headers_and_accepts_good_ones() -> None:
    good = properties.encode({"delivery_mode": 2, "headers": X_DEATH, "message_id": "m"})
    publish.check(good, properties.scan(good))
    flags = struct.pack(">H", 0x2000 | 0x1000)
    for table in (table_of(("k", b"Z\x00")), nested_tables(3000),
                  table_of(("k", b"S" + struct.pack(">I", 99) + b"abc"))):
        bad_headers = flags + table + b"\x02"
        summary = properties.scan(bad_headers)  # the scan only skips the table
        with pytest.raises(properties.PropertiesError, match="headers do not decode"):
            publish.check(bad_headers, summary)


def test_properties_encode_refuses_a_timestamp_beyond_64_bits() -> None:
    with pytest.raises(properties.PropertiesError):
        properties.encode({"timestamp": 2**70})


# -- property tests: any bytes, only the protocol error ----------------------------------------------

SEEDS = [encode_table(X_DEATH), encode_table({"a": 1, "b": "text", "c": [1.5, b"raw", True]}),
         nested_tables(5), nested_arrays(5), table_of(("k", b"D\x02\x00\x00\x01\x00"))]


def _only_protocol_errors(data: bytes) -> None:
    try:
        both(data)
    except FieldTableError:
        pass
    try:
        summary = properties.scan(data)
        publish.check(data, summary)
        properties.decode(data)
    except properties.PropertiesError:
        pass


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_protocol_errors(data: bytes) -> None:
    _only_protocol_errors(data)
    _only_protocol_errors(struct.pack(">I", len(data)) + data)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(SEEDS), st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=6),
       st.integers(0, 400))
def test_mutated_tables_raise_only_protocol_errors(seed: bytes, flips: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(seed)
    for at, value in flips:
        data[at % len(data)] = value
    _only_protocol_errors(bytes(data[: max(cut, 1)]))
    _only_protocol_errors(bytes(data))
    flags = struct.pack(">H", 0x2000)
    _only_protocol_errors(flags + bytes(data))  # as the headers of a content header
