"""The native gRPC API and its Python client against a real node, with AMQP (pika) on the same queues."""

from __future__ import annotations

import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pika
import pytest
from pika.adapters.blocking_connection import BlockingChannel as AmqpChannel

from harness.node import REPO_ROOT, free_ports, node_env, serve_command
from leveret.client import Client, LeveretError

WAIT = 10.0


@dataclass
class GrpcNode:
    amqp_port: int
    grpc_port: int
    proc: subprocess.Popen[bytes]
    data_dir: Path
    stderr: Path

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def amqp_url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.amqp_port}/"


def _start(data_dir: Path, log_dir: Path) -> GrpcNode:
    amqp_port, grpc_port = free_ports(2)
    stderr = log_dir / f"stderr-{amqp_port}.log"
    with open(stderr, "wb") as err:
        proc = subprocess.Popen(serve_command(amqp_port, grpc_port, data_dir, ()), cwd=REPO_ROOT,
                                stdout=subprocess.DEVNULL, stderr=err, env=node_env())
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            pytest.fail(f"node exited during start-up:\n{stderr.read_text(errors='replace')}", pytrace=False)
        try:
            socket.create_connection(("127.0.0.1", grpc_port), timeout=0.5).close()
            socket.create_connection(("127.0.0.1", amqp_port), timeout=0.5).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail("node did not listen in 30 s", pytrace=False)
            time.sleep(0.05)
    return GrpcNode(amqp_port, grpc_port, proc, data_dir, stderr)


def _stop(node: GrpcNode) -> None:
    if node.proc.poll() is None:
        node.proc.send_signal(signal.SIGTERM)
        try:
            node.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            node.proc.kill()
            node.proc.wait()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrpcNode]:
    work = tmp_path_factory.mktemp("grpc-node")
    (work / "data").mkdir()
    n = _start(work / "data", work)
    yield n
    _stop(n)


@pytest.fixture
def client(node: GrpcNode) -> Iterator[Client]:
    c = Client(node.target, username="guest", password="guest")
    yield c
    c.close()


@pytest.fixture
def amqp(node: GrpcNode) -> Iterator[AmqpChannel]:
    conn = pika.BlockingConnection(pika.URLParameters(node.amqp_url))
    yield conn.channel()
    if conn.is_open:
        conn.close()


def _name(prefix: str) -> str:
    return f"{prefix}-{time.monotonic_ns()}"


def test_every_rpc_through_the_client(client: Client) -> None:
    q = _name("rpc")
    status = client.status_subscriber()
    assert status.get(timeout=WAIT).kind == "NODE_UP"  # type: ignore[union-attr]
    assert client.create_queue(q).name == q
    with pytest.raises(LeveretError) as info:
        client.create_queue(q)
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert q in [x.name for x in client.list_queues()]
    ch = client.create_channel(q, topic="a.#")
    assert [c.id for c in client.list_channels(q)] == [f"{q}/", ch]
    mid = client.push(q, b"hello", topic="a.b", properties={"content_type": "text/plain"})
    sub = client.subscribe(ch, prefetch=5)
    m = sub.get(timeout=WAIT)
    assert m is not None
    assert (m.id, m.topic, m.content, m.offset, m.redelivered) == (mid, "a.b", b"hello", 0, False)
    assert m.properties["content_type"] == "text/plain"
    assert sub.ack(m) == 1
    assert client.nack(m) == 0  # already settled
    sub.close()
    assert client.delete_channel(ch) == 0
    assert client.delete_queue(q) == 1  # the default channel still held it
    events = [status.get(timeout=WAIT) for _ in range(2)]
    assert [(e.kind, e.queue) for e in events if e] == [("QUEUE_CREATED", q), ("QUEUE_DELETED", q)]
    status.close()


def test_authentication_refused(node: GrpcNode) -> None:
    for user, password in ((None, None), ("guest", "wrong"), ("nobody", "guest")):
        with Client(node.target, username=user, password=password) as c:
            with pytest.raises(LeveretError) as info:
                c.list_queues()
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(LeveretError) as info:
                c.subscribe("x/")
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_amqp_publish_reaches_native_channels(client: Client, amqp: AmqpChannel) -> None:
    q = _name("interop-in")
    amqp.queue_declare(q, auto_delete=False)
    amqp.queue_bind(q, "amq.topic", routing_key="news.#")
    exact = client.create_channel(q, topic="news.sport")
    prefix = client.create_channel(q, topic="news.we", kind="prefix")
    pattern = client.create_channel(q, topic="news.*.local")
    subs = {name: client.subscribe(ch, prefetch=10) for name, ch in
            (("exact", exact), ("prefix", prefix), ("pattern", pattern))}
    props = pika.BasicProperties(content_type="application/json", headers={"source": "amqp"}, delivery_mode=1)
    for rk in ("news.sport", "news.weather", "news.city.local", "news.other"):
        amqp.basic_publish("amq.topic", rk, rk.encode(), props)
    got = {name: sub.get(timeout=WAIT) for name, sub in subs.items()}
    assert {k: m.topic for k, m in got.items() if m} == {
        "exact": "news.sport", "prefix": "news.weather", "pattern": "news.city.local"}
    m = got["exact"]
    assert m is not None and m.properties["content_type"] == "application/json" and m.properties["source"] == "amqp"
    for sub in subs.values():
        assert sub.get(timeout=0.2) is None  # nothing else passed the filters
        sub.close()
    # The default channel (AMQP consumers) holds all four.
    assert amqp.queue_declare(q, passive=True).method.message_count == 4
    amqp.queue_delete(q)


def test_native_push_reaches_amqp_consumer(client: Client, amqp: AmqpChannel) -> None:
    q = _name("interop-out")
    client.create_queue(q)
    mid = client.push(q, b"native", topic="orders.new", properties={"content_type": "text/plain", "x-k": "v"})
    method, props, body = None, None, None
    deadline = time.monotonic() + WAIT
    while method is None and time.monotonic() < deadline:
        method, props, body = amqp.basic_get(q, auto_ack=True)
    assert method is not None and props is not None
    assert (body, method.routing_key, method.exchange) == (b"native", "orders.new", "")
    assert props.content_type == "text/plain" and props.headers == {"x-k": "v"}
    # And through basic.consume.
    client.push(q, b"second", topic="t")
    for _method, _props, body in amqp.consume(q, auto_ack=True, inactivity_timeout=WAIT):
        assert body == b"second"
        break
    amqp.cancel()
    assert mid
    client.delete_queue(q)


def test_select_on_fileno(client: Client) -> None:
    q = _name("select")
    client.create_queue(q)
    sub = client.subscribe(f"{q}/", prefetch=100)
    assert select.select([sub], [], [], 0)[0] == []
    client.push_many(q, [b"1", b"2", b"3"])
    seen: list[bytes] = []
    deadline = time.monotonic() + WAIT
    while len(seen) < 3 and time.monotonic() < deadline:
        readable, _, _ = select.select([sub.fileno()], [], [], WAIT)
        if readable:
            batch = sub.poll()
            seen.extend(m.content for m in batch)
            sub.ack(batch)
    assert seen == [b"1", b"2", b"3"]
    assert sub.available() == 0 and select.select([sub], [], [], 0)[0] == []
    sub.close()
    client.delete_queue(q)


def test_credit_and_redelivery_after_disconnect(node: GrpcNode, client: Client) -> None:
    q = _name("credit")
    client.create_queue(q)
    client.push_many(q, [b"%d" % i for i in range(4)])
    with Client(node.target) as other:
        sub = other.subscribe(f"{q}/", prefetch=2)
        first = [sub.get(timeout=WAIT), sub.get(timeout=WAIT)]
        assert [m.content for m in first if m] == [b"0", b"1"]
        assert sub.get(timeout=0.2) is None  # no credit left
        sub.ack(first[0])  # type: ignore[arg-type]
        third = sub.get(timeout=WAIT)
        assert third is not None and third.content == b"2"
    # That client went away holding 1 and 2 unacked: they come back, redelivered, in order
    # (once the node has seen the stream end: wait for it, another connection is not ordered with it).
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        (default,) = [c for c in client.list_channels(q) if c.id == f"{q}/"]
        if default.consumers == 0 and default.unacked == 0:
            break
        time.sleep(0.01)
    assert (default.ready, default.unacked) == (3, 0)
    sub = client.subscribe(f"{q}/", prefetch=10)
    got = [sub.get(timeout=WAIT) for _ in range(3)]
    assert [(m.content, m.redelivered) for m in got if m] == [(b"1", True), (b"2", True), (b"3", False)]
    assert got[0] is not None and first[1] is not None and got[0].id == first[1].id
    sub.ack([m for m in got if m])
    sub.close()
    client.delete_queue(q)


def test_durable_push_survives_restart(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    n = _start(tmp_path / "data", tmp_path)
    try:
        with Client(n.target) as c:
            c.create_queue("durable-q", durable=True)
            mid = c.push("durable-q", b"keep", topic="t")  # persistent by default: returns after the commit
        n.proc.kill()
        n.proc.wait()
        n = _start(tmp_path / "data", tmp_path)
        with Client(n.target) as c:
            sub = c.subscribe("durable-q/", prefetch=1)
            m = sub.get(timeout=WAIT)
            assert m is not None and (m.id, m.content, m.redelivered, m.topic) == (mid, b"keep", True, "t")
            assert m.properties["delivery_mode"] == "2"
            sub.ack(m)
            sub.close()
    finally:
        _stop(n)


def test_grpc_subscriber_example(node: GrpcNode, client: Client, amqp: AmqpChannel) -> None:
    """examples/grpc_subscriber.py receives AMQP publishes and pushes whose topic matches its pattern."""
    q = _name("example")
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen(
        [sys.executable, str(root / "examples" / "grpc_subscriber.py"), "--target", node.target, "--queue", q,
         "--topic", "news.sport.#", "--count", "2", "--idle-timeout", "20"],
        cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        assert "subscribed" in proc.stdout.readline()
        # One over AMQP through a topic exchange (the routing key is the topic), two pushed natively.
        exchange = _name("example-x")
        amqp.exchange_declare(exchange, "topic", auto_delete=True)
        amqp.queue_bind(q, exchange, "news.#")
        amqp.basic_publish(exchange, "news.weather", b"skip")
        amqp.basic_publish(exchange, "news.sport.uk", b"goal")
        client.push(q, b"match", topic="news.sport")
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert out.splitlines() == ["news.sport.uk goal", "news.sport match"]
