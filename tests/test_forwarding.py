"""Inter-node forwarding (core/cluster/: wire, link, remote, service) between two in-process brokers over real gRPC.

No etcd here: the test plays the coordinator, giving node A a remote view of
a queue node B owns. The cluster as a whole is tested with processes in
compat_tests/test_cluster.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from core.cluster import internal_pb2_grpc
from core.cluster.auth import PeerAuth
from core.cluster.link import Peers
from core.cluster.remote import QueueRemote
from core.cluster.service import NodeService
from core.engine.broker import Broker
from core.engine.queue import Consumer, Queue
from core.model import properties
from core.model.message import Message, QueuedMessage

PERSISTENT = properties.encode({"delivery_mode": 2})
TRANSIENT = properties.encode({})


class Sink:
    """A consumer's receiving end that records deliveries and has a prefetch."""

    def __init__(self, prefetch: int = 0) -> None:
        self.prefetch = prefetch
        self.got: list[QueuedMessage] = []
        self.cancelled = False

    def has_credit(self, consumer: Consumer) -> bool:
        return not self.prefetch or consumer.unacked < self.prefetch

    def deliver(self, consumer: Consumer, qm: QueuedMessage) -> None:
        self.got.append(qm)

    def consumer_cancelled(self, consumer: Consumer) -> None:
        self.cancelled = True


async def _owned_by(broker: Broker) -> Any:
    async def owned(vhost: str, queue: str) -> Queue | None:
        q = broker.vhosts[vhost].queues.get(queue)
        return q if q is not None and q.remote is None else None

    return owned


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Broker, Broker, Queue, Queue, Peers]]:
    owner = Broker(node_id="b")
    other = Broker(node_id="a")
    q_owner = owner.vhosts["/"].declare_queue("q", None, durable=True)
    q_remote = other.vhosts["/"].declare_queue("q", None, durable=True)
    auth = PeerAuth(secret=b"a test cluster secret")
    server = grpc.aio.server(interceptors=[auth.server_interceptor()])  # as the cluster port's (auth.py)
    internal_pb2_grpc.add_NodeServicer_to_server(NodeService(owner, await _owned_by(owner), auth), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    broken: list[str] = []
    peers = Peers(lambda node: f"127.0.0.1:{port}" if node == "b" else None, broken.append, auth)
    q_remote.remote = QueueRemote(q_remote, peers, "b")
    try:
        yield owner, other, q_owner, q_remote, peers
    finally:
        await peers.close()
        await server.stop(0)


async def _until(predicate: Any, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def test_forwarded_publishes_reach_the_owner_in_order_and_are_answered(pair: Any) -> None:
    _, _, q_owner, q_remote, _ = pair
    answers: list[bool] = []
    for i in range(50):
        assert q_remote.enqueue(Message("", "q", PERSISTENT, f"m{i}".encode()))
        q_remote.remote.when_forwarded(answers.append)
    await _until(lambda: len(answers) == 50)
    assert answers == [True] * 50
    assert [qm.message.body for qm in q_owner.default.ready] == [f"m{i}".encode() for i in range(50)]
    assert q_remote.message_count == 0  # nothing is kept on the forwarding node


async def test_owner_refusal_is_a_negative_answer(pair: Any) -> None:
    owner, _, _, q_remote, _ = pair
    full = owner.vhosts["/"].declare_queue(
        "full", None, arguments={"x-max-length": 1, "x-overflow": "reject-publish"}
    )
    assert full.enqueue(Message("", "full", TRANSIENT, b"first"))
    remote_full = pair[1].vhosts["/"].declare_queue("full", None, arguments=dict(full.arguments))
    remote_full.remote = QueueRemote(remote_full, pair[4], "b")
    answers: list[bool] = []
    remote_full.enqueue(Message("", "full", TRANSIENT, b"second"))
    remote_full.remote.when_forwarded(answers.append)
    await _until(lambda: answers)
    assert answers == [False]


async def test_proxied_consumer_honours_prefetch_and_settles_at_the_owner(pair: Any) -> None:
    _, _, q_owner, q_remote, _ = pair
    for i in range(10):
        q_owner.enqueue(Message("", "q", PERSISTENT, f"m{i}".encode()))
    sink = Sink(prefetch=3)
    consumer = Consumer("c1", q_remote.default, sink, no_ack=False, prefetch=3)
    q_remote.default.add_consumer(consumer)
    await _until(lambda: len(sink.got) == 3)
    await asyncio.sleep(0.1)
    assert len(sink.got) == 3  # the window is the local prefetch: no more arrive
    assert q_owner.default.unacked == 3
    # Ack two, reject one without requeue: the owner settles all three.
    for qm in sink.got[:2]:
        q_remote.default.settle(qm, consumer)
    q_remote.default.discard([(sink.got[2], consumer)])
    await _until(lambda: len(sink.got) == 6)
    await _until(lambda: q_owner.default.unacked == 3 and len(q_owner.default.ready) == 4)
    # The consumer goes away, then its three unacked are requeued (as a closing
    # AMQP channel does): with no subscription left, they go back to the owner.
    q_remote.default.remove_consumer(consumer)
    q_remote.default.requeue([(qm, consumer) for qm in sink.got[3:6]])
    assert len(q_remote.default.ready) == 0
    await _until(lambda: q_owner.default.unacked == 0 and len(q_owner.default.ready) == 7)
    bodies = [qm.message.body for qm in q_owner.default.ready]
    assert bodies == [f"m{i}".encode() for i in range(3, 10)]  # order kept, requeued in place


async def test_session_end_requeues_everything_it_held(pair: Any) -> None:
    _, _, q_owner, q_remote, peers = pair
    for i in range(5):
        q_owner.enqueue(Message("", "q", PERSISTENT, f"m{i}".encode()))
    sink = Sink()
    q_remote.default.add_consumer(Consumer("c1", q_remote.default, sink, no_ack=False))
    await _until(lambda: len(sink.got) == 5)
    assert q_owner.default.unacked == 5
    await peers.close()  # the non-owner node goes away
    await _until(lambda: q_owner.default.unacked == 0 and len(q_owner.default.ready) == 5)
    assert all(qm.redelivered for qm in q_owner.default.ready)


async def test_publishes_wait_for_an_owner_and_follow_it(pair: Any) -> None:
    _, _, q_owner, q_remote, _ = pair
    q_remote.remote.set_owner(None)  # failover in progress
    answers: list[bool] = []
    q_remote.enqueue(Message("", "q", TRANSIENT, b"held"))
    q_remote.remote.when_forwarded(answers.append)
    await asyncio.sleep(0.05)
    assert answers == [] and q_owner.message_count == 0
    q_remote.remote.set_owner("b")
    await _until(lambda: answers == [True])
    assert [qm.message.body for qm in q_owner.default.ready] == [b"held"]


async def test_basic_get_through_the_owner_sees_earlier_forwarded_publishes(pair: Any) -> None:
    _, _, _, q_remote, _ = pair
    link = q_remote.remote.link
    assert link is not None
    q_remote.enqueue(Message("", "q", TRANSIENT, b"just published"))
    await link.barrier()
    qm, remaining = await link.get("/", "q", no_ack=True)
    assert qm is not None and qm.message.body == b"just published" and remaining == 0
    empty, _ = await link.get("/", "q", no_ack=True)
    assert empty is None


async def test_forwarding_past_the_high_water_mark_raises_congestion_until_answered(
    pair: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from core.cluster import link as link_module

    _, other, q_owner, q_remote, peers = pair
    monkeypatch.setattr(link_module, "FORWARD_HIGH_WATER", 64 * 1024)
    states: list[bool] = []
    link = q_remote.remote.link
    assert link is not None
    link.on_congestion = states.append
    for _ in range(100):  # 100 x 4 KiB, sent in one batch: over the mark until the owner answers
        q_remote.enqueue(Message("", "q", TRANSIENT, b"x" * 4096))
    await _until(lambda: len(q_owner.default.ready) == 100)
    await _until(lambda: states == [True, False])
    assert not link.congested and link.inflight_bytes == 0


async def test_broker_congestion_reaches_its_flow_listeners() -> None:
    broker = Broker(node_id="a")
    seen: list[bool] = []
    broker.flow_listeners.append(seen.append)
    broker.set_forward_congestion(True)
    broker.set_forward_congestion(True)  # no repeat
    broker.set_forward_congestion(False)
    assert seen == [True, False] and not broker.forward_congested


class _Link:
    """Where the unpacked deliveries' settlements would be reported (never called here)."""


def _mixed_messages() -> list[tuple[bytes, bytes, Message]]:
    """Forwards whose queue, names, properties and ids change at different records."""
    headers = properties.encode({"headers": {"k": "v"}, "delivery_mode": 2, "expiration": "60000"})
    out = []
    for i, (vhost, queue, exchange, rk, props) in enumerate([
        (b"/", b"q1", "", "q1", TRANSIENT),
        (b"/", b"q1", "", "q1", TRANSIENT),
        (b"/", b"q1", "amq.direct", "q1", TRANSIENT),
        (b"/", b"q1", "amq.direct", "q1", headers),
        (b"/", b"q2", "amq.direct", "q2", headers),
        (b"other", b"q2", "amq.direct", "q2", headers),
        (b"/", b"q1", "", "q1", PERSISTENT),
        (b"/", b"q1", "", "q1", PERSISTENT),
    ]):
        m = Message(exchange, rk, props, f"body {i}".encode() * i, node="a")
        if i in (1, 5):
            m.id = f"id-{i}"
        out.append((vhost, queue, m))
    return out


def test_packed_forwards_unpack_to_the_same_messages_in_runs_per_queue() -> None:
    from core.cluster.wire import Packer, unpack_forwarded

    sent = _mixed_messages()
    packer = Packer()
    for vhost, queue, m in sent:
        packer.forwarded(vhost, queue, m)
    data = packer.take()
    runs = unpack_forwarded(data, "b")
    assert [(v, q, len(ms)) for v, q, ms in runs] == [("/", "q1", 4), ("/", "q2", 1), ("other", "q2", 1),
                                                     ("/", "q1", 2)]  # fmt: skip
    got = [m for _, _, ms in runs for m in ms]
    for (_, _, m), g in zip(sent, got, strict=True):
        assert (g.exchange, g.routing_key, g.props, g.body, g.timestamp) == (
            m.exchange, m.routing_key, m.props, m.body, m.timestamp)  # fmt: skip
        assert g.summary.delivery_mode == m.summary.delivery_mode
        assert g.summary.expiration == m.summary.expiration and g.headers == m.headers
        assert g._id == m._id and g.node == "b"
    # A new batch starts afresh: its first record carries every field again.
    packer.forwarded(*sent[1])
    again = unpack_forwarded(packer.take(), "b")
    assert [(v, q, [m.body for m in ms]) for v, q, ms in again] == [("/", "q1", [sent[1][2].body])]
    with pytest.raises(ValueError):
        unpack_forwarded(data[len(data) // 2 :], "b")


def test_packed_deliveries_unpack_to_the_same_messages() -> None:
    from core.cluster.wire import Packer, unpack_deliveries

    packer = Packer()
    qms = []
    for i, (_, _, m) in enumerate(_mixed_messages()):
        qm = QueuedMessage(m, 100 + i)
        qm.redelivered = i % 3 == 0
        qm.delivery_count = i
        packer.delivery(1000 + i, qm)
        qms.append(qm)
    got = unpack_deliveries(packer.take(), _Link(), "b", 7)  # type: ignore[arg-type]
    assert len(got) == len(qms)
    for qm, g in zip(qms, got, strict=True):
        m, gm = qm.message, g.message
        assert (g.remote_id, g.offset, g.redelivered, g.delivery_count, g.sub) == (
            1000 + qm.offset - 100, qm.offset, qm.redelivered, qm.delivery_count, 7)  # fmt: skip
        assert (gm.exchange, gm.routing_key, gm.props, gm.body, gm.timestamp, gm._id) == (
            m.exchange, m.routing_key, m.props, m.body, m.timestamp, m._id)  # fmt: skip
        assert gm.summary.delivery_mode == m.summary.delivery_mode and gm.headers == m.headers
        assert g.expires_at is None and not g.persisted and not g.reject


async def test_a_peer_speaking_another_internal_protocol_is_refused(pair: Any) -> None:
    """Mixed versions would misread each other's packed records: the call is refused, naming both versions."""
    from core.cluster import internal_pb2
    from core.cluster.wire import INTERNAL_PROTOCOL

    _, _, _, _, peers = pair
    link = peers.link("b")
    assert link is not None
    for metadata in ((), (("leveret-internal-protocol", "0"),)):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await link.stub.Stats(internal_pb2.QueueRef(vhost="/", queue="q"), timeout=5,
                                  metadata=link.auth.metadata(metadata))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"this node's {INTERNAL_PROTOCOL}" in (info.value.details() or "")
    assert (await link.stats("/", "q")) == (0, 0)  # the node's own calls name the protocol


async def test_a_caller_without_the_cluster_secret_is_refused(pair: Any) -> None:
    """The internal service reads and removes messages: no token, a wrong secret or a replayed token is refused."""
    from core.cluster import internal_pb2
    from core.cluster.wire import PROTOCOL_MD

    owner, _, q_owner, _, peers = pair
    assert q_owner.enqueue(Message("", "q", TRANSIENT, b"secret body"))
    link = peers.link("b")
    assert link is not None
    stranger = PeerAuth(secret=b"not the cluster's secret")
    ref = internal_pb2.QueueRef(vhost="/", queue="q")
    stats, purge = "/leveret.internal.v1.Node/Stats", "/leveret.internal.v1.Node/Purge"
    token = link.auth.metadata(PROTOCOL_MD, stats)
    await link.stub.Stats(ref, timeout=5, metadata=token)  # the genuine token works once
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await link.stub.Stats(ref, timeout=5, metadata=token)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # A token covers its method: one minted for Stats does not open Purge, even unused.
    for metadata in (stranger.metadata(PROTOCOL_MD, purge), link.auth.metadata(PROTOCOL_MD, stats)):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await link.stub.Purge(ref, timeout=5, metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # No token at all: a channel of its own (the link's channel adds one to every call).
    async with grpc.aio.insecure_channel(link.address) as bare:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await internal_pb2_grpc.NodeStub(bare).Purge(ref, timeout=5, metadata=PROTOCOL_MD)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert q_owner.message_count == 1  # nothing was purged
    assert (await link.stats("/", "q")) == (1, 0)


async def test_forwarded_batches_wait_while_the_owner_has_a_resource_alarm(pair: Any) -> None:
    """#17: the owner's memory or disk alarm holds batches from other nodes, as it blocks its own publishers."""
    from core.engine.alarms import MEMORY

    owner, _, q_owner, q_remote, _ = pair
    owner.alarms.set(MEMORY, True)
    answers: list[bool] = []
    assert q_remote.enqueue(Message("", "q", TRANSIENT, b"held"))
    q_remote.remote.when_forwarded(answers.append)
    await asyncio.sleep(0.5)
    assert answers == [] and q_owner.message_count == 0
    owner.alarms.set(MEMORY, False)
    await _until(lambda: answers == [True])
    assert [qm.message.body for qm in q_owner.default.ready] == [b"held"]
