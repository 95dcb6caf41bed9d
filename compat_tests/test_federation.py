"""Exchange federation (leveret/links/federation/) between single-node brokers, driven through the management API.

Every broker is a real ``leveret serve`` process with its own cluster name;
messages are published and consumed with pika. The downstream's federated
exchange is made so by a policy, its upstream by a ``federation-upstream``
parameter, as in RabbitMQ.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pytest

from compat_tests.mgmt_http import wait_http
from compat_tests.test_metrics import MetricsNode, samples, value
from compat_tests.test_shovel import RABBIT_ENV, Broker, drain, wait_for
from harness.node import REPO_ROOT, _python
from harness.ports import free_port

X = "fed.events"


def named(path: Path, name: str, metrics: bool = False) -> Broker:
    b = Broker(path / name)
    if metrics:  # with its Prometheus endpoint
        b.node = MetricsNode(path / name / "data", path / name / "logs")
    b.start()
    b.mgmt.ok("PUT", "/api/cluster-name", {"name": name})
    return b


@pytest.fixture
def two(tmp_path: Path) -> Iterator[tuple[Broker, Broker]]:
    up, down = named(tmp_path, "upstream"), named(tmp_path, "downstream", metrics=True)
    try:
        yield up, down
    finally:
        for broker in (up, down):
            broker.node.cleanup()


def federate(down: Broker, uri: str, extra: dict[str, Any] | None = None) -> None:
    down.mgmt.ok("PUT", "/api/parameters/federation-upstream/%2F/up",
                 {"value": {"uri": uri, "reconnect-delay": 0.5, **(extra or {})}})
    down.mgmt.ok("PUT", "/api/policies/%2F/federate", {"pattern": r"^fed\.", "apply-to": "exchanges",
                                                       "definition": {"federation-upstream-set": "all"}})


def links(broker: Broker) -> list[dict[str, Any]]:
    return list(broker.mgmt.get("/api/federation-links"))


def running(broker: Broker, n: int = 1) -> bool:
    return sum(1 for link in links(broker) if link["status"] == "running") >= n


def topology(url: str, exchange: str, bindings: dict[str, list[str]], kind: str = "topic") -> None:
    """The exchange and durable queues bound to it: {queue: [routing keys]}."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.exchange_declare(exchange, kind, durable=True)
    for queue, keys in bindings.items():
        ch.queue_declare(queue, durable=True)
        for key in keys:
            ch.queue_bind(queue, exchange, key)
    conn.close()


def publish(url: str, exchange: str, messages: list[tuple[str, bytes]]) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.confirm_delivery()
    for key, body in messages:
        ch.basic_publish(exchange, key, body, pika.BasicProperties(delivery_mode=2))
    conn.close()


def get_all(url: str, queue: str, settle: float = 1.0) -> list[tuple[bytes, dict[str, Any]]]:
    """Everything in ``queue`` once nothing more arrived for ``settle`` seconds (body, headers)."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    got: list[tuple[bytes, dict[str, Any]]] = []
    quiet = time.monotonic() + settle
    while time.monotonic() < quiet:
        method, props, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            time.sleep(0.05)
            continue
        got.append((body, dict(props.headers or {})))
        quiet = time.monotonic() + settle
    conn.close()
    return got


def crossing(up: Broker, down: Broker, key: str, queue: str, timeout: float = 15) -> None:
    """Publish probes upstream with ``key`` until one arrives downstream (the link's binding is in place)."""
    deadline = time.monotonic() + timeout
    conn = pika.BlockingConnection(pika.URLParameters(down.node.url))
    ch = conn.channel()
    while time.monotonic() < deadline:
        publish(up.node.url, X, [(key, b"probe")])
        time.sleep(0.3)
        method, _, _ = ch.basic_get(queue, auto_ack=True)
        if method is not None:
            ch.queue_purge(queue)
            conn.close()
            time.sleep(0.5)  # probes still in flight arrive, then are purged below by the caller's drain
            return
    conn.close()
    raise AssertionError(f"nothing published upstream with key {key!r} reached {queue!r} downstream")


def purge(url: str, queue: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    conn.channel().queue_purge(queue)
    conn.close()


def test_bindings_downstream_decide_what_crosses(two: tuple[Broker, Broker]) -> None:
    up, down = two
    topology(up.node.url, X, {})
    topology(down.node.url, X, {"sports": ["news.sports.*"]})
    federate(down, up.node.url, {"expires": 3600000, "message-ttl": 600000})
    wait_for(lambda: running(down), 15, "the link to run")
    crossing(up, down, "news.sports.probe", "sports")
    purge(down.node.url, "sports")

    publish(up.node.url, X, [("news.sports.football", b"goal"), ("news.tech.ai", b"model"), ("other", b"x")])
    got = get_all(down.node.url, "sports")
    assert [body for body, _ in got] == [b"goal"]
    received = got[0][1]["x-received-from"]
    assert len(received) == 1
    entry = received[0]
    assert entry["exchange"] == X and entry["cluster-name"] == "upstream" and entry["redelivered"] is False
    assert "guest:guest" not in entry["uri"] and str(up.node.amqp_port) in entry["uri"]

    # The upstream queue RabbitMQ's way: named after the exchange and this broker's cluster name.
    queues = {q["name"]: q for q in up.mgmt.get("/api/queues/%2F")}
    assert queues[f"federation: {X} to downstream"]["arguments"] == {"x-expires": 3600000, "x-message-ttl": 600000}
    assert queues[f"federation: {X} to downstream"]["durable"] is True

    # user_id is cleared (trust-user-id false): nobody here checked it.
    conn = pika.BlockingConnection(pika.URLParameters(up.node.url))
    conn.channel().basic_publish(X, "news.sports.tennis", b"ace", pika.BasicProperties(user_id="guest"))
    conn.close()
    conn = pika.BlockingConnection(pika.URLParameters(down.node.url))
    ch = conn.channel()
    deadline = time.monotonic() + 10
    method, props, body = ch.basic_get("sports", auto_ack=True)
    while method is None and time.monotonic() < deadline:
        time.sleep(0.05)
        method, props, body = ch.basic_get("sports", auto_ack=True)
    conn.close()
    assert body == b"ace" and props.user_id is None

    # A binding added downstream starts the flow for its key...
    topology(down.node.url, X, {"tech": ["news.tech.#"]})
    crossing(up, down, "news.tech.probe", "tech")
    purge(down.node.url, "tech")
    purge(down.node.url, "sports")
    publish(up.node.url, X, [("news.tech.ai", b"model"), ("news.sports.f1", b"lap")])
    assert [b for b, _ in get_all(down.node.url, "tech")] == [b"model"]
    assert [b for b, _ in get_all(down.node.url, "sports")] == [b"lap"]

    # ... and one removed stops it.
    conn = pika.BlockingConnection(pika.URLParameters(down.node.url))
    conn.channel().queue_unbind("tech", X, "news.tech.#")
    conn.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        status = links(down)[0]
        if status["bindings"] == 1:
            break
        time.sleep(0.1)
    assert links(down)[0]["bindings"] == 1
    # The queue is still bound by hand elsewhere downstream? No: nothing downstream asks for news.tech.# now,
    # so a message with that key stays upstream (it is not even routed to the upstream queue).
    topology(down.node.url, "catch-all", {"tech": ["#"]})  # would show a leak into "tech" if one crossed
    publish(up.node.url, X, [("news.tech.ml", b"leak?"), ("news.sports.f2", b"lap2")])
    assert [b for b, _ in get_all(down.node.url, "sports")] == [b"lap2"]
    assert get_all(down.node.url, "tech", settle=0.5) == []
    upstream_queue = next(q for q in up.mgmt.get("/api/queues/%2F") if q["name"].startswith("federation: "))
    assert upstream_queue.get("messages", 0) == 0

    # Status as RabbitMQ writes it.
    status = links(down)[0]
    for key in ("node", "exchange", "upstream_exchange", "type", "vhost", "upstream", "id", "status",
                "local_connection", "uri", "timestamp"):
        assert key in status, key
    assert status["type"] == "exchange" and status["exchange"] == X and status["upstream"] == "up"
    assert "guest:guest@" not in status["uri"]
    assert down.mgmt.get("/api/federation-links/%2F") == links(down)
    assert isinstance(down.node, MetricsNode)
    found = samples(down.node.scrape())
    assert value(found, "leveret_federation_links", status="running") == 1
    forwarded = value(found, "leveret_federation_messages_forwarded_total", vhost="/", exchange=X, upstream="up")
    assert forwarded == status["messages_forwarded"] >= 4

    # The policy cleared: the link stops, and its bindings upstream go (the queue stays, with what it holds).
    down.mgmt.ok("DELETE", "/api/policies/%2F/federate")
    wait_for(lambda: links(down) == [], 10, "the link to go with its policy")
    wait_for(lambda: not [x for x in up.mgmt.get("/api/exchanges/%2F") if x["name"].startswith("federation: ")], 10,
             "the link's exchange upstream to go")
    publish(up.node.url, X, [("news.sports.f3", b"after")])
    queue = next(q for q in up.mgmt.get("/api/queues/%2F") if q["name"].startswith("federation: "))
    assert queue.get("messages", 0) == 0


def test_bad_parameters_and_policies_are_refused(two: tuple[Broker, Broker]) -> None:
    _, down = two
    for bad, text in (({"exchange": "x"}, "uri"), ({"uri": "http://x"}, "amqp"),
                        ({"uri": "amqp://", "max-hops": 0}, "max-hops"), ({"uri": "amqp://", "nope": 1}, "nope"),
                        ({"uri": "amqp://", "ack-mode": "sometimes"}, "ack-mode")):
        r = down.mgmt.request("PUT", "/api/parameters/federation-upstream/%2F/bad", {"value": bad})
        assert r.status == 400 and text in str(r.body), (bad, r.status, r.body)
    r = down.mgmt.request("PUT", "/api/parameters/federation-upstream-set/%2F/s", {"value": [{"name": "x"}]})
    assert r.status == 400
    down.mgmt.ok("PUT", "/api/parameters/federation-upstream-set/%2F/s", {"value": [{"upstream": "a"}]})
    r = down.mgmt.request("PUT", "/api/policies/%2F/both", {"pattern": ".", "apply-to": "exchanges", "definition": {
        "federation-upstream": "a", "federation-upstream-set": "s"}})
    assert r.status == 400 and "together" in str(r.body)
    r = down.mgmt.request("PUT", "/api/policies/%2F/num", {"pattern": ".", "definition": {"federation-upstream": 3}})
    assert r.status == 400
    r = down.mgmt.request("PUT", "/api/cluster-name", {"name": ""})
    assert r.status == 400
    assert down.mgmt.get("/api/cluster-name") == {"name": "downstream"}
    assert down.mgmt.get("/api/overview")["cluster_name"] == "downstream"
    # Exported with the definitions, and imported back.
    down.mgmt.ok("PUT", "/api/parameters/federation-upstream/%2F/a", {"value": {"uri": "amqp://h/", "max-hops": 2}})
    params = {(p["component"], p["name"]): p["value"] for p in down.mgmt.get("/api/definitions")["parameters"]}
    assert params[("federation-upstream", "a")] == {"uri": "amqp://h/", "max-hops": 2}
    assert params[("federation-upstream-set", "s")] == [{"upstream": "a"}]
    r = down.mgmt.request("POST", "/api/definitions", {"parameters": [
        {"vhost": "/", "component": "federation-upstream", "name": "b", "value": {"uri": 5}}]})
    assert r.status == 400
    down.mgmt.ok("POST", "/api/definitions", {"parameters": [
        {"vhost": "/", "component": "federation-upstream", "name": "c", "value": {"uri": "amqp://c/"}}]})
    assert down.mgmt.get("/api/parameters/federation-upstream/%2F/c")["value"] == {"uri": "amqp://c/"}


def test_confirmed_upstream_messages_survive_kill9_of_the_downstream(two: tuple[Broker, Broker]) -> None:
    up, down = two
    topology(up.node.url, X, {})
    topology(down.node.url, X, {"all": ["#"]})
    federate(down, up.node.url, {"prefetch-count": 50})
    wait_for(lambda: running(down), 15, "the link to run")
    crossing(up, down, "k.probe", "all")
    purge(down.node.url, "all")

    confirmed: list[bytes] = []
    stop = threading.Event()

    def publisher(prefix: str) -> None:
        conn = pika.BlockingConnection(pika.URLParameters(up.node.url))
        ch = conn.channel()
        ch.confirm_delivery()
        i = 0
        while not stop.is_set():
            body = f"{prefix}-{i}".encode()
            ch.basic_publish(X, f"k.{i % 7}", body, pika.BasicProperties(delivery_mode=2))
            confirmed.append(body)  # confirmed: basic_publish returned under confirm_delivery
            i += 1
        conn.close()

    t = threading.Thread(target=publisher, args=("m",))
    t.start()
    wait_for(lambda: len(confirmed) >= 1000, 60, "messages published before the kill")
    down.node.kill()  # kill -9 of the downstream, with the link mid-stream
    wait_for(lambda: len(confirmed) >= 2000, 60, "messages published while the downstream is down")
    down.node.start()
    wait_http(down.mgmt)
    wait_for(lambda: running(down), 30, "the link to resume after the restart")
    wait_for(lambda: len(confirmed) >= 3000, 60, "messages published after the restart")
    stop.set()
    t.join(30)

    wanted = set(confirmed)
    got = drain(down.node.url, "all", lambda got: wanted <= set(got), timeout=120)
    missing = wanted - set(got)
    assert not missing, f"{len(missing)} confirmed messages never arrived, e.g. {sorted(missing)[:5]}"
    dups = {body: n for body, n in Counter(got).items() if n > 1}
    print(f"confirmed {len(wanted)}, received {len(got)}, duplicates {len(dups)}")
    # A duplicate is a redelivery of a message in flight when the downstream died: at most the prefetch window.
    assert len(dups) <= 50, f"{len(dups)} duplicates, more than the 50 messages in flight"


@pytest.mark.parametrize("max_hops", [1, 2, 10])
def test_a_loop_of_three_delivers_a_bounded_number_of_times(tmp_path: Path, max_hops: int) -> None:
    a, b, c = (named(tmp_path, n) for n in "abc")
    try:
        for broker in (a, b, c):
            topology(broker.node.url, X, {"seen": ["#"]})
        # A -> B -> C -> A: each is downstream of the one before it.
        for down, up in ((b, a), (c, b), (a, c)):
            federate(down, up.node.url, {"max-hops": max_hops})
        for broker in (a, b, c):
            wait_for(lambda broker=broker: running(broker), 15, "every link to run")  # type: ignore[misc]
        for broker, source in ((b, a), (c, b), (a, c)):
            crossing(source, broker, "probe", "seen")
        time.sleep(2)  # probes that went round settle before the queues are emptied
        for broker in (a, b, c):
            purge(broker.node.url, "seen")
        publish(a.node.url, X, [("k", b"from-a")])
        counts = {name: len(get_all(broker.node.url, "seen", settle=2.0))
                  for name, broker in (("a", a), ("b", b), ("c", c))}
        # Published at A: A has it once; it travels max-hops links, and never back to A.
        expected = {"a": 1, "b": 1, "c": 1 if max_hops >= 2 else 0}
        assert counts == expected, counts
        dropped = sum(link.get("messages_dropped_by_loop_prevention", 0) for br in (a, b, c) for link in links(br))
        assert dropped >= 1
    finally:
        for broker in (a, b, c):
            broker.node.cleanup()


def test_federation_from_rabbitmq(tmp_path: Path) -> None:
    url = os.environ.get(RABBIT_ENV)
    if not url:
        pytest.skip(f"{RABBIT_ENV} is not set: no RabbitMQ to federate from (set it to amqp://user:pass@host:5672/)")
    name = f"leveret-{uuid.uuid4().hex[:6]}"
    down = named(tmp_path, name)
    exchange = f"fed.rabbit-{uuid.uuid4().hex[:8]}"
    conn = pika.BlockingConnection(pika.URLParameters(url))
    conn.channel().exchange_declare(exchange, "topic", durable=False, auto_delete=False)
    conn.close()
    try:
        topology(down.node.url, exchange, {"in": ["orders.*"]})
        federate(down, url, {"expires": 60000})
        wait_for(lambda: running(down), 20, "the link to run")
        deadline = time.monotonic() + 15
        while not get_all(down.node.url, "in", settle=0.3) and time.monotonic() < deadline:
            publish(url, exchange, [("orders.probe", b"probe")])
        purge(down.node.url, "in")
        publish(url, exchange, [("orders.new", b"o1"), ("invoices.new", b"i1"), ("orders.paid", b"o2")])
        got = get_all(down.node.url, "in")
        assert sorted(b for b, _ in got) == [b"o1", b"o2"]
        entry = got[0][1]["x-received-from"][0]
        assert entry["exchange"] == exchange and entry["cluster-name"]  # RabbitMQ's own cluster name
        down.mgmt.ok("DELETE", "/api/policies/%2F/federate")
        wait_for(lambda: links(down) == [], 10, "the link to stop")
    finally:
        down.node.cleanup()
        conn = pika.BlockingConnection(pika.URLParameters(url))
        ch = conn.channel()
        ch.exchange_delete(exchange)
        # What the link left in the shared RabbitMQ (the queue would expire after 60 s anyway).
        ch.queue_delete(f"federation: {exchange} to {name}")
        for suffix in (" A", " B"):
            ch.exchange_delete(f"federation: {exchange} to {name}{suffix}")
        conn.close()


@pytest.mark.skipif(not os.path.exists("/usr/bin/chromium"), reason="/usr/bin/chromium is not installed")
def test_console_lists_links_with_status_and_error(two: tuple[Broker, Broker], tmp_path: Path) -> None:
    up, down = two
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    topology(down.node.url, X, {"q": ["#"]})
    topology(down.node.url, "fed.broken", {"q": ["#"]})
    federate(down, up.node.url)
    down.mgmt.ok("PUT", "/api/parameters/federation-upstream/%2F/gone", {"value": {
        "uri": f"amqp://guest:secret@127.0.0.1:{free_port()}/", "reconnect-delay": 0.2}})
    wait_for(lambda: running(down, 2), 15, "the links to the live upstream to run")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium",
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 700})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(down.mgmt.base + "/")
            page.fill("input[name=username]", "guest")
            page.fill("input[name=password]", "guest")
            page.click("#login button")
            page.wait_for_selector("#totals")
            page.click("a[href='#/federation']")
            rows = page.locator("#federation tr", has_text="fed.broken")
            rows.locator("td", has_text="running").first.wait_for()
            bad = page.locator("#federation tr", has_text="gone").first
            bad.locator("td", has_text="error").first.wait_for()
            text = bad.inner_text()
            assert "refused" in text.lower() and "secret" not in text  # the error; no password anywhere
            shot = tmp_path / "console-federation.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"console screenshot: {shot}")
            assert errors == []
        finally:
            browser.close()


def test_ctl_sets_the_upstream_and_shows_the_links(two: tuple[Broker, Broker]) -> None:
    up, down = two
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEVERET_")}
    env.update(LEVERET_CTL_NODE=down.mgmt.host_port)

    def ctl(*args: str) -> str:
        out = subprocess.run([_python(), "-m", "leveret", "ctl", *args], cwd=REPO_ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, (args, out.stdout, out.stderr)
        return out.stdout

    topology(down.node.url, X, {"q": ["#"]})
    ctl("set_parameter", "federation-upstream", "by-ctl", f'{{"uri": "{up.node.url}", "reconnect-delay": 0.5}}')
    ctl("set_policy", "--apply-to", "exchanges", "fed", r"^fed\.", '{"federation-upstream": "by-ctl"}')
    wait_for(lambda: f"{X}\tby-ctl\t/\trunning\t" in ctl("federation_status"), 15, "ctl to show the link running")
    crossing(up, down, "k", "q")

    # Renamed: the link starts again under an upstream queue of the new name; the old one stops filling.
    ctl("set_cluster_name", "renamed")
    assert down.mgmt.get("/api/cluster-name") == {"name": "renamed"}
    wait_for(lambda: f"federation: {X} to renamed" in {q["name"] for q in up.mgmt.get("/api/queues/%2F")}, 15,
             "the upstream queue of the new name")
    wait_for(lambda: not any(x["name"].startswith(f"federation: {X} to downstream")
                             for x in up.mgmt.get("/api/exchanges/%2F")), 15, "the old name's exchange to go")
    purge(down.node.url, "q")
    crossing(up, down, "k", "q")
    ctl("clear_parameter", "federation-upstream", "by-ctl")
    wait_for(lambda: X not in ctl("federation_status"), 10, "the link to go with its upstream")
