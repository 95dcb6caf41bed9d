"""Queue arguments on the core engine under a manual clock: TTL, x-expires, dead-lettering,
length limits, priorities, single active consumer, consumer priorities.
"""

from __future__ import annotations

from typing import Any

import pytest

from core.engine.queue import Consumer, Queue
from core.engine.vhost import VirtualHost
from core.model import properties
from core.model.clock import ManualScheduler
from core.model.errors import PreconditionFailed
from core.model.message import Message
from tests.test_queue import FakeSink, ready_bodies

OWNER = object()


@pytest.fixture
def clock() -> ManualScheduler:
    return ManualScheduler()


@pytest.fixture
def vh(clock: ManualScheduler) -> VirtualHost:
    return VirtualHost("/", clock)


def publish(vh: VirtualHost, queue: str, body: bytes, **props: Any) -> None:
    raw = properties.encode(props) if props else properties.EMPTY
    message = Message("", queue, raw, body)
    for q in vh.route(None, message):
        q.enqueue(message)


def subscribe(q: Queue, sink: FakeSink, tag: str, no_ack: bool = True, priority: int = 0) -> Consumer:
    c = Consumer(tag, q.default, sink, no_ack=no_ack, priority=priority)
    q.default.add_consumer(c)
    return c


def deaths(vh: VirtualHost, queue: str) -> list[tuple[bytes, dict[str, Any]]]:
    q = vh.queues[queue]
    return [(qm.message.body, qm.message.headers) for qm in q.default.ready]


# ------------------------------------------------------------------------- TTL


def test_queue_ttl_expires_messages(vh: VirtualHost, clock: ManualScheduler) -> None:
    q = vh.declare_queue("q", OWNER, arguments={"x-message-ttl": 1000})
    publish(vh, "q", b"a")
    clock.advance(0.5)
    publish(vh, "q", b"b")
    clock.advance(0.6)  # a is 1.1 s old, b 0.6 s
    assert ready_bodies(q.default) == [b"b"]
    clock.advance(0.5)
    assert q.message_count == 0


def test_per_message_ttl_and_the_smaller_wins(vh: VirtualHost, clock: ManualScheduler) -> None:
    q = vh.declare_queue("q", OWNER, arguments={"x-message-ttl": 10_000})
    publish(vh, "q", b"short", expiration="500")
    publish(vh, "q", b"long", expiration="60000")
    clock.advance(0.6)
    assert ready_bodies(q.default) == [b"long"]
    clock.advance(10)
    assert q.message_count == 0


def test_expired_messages_not_delivered_or_got(vh: VirtualHost, clock: ManualScheduler) -> None:
    q = vh.declare_queue("q", OWNER, arguments={"x-message-ttl": 1000})
    publish(vh, "q", b"old")
    clock._now += 5  # time passes but the expiry timer has not fired yet
    assert q.default.get(no_ack=True) is None
    publish(vh, "q", b"old2")
    clock._now += 5
    sink = FakeSink()
    subscribe(q, sink, "c")
    assert sink.delivered == []


@pytest.mark.parametrize("arguments, props", [({"x-message-ttl": 0}, {}), ({}, {"expiration": "0"})],
                         ids=["queue-ttl-0", "expiration-0"])
def test_ttl_zero_delivers_to_waiting_consumer(vh: VirtualHost, arguments: dict[str, Any],
                                               props: dict[str, Any]) -> None:
    # RabbitMQ: a TTL of 0 expires a message on arrival unless a consumer can take it at once.
    q = vh.declare_queue("q", OWNER, arguments=arguments)
    sink = FakeSink()
    subscribe(q, sink, "c")
    publish(vh, "q", b"now", **props)
    assert sink.bodies() == [b"now"]


@pytest.mark.parametrize("arguments, props", [({"x-message-ttl": 0}, {}), ({}, {"expiration": "0"})],
                         ids=["queue-ttl-0", "expiration-0"])
def test_ttl_zero_without_consumer_expires(vh: VirtualHost, clock: ManualScheduler, arguments: dict[str, Any],
                                           props: dict[str, Any]) -> None:
    q = vh.declare_queue("q", OWNER, arguments=arguments)
    publish(vh, "q", b"gone", **props)
    clock.advance(0.001)
    assert q.message_count == 0
    sink = FakeSink()
    subscribe(q, sink, "c")
    assert sink.delivered == []


def test_requeued_message_keeps_its_expiry(vh: VirtualHost, clock: ManualScheduler) -> None:
    q = vh.declare_queue("q", OWNER, arguments={"x-message-ttl": 1000})
    publish(vh, "q", b"m")
    qm = q.default.get(no_ack=False)
    assert qm is not None
    clock.advance(2)
    q.default.requeue([(qm, None)])
    assert q.default.get(no_ack=True) is None


# ---------------------------------------------------------------- dead-lettering


def test_expired_message_dead_lettered_with_x_death(vh: VirtualHost, clock: ManualScheduler) -> None:
    vh.declare_queue("dlq", OWNER)
    vh.declare_queue("q", OWNER, arguments={"x-message-ttl": 1000, "x-dead-letter-exchange": "",
                                             "x-dead-letter-routing-key": "dlq"})
    publish(vh, "q", b"late", message_id="m1")
    clock.advance(1.5)
    ((body, headers),) = deaths(vh, "dlq")
    assert body == b"late"
    (death,) = headers["x-death"]
    assert death["reason"] == "expired"
    assert death["queue"] == "q"
    assert death["count"] == 1
    assert death["exchange"] == ""
    assert death["routing-keys"] == ["q"]
    assert headers["x-first-death-reason"] == "expired"
    assert headers["x-first-death-queue"] == "q"
    msg = vh.queues["dlq"].default.ready[0].message
    assert msg.routing_key == "dlq"
    assert properties.decode(msg.props)["message_id"] == "m1"


def test_per_message_expiration_becomes_original_expiration(vh: VirtualHost, clock: ManualScheduler) -> None:
    vh.declare_queue("dlq", OWNER)
    vh.declare_queue("q", OWNER, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": "dlq"})
    publish(vh, "q", b"m", expiration="100")
    clock.advance(0.2)
    msg = vh.queues["dlq"].default.ready[0].message
    decoded = properties.decode(msg.props)
    assert "expiration" not in decoded
    assert decoded["headers"]["x-death"][0]["original-expiration"] == "100"
    clock.advance(100)
    assert vh.queues["dlq"].message_count == 1  # no longer expires


def test_rejected_message_dead_lettered_through_exchange(vh: VirtualHost) -> None:
    dlq = vh.declare_queue("dlq", OWNER)
    vh.declare_exchange("dlx", "fanout")
    vh.bind("dlx", dlq, "", None)
    q = vh.declare_queue("q", OWNER, arguments={"x-dead-letter-exchange": "dlx"})
    publish(vh, "q", b"bad")
    qm = q.default.get(no_ack=False)
    assert qm is not None
    q.default.discard([(qm, None)])
    ((body, headers),) = deaths(vh, "dlq")
    assert body == b"bad"
    assert headers["x-death"][0]["reason"] == "rejected"
    assert vh.queues["dlq"].default.ready[0].message.exchange == "dlx"
    assert vh.queues["dlq"].default.ready[0].message.routing_key == "q"


def test_no_dead_letter_exchange_drops(vh: VirtualHost, clock: ManualScheduler) -> None:
    q = vh.declare_queue("q", OWNER, arguments={"x-message-ttl": 10, "x-dead-letter-exchange": "missing"})
    publish(vh, "q", b"x")
    clock.advance(1)
    assert q.message_count == 0


def test_dead_letter_count_grows_and_newest_first(vh: VirtualHost, clock: ManualScheduler) -> None:
    # q1 (ttl) -> q2 (reject) -> q1 ... a loop broken by a client rejection is allowed.
    vh.declare_queue("q1", OWNER, arguments={"x-message-ttl": 10, "x-dead-letter-exchange": "",
                                              "x-dead-letter-routing-key": "q2"})
    q2 = vh.declare_queue("q2", OWNER, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": "q1"})
    publish(vh, "q1", b"m")
    for _ in range(2):
        clock.advance(0.1)  # expires from q1 into q2
        qm = q2.default.get(no_ack=False)
        assert qm is not None
        q2.default.discard([(qm, None)])  # rejected back into q1
    clock.advance(0.1)
    ((_, headers),) = deaths(vh, "q2")
    summary = [(d["queue"], d["reason"], d["count"]) for d in headers["x-death"]]
    assert summary == [("q1", "expired", 3), ("q2", "rejected", 2)]
    assert headers["x-first-death-queue"] == "q1"


def test_automatic_dead_letter_cycle_is_dropped(vh: VirtualHost, clock: ManualScheduler) -> None:
    q = vh.declare_queue("loop", OWNER, arguments={"x-message-ttl": 10, "x-dead-letter-exchange": ""})
    publish(vh, "loop", b"m")
    clock.advance(0.05)  # expires and would dead-letter to itself
    clock.advance(1)
    assert q.message_count == 0


# --------------------------------------------------------------- length limits


def test_max_length_drop_head_dead_letters(vh: VirtualHost) -> None:
    vh.declare_queue("dlq", OWNER)
    q = vh.declare_queue("q", OWNER, arguments={"x-max-length": 2, "x-dead-letter-exchange": "",
                                                "x-dead-letter-routing-key": "dlq"})
    for i in range(4):
        publish(vh, "q", b"m%d" % i)
    assert ready_bodies(q.default) == [b"m2", b"m3"]
    assert [(b, h["x-death"][0]["reason"]) for b, h in deaths(vh, "dlq")] == [(b"m0", "maxlen"), (b"m1", "maxlen")]


def test_max_length_bytes(vh: VirtualHost) -> None:
    q = vh.declare_queue("q", OWNER, arguments={"x-max-length-bytes": 10})
    for body in (b"aaaa", b"bbbb", b"cccc"):
        publish(vh, "q", body)
    assert ready_bodies(q.default) == [b"bbbb", b"cccc"]
    assert q.default.ready_bytes == 8


def test_reject_publish_refuses_new_messages(vh: VirtualHost) -> None:
    q = vh.declare_queue("q", OWNER, arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
    assert q.enqueue(Message("", "q", properties.EMPTY, b"first")) is True
    assert q.enqueue(Message("", "q", properties.EMPTY, b"second")) is False
    assert ready_bodies(q.default) == [b"first"]


def test_max_length_counts_ready_only(vh: VirtualHost) -> None:
    q = vh.declare_queue("q", OWNER, arguments={"x-max-length": 1})
    sink = FakeSink({"c": 1})
    subscribe(q, sink, "c", no_ack=False)
    publish(vh, "q", b"out")
    publish(vh, "q", b"waiting")
    assert sink.bodies() == [b"out"]
    assert ready_bodies(q.default) == [b"waiting"]


# ------------------------------------------------------------------ priorities


def test_priority_queue_order(vh: VirtualHost) -> None:
    q = vh.declare_queue("q", OWNER, arguments={"x-max-priority": 5})
    for body, priority in ((b"p1", 1), (b"p5", 5), (b"p0", 0), (b"p9", 9), (b"p3", 3), (b"p5b", 5)):
        publish(vh, "q", body, priority=priority)
    # Above the maximum counts as the maximum; FIFO within a priority.
    assert ready_bodies(q.default) == [b"p5", b"p9", b"p5b", b"p3", b"p1", b"p0"]
    sink = FakeSink()
    subscribe(q, sink, "c")
    assert sink.bodies() == [b"p5", b"p9", b"p5b", b"p3", b"p1", b"p0"]


def test_priority_queue_requeue(vh: VirtualHost) -> None:
    q = vh.declare_queue("q", OWNER, arguments={"x-max-priority": 2})
    for body, priority in ((b"lo1", 0), (b"hi1", 2), (b"lo2", 0), (b"hi2", 2)):
        publish(vh, "q", body, priority=priority)
    taken = [q.default.get(no_ack=False) for _ in range(3)]  # hi1 hi2 lo1
    q.default.requeue([(qm, None) for qm in reversed(taken) if qm is not None])
    assert ready_bodies(q.default) == [b"hi1", b"hi2", b"lo1", b"lo2"]


def test_consumer_priorities(vh: VirtualHost) -> None:
    q = vh.declare_queue("q", OWNER)
    sink = FakeSink({"low": None, "high": 2})
    subscribe(q, sink, "low", priority=0)
    subscribe(q, sink, "high", priority=10)
    for i in range(4):
        publish(vh, "q", b"m%d" % i)
    assert [t for t, _ in sink.delivered] == ["high", "high", "low", "low"]


def test_single_active_consumer(vh: VirtualHost) -> None:
    q = vh.declare_queue("q", OWNER, arguments={"x-single-active-consumer": True})
    sink = FakeSink({"first": 2, "second": None})
    first = subscribe(q, sink, "first", no_ack=False)
    subscribe(q, sink, "second")
    for i in range(4):
        publish(vh, "q", b"m%d" % i)
    assert [t for t, _ in sink.delivered] == ["first", "first"]
    q.default.remove_consumer(first)
    assert [t for t, _ in sink.delivered] == ["first", "first", "second", "second"]


# -------------------------------------------------------------------- x-expires


def test_x_expires_deletes_unused_queue(vh: VirtualHost, clock: ManualScheduler) -> None:
    vh.declare_queue("tmp", OWNER, arguments={"x-expires": 1000})
    clock.advance(0.9)
    vh.declare_queue("tmp", OWNER, arguments={"x-expires": 1000})  # redeclare counts as use
    clock.advance(0.9)
    assert "tmp" in vh.queues
    vh.queues["tmp"].touch()  # what basic.get does (amqp_frontend.channel._basic_get)
    clock.advance(1.1)
    assert "tmp" not in vh.queues


def test_x_expires_waits_while_consumed(vh: VirtualHost, clock: ManualScheduler) -> None:
    q = vh.declare_queue("tmp", OWNER, arguments={"x-expires": 1000})
    sink = FakeSink()
    c = subscribe(q, sink, "c")
    clock.advance(5)
    assert "tmp" in vh.queues
    q.default.remove_consumer(c)
    clock.advance(0.9)
    assert "tmp" in vh.queues
    clock.advance(0.2)
    assert "tmp" not in vh.queues


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "arguments, why",
    [
        ({"x-message-ttl": "100"}, "x-message-ttl' for queue 'q' in vhost '/': {unacceptable_type,longstr}"),
        ({"x-message-ttl": -1}, "x-message-ttl' for queue 'q' in vhost '/': {value_negative,-1}"),
        ({"x-expires": 0}, "x-expires' for queue 'q' in vhost '/': {value_zero,0}"),
        ({"x-max-length": True}, "x-max-length' for queue 'q' in vhost '/': {unacceptable_type,bool}"),
        ({"x-overflow": "drop-tail"}, "x-overflow' for queue 'q' in vhost '/': {unacceptable_value,drop-tail}"),
        ({"x-max-priority": 256}, "x-max-priority' for queue 'q' in vhost '/': {value_too_large,256,255}"),
    ],
)
def test_invalid_queue_arguments(vh: VirtualHost, arguments: dict[str, Any], why: str) -> None:
    with pytest.raises(PreconditionFailed) as info:
        vh.declare_queue("q", OWNER, arguments=arguments)
    assert info.value.reply_text == "PRECONDITION_FAILED - invalid arg '" + why
    assert "q" not in vh.queues


def test_dead_letter_routing_key_needs_exchange(vh: VirtualHost) -> None:
    with pytest.raises(PreconditionFailed):
        vh.declare_queue("q", OWNER, arguments={"x-dead-letter-routing-key": "k"})


def test_queue_argument_equivalence(vh: VirtualHost) -> None:
    vh.declare_queue("q", OWNER, arguments={"x-message-ttl": 1000})
    with pytest.raises(PreconditionFailed) as info:
        vh.declare_queue("q", OWNER, arguments={"x-message-ttl": 2000})
    assert "inequivalent arg 'x-message-ttl'" in info.value.text


def test_quorum_args_defaults_and_fallbacks() -> None:
    from core.engine.queue_args import QUORUM_DELIVERY_LIMIT, parse_queue_args, quorum_args

    plain = quorum_args(parse_queue_args({"x-queue-type": "quorum"}, "q", "/"))
    assert plain.quorum and plain.delivery_limit == QUORUM_DELIVERY_LIMIT == 20
    unlimited = parse_queue_args({"x-queue-type": "quorum", "x-delivery-limit": -1}, "q", "/")
    assert quorum_args(unlimited).delivery_limit is None
    # reject-publish-dlx acts as drop-head; at-least-once without reject-publish is at-most-once (RabbitMQ's fallbacks)
    a = quorum_args(parse_queue_args({"x-queue-type": "quorum", "x-overflow": "reject-publish-dlx",
                                      "x-dead-letter-strategy": "at-least-once", "x-dead-letter-exchange": "d"},
                                     "q", "/"))
    assert a.overflow == "drop-head" and a.dead_letter_strategy == "at-most-once"
    b = quorum_args(parse_queue_args({"x-queue-type": "quorum", "x-overflow": "reject-publish",
                                      "x-dead-letter-strategy": "at-least-once", "x-dead-letter-exchange": "d"},
                                     "q", "/"))
    assert b.dead_letter_strategy == "at-least-once"
    classic = quorum_args(parse_queue_args({"x-queue-type": "classic"}, "q", "/"))
    assert not classic.quorum and classic.delivery_limit is None
