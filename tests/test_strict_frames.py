"""Strict frames (issue #26, item 16): a method frame with bytes left over after its arguments
closes the connection with 501 FRAME_ERROR, as RabbitMQ does; exactly sized frames still work.

Every path that decodes a method is tried: pamqp's general decoder (channel and connection
methods), and the hand-written fast paths of basic.publish (whole and split) and basic.ack.
"""

from __future__ import annotations

import struct

import pytest
from pamqp import commands, frame
from pamqp.base import Frame as Method

from amqp_frontend import codec
from harness.fuzzing import fresh_broker
from tests.amqp_client import PROTOCOL_HEADER, Client, Received, connected, content_frames


def _frame(channel: int, payload: bytes) -> bytes:
    return struct.pack(">BHI", 1, channel, len(payload)) + payload + b"\xce"


def _payload(method: Method) -> bytes:
    return frame.marshal(method, 1)[7:-1]


def _closes(frames: Received) -> list[tuple[int, int | None, str]]:
    return [(ch, v.reply_code, v.reply_text) for ch, v in frames
            if isinstance(v, (commands.Channel.Close, commands.Connection.Close))]


METHODS = [
    commands.Queue.Declare(queue="q"),  # ends with a table
    commands.Basic.Qos(prefetch_count=1),  # ends with a bit
    commands.Basic.Get(queue="q", no_ack=True),
    commands.Exchange.Declare(exchange="x", exchange_type="direct"),
    commands.Channel.Flow(active=True),
    commands.Basic.Publish(exchange="", routing_key="q"),
    commands.Basic.Ack(delivery_tag=1),
]


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
@pytest.mark.parametrize("extra", [b"\x00", b"junk" * 10])
def test_bytes_after_a_methods_arguments_close_the_connection_with_501(method: Method, extra: bytes) -> None:
    c = connected(fresh_broker(), channels=(1,))
    data = _frame(1, _payload(method) + extra)
    if isinstance(method, commands.Basic.Publish):  # whole in the buffer: the publish fast path
        data += content_frames(1, b"body")
    c.send_raw(data)
    closes = _closes(c.read())
    assert [(ch, code) for ch, code, _ in closes] == [(0, 501)], closes
    assert "after its arguments" in closes[0][2]


def test_a_publish_split_from_its_body_with_trailing_bytes_is_501_too() -> None:
    c = connected(fresh_broker(), channels=(1,))
    c.send_raw(_frame(1, _payload(commands.Basic.Publish(exchange="", routing_key="q")) + b"\x00"))
    assert [code for _, code, _ in _closes(c.read())] == [501]


def test_a_connection_method_with_trailing_bytes_is_501() -> None:
    c = Client(fresh_broker())
    c.send_raw(PROTOCOL_HEADER)
    c.read()
    ok = commands.Connection.StartOk(client_properties={}, mechanism="PLAIN", response="\x00guest\x00guest")
    c.send_raw(struct.pack(">BHI", 1, 0, len(_payload(ok)) + 2) + _payload(ok) + b"\x01\x02\xce")
    assert [code for _, code, _ in _closes(c.read())] == [501]


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_exact_frames_decode_to_the_same_method(method: Method) -> None:
    decoded = codec.decode_method(_payload(method))
    assert type(decoded) is type(method)
    assert {s: getattr(decoded, s) for s in method.__slots__} == {s: getattr(method, s) for s in method.__slots__}
