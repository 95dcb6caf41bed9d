"""Federation (leveret/links/federation/) without sockets: parameters, the links policies ask for, loop prevention."""

from __future__ import annotations

from typing import Any

import pytest
from pamqp import commands

from coordination.local import LocalCoordinator
from core.engine.broker import Broker
from core.model import properties
from core.model.policy import Policy, PolicyError
from leveret.links.federation.link import already_seen, should_forward, stamp, upstream_vhost, wanted_bindings
from leveret.links.federation.manager import FederationManager
from leveret.links.federation.spec import FederationError, parse_upstream, upstreams_of, validate


def test_upstream_defaults_are_rabbitmqs() -> None:
    up = parse_upstream("u", {"uri": "amqp://h/"})
    assert (up.uris, up.exchange, up.max_hops, up.expires, up.message_ttl, up.prefetch, up.reconnect_delay,
            up.ack_mode, up.trust_user_id) == (("amqp://h/",), None, 1, None, None, 1000, 5.0, "on-confirm", False)
    full = parse_upstream("u", {"uri": ["amqp://a/", "amqps://b/"], "exchange": "x", "max-hops": 3,
                                "expires": 60000, "message-ttl": 0, "prefetch-count": 10, "reconnect-delay": 0.5,
                                "ack-mode": "no-ack", "trust-user-id": True, "ha-policy": "all"})
    assert (full.uris, full.exchange, full.max_hops, full.expires, full.message_ttl, full.prefetch, full.ack_mode,
            full.trust_user_id) == (("amqp://a/", "amqps://b/"), "x", 3, 60000, 0, 10, "no-ack", True)


@pytest.mark.parametrize(("value", "reason"), [
    ({}, "uri"), ({"uri": []}, "uri"), ({"uri": "http://h/"}, "amqp"), ({"uri": "amqp://", "max-hops": 0}, "max-hops"),
    ({"uri": "amqp://", "max-hops": True}, "max-hops"), ({"uri": "amqp://", "expires": 0}, "expires"),
    ({"uri": "amqp://", "message-ttl": -1}, "message-ttl"), ({"uri": "amqp://", "prefetch-count": "5"}, "prefetch"),
    ({"uri": "amqp://", "ack-mode": "later"}, "ack-mode"), ({"uri": "amqp://", "trust-user-id": "yes"}, "trust"),
    ({"uri": "amqp://", "exchange": 5}, "exchange"), ({"uri": "amqp://", "src-queue": "q"}, "src-queue"),
    ({"uri": "amqp://", "reconnect-delay": -1}, "reconnect-delay"), ("amqp://", "JSON object"),
])
def test_bad_upstreams_are_refused(value: Any, reason: str) -> None:
    with pytest.raises(FederationError, match=reason):
        validate("federation-upstream", "u", value)


def test_upstream_sets() -> None:
    validate("federation-upstream-set", "s", [{"upstream": "a"}, {"upstream": "b", "max-hops": 2}])
    for bad in ({"upstream": "a"}, [{"name": "a"}], [{"upstream": "a", "nope": 1}], [{"upstream": "a", "max-hops": 0}]):
        with pytest.raises(FederationError):
            validate("federation-upstream-set", "s", bad)
    with pytest.raises(FederationError, match="reserved"):
        validate("federation-upstream-set", "all", [])


def test_a_policy_names_its_upstreams() -> None:
    ups = {"a": {"uri": "amqp://a/"}, "b": {"uri": "amqp://b/", "max-hops": 2}, "broken": {"uri": 5}}
    sets = {"s": [{"upstream": "b", "max-hops": 4, "exchange": "other"}, {"upstream": "missing"}]}
    assert [u.name for u in upstreams_of({"federation-upstream": "a"}, ups, sets)] == ["a"]
    assert [u.name for u in upstreams_of({"federation-upstream-set": "all"}, ups, sets)] == ["a", "b"]
    (b,) = upstreams_of({"federation-upstream-set": "s"}, ups, sets)
    assert (b.name, b.max_hops, b.exchange) == ("b", 4, "other")  # the set's entry overrides the upstream
    assert list(upstreams_of({"federation-upstream": "missing"}, ups, sets)) == []
    assert list(upstreams_of({"max-length": 1}, ups, sets)) == []


def test_policy_keys_are_validated_as_rabbitmq_does() -> None:
    Policy.create("/", "p", ".", {"federation-upstream-set": "all"}, apply_to="exchanges")
    Policy.create("/", "p", ".", {"federation-upstream": "u", "alternate-exchange": "ae"})
    with pytest.raises(PolicyError, match="together"):
        Policy.create("/", "p", ".", {"federation-upstream": "u", "federation-upstream-set": "s"})
    with pytest.raises(PolicyError, match="not a string"):
        Policy.create("/", "p", ".", {"federation-upstream": ["u"]})
    with pytest.raises(PolicyError, match="not recognised"):
        Policy.create("/", "p", ".", {"federation-upstream": "u"}, operator=True)


def test_loop_prevention() -> None:
    hop = {"uri": "amqp://h", "exchange": "x", "redelivered": False, "cluster-name": "b", "vhost": "/"}
    assert should_forward(None, 1, "me", "/")
    assert should_forward({"other": 1}, 1, "me", "/")
    assert not should_forward({"x-received-from": [hop]}, 1, "me", "/")  # max-hops reached
    assert should_forward({"x-received-from": [hop]}, 2, "me", "/")
    assert not should_forward({"x-received-from": [hop, {**hop, "cluster-name": b"me"}]}, 10, "me", "/")
    # The same cluster name in another vhost is another downstream; an entry with no vhost (older brokers) is not.
    assert should_forward({"x-received-from": [{**hop, "cluster-name": "me", "vhost": "v2"}]}, 10, "me", "/")
    assert already_seen([{"cluster-name": "me"}], "me", "/")
    assert upstream_vhost("amqp://h:1/") == "/" and upstream_vhost("amqp://h/%2Fprod") == "/prod"
    assert upstream_vhost("amqp://h") == "/"


def _broker() -> Broker:
    return Broker(node_id="n")  # with its default vhost "/"


def test_bindings_forwarded_with_their_hops() -> None:
    vh = _broker().vhosts["/"]
    x = vh.declare_exchange("fed.x", "topic", durable=True)
    vh.declare_exchange("sink", "fanout")
    vh.bind("fed.x", vh.get_exchange("sink"), "a.*", None)
    vh.bind("fed.x", vh.get_exchange("sink"), "a.*", {"k": "v"})
    # Another link's binding here (it came from cluster "far", 2 hops left) and one that came from the upstream.
    vh.bind("fed.x", vh.get_exchange("sink"), "far.#", {"x-bound-from": [{"cluster-name": "far", "vhost": "/",
                                                                         "exchange": "/:fed.x", "hops": 2}]})
    vh.bind("fed.x", vh.get_exchange("sink"), "spent.#", {"x-bound-from": [{"cluster-name": "far", "vhost": "/",
                                                                           "exchange": "/:fed.x", "hops": 1}]})
    vh.bind("fed.x", vh.get_exchange("sink"), "back.#", {"x-bound-from": [{"cluster-name": "up", "vhost": "/",
                                                                          "exchange": "/:fed.x", "hops": 5}]})
    wanted = wanted_bindings(x, 3, "me", "/", "up", "/")
    got = sorted((rk, args["x-bound-from"][0]["hops"], len(args["x-bound-from"])) for rk, args in wanted.values())
    # Own bindings: max-hops; far's: one hop less (none left: not forwarded); the upstream's never goes back to it.
    assert got == [("a.*", 3, 1), ("a.*", 3, 1), ("far.#", 1, 2)]
    assert {args.get("k") for rk, args in wanted.values() if rk == "a.*"} == {None, "v"}
    # RabbitMQ's min(hops left - 1, max-hops): this link's own max-hops caps what it passes on.
    assert sorted((rk, args["x-bound-from"][0]["hops"]) for rk, args in wanted_bindings(x, 1, "me", "/", "up",
                                                                                        "/").values()) == \
        [("a.*", 1), ("a.*", 1), ("far.#", 1)]


async def test_desired_links_follow_policies_and_parameters() -> None:
    broker = _broker()
    vh = broker.vhosts["/"]
    vh.declare_exchange("fed.a", "topic", durable=True)
    vh.declare_exchange("plain", "direct")
    names: list[str] = []
    manager = FederationManager(broker, LocalCoordinator("n", broker), "n", 0, "node-n", names.append)
    assert names == ["node-n"] and manager.cluster_name() == "node-n"
    manager.apply("/", "federation-upstream", "u1", {"uri": "amqp://h1/"})
    manager.apply("/", "federation-upstream", "u2", {"uri": "amqp://h2/", "exchange": "remote"})
    assert manager.desired() == {}  # no policy yet
    vh.set_policy(Policy.create("/", "fed", "^fed\\.", {"federation-upstream-set": "all"}, apply_to="exchanges"))
    desired = manager.desired()
    assert sorted(desired) == [("/", "fed.a", "u1"), ("/", "fed.a", "u2")]
    spec = desired[("/", "fed.a", "u2")]
    assert (spec.exchange_type, spec.durable, spec.policy, spec.upstream_exchange) == ("topic", True, "fed", "remote")
    manager.apply("/", "federation-upstream", "u2", None)
    assert sorted(manager.desired()) == [("/", "fed.a", "u1")]
    manager.apply("", "global", "cluster_name", "blue")
    assert manager.cluster_name() == "blue" and names[-1] == "blue"
    with pytest.raises(FederationError):
        manager.validate("", "global", "cluster_name", "")


@pytest.mark.parametrize("trust", [False, True])
def test_a_forwarded_message_is_stamped(trust: bool) -> None:
    earlier: dict[str, Any] = {"uri": "amqp://a", "exchange": "x", "redelivered": False, "cluster-name": "a",
                               "vhost": "/"}
    headers: Any = {"k": "v", "x-received-from": [earlier]}
    props = commands.Basic.Properties(headers=headers, user_id="alice",
                                      delivery_mode=2, message_id="m1")
    entry = {"uri": "amqp://b", "exchange": "x", "redelivered": True, "cluster-name": "b", "vhost": "/"}
    stamp(props, dict(props.headers or {}), entry, trust)
    out = properties.decode(props.marshal())  # what the publish path gets, decoded by Leveret's own codec
    assert out["headers"]["x-received-from"] == [entry, earlier]  # the newest hop first, as RabbitMQ
    assert out["headers"]["k"] == "v" and out["delivery_mode"] == 2 and out["message_id"] == "m1"
    assert out.get("user_id") == ("alice" if trust else None)
