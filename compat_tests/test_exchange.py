"""Exchange declaration, deletion and routing semantics."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pika
import pytest

from compat_tests.util import BlockingChannel, Names, channel_error, connection_error, sync

pytestmark = pytest.mark.timeout(30)


def _bodies(ch: BlockingChannel, queue: str) -> list[str]:
    """Fetch everything currently in ``queue`` (auto-ack) as text."""
    out: list[str] = []
    while True:
        method, _props, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            return out
        out.append(body.decode())


def _route(
    ch: BlockingChannel,
    exchange: str,
    bindings: Mapping[str, Sequence[tuple[str, dict[str, Any] | None]]],
    messages: Sequence[tuple[str, dict[str, Any] | None, str]],
) -> dict[str, list[str]]:
    """Bind one exclusive queue per key of ``bindings``, publish, collect."""
    queues: dict[str, str] = {}
    for label, binds in bindings.items():
        queue = ch.queue_declare("", exclusive=True).method.queue
        for routing_key, args in binds:
            ch.queue_bind(queue, exchange, routing_key, arguments=args)
        queues[label] = queue
    for routing_key, headers, body in messages:
        ch.basic_publish(exchange, routing_key, body.encode(), pika.BasicProperties(headers=headers))
    sync(ch)
    return {label: _bodies(ch, queue) for label, queue in queues.items()}


# -------------------------------------------------------------- declaration
def test_passive_declare_missing_exchange(channel: BlockingChannel, names: Names) -> None:
    name = names("compat.nope")
    with channel_error(404, f"NOT_FOUND - no exchange '{name}' in vhost '/'"):
        channel.exchange_declare(name, passive=True)
    assert channel.is_closed


def test_declare_and_passive_declare(channel: BlockingChannel, names: Names) -> None:
    name = names.exchange()
    channel.exchange_declare(name, "direct")
    channel.exchange_declare(name, passive=True)
    # passive declare does not check type or flags
    channel.exchange_declare(name, "fanout", passive=True, durable=True)
    # an equivalent redeclare is fine
    channel.exchange_declare(name, "direct")


@pytest.mark.parametrize("kind", ["direct", "fanout", "topic", "headers"])
def test_declare_each_type(channel: BlockingChannel, names: Names, kind: str) -> None:
    name = names.exchange()
    channel.exchange_declare(name, kind)
    channel.exchange_declare(name, kind)


def test_durable_exchange(connect: Callable[..., pika.BlockingConnection], names: Names) -> None:
    name = names.exchange()
    conn = connect()
    conn.channel().exchange_declare(name, "topic", durable=True)
    ch = conn.channel()
    ch.exchange_declare(name, "topic", durable=True)
    with channel_error(406, "PRECONDITION_FAILED - inequivalent arg 'durable'"):
        ch.exchange_declare(name, "topic", durable=False)


def test_redeclare_with_other_type(channel: BlockingChannel, names: Names) -> None:
    name = names.exchange()
    channel.exchange_declare(name, "direct")
    with channel_error(406, "PRECONDITION_FAILED - inequivalent arg 'type' for exchange"):
        channel.exchange_declare(name, "fanout")


@pytest.mark.parametrize(
    ("flags", "arg"),
    [({"auto_delete": True}, "auto_delete"), ({"internal": True}, "internal")],
)
def test_redeclare_with_other_flags(
    connection: pika.BlockingConnection, names: Names, flags: dict[str, bool], arg: str
) -> None:
    name = names.exchange()
    connection.channel().exchange_declare(name, "direct")
    with channel_error(406, f"inequivalent arg '{arg}'"):
        connection.channel().exchange_declare(name, "direct", **flags)


def test_reserved_amq_prefix(channel: BlockingChannel, names: Names) -> None:
    name = names("amq.compat")
    with channel_error(403, "ACCESS_REFUSED - exchange name '"):
        channel.exchange_declare(name, "direct")


def test_unknown_exchange_type_is_connection_error(connection: pika.BlockingConnection, names: Names) -> None:
    ch = connection.channel()
    with connection_error(503, "COMMAND_INVALID - unknown exchange type 'no-such-type'"):
        ch.exchange_declare(names("compat.x"), "no-such-type")


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("amq.direct", "direct"),
        ("amq.fanout", "fanout"),
        ("amq.topic", "topic"),
        ("amq.headers", "headers"),
        ("amq.match", "headers"),
    ],
)
def test_standard_exchanges_exist(channel: BlockingChannel, name: str, kind: str) -> None:
    channel.exchange_declare(name, passive=True)
    # an equivalent (durable) redeclare of a predeclared exchange is allowed
    channel.exchange_declare(name, kind, durable=True)


def test_default_exchange_routes_by_queue_name(channel: BlockingChannel) -> None:
    queue = channel.queue_declare("", exclusive=True).method.queue
    channel.basic_publish("", queue, b"via default")
    sync(channel)
    assert _bodies(channel, queue) == ["via default"]


@pytest.mark.parametrize(
    "operation",
    ["declare", "passive", "delete", "bind", "unbind"],
)
def test_default_exchange_is_off_limits(connection: pika.BlockingConnection, operation: str) -> None:
    queue = connection.channel().queue_declare("", exclusive=True).method.queue
    ch = connection.channel()
    with channel_error(403, "ACCESS_REFUSED - operation not permitted on the default exchange"):
        if operation == "declare":
            ch.exchange_declare("", "direct", durable=True)
        elif operation == "passive":
            ch.exchange_declare("", passive=True)
        elif operation == "delete":
            ch.exchange_delete("")
        elif operation == "bind":
            ch.queue_bind(queue, "", queue)
        else:
            ch.queue_unbind(queue, "", queue)


def test_delete_standard_exchange_refused(channel: BlockingChannel) -> None:
    with channel_error(403, "ACCESS_REFUSED"):
        channel.exchange_delete("amq.direct")


# ----------------------------------------------------------------- deletion
def test_delete_exchange(connection: pika.BlockingConnection, names: Names) -> None:
    name = names.exchange()
    ch = connection.channel()
    ch.exchange_declare(name, "fanout")
    ch.exchange_delete(name)
    with channel_error(404, "NOT_FOUND - no exchange"):
        connection.channel().exchange_declare(name, passive=True)


def test_delete_missing_exchange_is_ok(channel: BlockingChannel, names: Names) -> None:
    # RabbitMQ 3.x: exchange.delete is idempotent
    channel.exchange_delete(names("compat.nope"))
    channel.exchange_delete(names("compat.nope"), if_unused=True)
    assert channel.is_open


def test_delete_if_unused(connection: pika.BlockingConnection, names: Names) -> None:
    name = names.exchange()
    ch = connection.channel()
    ch.exchange_declare(name, "direct")
    queue = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(queue, name, "rk")
    with channel_error(406, f"PRECONDITION_FAILED - exchange '{name}' in vhost '/' in use"):
        connection.channel().exchange_delete(name, if_unused=True)
    ch.queue_unbind(queue, name, "rk")
    ch.exchange_delete(name, if_unused=True)
    with channel_error(404):
        connection.channel().exchange_declare(name, passive=True)


def test_delete_if_unused_counts_exchange_bindings_as_source(connection: pika.BlockingConnection, names: Names) -> None:
    source, destination = names.exchange(), names.exchange()
    ch = connection.channel()
    ch.exchange_declare(source, "fanout")
    ch.exchange_declare(destination, "fanout")
    ch.exchange_bind(destination, source)
    with channel_error(406, "in use"):
        connection.channel().exchange_delete(source, if_unused=True)
    # being only the *destination* of a binding does not make it "used"
    connection.channel().exchange_delete(destination, if_unused=True)


def test_delete_removes_bindings(connection: pika.BlockingConnection, names: Names) -> None:
    name = names.exchange()
    ch = connection.channel()
    ch.exchange_declare(name, "fanout")
    queue = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(queue, name)
    ch.exchange_delete(name)
    ch.exchange_declare(name, "fanout")
    ch.basic_publish(name, "", b"lost")
    sync(ch)
    assert _bodies(ch, queue) == []


def test_auto_delete_exchange(connection: pika.BlockingConnection, names: Names) -> None:
    name = names.exchange()
    ch = connection.channel()
    ch.exchange_declare(name, "direct", auto_delete=True)
    # never bound: stays
    ch.exchange_declare(name, passive=True)
    q1 = ch.queue_declare("", exclusive=True).method.queue
    q2 = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(q1, name, "a")
    ch.queue_bind(q2, name, "b")
    ch.queue_unbind(q1, name, "a")
    ch.exchange_declare(name, passive=True)  # one binding left
    ch.queue_unbind(q2, name, "b")
    with channel_error(404, "NOT_FOUND - no exchange"):
        ch.exchange_declare(name, passive=True)


def test_auto_delete_exchange_removed_with_last_bound_queue(connection: pika.BlockingConnection, names: Names) -> None:
    name = names.exchange()
    ch = connection.channel()
    ch.exchange_declare(name, "fanout", auto_delete=True)
    queue = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(queue, name)
    ch.queue_delete(queue)
    with channel_error(404):
        ch.exchange_declare(name, passive=True)


def test_internal_exchange(connection: pika.BlockingConnection, names: Names) -> None:
    public, internal = names.exchange(), names.exchange()
    ch = connection.channel()
    ch.exchange_declare(public, "fanout")
    ch.exchange_declare(internal, "fanout", internal=True)
    ch.exchange_bind(internal, public)
    queue = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(queue, internal)
    ch.basic_publish(public, "", b"through internal")
    sync(ch)
    assert _bodies(ch, queue) == ["through internal"]
    with channel_error(403, f"ACCESS_REFUSED - cannot publish to internal exchange '{internal}'"):
        ch.basic_publish(internal, "", b"direct to internal")
        sync(ch)


def test_publish_to_missing_exchange(channel: BlockingChannel, names: Names) -> None:
    name = names("compat.nope")
    with channel_error(404, f"NOT_FOUND - no exchange '{name}' in vhost '/'"):
        channel.basic_publish(name, "rk", b"body")
        sync(channel)


def test_bind_errors(connection: pika.BlockingConnection, names: Names) -> None:
    exchange = names.exchange()
    ch = connection.channel()
    ch.exchange_declare(exchange, "direct")
    queue = ch.queue_declare("", exclusive=True).method.queue
    missing = names("compat.nope")
    with channel_error(404, f"NOT_FOUND - no exchange '{missing}'"):
        connection.channel().queue_bind(queue, missing, "rk")
    with channel_error(404, f"NOT_FOUND - no queue '{missing}'"):
        connection.channel().queue_bind(missing, exchange, "rk")
    with channel_error(404, "NOT_FOUND - no exchange"):
        connection.channel().exchange_bind(exchange, missing, "rk")
    with channel_error(404, "NOT_FOUND - no exchange"):
        connection.channel().exchange_bind(missing, exchange, "rk")
    # unbinding something that is not bound is a no-op in RabbitMQ
    ok = connection.channel()
    ok.queue_unbind(queue, exchange, "never-bound")
    assert ok.is_open


# ------------------------------------------------------------------ routing
def test_direct_routing(channel: BlockingChannel, names: Names) -> None:
    name = names.exchange()
    channel.exchange_declare(name, "direct")
    got = _route(
        channel,
        name,
        {
            "red": [("red", None)],
            "red2": [("red", None)],
            "both": [("red", None), ("green", None)],
            "empty": [("", None)],
        },
        [("red", None, "r"), ("green", None, "g"), ("blue", None, "b"), ("", None, "e"), ("RED", None, "R")],
    )
    assert got == {"red": ["r"], "red2": ["r"], "both": ["r", "g"], "empty": ["e"]}


def test_sender_selected_distribution_cc_and_bcc(channel: BlockingChannel, names: Names) -> None:
    """RabbitMQ's extension: the CC and BCC headers' keys route too; BCC never reaches a consumer."""
    name = names.exchange()
    channel.exchange_declare(name, "direct")
    queues = {}
    for key in ("one", "two", "three", "four", "five"):
        queues[key] = channel.queue_declare("", exclusive=True).method.queue
        channel.queue_bind(queues[key], name, key)
    channel.basic_publish(name, "one", b"cc", pika.BasicProperties(headers={"CC": ["two", "three"]}))
    channel.basic_publish(name, "one", b"bcc", pika.BasicProperties(headers={"BCC": ["four"], "k": "v"}))
    sync(channel)
    got: dict[str, list[tuple[str, Any]]] = {}
    for key, queue in queues.items():
        got[key] = []
        while True:
            method, props, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                break
            got[key].append((body.decode(), props.headers))
    cc = ("cc", {"CC": ["two", "three"]})
    bcc = ("bcc", {"k": "v"})  # BCC taken out of the headers before delivery
    assert got == {"one": [cc, bcc], "two": [cc], "three": [cc], "four": [bcc], "five": []}


def test_duplicate_binding_delivers_once(channel: BlockingChannel, names: Names) -> None:
    name = names.exchange()
    channel.exchange_declare(name, "direct")
    got = _route(channel, name, {"q": [("k", None), ("k", None), ("k2", None)]}, [("k", None, "once")])
    assert got == {"q": ["once"]}


def test_fanout_routing(channel: BlockingChannel, names: Names) -> None:
    name = names.exchange()
    channel.exchange_declare(name, "fanout")
    got = _route(
        channel,
        name,
        {"a": [("", None)], "b": [("ignored", None)]},
        [("x", None, "1"), ("", None, "2")],
    )
    assert got == {"a": ["1", "2"], "b": ["1", "2"]}


TOPIC_KEYS = ["", "a", "a.b", "a.b.c", "a.x.b", "a.x.y.b", "b.a", "x.b", "a.x.c", "a..b"]

TOPIC_CASES: list[tuple[str, list[str]]] = [
    ("a.b", ["a.b"]),
    ("*", ["a"]),
    ("#", TOPIC_KEYS),
    ("a.*", ["a.b"]),
    ("*.b", ["a.b", "x.b"]),
    ("a.*.b", ["a.x.b", "a..b"]),
    ("a.#", ["a", "a.b", "a.b.c", "a.x.b", "a.x.y.b", "a.x.c", "a..b"]),
    ("#.a", ["a", "b.a"]),
    ("a.#.b", ["a.b", "a.x.b", "a.x.y.b", "a..b"]),
    ("*.#", [k for k in TOPIC_KEYS if k != ""]),
    ("#.#", TOPIC_KEYS),
    ("*.*.*", ["a.b.c", "a.x.b", "a.x.c", "a..b"]),
    ("a.b.c.#", ["a.b.c"]),
]


@pytest.mark.parametrize(("pattern", "expected"), TOPIC_CASES, ids=[c[0] or "<empty>" for c in TOPIC_CASES])
def test_topic_routing(channel: BlockingChannel, names: Names, pattern: str, expected: list[str]) -> None:
    name = names.exchange()
    channel.exchange_declare(name, "topic")
    got = _route(channel, name, {"q": [(pattern, None)]}, [(k, None, k or "<empty>") for k in TOPIC_KEYS])
    assert got["q"] == [k or "<empty>" for k in TOPIC_KEYS if k in expected]


def test_topic_multiple_matching_bindings_deliver_once(channel: BlockingChannel, names: Names) -> None:
    name = names.exchange()
    channel.exchange_declare(name, "topic")
    got = _route(
        channel,
        name,
        {"q": [("a.*", None), ("#", None), ("a.b", None)]},
        [("a.b", None, "one")],
    )
    assert got == {"q": ["one"]}


HEADER_MESSAGES: list[tuple[str, dict[str, Any] | None, str]] = [
    ("", None, "none"),
    ("", {"a": 1}, "a1"),
    ("", {"a": 1, "b": "x"}, "a1bx"),
    ("", {"b": "x"}, "bx"),
    ("", {"a": 2, "b": "x"}, "a2bx"),
    ("", {"a": "1"}, "astr"),
    ("", {"a": 1, "b": "x", "c": True}, "a1bxc"),
    ("", {"x-foo": "bar"}, "xfoo"),
]


@pytest.mark.parametrize(
    ("label", "args", "expected"),
    [
        ("all", {"x-match": "all", "a": 1, "b": "x"}, ["a1bx", "a1bxc"]),
        ("any", {"x-match": "any", "a": 1, "b": "x"}, ["a1", "a1bx", "bx", "a2bx", "a1bxc"]),
        ("default-is-all", {"a": 1, "b": "x"}, ["a1bx", "a1bxc"]),
        ("all-empty-matches-everything", {"x-match": "all"}, [m[2] for m in HEADER_MESSAGES]),
        ("any-empty-matches-nothing", {"x-match": "any"}, []),
        ("types-matter", {"a": "1"}, ["astr"]),
        ("bool", {"c": True}, ["a1bxc"]),
        ("void-matches-presence", {"a": None}, ["a1", "a1bx", "a2bx", "astr", "a1bxc"]),
        ("x-keys-ignored", {"x-match": "all", "a": 1, "x-foo": "bar"}, ["a1", "a1bx", "a1bxc"]),
    ],
)
def test_headers_routing(
    channel: BlockingChannel, names: Names, label: str, args: dict[str, Any], expected: list[str]
) -> None:
    name = names.exchange()
    channel.exchange_declare(name, "headers")
    got = _route(channel, name, {label: [("ignored", args)]}, HEADER_MESSAGES)
    assert got[label] == expected


def test_headers_invalid_x_match(channel: BlockingChannel, names: Names) -> None:
    name = names.exchange()
    channel.exchange_declare(name, "headers")
    queue = channel.queue_declare("", exclusive=True).method.queue
    with channel_error(406, "PRECONDITION_FAILED - Invalid x-match field value"):
        channel.queue_bind(queue, name, "", arguments={"x-match": "bogus"})


def test_amq_topic_and_amq_headers(channel: BlockingChannel) -> None:
    queue = channel.queue_declare("", exclusive=True).method.queue
    channel.queue_bind(queue, "amq.topic", f"{queue}.#")
    channel.queue_bind(queue, "amq.headers", "", arguments={"x-match": "all", "to": queue})
    channel.basic_publish("amq.topic", f"{queue}.x.y", b"topic")
    channel.basic_publish("amq.headers", "", b"headers", pika.BasicProperties(headers={"to": queue}))
    channel.basic_publish("amq.headers", "", b"other", pika.BasicProperties(headers={"to": "else"}))
    sync(channel)
    assert _bodies(channel, queue) == ["topic", "headers"]


# --------------------------------------------------- exchange-to-exchange
def test_exchange_to_exchange_binding(connection: pika.BlockingConnection, names: Names) -> None:
    source, destination = names.exchange(), names.exchange()
    ch = connection.channel()
    ch.exchange_declare(source, "topic")
    ch.exchange_declare(destination, "direct")
    queue = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(queue, destination, "k.1")
    ch.exchange_bind(destination, source, "k.*")
    for key in ("k.1", "k.2", "j.1"):
        ch.basic_publish(source, key, key.encode())
    sync(ch)
    # the topic binding lets k.1 and k.2 through; the direct one keeps k.1 only
    assert _bodies(ch, queue) == ["k.1"]
    ch.exchange_unbind(destination, source, "k.*")
    ch.basic_publish(source, "k.1", b"after unbind")
    ch.basic_publish(destination, "k.1", b"direct")
    sync(ch)
    assert _bodies(ch, queue) == ["direct"]


def test_exchange_binding_fan_in_delivers_once(connection: pika.BlockingConnection, names: Names) -> None:
    x1, x2 = names.exchange(), names.exchange()
    ch = connection.channel()
    ch.exchange_declare(x1, "fanout")
    ch.exchange_declare(x2, "fanout")
    ch.exchange_bind(x2, x1)
    ch.exchange_bind(x1, x2)  # a cycle
    queue = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(queue, x1)
    ch.queue_bind(queue, x2)
    ch.basic_publish(x1, "", b"once")
    sync(ch)
    assert _bodies(ch, queue) == ["once"]
