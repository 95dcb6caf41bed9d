"""The etcd cluster end to end (issue #5): three node processes, one etcd, one Postgres.

Each test starts its own cluster (harness/cluster.py) on a shared
etcd and Postgres server (own cluster name, own database), except the tests
that only read, which share one cluster. Lease TTL is 2 s, so a failover takes
a few seconds.

What is checked, with real clients (pika, and the confirm-tracking raw
publisher of harness/node.py):
- a kill -9 of a durable queue's owner, or a SIGSTOP past its lease, during a
  confirmed publishing stream through another node loses no confirmed
  message; duplicates come with redelivered=true only; after a SIGSTOP the
  takeover does not wait for the stopped process;
- an owner stopped (SIGSTOP) past its lease is fenced: what its own clients
  sent it meanwhile is, after SIGCONT, either refused or handed to the new
  owner (stored after the new owner's writes, exactly the confirmed ones), the
  stored epoch is the new owner's, and it serves the queue through the new owner;
- an etcd restart keeps queues, owners and bindings, and the cluster keeps serving;
- a joining node receives new durable queues (fewest queues first);
- declarations, publishes and consumers work through any node; status and
  drain; SQLite with --etcd is refused.

When an assertion fails, the tail of every node's log and of etcd's is in its
message or in the captured teardown output.
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pika
import pika.exceptions
import pytest

from harness.cluster import Cluster
from harness.etcd import EtcdServer
from harness.etcd import etcd_server_fixture as etcd_server_fixture  # the module-scoped `etcd_server`
from harness.node import REPO_ROOT, ConfirmingPublisher, ConnectionLost, _python, free_ports, node_env
from harness.pg import throwaway_postgres

pytestmark = pytest.mark.timeout(120)

LEASE_TTL = 2
PERSISTENT = pika.BasicProperties(delivery_mode=2)


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster_postgres() -> Iterator[str]:
    with throwaway_postgres() as dsn:
        yield dsn


@pytest.fixture
def make_cluster(etcd_server: EtcdServer, cluster_postgres: str) -> Iterator[Callable[..., Cluster]]:
    """Start a cluster on the module's etcd and Postgres; closed (and its logs printed) at teardown."""
    clusters: list[Cluster] = []

    def factory(size: int = 3, own_etcd: bool = False, **kwargs: object) -> Cluster:
        cluster = Cluster(
            size, etcd=None if own_etcd else etcd_server, postgres_dsn=cluster_postgres, lease_ttl=LEASE_TTL,
            **kwargs,  # type: ignore[arg-type]
        )  # fmt: skip
        clusters.append(cluster)
        cluster.__enter__()
        return cluster

    yield factory
    for cluster in clusters:
        print(cluster.diagnostics())  # shown by pytest for a failed test only
        cluster.close()


@pytest.fixture(scope="module")
def shared_cluster(etcd_server: EtcdServer, cluster_postgres: str) -> Iterator[Cluster]:
    """One cluster for the tests that neither stop nodes nor depend on placement counts."""
    with Cluster(3, etcd=etcd_server, postgres_dsn=cluster_postgres, lease_ttl=LEASE_TTL) as cluster:
        yield cluster
        print(cluster.diagnostics())


# -- client helpers ----------------------------------------------------------------------------


def qname(tag: str) -> str:
    return f"cl.{tag}.{uuid.uuid4().hex[:8]}"


def connect(cluster: Cluster, node_id: str) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.URLParameters(cluster.url(node_id)))


def declare(cluster: Cluster, node_id: str, queue: str, durable: bool = True, **kwargs: object) -> None:
    with connect(cluster, node_id) as conn:
        conn.channel().queue_declare(queue, durable=durable, **kwargs)  # type: ignore[arg-type]


def publish_confirmed(cluster: Cluster, node_id: str, queue: str, bodies: list[bytes], exchange: str = "") -> None:
    """Publish persistent messages with confirms through ``node_id``; each must be confirmed."""
    with connect(cluster, node_id) as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        for body in bodies:
            ch.basic_publish(exchange, queue, body, PERSISTENT, mandatory=True)


def get_all(cluster: Cluster, node_id: str, queue: str, expect: int, timeout: float = 15.0) -> list[tuple[bytes, bool]]:
    """Consume (manual ack) through ``node_id`` until ``expect`` messages arrived and 0.5 s passed without more."""
    got: list[tuple[bytes, bool]] = []
    deadline = time.monotonic() + timeout
    with connect(cluster, node_id) as conn:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=500)
        for method, _props, body in ch.consume(queue, inactivity_timeout=0.5):
            if method is None:
                if len(got) >= expect or time.monotonic() > deadline:
                    break
                continue
            got.append((body, bool(method.redelivered)))
            ch.basic_ack(method.delivery_tag)
            if time.monotonic() > deadline:
                break
        ch.cancel()
    return got


@dataclass
class Collector:
    """A pika consumer (manual acks) in a thread, through one node, for the whole test.

    When its subscription ends (consumer cancelled by the broker, channel or
    connection closed), it records why and subscribes again after 0.2 s.
    """

    url: str
    queue: str
    prefetch: int = 200
    deliveries: list[tuple[bytes, bool, float]] = field(default_factory=list)
    interruptions: list[str] = field(default_factory=list)
    subscriptions: int = 0
    stop_flag: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, name=f"collector-{self.queue}", daemon=True)

    def start(self) -> Collector:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stop_flag.set()
        self.thread.join(15)

    def bodies(self) -> set[bytes]:
        return {b for b, _r, _t in list(self.deliveries)}

    def wait_for(self, wanted: set[bytes], timeout: float) -> set[bytes]:
        """Wait until every body of ``wanted`` was delivered; the ones still missing."""
        deadline = time.monotonic() + timeout
        while True:
            missing = wanted - self.bodies()
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.1)

    def duplicates_not_flagged(self) -> list[bytes]:
        """Bodies delivered more than once where a later delivery was not marked redelivered."""
        seen: set[bytes] = set()
        bad = []
        for body, redelivered, _t in list(self.deliveries):
            if body in seen and not redelivered:
                bad.append(body)
            seen.add(body)
        return bad

    def _run(self) -> None:
        while not self.stop_flag.is_set():
            conn = None
            try:
                conn = pika.BlockingConnection(pika.URLParameters(self.url))
                ch = conn.channel()
                ch.basic_qos(prefetch_count=self.prefetch)
                self.subscriptions += 1
                for method, _props, body in ch.consume(self.queue, inactivity_timeout=0.2):
                    if self.stop_flag.is_set():
                        break
                    if method is None:
                        continue
                    self.deliveries.append((body, bool(method.redelivered), time.monotonic()))
                    ch.basic_ack(method.delivery_tag)
                else:
                    self.interruptions.append("consumer cancelled by the broker")
            except (pika.exceptions.AMQPError, OSError) as exc:
                self.interruptions.append(f"{type(exc).__name__}: {exc}")
                self.stop_flag.wait(0.2)
            finally:
                if conn is not None and conn.is_open:
                    try:
                        conn.close()
                    except (pika.exceptions.AMQPError, OSError):
                        pass


@dataclass
class Stream:
    """Persistent publishes with confirms through one node, as a steady stream; reconnects when closed.

    Bodies are ``<prefix>-<n>`` with n counting across connections; ``acked``
    maps each confirmed body to the monotonic time it was published at.
    """

    port: int
    queue: str
    prefix: str
    window: int = 200
    batch: int = 10
    interval: float = 0.01
    publishers: list[ConfirmingPublisher] = field(default_factory=list)
    sent_at: list[list[tuple[bytes, float]]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    count: int = 0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            pub = ConfirmingPublisher()
            try:
                await pub.open("127.0.0.1", self.port)
            except (OSError, ConnectionLost, AssertionError, TimeoutError) as exc:
                self.problems.append(f"open: {exc!r}")
                await asyncio.sleep(0.2)
                continue
            self.publishers.append(pub)
            sent: list[tuple[bytes, float]] = []
            self.sent_at.append(sent)
            try:
                while not stop.is_set() and not pub.closed.is_set():
                    if pub.outstanding >= self.window:
                        await pub.wait_progress(0.1)
                        continue
                    now = time.monotonic()
                    for _ in range(self.batch):
                        body = f"{self.prefix}-{self.count:07d}".encode()
                        self.count += 1
                        pub.publish("", self.queue, body)
                        sent.append((body, now))
                    await pub.flush()
                    await asyncio.sleep(self.interval)
            except ConnectionLost as exc:
                self.problems.append(f"lost: {exc}")
            if pub.closed.is_set():
                self.problems.append(f"closed: {pub.close_reason}")
                await asyncio.sleep(0.2)

    async def settle(self, timeout: float) -> None:
        for pub in self.publishers:
            await pub.wait_settled(pub.published, timeout)

    async def close(self) -> None:
        for pub in self.publishers:
            await pub.close()

    def acked(self) -> dict[bytes, float]:
        out = {}
        for pub, sent in zip(self.publishers, self.sent_at, strict=True):
            for seq in pub.acked():
                body, at = sent[seq - 1]
                out[body] = at
        return out

    def summary(self) -> str:
        parts = []
        for i, pub in enumerate(self.publishers):
            parts.append(
                f"publisher {i}: published {pub.published}, acked {len(pub.acked())}, nacked {len(pub.nacked())}, "
                f"waiting {pub.outstanding}, closed: {pub.close_reason}, anomalies: {pub.anomalies[:3]}"
            )
        return "; ".join(parts) + f"; problems: {self.problems[:5]}"


# -- the etcd fixture itself -------------------------------------------------------------------


def test_etcd_fixture_keeps_data_across_restart(etcd_server: EtcdServer) -> None:
    key = f"/fixture-check/{uuid.uuid4().hex}"
    etcd_server.put(key, "v1")
    kv = etcd_server.get(key)
    assert kv is not None and kv.value == "v1" and kv.create_revision > 0
    url = etcd_server.url
    etcd_server.restart()
    assert etcd_server.url == url
    again = etcd_server.get(key)
    assert again == kv, f"{again} != {kv}"
    assert etcd_server.get(key + "/absent") is None


# -- any node serves any client ----------------------------------------------------------------


def test_inequivalent_redeclare_through_another_node_is_406(shared_cluster: Cluster) -> None:
    cluster = shared_cluster
    queue = qname("equiv")
    declare(cluster, "n1", queue, arguments={"x-max-length": 10})
    cluster.wait_owner(queue)
    for node_id, kwargs in (
        ("n2", {"durable": True, "arguments": {"x-max-length": 20}}),
        ("n3", {"durable": False, "arguments": {"x-max-length": 10}}),
        ("n2", {"durable": True}),
    ):
        with connect(cluster, node_id) as conn:
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as info:
                conn.channel().queue_declare(queue, **kwargs)  # type: ignore[arg-type]
        assert info.value.reply_code == 406, f"{node_id} {kwargs}: {info.value!r}"
        assert "PRECONDITION_FAILED" in info.value.reply_text, info.value.reply_text
    # The same declaration, passive or equivalent, is fine anywhere.
    with connect(cluster, "n3") as conn:
        ch = conn.channel()
        ch.queue_declare(queue, durable=True, arguments={"x-max-length": 10})
        ch.queue_declare(queue, passive=True)


def test_publish_through_non_owner_reaches_consumer_on_third_node(shared_cluster: Cluster) -> None:
    cluster = shared_cluster
    queue = qname("fwd")
    declare(cluster, "n1", queue)
    owner = cluster.wait_owner(queue)
    assert owner is not None
    publisher, consumer = cluster.others(owner)
    bodies = [f"fwd-{i}".encode() for i in range(200)]
    publish_confirmed(cluster, publisher, queue, bodies)
    got = get_all(cluster, consumer, queue, len(bodies))
    assert [b for b, _r in got] == bodies, f"through {publisher} to {owner}, consumed on {consumer}"
    assert not any(r for _b, r in got)

    # A non-durable queue lives on the declaring node and is reachable from the others too.
    local = qname("fwd-local")
    declare(cluster, "n1", local, durable=False)
    assert cluster.wait_owner(local) == "n1"
    publish_confirmed(cluster, "n2", local, [b"a", b"b", b"c"])
    assert [b for b, _r in get_all(cluster, "n3", local, 3)] == [b"a", b"b", b"c"]


def test_cluster_status_json(shared_cluster: Cluster) -> None:
    cluster = shared_cluster
    durable, local = qname("st"), qname("st-local")
    declare(cluster, "n2", durable)
    declare(cluster, "n3", local, durable=False)
    owner = cluster.wait_owner(durable)
    cluster.wait_owner(local)
    doc = cluster.status()
    nodes = {n["id"]: n for n in doc["nodes"]}
    assert set(nodes) == {"n1", "n2", "n3"}, doc
    for node_id, entry in nodes.items():
        assert entry["region"] == "r1"
        assert str(cluster[node_id].amqp_port) in str(entry["amqp"]), entry
        assert str(cluster[node_id].grpc_port) in str(entry["grpc"]), entry
        owned = [q for q in doc["queues"] if q["owner"] == node_id]
        assert entry["queues"] == len(owned), (entry, owned)
    queues = {(q["vhost"], q["name"]): q for q in doc["queues"]}
    assert queues["/", durable]["owner"] == owner
    assert queues["/", durable]["epoch"] == cluster.epoch(durable)
    assert queues["/", durable]["durable"] is True
    assert queues["/", local]["owner"] == "n3"
    assert queues["/", local]["durable"] is False


# -- failover, etcd restart, membership, drain -----------------------------------------------------


@pytest.mark.parametrize("how", ["kill", "stop"])
async def test_owner_lost_during_confirmed_stream_loses_no_confirmed_message(
    make_cluster: Callable[..., Cluster], how: str
) -> None:
    """kill -9 of the owner, or SIGSTOP past its lease (SIGCONT at the end), mid-stream.

    The stream is published through another node, so the owner is committing
    forwarded publishes when it is lost. After a SIGSTOP the takeover must not
    wait for the stopped process: publishes are confirmed again while it is
    still stopped.
    """
    cluster = make_cluster()
    queue = qname(how)
    declare(cluster, "n1", queue)
    owner = cluster.wait_owner(queue)
    assert owner is not None
    old_epoch = cluster.epoch(queue)
    publisher_node, consumer_node = cluster.others(owner)
    collector = Collector(cluster.url(consumer_node), queue).start()
    stream = Stream(cluster[publisher_node].amqp_port, queue, how)
    stop = asyncio.Event()
    task = asyncio.create_task(stream.run(stop))
    acked_while_lost: dict[bytes, float] = {}
    try:
        deadline = time.monotonic() + 20
        while len(stream.acked()) < 300:
            assert time.monotonic() < deadline and not task.done(), f"stream did not start: {stream.summary()}"
            await asyncio.sleep(0.05)
        lost_at = time.monotonic()
        if how == "kill":
            cluster[owner].send_kill()
        else:
            cluster.pause(owner)
        await asyncio.sleep(LEASE_TTL + 5)  # the stream goes on through the failover
        acked_while_lost = stream.acked()
        if how == "stop":
            cluster.resume(owner)
            await asyncio.sleep(1)
        stop.set()
        await asyncio.wait_for(task, 15)
        await stream.settle(20)
    finally:
        stop.set()
        await stream.close()
        if how == "stop" and cluster[owner].paused:
            cluster.resume(owner)
    if how == "kill":
        cluster[owner].proc.wait(10)  # type: ignore[union-attr]
    new_owner = cluster.wait_owner(queue, lambda o: o not in (None, owner))
    acked = stream.acked()
    missing = await asyncio.to_thread(collector.wait_for, set(acked), 30)
    collector.stop()
    context = (
        f"\nstream: {stream.summary()}\nconsumer on {consumer_node}: {len(collector.deliveries)} deliveries, "
        f"{collector.subscriptions} subscriptions, interruptions {collector.interruptions[:5]}\n"
        f"{cluster.diagnostics()}"
    )
    print(context.split("\ncluster ")[0])
    assert all(not p.anomalies for p in stream.publishers), context
    assert any(at > lost_at for at in acked_while_lost.values()), (
        f"nothing published after the owner was lost ({how}) was confirmed within {LEASE_TTL + 5} s{context}"
    )
    assert not missing, f"{len(missing)} confirmed messages never delivered, e.g. {sorted(missing)[:5]}{context}"
    assert not collector.duplicates_not_flagged(), f"duplicates without redelivered: {context}"
    new_epoch = cluster.epoch(queue)
    assert old_epoch is not None and new_epoch is not None and new_epoch > old_epoch
    assert new_owner in cluster.others(owner)
    assert cluster.stored_epoch(queue) == new_epoch, context
    if how == "stop":
        assert cluster[owner].running(), f"the old owner exited after SIGCONT{context}"


async def test_paused_owner_is_fenced_after_takeover(make_cluster: Callable[..., Cluster]) -> None:
    """A publisher connected to the owner itself writes into its socket while the owner is stopped.

    After SIGCONT the old owner may refuse those publishes (it can no longer
    write under its epoch) or, once it knows it lost the queue, forward them to
    the new owner like any non-owner: both are correct. What must never happen:
    a write under the old epoch after the takeover (it would sit among or
    before the new owner's writes), a refused publish stored anyway, or a
    confirmed one missing.
    """
    cluster = make_cluster()
    queue = qname("fence")
    declare(cluster, "n1", queue)
    old = cluster.wait_owner(queue)
    assert old is not None
    helper = cluster.others(old)[0]
    base = [f"base-{i}".encode() for i in range(20)]
    publish_confirmed(cluster, helper, queue, base)

    # A publisher on the old owner itself, confirmed once before the pause.
    stale_pub = ConfirmingPublisher()
    await stale_pub.open("127.0.0.1", cluster[old].amqp_port)
    stale_pub.publish("", queue, b"pre-0")
    await stale_pub.flush()
    assert await stale_pub.wait_settled(1, 10) and stale_pub.acked() == {1}, stale_pub.close_reason
    old_epoch = cluster.epoch(queue)

    cluster.pause(old)
    try:
        stale = [f"stale-{i}".encode() for i in range(50)]
        for body in stale:
            stale_pub.publish("", queue, body)
        await stale_pub.flush()  # into the kernel's socket buffer; the old owner reads it after SIGCONT

        new = await asyncio.to_thread(cluster.wait_owner, queue, lambda o: o not in (None, old), 5 * LEASE_TTL + 10)
        new_epoch = cluster.epoch(queue)
        assert old_epoch is not None and new_epoch is not None and new_epoch > old_epoch
        fresh = [f"fresh-{i}".encode() for i in range(20)]
        await asyncio.to_thread(publish_confirmed, cluster, helper, queue, fresh)
    finally:
        cluster.resume(old)

    # Give the old owner time to read the buffered publishes and to notice it lost its lease.
    await stale_pub.wait_settled(stale_pub.published, 2 * LEASE_TTL + 6)
    await asyncio.sleep(1)
    stale_acked = {stale[seq - 2] for seq in stale_pub.acked() - {1}}
    stale_nacked = {stale[seq - 2] for seq in stale_pub.nacked()}
    status = (
        f"stale publisher: {len(stale_acked)} acked, {len(stale_nacked)} nacked, waiting {stale_pub.outstanding}, "
        f"closed: {stale_pub.close_reason}\n{cluster.diagnostics()}"
    )
    await stale_pub.close()
    print(status.splitlines()[0])  # which way the implementation went, in the captured output
    # Every publisher gets an answer: confirmed, nacked, or its channel closed.
    assert stale_pub.outstanding == 0 or stale_pub.close_reason is not None, f"publishes left hanging\n{status}"
    assert cluster.stored_epoch(queue) == new_epoch, status
    assert cluster.owner(queue) == new, status
    assert cluster[old].running(), f"the old owner exited after SIGCONT\n{status}"

    # What the old owner received while paused was either refused (nack / close) or handed to
    # the new owner, which stored it after its own writes: a write of the old owner under its
    # old epoch would sit among or before them (or collide with them). Nothing refused is stored.
    stored = cluster.stored_bodies(queue)
    stale_stored = [b for b in stored if b.startswith(b"stale-")]
    assert not set(stale_stored) & stale_nacked, f"nacked publishes were stored anyway\n{status}"
    assert set(stale_stored) == stale_acked, f"stored {len(stale_stored)} stale messages\n{status}"
    expected_order = [*base, b"pre-0", *fresh, *[b for b in stale if b in stale_acked]]
    assert stored == expected_order, f"store holds {[b.decode() for b in stored]}\n{status}"

    # The old owner dropped its copy: through it, the queue holds what the new owner has, once each.
    got = await asyncio.to_thread(get_all, cluster, old, queue, len(expected_order))
    bodies = sorted(b for b, _r in got)
    assert bodies == sorted(expected_order), f"through the old owner: {[b.decode() for b in bodies]}\n{status}"


def test_etcd_restart_keeps_queues_owners_and_bindings(make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster(own_etcd=True)  # this test restarts etcd
    queues = [qname(f"etcd{i}") for i in range(3)]
    exchange = qname("etcdx")
    with connect(cluster, "n1") as conn:
        ch = conn.channel()
        ch.exchange_declare(exchange, "direct", durable=True)
        for i, q in enumerate(queues):
            ch.queue_declare(q, durable=True)
            ch.queue_bind(q, exchange, routing_key=f"k{i}")
    owners = {q: cluster.wait_owner(q) for q in queues}
    epochs = {q: cluster.epoch(q) for q in queues}
    before = cluster.status()

    cluster.restart_etcd()
    time.sleep(2 * LEASE_TTL + 1)  # long enough for a lease to lapse if the nodes failed to keep it alive

    cluster.wait_members(["n1", "n2", "n3"])
    assert {q: cluster.owner(q) for q in queues} == owners, cluster.diagnostics()
    assert {q: cluster.epoch(q) for q in queues} == epochs, cluster.diagnostics()
    after = cluster.status()
    key = lambda q: (q["vhost"], q["name"], q["owner"], q["durable"])  # noqa: E731
    assert sorted(map(key, after["queues"])) == sorted(map(key, before["queues"]))

    # Routing through the exchange from another node, to consumers on a third.
    for i, q in enumerate(queues):
        with connect(cluster, "n3") as conn:
            ch = conn.channel()
            ch.confirm_delivery()
            for j in range(5):
                ch.basic_publish(exchange, f"k{i}", f"{q}-{j}".encode(), PERSISTENT, mandatory=True)
        got = get_all(cluster, "n2", q, 5)
        assert [b for b, _r in got] == [f"{q}-{j}".encode() for j in range(5)], cluster.diagnostics()
    # New declarations still get owners.
    late = qname("etcd-late")
    declare(cluster, "n2", late)
    assert cluster.wait_owner(late) in {"n1", "n2", "n3"}


def test_joining_node_receives_new_durable_queues(make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster()
    first = [qname(f"join{i}") for i in range(6)]
    for i, q in enumerate(first):
        declare(cluster, f"n{i % 3 + 1}", q)
    placed = {q: cluster.wait_owner(q) for q in first}
    counts = {n: list(placed.values()).count(n) for n in ("n1", "n2", "n3")}
    assert counts == {"n1": 2, "n2": 2, "n3": 2}, f"placement by fewest queues: {placed}"

    cluster.add_node()
    assert "n4" in {n["id"] for n in cluster.status()["nodes"]}
    later = [qname(f"late{i}") for i in range(2)]
    for q in later:
        declare(cluster, "n1", q)
    late_owners = [cluster.wait_owner(q) for q in later]
    assert late_owners == ["n4", "n4"], f"new durable queues should go to the empty node n4: {late_owners}"
    publish_confirmed(cluster, "n2", later[0], [b"to-n4"])
    assert [b for b, _r in get_all(cluster, "n3", later[0], 1)] == [b"to-n4"]


async def test_drain_moves_queues_and_consumers_keep_receiving(make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster()
    queues = [qname(f"drain{i}") for i in range(3)]
    for q in queues:
        declare(cluster, "n1", q)
    owners = {q: cluster.wait_owner(q) for q in queues}
    queue = queues[0]
    drained = owners[queue]
    assert drained is not None
    consumer_node, publisher_node = cluster.others(drained)
    collector = Collector(cluster.url(consumer_node), queue).start()
    stream = Stream(cluster[publisher_node].amqp_port, queue, "drain", batch=5)
    stop = asyncio.Event()
    task = asyncio.create_task(stream.run(stop))
    try:
        await asyncio.sleep(1.0)
        proc = await asyncio.create_subprocess_exec(
            _python(), "-m", "leveret", "cluster", "drain", drained, "--etcd", cluster.etcd.url,
            "--cluster", cluster.name, cwd=REPO_ROOT, env=node_env(),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        drained_at = time.monotonic()
        await asyncio.sleep(2.0)
        stop.set()
        await asyncio.wait_for(task, 15)
        await stream.settle(20)
    finally:
        stop.set()
        await stream.close()
    acked = stream.acked()
    missing = await asyncio.to_thread(collector.wait_for, set(acked), 20)
    collector.stop()
    context = (
        f"\ndrain exit {proc.returncode}: {out.decode()!r} {err.decode()[-2000:]}\nstream: {stream.summary()}\n"
        f"consumer on {consumer_node}: {len(collector.deliveries)} deliveries, {collector.subscriptions} "
        f"subscriptions, interruptions {collector.interruptions[:5]}\n{cluster.diagnostics()}"
    )
    print(context.split("\ncluster ")[0])
    assert proc.returncode == 0, context
    moved = {q: cluster.owner(q) for q in queues}
    assert all(o not in (None, drained) for o in moved.values()), f"after drain: {moved}{context}"
    assert not [q for q in cluster.status()["queues"] if q["owner"] == drained], context
    assert cluster[drained].running(), context
    assert not missing, f"{len(missing)} confirmed messages not delivered{context}"
    assert not collector.duplicates_not_flagged(), context
    assert any(at > drained_at for at in acked.values()), f"nothing confirmed after the drain{context}"
    assert collector.subscriptions == 1 and not collector.interruptions, f"the consumer was interrupted{context}"


# -- configuration -----------------------------------------------------------------------------


def test_sqlite_with_etcd_is_refused(etcd_server: EtcdServer, tmp_path: object) -> None:
    amqp_port, grpc_port = free_ports(2)
    cmd = [
        _python(), "-m", "leveret", "serve", "--node-id", "n1", "--bind", "127.0.0.1",
        "--amqp-port", str(amqp_port), "--grpc-port", str(grpc_port), "--data-dir", str(tmp_path),
        "--log-format", "json", "--store", "sqlite", "--etcd", etcd_server.url, "--cluster", "refused",
    ]  # fmt: skip
    try:
        done = subprocess.run(cmd, cwd=REPO_ROOT, env=node_env(), capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the node kept running with --store sqlite --etcd: {exc.stderr!r}") from exc
    assert done.returncode != 0, done.stderr
    assert "postgres" in done.stderr.lower(), done.stderr
    assert etcd_server.get_prefix("/leveret/refused/") == []


# -- last: the shared cluster has been up for a while by now ------------------------------------

QUIET_SECONDS = 30


def test_peer_sessions_stay_up(shared_cluster: Cluster) -> None:
    """The nodes' standing gRPC session streams to each other do not break on their own.

    Last in the module so the shared cluster has usually been up long enough
    (gRPC keepalive pings the server's policy refuses end in GOAWAY
    "too_many_pings" after a few of them); when run alone it waits.
    """
    cluster = shared_cluster
    up = time.monotonic() - cluster.started_at
    if up < QUIET_SECONDS:
        time.sleep(QUIET_SECONDS - up)
    lost = {
        node_id: [r for r in node.log_records() if r.get("msg") == "session stream to peer lost"]
        for node_id, node in cluster.nodes.items()
    }
    assert not any(lost.values()), f"session streams lost: {lost}\n{cluster.diagnostics()}"
