"""Policies: validation, matching, RabbitMQ's precedence, and their application to live queues."""

from __future__ import annotations

import pytest

from core.engine.queue import Consumer
from core.engine.queue_args import parse_queue_args
from core.engine.vhost import VirtualHost
from core.model import properties
from core.model.clock import ManualScheduler
from core.model.message import Message
from core.model.policy import Policy, PolicyError, select
from tests.test_queue import FakeSink


def policy(name: str, pattern: str, definition: dict[str, object], apply_to: str = "all", priority: int = 0,
           operator: bool = False, vhost: str = "/") -> Policy:
    return Policy.create(vhost, name, pattern, definition, apply_to, priority, operator)


def msg(body: bytes = b"x", routing_key: str = "rk", expiration: str | None = None) -> Message:
    props = properties.encode({"expiration": expiration}) if expiration else properties.EMPTY
    return Message("", routing_key, props, body)


# -- validation ------------------------------------------------------------------------
@pytest.mark.parametrize(("definition", "why"), [
    ({"max-length": -1}, "non-negative"),
    ({"max-length": "2"}, "non-negative"),
    ({"expires": 0}, "positive"),
    ({"overflow": "drop-tail"}, "drop-head"),
    ({"ha-mode": "all"}, "not recognised"),
    ({"max-age": "7 days"}, "duration"),
    ({"dead-letter-routing-key": "k"}, "needs dead-letter-exchange"),
    ({}, "non-empty"),
])
def test_bad_definitions_are_refused(definition: dict[str, object], why: str) -> None:
    with pytest.raises(PolicyError, match=why):
        policy("p", ".*", definition)


def test_bad_pattern_apply_to_and_operator_keys() -> None:
    with pytest.raises(PolicyError, match="not a regular expression"):
        policy("p", "([", {"max-length": 1})
    with pytest.raises(PolicyError, match="apply-to"):
        policy("p", ".*", {"max-length": 1}, apply_to="bindings")
    with pytest.raises(PolicyError, match="not recognised"):
        policy("p", ".*", {"dead-letter-exchange": "dlx"}, operator=True)


# -- matching ----------------------------------------------------------------------------
def test_highest_priority_wins_and_only_one_applies() -> None:
    low = policy("low", "^orders", {"max-length": 10}, priority=1)
    high = policy("high", "^orders\\.", {"message-ttl": 5}, priority=5)
    other = policy("other", "^invoices", {"max-length": 1}, priority=9)
    assert select([low, high, other], "queue", "orders.eu") is high
    assert select([low, high, other], "queue", "orders") is low
    assert select([low, high, other], "queue", "users") is None


def test_equal_priorities_pick_by_name_and_pattern_is_searched() -> None:
    b = policy("b", "eu", {"max-length": 1})
    a = policy("a", "eu", {"max-length": 2})
    assert select([b, a], "queue", "orders.eu.1") is a  # re.search, as RabbitMQ's patterns


def test_apply_to() -> None:
    queues = policy("q", ".*", {"max-length": 1}, apply_to="queues")
    exchanges = policy("x", ".*", {"alternate-exchange": "ae"}, apply_to="exchanges")
    assert select([queues, exchanges], "queue", "a") is queues
    assert select([queues, exchanges], "exchange", "a") is exchanges
    streams = policy("s", ".*", {"max-age": "1h"}, apply_to="streams")
    assert select([streams], "queue", "a", stream=True) is streams
    assert select([streams], "queue", "a", stream=False) is None


# -- precedence ----------------------------------------------------------------------------
def vhost_with(*policies: Policy) -> VirtualHost:
    vh = VirtualHost("/", ManualScheduler())
    for p in policies:
        vh.set_policy(p)
    return vh


def test_limits_take_the_smallest_of_argument_policy_and_operator_policy() -> None:
    vh = vhost_with(policy("p", ".*", {"max-length": 10, "message-ttl": 60_000}),
                    policy("cap", ".*", {"max-length": 5}, operator=True))
    q = vh.declare_queue("a", None, arguments={"x-max-length": 7})
    assert q.args.max_length == 5  # the operator policy caps the argument and the policy
    assert q.args.message_ttl == 60_000
    small = vh.declare_queue("b", None, arguments={"x-max-length": 3, "x-message-ttl": 1000})
    assert small.args.max_length == 3 and small.args.message_ttl == 1000  # less than the policy: kept
    assert small.arguments == {"x-max-length": 3, "x-message-ttl": 1000}  # the declared ones are untouched


def test_queue_argument_beats_policy_for_dead_lettering_and_overflow() -> None:
    vh = vhost_with(policy("p", ".*", {"dead-letter-exchange": "policy-dlx", "dead-letter-routing-key": "prk",
                                       "overflow": "reject-publish"}))
    own = vh.declare_queue("own", None, arguments={"x-dead-letter-exchange": "own-dlx", "x-overflow": "drop-head"})
    assert own.args.dead_letter_exchange == "own-dlx"
    assert own.args.overflow == "drop-head"
    assert own.args.dead_letter_routing_key == "prk"  # each key is looked up on its own, as in RabbitMQ
    plain = vh.declare_queue("plain", None)
    assert (plain.args.dead_letter_exchange, plain.args.overflow) == ("policy-dlx", "reject-publish")


def test_stream_retention_keys() -> None:
    vh = vhost_with(policy("s", "^log", {"max-age": "2h", "max-length-bytes": 1000, "max-length": 1}))
    q = vh.declare_queue("log", None, durable=True, arguments={"x-queue-type": "stream"})
    assert q.args.max_age == 7200.0 and q.args.max_length_bytes == 1000
    assert q.args.max_length is None  # max-length is not a stream key


# -- live application ----------------------------------------------------------------------
def test_a_max_length_policy_trims_a_live_queue_and_clearing_it_lifts_the_limit() -> None:
    vh = VirtualHost("/", ManualScheduler())
    q = vh.declare_queue("orders", None)
    for i in range(5):
        q.enqueue(msg(b"m%d" % i))
    vh.set_policy(policy("two", "^orders$", {"max-length": 2}))
    assert [qm.message.body for qm in q.default.ready] == [b"m3", b"m4"]  # drop-head, at once
    vh.clear_policy("two")
    assert q.args.max_length is None
    for i in range(5, 8):
        q.enqueue(msg(b"m%d" % i))
    assert q.message_count == 5


def test_dead_letter_policy_applies_to_existing_queue() -> None:
    vh = VirtualHost("/", ManualScheduler())
    src = vh.declare_queue("src", None)
    dead = vh.declare_queue("dead", None)
    vh.set_policy(policy("dl", "^src$", {"dead-letter-exchange": "", "dead-letter-routing-key": "dead",
                                         "max-length": 1}))
    src.enqueue(msg(b"first"))
    src.enqueue(msg(b"second"))  # pushes "first" out: dead-lettered by the policy's exchange
    assert [qm.message.body for qm in dead.default.ready] == [b"first"]


def test_message_ttl_policy_expires_new_messages() -> None:
    sched = ManualScheduler()
    vh = VirtualHost("/", sched)
    q = vh.declare_queue("t", None)
    vh.set_policy(policy("ttl", ".*", {"message-ttl": 1000}))
    q.enqueue(msg())
    sched.advance(1.5)
    assert q.message_count == 0


def test_expires_policy_deletes_an_unused_queue() -> None:
    sched = ManualScheduler()
    vh = VirtualHost("/", sched)
    vh.declare_queue("idle", None)
    vh.set_policy(policy("exp", "^idle$", {"expires": 2000}))
    sched.advance(2.5)
    assert "idle" not in vh.queues


def test_alternate_exchange_policy() -> None:
    vh = VirtualHost("/", ManualScheduler())
    vh.declare_exchange("in", "direct")
    vh.declare_exchange("ae", "fanout")
    caught = vh.declare_queue("caught", None)
    vh.bind("ae", caught, "", None)
    assert vh.route(vh.exchanges["in"], msg()) == []
    vh.set_policy(policy("ae", "^in$", {"alternate-exchange": "ae"}, apply_to="exchanges"))
    assert vh.route(vh.exchanges["in"], msg()) == [caught]
    vh.declare_exchange("in2", "direct")
    vh.set_policy(policy("ae", "^in", {"alternate-exchange": "ae"}, apply_to="exchanges"))
    assert vh.route(vh.exchanges["in2"], msg()) == [caught]  # a pattern change reaches other exchanges


def test_delivery_limit_dead_letters_a_message_returned_too_often() -> None:
    vh = VirtualHost("/", ManualScheduler())
    q = vh.declare_queue("work", None)
    dead = vh.declare_queue("dead", None)
    vh.set_policy(policy("dl", "^work$", {"delivery-limit": 1, "dead-letter-exchange": "",
                                          "dead-letter-routing-key": "dead"}))
    sink = FakeSink()
    c = Consumer("c", q.default, sink, no_ack=False)
    q.enqueue(msg(b"poison"))
    q.default.add_consumer(c)
    for _ in range(2):
        qm = sink.delivered[-1][1]
        q.default.requeue([(qm, c)])
    assert len(sink.delivered) == 2  # delivered twice, then dead-lettered on its second return
    assert [m.message.body for m in dead.default.ready] == [b"poison"]
    assert q.message_count == 0


def test_policy_of_another_vhost_is_refused() -> None:
    vh = VirtualHost("/", ManualScheduler())
    with pytest.raises(ValueError, match="belongs to vhost"):
        vh.set_policy(policy("p", ".*", {"max-length": 1}, vhost="other"))


def test_x_delivery_limit_argument_is_accepted() -> None:
    assert parse_queue_args({"x-delivery-limit": 3}, "q", "/").delivery_limit == 3


def test_an_archiving_policy_leaves_its_limits_to_the_retention_job() -> None:
    vh = vhost_with(policy("logs", "^logs", {"max-length": 4, "archive": True, "dead-letter-exchange": "dlx"}))
    q = vh.declare_queue("logs.app", None)
    for i in range(6):
        q.enqueue(msg(b"m%d" % i))
    assert q.message_count == 6  # the job archives, then removes them through a retention request
    assert q.args.max_length is None and q.args.dead_letter_exchange == "dlx"


def test_effective_definition_for_the_management_api() -> None:
    from core.engine.policy import effective_definition

    p = policy("p", ".*", {"max-length": 10, "dead-letter-exchange": "dlx"})
    cap = policy("cap", ".*", {"max-length": 3, "message-ttl": 1000}, operator=True)
    assert effective_definition(p, cap) == {"max-length": 3, "dead-letter-exchange": "dlx", "message-ttl": 1000}
    assert effective_definition(None, None) == {}


def test_delivery_limit_policy_on_quorum_queues_as_rabbitmq_4() -> None:
    """No argument: the policy's limit (above or below the default 20); with both, the smaller; none: 20."""
    vh = VirtualHost("/", ManualScheduler())
    quorum = {"x-queue-type": "quorum"}
    plain = vh.declare_queue("qq.plain", None, durable=True, arguments=quorum)
    own = vh.declare_queue("qq.own", None, durable=True, arguments={**quorum, "x-delivery-limit": 5})
    assert plain.args.delivery_limit == 20 and own.args.delivery_limit == 5
    vh.set_policy(policy("dl", "^qq", {"delivery-limit": 50}))
    assert plain.args.delivery_limit == 50 and own.args.delivery_limit == 5
    vh.set_policy(policy("dl", "^qq", {"delivery-limit": 3}))
    assert plain.args.delivery_limit == 3 and own.args.delivery_limit == 3
    vh.set_policy(policy("dl", "^qq", {"dead-letter-strategy": "at-least-once", "overflow": "reject-publish",
                                       "dead-letter-exchange": "dlx"}))
    assert plain.args.delivery_limit == 20 and plain.at_least_once  # the policy no longer sets a limit
    classic = vh.declare_queue("qq.classic", None, durable=True)
    assert classic.args.delivery_limit is None and not classic.at_least_once  # quorum-only keys leave it alone
