"""Malformed input found by the fuzzer: each gets its protocol reply code, never 541.

Each test is a regression for one finding of tests/test_fuzz.py or bench/fuzz.py.
"""

from __future__ import annotations

import datetime
import logging
import struct
from collections.abc import Iterator

import pytest
from pamqp import commands, encode, frame
from pamqp.base import Frame as Method

from amqp_frontend import codec
from harness.fuzzing import fresh_broker
from tests.amqp_client import PROTOCOL_HEADER, Client, Received, connected, content_frames


def _frame(channel: int, payload: bytes) -> bytes:
    return struct.pack(">BHI", 1, channel, len(payload)) + payload + b"\xce"


def _method_payload(method: Method) -> bytes:
    return frame.marshal(method, 1)[7:-1]


def _feed(c: Client, data: bytes) -> Received:
    c.send_raw(data)
    return c.read()


def _closes(frames: Received) -> list[tuple[int, int | None, str]]:
    return [
        (ch, v.reply_code, v.reply_text)
        for ch, v in frames
        if isinstance(v, (commands.Channel.Close, commands.Connection.Close))
    ]


@pytest.fixture(autouse=True)
def no_tracebacks(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    caplog.set_level(logging.INFO)
    yield
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged for a client's error"


def test_reply_text_is_cut_to_255_bytes_not_characters() -> None:
    """A name of 127 'é' (254 bytes) makes a 404 text of ~150 characters and ~290 bytes."""
    c = connected(fresh_broker(), channels=(1,))
    name = ("é" * 127).encode()
    # Built by hand: pamqp's constructor refuses a non-ASCII queue name, the wire does not.
    payload = struct.pack(">HHH", 50, 10, 0) + bytes([len(name)]) + name + b"\x01" + struct.pack(">I", 0)
    closes = _closes(_feed(c, _frame(1, payload)))
    assert len(closes) == 1
    ch, code, text = closes[0]
    assert (ch, code) == (1, 404)
    assert text.startswith("NOT_FOUND - no queue 'éé") and len(text.encode()) <= 255


def test_x_match_that_is_not_utf8_is_406() -> None:
    c = connected(fresh_broker(), channels=(1,))
    c.call(1, commands.Exchange.Declare(exchange="h", exchange_type="headers"))
    c.call(1, commands.Queue.Declare(queue="q"))
    payload = _method_payload(
        commands.Queue.Bind(queue="q", exchange="h", arguments={"x-match": "anz", "a": 1})
    ).replace(b"anz", b"an\xcd")
    closes = _closes(_feed(c, _frame(1, payload)))
    assert [(ch, code) for ch, code, _ in closes] == [(1, 406)]
    assert "Invalid x-match field value" in closes[0][2]


def _nested_table(depth: int) -> bytes:
    """{'a': {'a': ... {}}} nested ``depth`` tables deep, as raw field-table bytes."""
    inner = struct.pack(">I", 0)
    for _ in range(depth - 1):
        entry = b"\x01a" + b"F" + inner
        inner = struct.pack(">I", len(entry)) + entry
    return inner


@pytest.mark.parametrize("depth", [codec.MAX_TABLE_DEPTH + 1, 5000])
def test_method_arguments_nested_too_deep_are_502(depth: int) -> None:
    c = connected(fresh_broker(), channels=(1,))
    head = _method_payload(commands.Queue.Declare(queue="deep", arguments={}))
    payload = head[: -4] + _nested_table(depth)  # arguments are the last field
    closes = _closes(_feed(c, _frame(1, payload)))
    assert [(ch, code) for ch, code, _ in closes] == [(0, 502)]


def test_method_arguments_at_the_depth_limit_are_accepted() -> None:
    c = connected(fresh_broker(), channels=(1,))
    head = _method_payload(commands.Queue.Declare(queue="ok", arguments={}))
    payload = head[: -4] + _nested_table(codec.MAX_TABLE_DEPTH)
    frames = _feed(c, _frame(1, payload))
    assert isinstance(frames[0][1], commands.Queue.DeclareOk), frames


def test_timestamp_out_of_range_in_arguments_is_502() -> None:
    c = connected(fresh_broker(), channels=(1,))
    stamp = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
    payload = _method_payload(commands.Queue.Declare(queue="t", arguments={"t": stamp}))
    raw = struct.pack(">Q", int(stamp.timestamp()))
    assert raw in payload
    closes = _closes(_feed(c, _frame(1, payload.replace(raw, b"\xff" * 8))))
    assert [(ch, code) for ch, code, _ in closes] == [(0, 502)]


def test_amqplain_with_a_bad_timestamp_is_a_refused_login() -> None:
    c = Client(fresh_broker())
    c.send_raw(PROTOCOL_HEADER)
    c.read()
    table = encode.field_table({"LOGIN": "guest", "T": datetime.datetime(2020, 1, 1)})[4:]
    table = table.replace(struct.pack(">Q", int(datetime.datetime(2020, 1, 1).timestamp())), b"\xff" * 8)
    frames = c.call(0, commands.Connection.StartOk(
        client_properties={"capabilities": {"authentication_failure_close": True}},
        mechanism="AMQPLAIN", response=table.decode("latin-1")))
    assert [code for _, code, _ in _closes(frames)] == [403]


def test_decode_method_raises_only_decode_error_on_deep_pamqp_recursion() -> None:
    head = _method_payload(commands.Queue.Declare(queue="deep", arguments={}))
    with pytest.raises(codec.DecodeError):
        codec.decode_method(head[: -4] + _nested_table(20_000))


def _shortstr(raw: bytes) -> bytes:
    return bytes([len(raw)]) + raw


@pytest.mark.parametrize("name", ["q 1", "очередь", "a/b?c"])
def test_queue_names_outside_the_spec_domain_are_declared_as_rabbitmq_does(name: str) -> None:
    """pamqp refused to build declare-ok for them after the queue existed (541, found by bench/fuzz.py)."""
    broker = fresh_broker()
    c = connected(broker, channels=(1,))
    payload = struct.pack(">HHH", 50, 10, 0) + _shortstr(name.encode()) + b"\x00" + struct.pack(">I", 0)
    frames = _feed(c, _frame(1, payload))
    assert len(frames) == 1 and isinstance(frames[0][1], commands.Queue.DeclareOk), frames
    assert frames[0][1].queue == name
    assert name in broker.vhosts["/"].queues
    passive = struct.pack(">HHH", 50, 10, 0) + _shortstr(name.encode()) + b"\x01" + struct.pack(">I", 0)
    assert isinstance(_feed(c, _frame(1, passive))[0][1], commands.Queue.DeclareOk)


def test_mandatory_return_from_an_exchange_named_outside_the_spec_domain() -> None:
    c = connected(fresh_broker(), channels=(1,))
    name = "ex é".encode()
    declare = struct.pack(">HHH", 40, 10, 0) + _shortstr(name) + _shortstr(b"direct") + b"\x00" + struct.pack(">I", 0)
    assert isinstance(_feed(c, _frame(1, declare))[0][1], commands.Exchange.DeclareOk)
    publish = struct.pack(">HHH", 60, 40, 0) + _shortstr(name) + _shortstr(b"nowhere") + b"\x01"
    frames = _feed(c, _frame(1, publish) + content_frames(1, b"x"))
    assert isinstance(frames[0][1], commands.Basic.Return), frames
