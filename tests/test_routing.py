"""Routing: topic matching, the four exchange types, exchange-to-exchange bindings, topology lifecycle."""

from __future__ import annotations

from typing import Any

import pytest

from core.engine.exchange import Binding, make_exchange
from core.engine.queue import Queue
from core.engine.topic import topic_matches
from core.engine.vhost import VirtualHost
from core.model import properties
from core.model.errors import AccessRefused, CommandInvalid, NotFound, PreconditionFailed
from core.model.message import Message

OWNER = object()

# ---------------------------------------------------------------------------- topic


TOPIC_CASES = [
    # '#' matches zero or more words, including the empty routing key.
    ("#", "", True),
    ("#", "a", True),
    ("#", "a.b.c", True),
    ("#.#", "", True),
    ("#.#", "a.b", True),
    ("a.#", "a", True),
    ("a.#", "a.b", True),
    ("a.#", "a.b.c", True),
    ("a.#", "b.a", False),
    ("#.a", "a", True),
    ("#.a", "x.y.a", True),
    ("#.a", "a.x", False),
    ("a.#.b", "a.b", True),
    ("a.#.b", "a.x.b", True),
    ("a.#.b", "a.x.y.z.b", True),
    ("a.#.b", "a.b.c", False),
    ("a.#.b", "a", False),
    ("#.b.#", "b", True),
    ("#.b.#", "a.b.c", True),
    ("#.b.#", "a.c", False),
    ("#.#.a", "a", True),
    # '*' matches exactly one word.
    ("*", "a", True),
    ("*", "", False),
    ("*", "a.b", False),
    ("*.*", "a.b", True),
    ("*.*", "a", False),
    ("*.*", "a.b.c", False),
    ("a.*", "a.b", True),
    ("a.*", "a", False),
    ("a.*", "a.", True),  # "a." has two words, the second one empty
    ("*.b", "a.b", True),
    ("*.b", "b", False),
    ("*.#", "", False),
    ("*.#", "a", True),
    ("*.#", "a.b.c", True),
    ("#.*", "a", True),
    ("#.*", "", False),
    ("a.*.#", "a", False),
    ("a.*.#", "a.b", True),
    ("a.*.#", "a.b.c.d", True),
    # Exact words.
    ("a.b", "a.b", True),
    ("a.b", "a.b.c", False),
    ("a.b", "a", False),
    ("a.b", "A.B", False),
    ("", "", True),
    ("", "a", False),
    ("stock.usd.nyse", "stock.usd.nyse", True),
    ("stock.*.nyse", "stock.eur.nyse", True),
    ("stock.*.nyse", "stock.eur.lse", False),
]


@pytest.mark.parametrize("pattern, key, expected", TOPIC_CASES)
def test_topic_matches(pattern: str, key: str, expected: bool) -> None:
    assert topic_matches(pattern, key) is expected


def test_topic_many_hashes_is_fast() -> None:
    # Backtracking over consecutive '#' must not explode.
    pattern = ".".join(["#"] * 30 + ["z"])
    key = ".".join(["a"] * 60)
    assert topic_matches(pattern, key) is False
    assert topic_matches(pattern, key + ".z") is True


# ------------------------------------------------------------------------ helpers


def msg(routing_key: str = "", headers: dict[str, Any] | None = None, exchange: str = "x") -> Message:
    props = properties.encode({"headers": headers}) if headers is not None else properties.EMPTY
    return Message(exchange, routing_key, props, b"body")


def names(queues: Any) -> set[str]:
    return {q.name for q in queues}


@pytest.fixture
def vh() -> VirtualHost:
    return VirtualHost("/")


def declare(vh: VirtualHost, *queue_names: str) -> list[Queue]:
    return [vh.declare_queue(n, OWNER) for n in queue_names]


def route(vh: VirtualHost, exchange: str, routing_key: str = "", headers: dict[str, Any] | None = None) -> set[str]:
    return names(vh.route(vh.get_exchange(exchange), msg(routing_key, headers, exchange)))


# ---------------------------------------------------------------------- exchanges


def test_default_exchange_routes_by_queue_name(vh: VirtualHost) -> None:
    declare(vh, "q1")
    assert names(vh.route(None, msg("q1"))) == {"q1"}
    assert vh.route(None, msg("nope")) == []


def test_standard_exchanges_exist(vh: VirtualHost) -> None:
    for name, kind in (("amq.direct", "direct"), ("amq.fanout", "fanout"), ("amq.topic", "topic"),
                       ("amq.headers", "headers"), ("amq.match", "headers")):
        x = vh.get_exchange(name)
        assert x.type == kind and x.durable


def test_direct_exchange(vh: VirtualHost) -> None:
    q1, q2, q3 = declare(vh, "q1", "q2", "q3")
    vh.declare_exchange("d", "direct")
    vh.bind("d", q1, "red", None)
    vh.bind("d", q2, "red", None)
    vh.bind("d", q2, "green", None)
    vh.bind("d", q3, "", None)
    assert route(vh, "d", "red") == {"q1", "q2"}
    assert route(vh, "d", "green") == {"q2"}
    assert route(vh, "d", "") == {"q3"}
    assert route(vh, "d", "blue") == set()
    # A queue bound twice with the same key gets one copy.
    assert len(vh.route(vh.get_exchange("d"), msg("red"))) == 2


def test_duplicate_binding_is_idempotent(vh: VirtualHost) -> None:
    (q,) = declare(vh, "q")
    x = vh.declare_exchange("d", "direct")
    assert x.add_binding(Binding(x, q, "k", {"a": 1})) is True
    assert x.add_binding(Binding(x, q, "k", {"a": 1})) is False
    assert x.add_binding(Binding(x, q, "k", {"a": 2})) is True
    assert len(x.bindings) == 2


def test_binding_watchers_hear_every_change_and_the_drop(vh: VirtualHost) -> None:
    """A federation link keeps its upstream bindings in step from these calls, not by polling."""
    (q,) = declare(vh, "q")
    x = vh.declare_exchange("t", "topic")
    calls: list[int] = []
    x.binding_watchers.append(lambda: calls.append(len(x.bindings)))
    vh.bind("t", q, "a.#", None)
    vh.bind("t", q, "a.#", None)  # identical: nothing changed, nobody told
    vh.bind("t", q, "b.*", None)
    vh.unbind("t", q, "a.#", None)
    vh.delete_exchange("t")
    assert calls == [1, 2, 1, 0]


def test_fanout_exchange_ignores_key(vh: VirtualHost) -> None:
    q1, q2 = declare(vh, "q1", "q2")
    vh.declare_exchange("f", "fanout")
    vh.bind("f", q1, "", None)
    vh.bind("f", q2, "whatever", None)
    vh.bind("f", q2, "again", None)
    assert route(vh, "f", "anything") == {"q1", "q2"}
    assert len(vh.route(vh.get_exchange("f"), msg("k"))) == 2


def test_topic_exchange(vh: VirtualHost) -> None:
    q1, q2, q3 = declare(vh, "q1", "q2", "q3")
    vh.declare_exchange("t", "topic")
    vh.bind("t", q1, "*.orange.*", None)
    vh.bind("t", q2, "*.*.rabbit", None)
    vh.bind("t", q2, "lazy.#", None)
    vh.bind("t", q3, "#", None)
    assert route(vh, "t", "quick.orange.rabbit") == {"q1", "q2", "q3"}
    assert route(vh, "t", "lazy.orange.elephant") == {"q1", "q2", "q3"}
    assert route(vh, "t", "quick.orange.fox") == {"q1", "q3"}
    assert route(vh, "t", "lazy.brown.fox") == {"q2", "q3"}
    assert route(vh, "t", "lazy") == {"q2", "q3"}
    assert route(vh, "t", "") == {"q3"}


def test_topic_exchange_cache_follows_binding_changes(vh: VirtualHost) -> None:
    q1, q2 = declare(vh, "q1", "q2")
    vh.declare_exchange("t", "topic")
    vh.bind("t", q1, "a.*", None)
    assert route(vh, "t", "a.b") == {"q1"}
    vh.bind("t", q2, "#.b", None)
    assert route(vh, "t", "a.b") == {"q1", "q2"}
    vh.unbind("t", q1, "a.*", None)
    assert route(vh, "t", "a.b") == {"q2"}


HEADER_CASES = [
    # (binding arguments, message headers, routed?)
    ({"x-match": "all", "a": 1, "b": "x"}, {"a": 1, "b": "x"}, True),
    ({"x-match": "all", "a": 1, "b": "x"}, {"a": 1, "b": "x", "c": 3}, True),
    ({"x-match": "all", "a": 1, "b": "x"}, {"a": 1}, False),
    ({"x-match": "all", "a": 1, "b": "x"}, {"a": 2, "b": "x"}, False),
    ({"a": 1, "b": "x"}, {"a": 1, "b": "x"}, True),  # x-match defaults to all
    ({"a": 1, "b": "x"}, {"a": 1}, False),
    ({"x-match": "any", "a": 1, "b": "x"}, {"a": 1}, True),
    ({"x-match": "any", "a": 1, "b": "x"}, {"b": "x", "z": 0}, True),
    ({"x-match": "any", "a": 1, "b": "x"}, {"a": 2, "b": "y"}, False),
    ({"x-match": "any", "a": 1, "b": "x"}, {}, False),
    # A void binding value means "present, with any value".
    ({"x-match": "all", "a": None}, {"a": "anything"}, True),
    ({"x-match": "all", "a": None}, {"a": None}, True),
    ({"x-match": "all", "a": None}, {"b": 1}, False),
    ({"x-match": "any", "a": None, "b": 2}, {"a": 5}, True),
    # No match arguments: all matches everything, any matches nothing.
    ({"x-match": "all"}, {}, True),
    ({"x-match": "all"}, {"a": 1}, True),
    ({"x-match": "any"}, {"a": 1}, False),
    # Other x- arguments are not match criteria for all / any.
    ({"x-match": "all", "x-extra": "y", "a": 1}, {"a": 1}, True),
    ({"x-match": "any", "x-extra": "y"}, {"x-extra": "y"}, False),
    # Integer widths do not matter; nested values compare by value.
    ({"x-match": "all", "n": 100000}, {"n": 100000}, True),
    ({"x-match": "all", "t": {"k": "v"}}, {"t": {"k": "v"}}, True),
]


@pytest.mark.parametrize("args, headers, routed", HEADER_CASES)
def test_headers_exchange(vh: VirtualHost, args: dict[str, Any], headers: dict[str, Any], routed: bool) -> None:
    (q,) = declare(vh, "q")
    vh.declare_exchange("h", "headers")
    vh.bind("h", q, "", args)
    assert route(vh, "h", "ignored-key", headers) == ({"q"} if routed else set())


def test_headers_exchange_without_headers_property(vh: VirtualHost) -> None:
    (q,) = declare(vh, "q")
    vh.declare_exchange("h", "headers")
    vh.bind("h", q, "", {"x-match": "all"})
    assert names(vh.route(vh.get_exchange("h"), Message("h", "", properties.EMPTY, b""))) == {"q"}


def test_headers_exchange_bad_x_match(vh: VirtualHost) -> None:
    (q,) = declare(vh, "q")
    vh.declare_exchange("h", "headers")
    with pytest.raises(PreconditionFailed):
        vh.bind("h", q, "", {"x-match": "most"})


@pytest.mark.parametrize("mode", ["any-with-x", "all-with-x"])
def test_headers_exchange_with_x_modes(vh: VirtualHost, mode: str) -> None:
    (q,) = declare(vh, "q")
    vh.declare_exchange("h", "headers")
    vh.bind("h", q, "", {"x-match": mode, "x-tenant": "acme"})
    assert route(vh, "h", "", {"x-tenant": "acme"}) == {"q"}
    assert route(vh, "h", "", {"x-tenant": "other"}) == set()


def test_headers_exchange_compares_types(vh: VirtualHost) -> None:
    (q,) = declare(vh, "q")
    vh.declare_exchange("h", "headers")
    vh.bind("h", q, "", {"x-match": "all", "flag": 1})
    assert route(vh, "h", "", {"flag": True}) == set()


def test_unknown_exchange_type(vh: VirtualHost) -> None:
    with pytest.raises(CommandInvalid):
        vh.declare_exchange("x", "x-consistent-weird")
    with pytest.raises(CommandInvalid):
        make_exchange("nope", "x")


# ------------------------------------------------------------ exchange to exchange


def test_exchange_to_exchange(vh: VirtualHost) -> None:
    q1, q2 = declare(vh, "q1", "q2")
    vh.declare_exchange("src", "topic")
    dst = vh.declare_exchange("dst", "direct")
    vh.bind("src", dst, "orders.#", None)
    vh.bind("dst", q1, "orders.eu", None)
    vh.bind("src", q2, "#", None)
    assert route(vh, "src", "orders.eu") == {"q1", "q2"}
    assert route(vh, "src", "orders.us") == {"q2"}
    assert route(vh, "src", "other") == {"q2"}


def test_exchange_cycle_terminates(vh: VirtualHost) -> None:
    q1, q2 = declare(vh, "q1", "q2")
    a = vh.declare_exchange("a", "fanout")
    b = vh.declare_exchange("b", "fanout")
    c = vh.declare_exchange("c", "topic")
    vh.bind("a", b, "", None)
    vh.bind("b", c, "", None)
    vh.bind("c", a, "#", None)  # a -> b -> c -> a
    vh.bind("b", a, "", None)  # and a short cycle a <-> b
    vh.bind("c", q1, "k", None)
    vh.bind("a", q2, "", None)
    for start in ("a", "b", "c"):
        queues = vh.route(vh.get_exchange(start), msg("k"))
        assert names(queues) == {"q1", "q2"}
        assert len(queues) == 2  # each queue once


def test_exchange_self_binding_terminates(vh: VirtualHost) -> None:
    (q,) = declare(vh, "q")
    x = vh.declare_exchange("self", "fanout")
    vh.bind("self", x, "", None)
    vh.bind("self", q, "", None)
    assert route(vh, "self") == {"q"}


def test_diamond_delivers_once(vh: VirtualHost) -> None:
    (q,) = declare(vh, "q")
    vh.declare_exchange("top", "fanout")
    left = vh.declare_exchange("left", "fanout")
    right = vh.declare_exchange("right", "fanout")
    vh.bind("top", left, "", None)
    vh.bind("top", right, "", None)
    vh.bind("left", q, "", None)
    vh.bind("right", q, "", None)
    assert len(vh.route(vh.get_exchange("top"), msg())) == 1


# --------------------------------------------------------------------- lifecycle


def test_auto_delete_exchange_removed_with_last_binding(vh: VirtualHost) -> None:
    q1, q2 = declare(vh, "q1", "q2")
    vh.declare_exchange("ad", "direct", auto_delete=True)
    vh.bind("ad", q1, "a", None)
    vh.bind("ad", q2, "b", None)
    vh.unbind("ad", q1, "a", None)
    assert "ad" in vh.exchanges
    vh.unbind("ad", q2, "b", None)
    assert "ad" not in vh.exchanges


def test_auto_delete_exchange_without_bindings_stays(vh: VirtualHost) -> None:
    vh.declare_exchange("ad", "fanout", auto_delete=True)
    assert "ad" in vh.exchanges


def test_auto_delete_exchange_removed_when_queue_deleted(vh: VirtualHost) -> None:
    (q,) = declare(vh, "q")
    vh.declare_exchange("ad", "fanout", auto_delete=True)
    vh.bind("ad", q, "", None)
    vh.delete_queue("q", OWNER)
    assert "ad" not in vh.exchanges
    with pytest.raises(NotFound):
        vh.get_exchange("ad")


def test_auto_delete_exchange_removed_when_destination_exchange_deleted(vh: VirtualHost) -> None:
    vh.declare_exchange("ad", "fanout", auto_delete=True)
    dst = vh.declare_exchange("dst", "fanout")
    vh.bind("ad", dst, "", None)
    vh.delete_exchange("dst")
    assert "ad" not in vh.exchanges


def test_queue_deletion_removes_its_bindings(vh: VirtualHost) -> None:
    q, other = declare(vh, "q", "other")
    vh.declare_exchange("d", "direct")
    vh.declare_exchange("t", "topic")
    vh.bind("d", q, "k", None)
    vh.bind("t", q, "#", None)
    vh.bind("amq.fanout", q, "", None)
    vh.bind("d", other, "k", None)
    vh.delete_queue("q", OWNER)
    for x in vh.exchanges.values():
        assert all(b.destination is not q for b in x.bindings.values()), x.name
    assert route(vh, "d", "k") == {"other"}
    assert route(vh, "t", "k") == set()
    assert route(vh, "amq.fanout") == set()
    # A new queue with the same name is not bound by the old bindings.
    declare(vh, "q")
    assert route(vh, "d", "k") == {"other"}
    assert route(vh, "t", "k") == set()


def test_exchange_deletion_removes_bindings_to_it(vh: VirtualHost) -> None:
    (q,) = declare(vh, "q")
    dst = vh.declare_exchange("dst", "fanout")
    vh.declare_exchange("src", "fanout")
    vh.bind("src", dst, "", None)
    vh.bind("dst", q, "", None)
    vh.delete_exchange("dst")
    assert vh.get_exchange("src").bindings == {}
    assert route(vh, "src") == set()


def test_delete_exchange_if_unused(vh: VirtualHost) -> None:
    (q,) = declare(vh, "q")
    vh.declare_exchange("x", "direct")
    vh.bind("x", q, "k", None)
    with pytest.raises(PreconditionFailed):
        vh.delete_exchange("x", if_unused=True)
    vh.unbind("x", q, "k", None)
    vh.delete_exchange("x", if_unused=True)
    assert "x" not in vh.exchanges
    vh.delete_exchange("x")  # idempotent


def test_default_and_reserved_exchanges_protected(vh: VirtualHost) -> None:
    (q,) = declare(vh, "q")
    for call in (
        lambda: vh.declare_exchange("", "direct"),
        lambda: vh.declare_exchange("amq.custom", "direct"),
        lambda: vh.delete_exchange(""),
        lambda: vh.delete_exchange("amq.topic"),
        lambda: vh.bind("", q, "q", None),
        lambda: vh.unbind("", q, "q", None),
        lambda: vh.declare_queue("amq.custom", OWNER),
    ):
        with pytest.raises(AccessRefused):
            call()


def test_bind_to_missing_exchange(vh: VirtualHost) -> None:
    (q,) = declare(vh, "q")
    with pytest.raises(NotFound):
        vh.bind("missing", q, "", None)


def test_unbind_missing_binding_is_a_no_op(vh: VirtualHost) -> None:
    (q,) = declare(vh, "q")
    vh.declare_exchange("x", "direct")
    vh.unbind("x", q, "never-bound", None)
    assert "x" in vh.exchanges
