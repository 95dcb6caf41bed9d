"""Crossing closes (both peers send channel.close or connection.close at once), sans-IO.

A client library's own integration tests do this: a publish to a missing
exchange (the node closes channel 1 with 404) and, before that arrives, the
client closes channel 1 itself. RabbitMQ ends it with channel 1 closed and
the connection untouched; so must we.
"""

from __future__ import annotations

import logging

import pytest
from pamqp import commands, frame

from core.engine.broker import Broker
from harness.fuzzing import fresh_broker
from tests.amqp_client import Client, Received, assemble, connected, content_frames, publish_bytes


def _close(text: str = "bye") -> commands.Channel.Close:
    return commands.Channel.Close(reply_code=200, reply_text=text, class_id=0, method_id=0)


def _kinds(frames: Received) -> list[tuple[int, str]]:
    return [(ch, type(v).__name__) for ch, v in frames]


def _second_channel_works(c: Client, broker: Broker) -> None:
    c.declare_queue(2, "q2")
    c.publish(2, b"still here", routing_key="q2")
    deliveries, _ = assemble(c.call(2, commands.Basic.Get(queue="q2", no_ack=True)))
    assert [d.body for d in deliveries] == [b"still here"]
    assert not c.conn.should_close


def test_client_close_then_close_ok_to_ours_is_not_a_connection_error() -> None:
    broker = fresh_broker()
    c = connected(broker, channels=(1, 2))
    # Node's close (404) crosses the client's close: the client's close arrives
    # while ours is in flight, then its close-ok to ours.
    c.publish(1, b"x", exchange="missing")
    assert _kinds(c.read()) == [(1, "Close")]
    assert _kinds(c.call(1, _close())) == [(1, "CloseOk")]
    assert c.call(1, commands.Channel.CloseOk()) == []
    _second_channel_works(c, broker)
    c.open_channel(1)


def test_frames_sent_before_the_client_saw_our_close_are_discarded() -> None:
    broker = fresh_broker()
    c = connected(broker, channels=(1, 2))
    c.publish(1, b"x", exchange="missing")
    c.read()
    # All in one read: the client's close, then (pipelined before it saw our
    # close) a publish split over method / header / body, a declare and an ack.
    c.send(1, _close())
    assert _kinds(c.read()) == [(1, "CloseOk")]
    c.send_raw(publish_bytes(1, b"late", exchange="missing"))
    c.send_raw(content_frames(1, b"orphan body"))
    c.send(1, commands.Queue.Declare(queue="late-q"), commands.Basic.Ack(delivery_tag=5))
    c.send(1, commands.Channel.CloseOk())
    assert c.read() == []
    assert "late-q" not in broker.vhosts["/"].queues
    _second_channel_works(c, broker)
    # Reopening the number ends the grace: it is an ordinary channel again.
    c.open_channel(1)
    c.declare_queue(1, "after")
    assert "after" in broker.vhosts["/"].queues


def test_crossing_close_in_one_read_with_the_failing_publish() -> None:
    """The publish that fails and the client's close in the same TCP segment."""
    broker = fresh_broker()
    c = connected(broker, channels=(1, 2))
    c.send_raw(publish_bytes(1, b"x", exchange="missing") + frame.marshal(_close(), 1))
    assert _kinds(c.read()) == [(1, "Close"), (1, "CloseOk")]
    c.send(1, commands.Channel.CloseOk())
    assert c.read() == []
    _second_channel_works(c, broker)


def test_unknown_channel_still_a_channel_error() -> None:
    """The grace is for crossed numbers only: a frame on a never-opened channel is still 504."""
    c = connected(fresh_broker(), channels=(1,))
    frames = c.call(5, commands.Queue.Declare(queue="x"))
    close = [v for _, v in frames if isinstance(v, commands.Connection.Close)]
    assert close and close[0].reply_code == 504


def test_connection_close_crossing_discards_pending_frames() -> None:
    c = connected(fresh_broker(), channels=(1,))
    c.conn.close()
    assert _kinds(c.read()) == [(0, "Close")]
    # Frames the client wrote before it saw our close, then its own close.
    c.publish(1, b"late", routing_key="q")
    c.send(1, commands.Queue.Declare(queue="late"))
    assert c.read() == []
    assert not c.conn.should_close
    frames = c.call(0, commands.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0))
    assert _kinds(frames) == [(0, "CloseOk")]
    assert c.conn.should_close


def test_connection_lost_runs_once(caplog: pytest.LogCaptureFixture) -> None:
    """The server calls it when its lingering close starts and again when the socket is gone."""
    broker = fresh_broker()
    c = connected(broker, channels=(1,))
    c.declare_queue(1, "mine", exclusive=True)
    c.call(0, commands.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0))
    with caplog.at_level(logging.INFO, logger="leveret.amqp"):
        c.conn.connection_lost()  # linger starts: released now
        assert "mine" not in broker.vhosts["/"].queues
        c.conn.connection_lost()  # socket gone
    assert [r.getMessage() for r in caplog.records].count("connection closed") == 1
