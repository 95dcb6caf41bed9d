"""core/engine/access.py and core/engine/limits.py without sockets: RabbitMQ's matching rules and the caches."""

from __future__ import annotations

import pytest

from core.engine import access, limits
from core.engine.broker import Broker, Permission
from core.model.errors import AccessRefused, NotAllowed, PreconditionFailed
from harness.brokers import local_broker


@pytest.fixture
def broker() -> Broker:
    b = local_broker()
    b.add_vhost("v")
    b.add_user("u", "p", vhosts={"v"})
    return b


def set_perm(b: Broker, configure: str, write: str, read: str) -> None:
    b.users["u"].permissions["v"] = Permission(configure, write, read)
    b.user_changed("u")


def test_regexes_search_unanchored_and_empty_means_nothing(broker: Broker) -> None:
    set_perm(broker, "cfg", "", "^r$")
    g = broker.access.grants("u", "v")
    access.check(g, "configure", "queue", "a-cfg-b")  # re:run is a search
    with pytest.raises(AccessRefused):
        access.check(g, "write", "exchange", "anything")  # "" is "^$"
    access.check(g, "write", "queue", "")  # ... which the empty name matches
    access.read_queue(g, "r")
    with pytest.raises(AccessRefused, match="access to queue 'rr' in vhost 'v' refused for user 'u'"):
        access.read_queue(g, "rr")


def test_default_exchange_is_checked_as_amq_default(broker: Broker) -> None:
    set_perm(broker, "", r"^amq\.default$", "")
    g = broker.access.grants("u", "v")
    access.publish(g, "")
    set_perm(broker, "", "^x$", "")
    with pytest.raises(AccessRefused, match="exchange 'amq.default'"):
        access.publish(g, "")


def test_a_change_reaches_a_grants_already_handed_out(broker: Broker) -> None:
    g = broker.access.grants("u", "v")
    access.publish(g, "x")  # ".*" by default: cached as allowed
    assert g.write["x"] is True
    set_perm(broker, ".*", "^y$", ".*")
    with pytest.raises(AccessRefused):
        access.publish(g, "x")
    broker.delete_user("u")
    with pytest.raises(AccessRefused):
        access.read_queue(g, "q")


def test_a_user_without_the_vhost_gets_nothing(broker: Broker) -> None:
    g = broker.access.grants("u", "/")
    with pytest.raises(AccessRefused):
        access.declare_queue(g, "q", {})


def test_bad_regex_allows_nothing(broker: Broker) -> None:
    set_perm(broker, "(", ".*", ".*")
    with pytest.raises(AccessRefused):
        access.delete_queue(broker.access.grants("u", "v"), "q")


def test_dlx_and_ae_rows(broker: Broker) -> None:
    set_perm(broker, ".*", "^dlx$", "^q$")
    g = broker.access.grants("u", "v")
    access.declare_queue(g, "q", {"x-dead-letter-exchange": "dlx"})
    with pytest.raises(AccessRefused, match="exchange 'other'"):
        access.declare_queue(g, "q", {"x-dead-letter-exchange": "other"})
    with pytest.raises(AccessRefused, match="queue 'q2'"):
        access.declare_queue(g, "q2", {"x-dead-letter-exchange": "dlx"})
    access.declare_queue(g, "q2", {})  # without a DLX only configure
    set_perm(broker, ".*", "^ae$", "^x$")
    access.declare_exchange(g, "x", {"alternate-exchange": "ae"})
    with pytest.raises(AccessRefused, match="exchange 'y'"):
        access.declare_exchange(g, "y", {"alternate-exchange": "ae"})


def test_undecodable_dlx_and_ae_names_are_checked_as_the_queue_arguments_decode_them(broker: Broker) -> None:
    """bench.fuzz found these as 541: an exchange name in an argument that is not UTF-8."""
    g = broker.access.grants("u", "v")
    access.declare_queue(g, "q", {"x-dead-letter-exchange": b"dl\xfax"})  # allowed by ".*", no error
    access.declare_exchange(g, "x", {"alternate-exchange": b"a\xfae"})
    set_perm(broker, ".*", "^dlx$", ".*")
    with pytest.raises(AccessRefused, match="exchange 'dl\ufffdx'"):
        access.declare_queue(g, "q", {"x-dead-letter-exchange": b"dl\xfax"})


def test_topic_permissions_expand_username_and_vhost(broker: Broker) -> None:
    broker.users["u"].topic_permissions["v"] = {"t": (r"^{username}\.{vhost}\.", "^r")}
    broker.user_changed("u")
    g = broker.access.grants("u", "v")
    access.check_topic(g, "write", "t", "u.v.x")
    access.check_topic(g, "write", "other", "anything")  # no topic permission there: allowed
    with pytest.raises(AccessRefused, match="access to topic 'w.v.x' in exchange 't' in vhost 'v' refused"):
        access.check_topic(g, "write", "t", "w.v.x")
    access.check_topic(g, "read", "t", "rk")
    with pytest.raises(AccessRefused):
        access.check_topic(g, "read", "t", "k")


def test_caches_are_bounded(broker: Broker) -> None:
    g = broker.access.grants("u", "v")
    for i in range(access.MAX_CACHED + 5):
        access.publish(g, f"x{i}")
    assert len(g.write) <= access.MAX_CACHED


def test_grants_record_round_trip(broker: Broker) -> None:
    u = broker.users["u"]
    u.permissions["v"] = Permission("a", "b", "c")
    u.topic_permissions["v"] = {"t": ("w", "r")}
    u.limits = {"max-channels": 3}
    other = broker.add_user("o", "p")
    other.load_grants(u.grants_record())
    assert (other.permissions, other.topic_permissions, other.limits) == \
        ({"v": Permission("a", "b", "c")}, {"v": {"t": ("w", "r")}}, {"max-channels": 3})
    other.load_grants({})  # a record from before permissions were stored
    assert other.permissions == {} and other.limits == {}


def test_limits_parse_and_check() -> None:
    assert limits.parse("limits", {"max-queues": 2}, limits.VHOST_LIMITS) == {"max-queues": 2}
    with pytest.raises(ValueError, match="Unrecognised terms"):
        limits.parse("limits", {"max-channels": 2}, limits.VHOST_LIMITS)
    with pytest.raises(ValueError, match="should be a number"):
        limits.parse("limits", {"max-queues": "2"}, limits.VHOST_LIMITS)
    limits.check_queue("v", {"max-queues": 1}, {"a": object()}, "a")  # exists already
    limits.check_queue("v", {"max-queues": -1}, {"a": object()}, "b")
    with pytest.raises(PreconditionFailed, match=r"queue limit in vhost 'v' \(1\) is reached"):
        limits.check_queue("v", {"max-queues": 1}, {"a": object()}, "b")
    t = limits.Tracker()
    conn = object()
    t.opened(conn, "u", "v")
    with pytest.raises(NotAllowed, match=r"user connection limit \(1\)"):
        t.check_connection("u", {"max-connections": 1}, "v", {})
    with pytest.raises(NotAllowed, match=r"access to vhost 'v' refused for user 'w': connection limit \(1\)"):
        t.check_connection("w", {}, "v", {"max-connections": 1})
    t.closed(conn, "u", "v")
    t.check_connection("u", {"max-connections": 1}, "v", {"max-connections": 1})
    assert t.by_user == {} and t.by_vhost == {}
