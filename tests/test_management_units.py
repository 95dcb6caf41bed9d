"""Pieces of the management API without sockets: counters, paging, hashes, policies, binding keys."""

from __future__ import annotations

import base64
import hashlib

import pytest

from core.engine.broker import Broker, User
from core.engine.queue import Consumer, Queue
from core.engine.stats import exchange_counters, queue_counters
from core.model import properties
from core.model.message import Message
from leveret.http import listing
from leveret.http.api_admin import policy_from_json, user_from_json
from leveret.http.errors import HttpError
from leveret.http.views import properties_key
from tests.test_queue import FakeSink


def test_queue_counters_follow_publish_deliver_ack_redeliver() -> None:
    q = Queue("q", "/")
    for i in range(3):
        q.enqueue(Message("", "q", properties.EMPTY, b"m%d" % i))
    sink = FakeSink()
    c = Consumer("c", q.default, sink, no_ack=False)
    q.default.add_consumer(c)
    first, second, _ = (qm for _, qm in sink.delivered)
    q.default.settle(first, c)
    q.default.requeue([(second, c)])  # delivered again at once: a redelivery
    got = q.default.get(no_ack=True)  # nothing ready: the consumer holds them
    assert got is None
    assert queue_counters(q) == (3, 4, 1, 1)


def test_exchange_counter_counts_publishes_routed_through_it() -> None:
    broker = Broker()
    vh = broker.vhosts["/"]
    x = vh.exchanges["amq.fanout"]
    vh.route(x, Message("amq.fanout", "", properties.EMPTY, b""))
    vh.route(None, Message("", "nothing", properties.EMPTY, b""))
    assert exchange_counters(x) == (1,)


def test_rabbitmq_sha256_user_checks_its_password_and_exports_the_same_hash() -> None:
    salt = b"\x01\x02\x03\x04"
    rabbit = base64.b64encode(salt + hashlib.sha256(salt + b"pw").digest()).decode()
    user = User.from_rabbit_hash("alice", rabbit)
    assert user.check_password("pw") and not user.check_password("pw ")
    assert user.rabbit_hash() == rabbit
    assert User.create("bob", "pw").rabbit_hash() is None
    with pytest.raises(ValueError):
        User.from_rabbit_hash("x", base64.b64encode(b"short").decode())


def test_user_from_json_refuses_unknown_algorithm_and_keeps_tags_only_updates() -> None:
    with pytest.raises(HttpError) as info:
        user_from_json("u", {"password_hash": "abc", "hashing_algorithm": "rabbit_password_hashing_md5"}, None)
    assert info.value.status == 400
    old = User.create("u", "pw", vhosts={"/"})
    again = user_from_json("u", {"tags": "administrator,monitoring"}, old)
    assert again.check_password("pw") and again.tags == ("administrator", "monitoring") and again.vhosts == {"/"}


def test_paging_sorting_and_columns() -> None:
    items = [{"name": f"q{i}", "messages": i % 3, "message_stats": {"publish": i}} for i in range(10)]
    page = listing.apply(list(items), {"page": "2", "page_size": "4", "sort": "message_stats.publish",
                                       "sort_reverse": "true", "columns": "name,message_stats.publish"})
    assert page["page_count"] == 3 and page["filtered_count"] == 10 and page["total_count"] == 10
    assert page["items"] == [{"name": f"q{i}", "message_stats": {"publish": i}} for i in (5, 4, 3, 2)]
    assert [i["name"] for i in listing.apply(list(items), {"name": "q1"})] == ["q1"]
    assert [i["name"] for i in listing.apply(list(items), {"name": "^q[12]$", "use_regex": "true"})] == ["q1", "q2"]
    for bad in ({"name": "(", "use_regex": "true"}, {"page": "0"}, {"page": "x"}, {"page": "9"},
                {"page": "1", "page_size": "501"}):
        with pytest.raises(HttpError) as info:
            listing.apply(list(items), bad)
        assert info.value.status == 400


def test_policy_validation() -> None:
    p = policy_from_json("/", "cap", {"pattern": "^a", "definition": {"max-length": 2}, "priority": "3",
                                      "apply-to": "queues"})
    assert (p.pattern, p.priority, p.apply_to, p.definition) == ("^a", 3, "queues", {"max-length": 2})
    for bad in ({"pattern": "(", "definition": {"x": 1}}, {"pattern": "a", "definition": {}},
                {"pattern": "a", "definition": {"x": 1}, "apply-to": "everything"},
                {"pattern": "a", "definition": {"x": 1}, "priority": "high"}):
        with pytest.raises(HttpError):
            policy_from_json("/", "p", bad)


def test_binding_properties_key_as_rabbitmq_quotes_it() -> None:
    assert properties_key("", {}) == "~"
    assert properties_key("a.#", {}) == "a.%23"
    assert properties_key("a~b", {}) == "a%7Eb"
    with_args = properties_key("k", {"x-match": "all"})
    assert with_args.startswith("k~") and with_args != properties_key("k", {"x-match": "any"})


def test_rates_are_the_difference_of_the_last_two_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    from leveret.http import rates

    clock = [100.0]
    monkeypatch.setattr(rates.time, "monotonic", lambda: clock[0])
    broker = Broker()
    q = broker.vhosts["/"].declare_queue("q", owner=None)
    sampler = rates.RateSampler(broker)
    sampler.sample()
    for _ in range(50):
        q.enqueue(Message("", "q", properties.EMPTY, b""))
    clock[0] += 5.0
    sampler.sample()
    stats = sampler.queue_stats("/", "q", queue_counters(q))
    assert stats["publish"] == 50 and stats["publish_details"] == {"rate": 10.0}
    assert stats["ack_details"] == {"rate": 0.0}
    assert sampler.rates(("q", "/", "gone"), 4) == (0.0, 0.0, 0.0, 0.0)
