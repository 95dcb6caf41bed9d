"""Dynamic shovels (leveret/links/shovel/) between two single-node brokers, driven through the management API.

Every node here is a real ``leveret serve`` process; messages are published and
consumed with pika. The shovel runs on the source node with ``src-uri
"amqp://"`` (the node itself), so the kill -9 test kills the node that runs the
shovel and holds the source queue, and its restart (on new ports) finds the
shovel again in its store.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pika
import pytest
import trustme

from compat_tests.mgmt_http import Mgmt, q, wait_http
from compat_tests.test_tls import Certs, TLSNode
from harness.node import REPO_ROOT, NodeProcess, _python
from harness.ports import free_port

RABBIT_ENV = "LEVERET_TEST_AMQP_URL"


class Broker:
    def __init__(self, path: Path) -> None:
        self.node = NodeProcess(path / "data", path / "logs")

    def start(self) -> None:
        self.node.start()
        wait_http(self.mgmt)

    @property
    def mgmt(self) -> Mgmt:
        return Mgmt(f"http://127.0.0.1:{self.node.management_port}", "guest", "guest", self.node.url, leveret=True)

    def shovel(self, name: str, value: dict[str, Any]) -> None:
        self.mgmt.ok("PUT", f"/api/parameters/shovel/%2F/{q(name)}", {"value": value})

    def shovels(self) -> list[dict[str, Any]]:
        return list(self.mgmt.get("/api/shovels"))


@pytest.fixture
def two(tmp_path: Path) -> Iterator[tuple[Broker, Broker]]:
    a, b = Broker(tmp_path / "a"), Broker(tmp_path / "b")
    a.start()
    b.start()
    try:
        yield a, b
    finally:
        for broker in (a, b):
            broker.node.cleanup()


def declare(url: str, *queues: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    for queue in queues:
        ch.queue_declare(queue, durable=True)
    conn.close()


def publish(url: str, queue: str, bodies: list[bytes]) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.confirm_delivery()
    for body in bodies:
        ch.basic_publish("", queue, body, pika.BasicProperties(delivery_mode=2))
    conn.close()


def drain(url: str, queue: str, until: Callable[[list[bytes]], bool], timeout: float = 60) -> list[bytes]:
    """Consume (and ack) from ``queue`` until ``until(received)`` holds or the time is up."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    while not until(got) and time.monotonic() < deadline:
        method, _, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            time.sleep(0.05)
            continue
        got.append(body)
    conn.close()
    return got


def count(url: str, queue: str) -> int:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    n = conn.channel().queue_declare(queue, passive=True).method.message_count
    conn.close()
    return int(n)


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def running(broker: Broker, name: str) -> bool:
    return any(s["name"] == name and s["state"] == "running" for s in broker.shovels())


def test_every_confirmed_message_arrives_across_kill9_of_the_shovel_node(two: tuple[Broker, Broker]) -> None:
    a, b = two
    declare(a.node.url, "src")
    a.shovel("move", {"src-uri": "amqp://", "src-queue": "src", "dest-uri": b.node.url, "dest-queue": "dst",
                      "ack-mode": "on-confirm", "src-prefetch-count": 50, "reconnect-delay": 0.5})
    wait_for(lambda: running(a, "move"), 15, "the shovel to run")

    confirmed: list[bytes] = []
    stop = threading.Event()

    def publisher(url: str, prefix: str) -> None:
        # Publishes with confirms until stopped or the node dies; only confirmed bodies are recorded.
        try:
            conn = pika.BlockingConnection(pika.URLParameters(url))
            ch = conn.channel()
            ch.confirm_delivery()
            i = 0
            while not stop.is_set():
                body = f"{prefix}-{i}".encode()
                ch.basic_publish("", "src", body, pika.BasicProperties(delivery_mode=2))
                confirmed.append(body)
                i += 1
        except pika.exceptions.AMQPError:
            return  # the node was killed under it: what was confirmed is recorded

    t = threading.Thread(target=publisher, args=(a.node.url, "before"))
    t.start()
    wait_for(lambda: len(confirmed) >= 1500, 60, "messages published before the kill")
    assert count(b.node.url, "dst") > 0  # the shovel was moving them when the node died
    a.node.kill()  # kill -9: the shovel and the source broker die mid-stream
    t.join(10)
    before = len(confirmed)
    a.node.start()
    wait_http(a.mgmt)
    wait_for(lambda: running(a, "move"), 30, "the shovel to resume after the restart")
    stop.clear()
    t = threading.Thread(target=publisher, args=(a.node.url, "after"))
    t.start()
    wait_for(lambda: len(confirmed) >= before + 500, 60, "messages published after the restart")
    stop.set()
    t.join(10)

    wanted = set(confirmed)
    got = drain(b.node.url, "dst", lambda got: wanted <= set(got), timeout=90)
    missing = wanted - set(got)
    assert not missing, f"{len(missing)} confirmed messages never arrived, e.g. {sorted(missing)[:5]}"
    dups = {body: n for body, n in Counter(got).items() if n > 1}
    print(f"confirmed {len(wanted)} ({before} before the kill), received {len(got)}, duplicates {len(dups)}")
    # A duplicate is a redelivery of a message in flight when the node died: at most the prefetch window.
    assert len(dups) <= 50, f"{len(dups)} duplicates, more than the 50 messages in flight"
    assert count(a.node.url, "src") == 0


def test_src_delete_after_moves_that_many_and_deletes_the_shovel(two: tuple[Broker, Broker]) -> None:
    a, b = two
    declare(a.node.url, "src")
    publish(a.node.url, "src", [f"m{i}".encode() for i in range(10)])
    a.shovel("five", {"src-uri": "amqp://", "src-queue": "src", "dest-uri": b.node.url, "dest-queue": "dst",
                      "src-delete-after": 4})
    wait_for(lambda: a.mgmt.request("GET", "/api/parameters/shovel/%2F/five").status == 404, 30,
             "the shovel to delete itself")
    assert count(b.node.url, "dst") == 4
    assert count(a.node.url, "src") == 6
    assert [s for s in a.shovels() if s["name"] == "five"] == []
    # queue-length: what the queue held when the shovel started (6), and no more.
    a.shovel("rest", {"src-uri": "amqp://", "src-queue": "src", "dest-uri": b.node.url, "dest-queue": "dst",
                      "src-delete-after": "queue-length"})
    wait_for(lambda: a.mgmt.request("GET", "/api/parameters/shovel/%2F/rest").status == 404, 30,
             "the queue-length shovel to delete itself")
    publish(a.node.url, "src", [b"late"])
    assert count(b.node.url, "dst") == 10
    got = drain(b.node.url, "dst", lambda got: len(got) >= 10)
    assert sorted(got) == sorted(f"m{i}".encode() for i in range(10))
    time.sleep(1.5)  # a shovel still running would take "late" within this
    assert count(a.node.url, "src") == 1


def test_status_json_errors_and_ctl(two: tuple[Broker, Broker]) -> None:
    a, b = two
    mgmt = a.mgmt
    # Bad definitions: 400 with the reason, nothing stored.
    for bad, reason in (({"src-queue": "x", "dest-uri": b.node.url}, "src-uri"),
                        ({"src-uri": "amqp://", "dest-uri": b.node.url}, "src-queue"),
                        ({"src-uri": "amqp://", "src-queue": "x", "dest-uri": "http://x"}, "amqp"),
                        ({"src-uri": "amqp://", "src-queue": "x", "dest-uri": b.node.url, "ack-mode": "maybe"},
                         "ack-mode"),
                        ({"src-uri": "amqp://", "src-queue": "x", "dest-uri": b.node.url, "src-delete-after": -1},
                         "src-delete-after")):
        reply = mgmt.request("PUT", "/api/parameters/shovel/%2F/bad", {"value": bad})
        assert reply.status == 400 and reason in reply.body["reason"], (bad, reply)
    assert mgmt.request("GET", "/api/parameters/shovel/%2F/bad").status == 404

    a.shovel("ok", {"src-uri": "amqp://", "src-exchange": "amq.topic", "src-exchange-key": "news.#",
                    "dest-uri": b.node.url, "dest-exchange": "amq.fanout", "dest-add-forward-headers": True,
                    "dest-add-timestamp-header": True, "dest-publish-properties": {"app_id": "shovelled"}})
    dead = f"amqp://guest:secret@127.0.0.1:{free_port()}/"
    a.shovel("broken", {"src-uri": "amqp://", "src-queue": "q2", "dest-uri": dead, "reconnect-delay": 0.2})
    wait_for(lambda: running(a, "ok"), 15, "the good shovel to run")
    wait_for(lambda: any(s["name"] == "broken" and s["state"] == "terminated" for s in a.shovels()), 15,
             "the broken shovel to report its error")
    by_name = {s["name"]: s for s in a.shovels()}
    ok, broken = by_name["ok"], by_name["broken"]
    assert (ok["vhost"], ok["type"], ok["state"], ok["src_exchange"], ok["src_exchange_key"]) == \
        ("/", "dynamic", "running", "amq.topic", "news.#")
    assert ok["node"] and ok["dest_exchange"] == "amq.fanout"
    assert broken["reason"] and "secret" not in broken["dest_uri"]  # the password never shows
    assert mgmt.get("/api/shovels/vhost/%2F/ok")["state"] == "running"
    assert mgmt.request("DELETE", "/api/shovels/vhost/%2F/nope/restart").status == 404

    def sessions() -> int:  # "shovel running" log lines of shovel "ok": one per (re)connection
        return sum(1 for line in a.node.stderr_tail(10**7).splitlines()
                   if '"msg": "shovel running"' in line and '"shovel": "ok"' in line)

    started = sessions()
    mgmt.ok("DELETE", "/api/shovels/vhost/%2F/ok/restart")
    wait_for(lambda: sessions() == started + 1, 15, "the shovel to connect again")

    # A message through the exchange shovel carries x-shovelled (dest-add-forward-headers).
    conn = pika.BlockingConnection(pika.URLParameters(b.node.url))
    ch = conn.channel()
    sink = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(sink, "amq.fanout")
    src = pika.BlockingConnection(pika.URLParameters(a.node.url))
    src.channel().basic_publish("amq.topic", "news.sports", b"goal")
    src.channel().basic_publish("amq.topic", "weather.rain", b"not shovelled")
    deadline = time.monotonic() + 15
    method = None
    while method is None and time.monotonic() < deadline:
        method, props, body = ch.basic_get(sink, auto_ack=True)
        time.sleep(0.05)
    assert method is not None and body == b"goal"
    assert props.headers["x-shovelled"][0]["shovel-name"] == "ok"
    assert abs(props.headers["x-shovelled-timestamp"] - time.time()) < 60 and props.app_id == "shovelled"
    time.sleep(0.5)
    assert ch.basic_get(sink, auto_ack=True)[0] is None  # the other routing key was not bound
    src.close()
    conn.close()

    # leveret ctl: set_parameter / shovel_status / clear_parameter.
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEVERET_")}
    env.update(LEVERET_CTL_NODE=mgmt.host_port)

    def ctl(*args: str) -> str:
        out = subprocess.run([_python(), "-m", "leveret", "ctl", *args], cwd=REPO_ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, (args, out.stdout, out.stderr)
        return out.stdout

    ctl("set_parameter", "shovel", "by-ctl", f'{{"src-uri": "amqp://", "src-queue": "q3", "dest-uri": "{b.node.url}"}}')
    wait_for(lambda: "by-ctl\t/\tdynamic\trunning" in ctl("shovel_status"), 15, "ctl to show the shovel running")
    assert "shovel\tby-ctl\t" in ctl("list_parameters")
    ctl("restart_shovel", "by-ctl")
    wait_for(lambda: "by-ctl\t/\tdynamic\trunning" in ctl("shovel_status"), 15, "the restarted shovel")
    ctl("clear_parameter", "shovel", "by-ctl")
    assert "by-ctl" not in ctl("shovel_status")
    assert mgmt.request("DELETE", "/api/parameters/shovel/%2F/by-ctl").status == 404

    # Definitions: the shovels are exported as parameters and imported back (and run).
    exported = mgmt.get("/api/definitions")
    assert {p["name"] for p in exported["parameters"] if p["component"] == "shovel"} == {"ok", "broken"}
    mgmt.ok("DELETE", "/api/parameters/shovel/%2F/ok")
    mgmt.ok("POST", "/api/definitions", exported)
    wait_for(lambda: running(a, "ok"), 15, "the imported shovel to run")


def test_shovel_survives_a_graceful_restart(two: tuple[Broker, Broker]) -> None:
    a, b = two
    declare(a.node.url, "src")
    a.shovel("keep", {"src-uri": "amqp://", "src-queue": "src", "dest-uri": b.node.url, "dest-queue": "dst"})
    wait_for(lambda: running(a, "keep"), 15, "the shovel to run")
    assert a.node.terminate() == 0
    a.node.start()
    wait_http(a.mgmt)
    assert a.mgmt.get("/api/parameters/shovel/%2F/keep")["value"]["src-queue"] == "src"
    wait_for(lambda: running(a, "keep"), 15, "the stored shovel to run again")
    publish(a.node.url, "src", [b"after restart"])
    assert drain(b.node.url, "dst", lambda got: len(got) >= 1, timeout=15) == [b"after restart"]


def test_a_deleted_source_queue_is_declared_again_and_the_shovel_goes_on(two: tuple[Broker, Broker]) -> None:
    a, b = two
    a.shovel("again", {"src-uri": "amqp://", "src-queue": "gone", "dest-uri": b.node.url, "dest-queue": "dst",
                       "reconnect-delay": 0.2})
    wait_for(lambda: running(a, "again"), 15, "the shovel to run")
    a.mgmt.ok("DELETE", "/api/queues/%2F/gone")  # the broker cancels the shovel's consumer
    wait_for(lambda: a.mgmt.request("GET", "/api/queues/%2F/gone").status == 200 and running(a, "again"), 15,
             "the shovel to declare its source again and run")
    publish(a.node.url, "gone", [b"still moving"])
    assert drain(b.node.url, "dst", lambda got: len(got) >= 1, timeout=15) == [b"still moving"]
    logs = a.node.stderr_tail(100_000)
    assert "cancelled the consumer" in logs and "Traceback" not in logs


def test_amqps_destination_with_rabbitmqs_tls_query_parameters(two: tuple[Broker, Broker], tmp_path: Path) -> None:
    a, _ = two
    certs, other_ca = Certs(tmp_path), tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other_ca))
    b = TLSNode(tmp_path / "tls" / "data", tmp_path / "tls" / "logs",
                ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)])
    b.start()
    try:
        dest = f"amqps://guest:guest@127.0.0.1:{b.amqps_port}/"
        a.shovel("tls", {"src-uri": "amqp://", "src-queue": "t", "dest-uri": f"{dest}?cacertfile={certs.ca_file}",
                         "dest-queue": "t"})
        a.shovel("untrusted", {"src-uri": "amqp://", "src-queue": "u", "dest-queue": "u",
                               "dest-uri": f"{dest}?cacertfile={other_ca}", "reconnect-delay": 0.2})
        wait_for(lambda: running(a, "tls"), 15, "the amqps shovel to run")
        publish(a.node.url, "t", [b"over tls"])
        assert drain(b.url, "t", lambda got: len(got) >= 1, timeout=15) == [b"over tls"]
        # A server certificate its CA file does not vouch for: refused, and said so.
        wait_for(lambda: any(s["name"] == "untrusted" and "CERTIFICATE_VERIFY_FAILED" in s.get("reason", "")
                             for s in a.shovels()), 15, "the untrusted shovel to report the certificate")
    finally:
        b.cleanup()


def test_shovel_from_rabbitmq_into_leveret(tmp_path: Path) -> None:
    url = os.environ.get(RABBIT_ENV)
    if not url:
        pytest.skip(f"{RABBIT_ENV} is not set: no RabbitMQ to shovel from (set it to amqp://user:pass@host:5672/)")
    b = Broker(tmp_path / "b")
    b.start()
    try:
        queue = f"shovel-src-{uuid.uuid4().hex[:8]}"
        declare(url, queue)
        bodies = [f"r{i}".encode() for i in range(200)]
        publish(url, queue, bodies[:100])
        b.shovel("from-rabbit", {"src-uri": url, "src-queue": queue, "dest-uri": b.node.url, "dest-queue": "in"})
        publish(url, queue, bodies[100:])
        got = drain(b.node.url, "in", lambda got: set(bodies) <= set(got), timeout=60)
        assert set(bodies) <= set(got)
        b.mgmt.ok("DELETE", "/api/parameters/shovel/%2F/from-rabbit")
        conn = pika.BlockingConnection(pika.URLParameters(url))
        conn.channel().queue_delete(queue)
        conn.close()
    finally:
        b.node.cleanup()


@pytest.mark.skipif(not os.path.exists("/usr/bin/chromium"), reason="/usr/bin/chromium is not installed")
def test_console_lists_shovels_with_state_and_last_error(two: tuple[Broker, Broker], tmp_path: Path) -> None:
    a, b = two
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    a.shovel("good", {"src-uri": "amqp://", "src-queue": "c1", "dest-uri": b.node.url, "dest-queue": "c1"})
    a.shovel("bad", {"src-uri": "amqp://", "src-queue": "c2", "dest-uri": f"amqp://127.0.0.1:{free_port()}/",
                     "reconnect-delay": 0.2})
    wait_for(lambda: running(a, "good"), 15, "the good shovel to run")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium",
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 700})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(a.mgmt.base + "/")
            page.fill("input[name=username]", "guest")
            page.fill("input[name=password]", "guest")
            page.click("#login button")
            page.wait_for_selector("#totals")
            page.click("a[href='#/shovels']")
            page.locator("#shovels tr", has_text="good").locator("td", has_text="running").wait_for()
            bad = page.locator("#shovels tr", has_text="bad")
            bad.locator("td", has_text="terminated").wait_for()
            assert "Connection refused" in bad.inner_text()  # the last error, as /api/shovels gives it
            shot = tmp_path / "console-shovels.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"console screenshot: {shot}")
            assert errors == []
        finally:
            browser.close()


def test_shovel_from_leveret_into_rabbitmq(tmp_path: Path) -> None:
    url = os.environ.get(RABBIT_ENV)
    if not url:
        pytest.skip(f"{RABBIT_ENV} is not set: no RabbitMQ to shovel into (set it to amqp://user:pass@host:5672/)")
    a = Broker(tmp_path / "a")
    a.start()
    try:
        queue = f"shovel-dest-{uuid.uuid4().hex[:8]}"
        declare(a.node.url, "out")
        bodies = [f"l{i}".encode() for i in range(200)]
        a.shovel("to-rabbit", {"src-uri": "amqp://", "src-queue": "out", "dest-uri": url, "dest-queue": queue,
                               "ack-mode": "on-confirm"})
        publish(a.node.url, "out", bodies)
        got = drain(url, queue, lambda got: set(bodies) <= set(got), timeout=60)
        assert set(bodies) <= set(got)
        a.mgmt.ok("DELETE", "/api/parameters/shovel/%2F/to-rabbit")
        conn = pika.BlockingConnection(pika.URLParameters(url))
        conn.channel().queue_delete(queue)
        conn.close()
    finally:
        a.node.cleanup()
