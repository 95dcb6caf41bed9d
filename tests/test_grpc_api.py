"""The native gRPC API in process: generated stubs against BrokerServicer on a grpc.aio server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest

from core.engine.broker import Broker
from core.grpc_api.servicer import decode_properties, encode_properties, make_filter
from harness.brokers import local_broker
from leveret.client import AsyncClient, Deduplicator, LeveretError, Message
from leveret.node.grpc_server import GRPCServer
from leveret_client.proto import leveret_pb2 as pb
from leveret_client.proto import leveret_pb2_grpc as pb_grpc

MD = (("username", "guest"), ("password", "guest"))
WAIT = 5.0


class Env:
    def __init__(self, broker: Broker, server: GRPCServer, channel: grpc.aio.Channel) -> None:
        self.broker = broker
        self.server = server
        self.channel = channel
        self.stub = pb_grpc.BrokerStub(channel)
        self.target = f"127.0.0.1:{server.port}"


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    broker = local_broker()
    server = GRPCServer(broker)
    await server.start("127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield Env(broker, server, channel)
    finally:
        await channel.close()
        await server.stop(0)


async def _code(coro: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    return info.value.code()


async def _next(call: Any, timeout: float = WAIT) -> list[pb.Delivery]:
    r = await asyncio.wait_for(call.read(), timeout)
    assert r is not grpc.aio.EOF
    return list(r.messages)


async def _collect(call: Any, n: int) -> list[pb.Delivery]:
    out: list[pb.Delivery] = []
    while len(out) < n:
        out.extend(await _next(call))
    return out


async def test_queue_rpcs(env: Env) -> None:
    s = env.stub
    info = await s.CreateQueue(pb.CreateQueueRequest(name="q", durable=False), metadata=MD)
    assert (info.name, info.channels) == ("q", 1)
    assert await _code(s.CreateQueue(pb.CreateQueueRequest(name="q"), metadata=MD)) == grpc.StatusCode.ALREADY_EXISTS
    again = await s.CreateQueue(pb.CreateQueueRequest(name="q", exist_ok=True), metadata=MD)
    assert again.name == "q"
    code = await _code(s.CreateQueue(pb.CreateQueueRequest(name="q", durable=True, exist_ok=True), metadata=MD))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert await _code(s.CreateQueue(pb.CreateQueueRequest(name=""), metadata=MD)) == grpc.StatusCode.INVALID_ARGUMENT
    names = [q.name for q in (await s.ListQueues(pb.ListQueuesRequest(), metadata=MD)).queues]
    assert names == ["q"]
    await s.Push(pb.PushRequest(queue="q", content=b"x"), metadata=MD)
    r = await s.DeleteQueue(pb.DeleteQueueRequest(name="q"), metadata=MD)
    assert r.messages_dropped == 1
    assert await _code(s.DeleteQueue(pb.DeleteQueueRequest(name="q"), metadata=MD)) == grpc.StatusCode.NOT_FOUND
    assert await _code(s.Push(pb.PushRequest(queue="q", content=b"x"), metadata=MD)) == grpc.StatusCode.NOT_FOUND


async def test_channel_rpcs(env: Env) -> None:
    s = env.stub
    await s.CreateQueue(pb.CreateQueueRequest(name="q"), metadata=MD)
    ch = await s.CreateChannel(pb.CreateChannelRequest(queue="q", topic="a.*", name="mine"), metadata=MD)
    assert (ch.id, ch.kind) == ("q/mine", pb.FILTER_PATTERN)
    dup = s.CreateChannel(pb.CreateChannelRequest(queue="q", name="mine"), metadata=MD)
    assert await _code(dup) == grpc.StatusCode.ALREADY_EXISTS
    bad = s.CreateChannel(pb.CreateChannelRequest(queue="q", name="a/b"), metadata=MD)
    assert await _code(bad) == grpc.StatusCode.INVALID_ARGUMENT
    missing = s.CreateChannel(pb.CreateChannelRequest(queue="nope"), metadata=MD)
    assert await _code(missing) == grpc.StatusCode.NOT_FOUND
    listed = (await s.ListChannels(pb.ListChannelsRequest(queue="q"), metadata=MD)).channels
    assert [c.id for c in listed] == ["q/", "q/mine"]
    await s.Push(pb.PushRequest(queue="q", topic="a.b", content=b"1"), metadata=MD)
    r = await s.DeleteChannel(pb.DeleteChannelRequest(id="q/mine"), metadata=MD)
    assert r.messages_dropped == 1
    default = s.DeleteChannel(pb.DeleteChannelRequest(id="q/"), metadata=MD)
    assert await _code(default) == grpc.StatusCode.FAILED_PRECONDITION
    gone = s.DeleteChannel(pb.DeleteChannelRequest(id="q/mine"), metadata=MD)
    assert await _code(gone) == grpc.StatusCode.NOT_FOUND
    assert len(env.broker.vhosts["/"].queues["q"].channels) == 1


async def test_authentication(env: Env) -> None:
    s = env.stub
    assert await _code(s.ListQueues(pb.ListQueuesRequest())) == grpc.StatusCode.UNAUTHENTICATED
    wrong = (("username", "guest"), ("password", "nope"))
    assert await _code(s.ListQueues(pb.ListQueuesRequest(), metadata=wrong)) == grpc.StatusCode.UNAUTHENTICATED
    call = s.Subscribe(pb.SubscribeRequest(channel_id="q/"), metadata=wrong)
    assert await _code(call.read()) == grpc.StatusCode.UNAUTHENTICATED
    other_vhost = (*MD, ("vhost", "/nope"))
    assert await _code(s.ListQueues(pb.ListQueuesRequest(), metadata=other_vhost)) == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize(
    ("kind", "topic", "expected"),
    [
        (pb.FILTER_AUTO, "", ["a.b", "a.b.c", "x", "ab"]),
        (pb.FILTER_AUTO, "a.b", ["a.b"]),
        (pb.FILTER_EXACT, "a.*", []),
        (pb.FILTER_PREFIX, "a.b", ["a.b", "a.b.c"]),
        (pb.FILTER_PREFIX, "a", ["a.b", "a.b.c", "ab"]),
        (pb.FILTER_AUTO, "a.*", ["a.b"]),
        (pb.FILTER_PATTERN, "a.#", ["a.b", "a.b.c"]),
        (pb.FILTER_PATTERN, "#", ["a.b", "a.b.c", "x", "ab"]),
    ],
)
async def test_topic_filters(env: Env, kind: int, topic: str, expected: list[str]) -> None:
    s = env.stub
    await s.CreateQueue(pb.CreateQueueRequest(name="q"), metadata=MD)
    ch = await s.CreateChannel(pb.CreateChannelRequest(queue="q", topic=topic, kind=kind), metadata=MD)  # type: ignore[arg-type]
    batch = [pb.PushRequest(topic=t, content=t.encode()) for t in ["a.b", "a.b.c", "x", "ab"]]
    await s.PushBatch(pb.PushBatchRequest(queue="q", messages=batch), metadata=MD)
    call = s.Subscribe(pb.SubscribeRequest(channel_id=ch.id, auto_ack=True), metadata=MD)
    # A marker that every filter lets through... only some do: read what is ready instead.
    got: list[str] = []
    if expected:
        got = [d.topic for d in await _collect(call, len(expected))]
    assert got == expected
    assert len(env.broker.vhosts["/"].queues["q"].channels[1].ready) == 0
    call.cancel()


def test_make_filter_rejects_unknown_kind() -> None:
    with pytest.raises(Exception, match="unknown filter kind"):
        make_filter(99, "x")


async def test_push_properties_roundtrip(env: Env) -> None:
    s = env.stub
    await s.CreateQueue(pb.CreateQueueRequest(name="q"), metadata=MD)
    props = {"content_type": "text/plain", "correlation_id": "c1", "priority": "3", "x-trace": "t"}
    pushed = await s.Push(pb.PushRequest(queue="q", topic="t", content=b"hi", properties=props), metadata=MD)
    assert pushed.id and pushed.offset == 0
    call = s.Subscribe(pb.SubscribeRequest(channel_id="q/", auto_ack=True), metadata=MD)
    (d,) = await _next(call)
    assert (d.id, d.topic, d.content, d.offset, d.redelivered) == (pushed.id, "t", b"hi", 0, False)
    assert dict(d.properties) == {**props, "delivery_mode": "1"}
    assert d.timestamp_ms > 0
    bad = s.Push(pb.PushRequest(queue="q", content=b"x", properties={"priority": "high"}), metadata=MD)
    assert await _code(bad) == grpc.StatusCode.INVALID_ARGUMENT
    spoof = s.Push(pb.PushRequest(queue="q", content=b"x", properties={"user_id": "root"}), metadata=MD)
    assert await _code(spoof) == grpc.StatusCode.FAILED_PRECONDITION
    call.cancel()


def test_property_codec() -> None:
    raw = encode_properties({"content_type": "a/b", "h": "v"}, persistent=True)
    assert decode_properties(raw) == {"content_type": "a/b", "delivery_mode": "2", "h": "v"}


async def test_credit_acks_and_nacks(env: Env) -> None:
    s = env.stub
    await s.CreateQueue(pb.CreateQueueRequest(name="q"), metadata=MD)
    batch = [pb.PushRequest(content=str(i).encode()) for i in range(5)]
    await s.PushBatch(pb.PushBatchRequest(queue="q", messages=batch), metadata=MD)
    call = s.Subscribe(pb.SubscribeRequest(channel_id="q/", prefetch=2), metadata=MD)
    first = await _collect(call, 2)
    assert [d.content for d in first] == [b"0", b"1"]
    qch = env.broker.vhosts["/"].queues["q"].default
    assert (qch.unacked, len(qch.ready)) == (2, 3)  # credit exhausted: nothing more goes out
    r = await s.Ack(pb.AckRequest(delivery_ids=[first[0].delivery_id, 999999]), metadata=MD)
    assert (r.settled, list(r.unknown)) == (1, [999999])
    (third,) = await _next(call)
    assert third.content == b"2"
    # Nack with requeue: back at its place, redelivered.
    r = await s.Nack(pb.NackRequest(delivery_ids=[first[1].delivery_id], requeue=True), metadata=MD)
    assert r.settled == 1
    (again,) = await _next(call)
    assert (again.content, again.redelivered, again.delivery_count) == (b"1", True, 2)
    # Nack without requeue drops it.
    r = await s.Nack(pb.NackRequest(delivery_ids=[again.delivery_id, third.delivery_id], requeue=False), metadata=MD)
    assert r.settled == 2
    rest = await _collect(call, 2)
    assert [d.content for d in rest] == [b"3", b"4"]
    await s.Ack(pb.AckRequest(delivery_ids=[d.delivery_id for d in rest]), metadata=MD)
    assert (qch.unacked, len(qch.ready)) == (0, 0)
    call.cancel()


async def test_redelivery_after_disconnect(env: Env) -> None:
    s = env.stub
    await s.CreateQueue(pb.CreateQueueRequest(name="q"), metadata=MD)
    await s.Push(pb.PushRequest(queue="q", content=b"m"), metadata=MD)
    call = s.Subscribe(pb.SubscribeRequest(channel_id="q/", prefetch=10), metadata=MD)
    (d,) = await _next(call)
    assert not d.redelivered
    call.cancel()
    qch = env.broker.vhosts["/"].queues["q"].default
    for _ in range(500):
        if not qch.consumers and qch.ready:
            break
        await asyncio.sleep(0.01)
    call2 = s.Subscribe(pb.SubscribeRequest(channel_id="q/", prefetch=10), metadata=MD)
    (d2,) = await _next(call2)
    assert (d2.id, d2.redelivered) == (d.id, True)
    r = await s.Ack(pb.AckRequest(delivery_ids=[d.delivery_id]), metadata=MD)
    assert list(r.unknown) == [d.delivery_id]  # the old delivery id died with its stream
    call2.cancel()


async def test_subscription_ends_when_queue_deleted(env: Env) -> None:
    s = env.stub
    await s.CreateQueue(pb.CreateQueueRequest(name="q"), metadata=MD)
    call = s.Subscribe(pb.SubscribeRequest(channel_id="q/"), metadata=MD)
    await call.initial_metadata()
    await s.DeleteQueue(pb.DeleteQueueRequest(name="q"), metadata=MD)
    assert await _code(asyncio.wait_for(call.read(), WAIT)) == grpc.StatusCode.NOT_FOUND
    missing = s.Subscribe(pb.SubscribeRequest(channel_id="q/"), metadata=MD)
    assert await _code(missing.read()) == grpc.StatusCode.NOT_FOUND
    bad = s.Subscribe(pb.SubscribeRequest(channel_id="q"), metadata=MD)
    assert await _code(bad.read()) == grpc.StatusCode.INVALID_ARGUMENT


async def test_watch_cluster(env: Env) -> None:
    s = env.stub
    call = s.WatchCluster(pb.WatchClusterRequest(), metadata=MD)
    first = await asyncio.wait_for(call.read(), WAIT)
    assert (first.kind, first.node) == (pb.ClusterEvent.NODE_UP, env.broker.node_id)
    await s.CreateQueue(pb.CreateQueueRequest(name="w"), metadata=MD)
    await s.DeleteQueue(pb.DeleteQueueRequest(name="w"), metadata=MD)
    created = await asyncio.wait_for(call.read(), WAIT)
    deleted = await asyncio.wait_for(call.read(), WAIT)
    assert (created.kind, created.queue, created.vhost) == (pb.ClusterEvent.QUEUE_CREATED, "w", "/")
    assert (deleted.kind, deleted.queue) == (pb.ClusterEvent.QUEUE_DELETED, "w")
    call.cancel()


async def test_async_client(env: Env) -> None:
    async with AsyncClient(env.target, username="guest", password="guest") as c:
        await c.create_queue("q")
        ch = await c.create_channel("q", topic="news.", kind="prefix")
        ids = await c.push_many("q", [b"a", b"b"], topic="news.x")
        await c.push("q", b"skip", topic="other")
        mid = await c.push("q", b"c", topic="news.y", properties={"k": 1})
        sub = await c.subscribe(ch, prefetch=10)
        got: list[Message] = []
        async for m in sub:
            got.append(m)
            if len(got) == 3:
                break
        assert [m.id for m in got] == [*ids, mid]
        assert got[2].properties["k"] == "1"
        assert await sub.ack(got) == 3
        assert await sub.get(timeout=0.05) is None and sub.available() == 0 and sub.poll() == []
        with pytest.raises(LeveretError) as info:
            await c.subscribe("q/none")
        assert info.value.code == grpc.StatusCode.NOT_FOUND
        status = await c.status_subscriber()
        ev = await status.get(timeout=WAIT)
        assert ev is not None and ev.kind == "NODE_UP"
        status.close()
    async with AsyncClient(env.target, username="guest", password="bad") as bad:
        with pytest.raises(LeveretError) as info:
            await bad.list_queues()
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_deduplicator_is_bounded() -> None:
    d = Deduplicator(capacity=3)
    assert [d.seen(x) for x in "abca"] == [False, False, False, True]
    assert not d.seen("d")  # evicts the oldest untouched id: b
    assert "b" not in d and "a" in d and len(d) == 3
    assert not d.seen("b")


async def test_batched_deliveries_keep_order(env: Env) -> None:
    s = env.stub
    await s.CreateQueue(pb.CreateQueueRequest(name="q"), metadata=MD)
    for start in range(0, 3000, 500):
        batch = [pb.PushRequest(content=b"%d" % i) for i in range(start, start + 500)]
        await s.PushBatch(pb.PushBatchRequest(queue="q", messages=batch), metadata=MD)
    call = s.Subscribe(pb.SubscribeRequest(channel_id="q/", prefetch=1000, max_batch=300), metadata=MD)
    got: list[pb.Delivery] = []
    sizes: list[int] = []
    while len(got) < 3000:
        part = await _next(call)
        sizes.append(len(part))
        got.extend(part)
        r = await s.Ack(pb.AckRequest(delivery_ids=[d.delivery_id for d in part]), metadata=MD)
        assert r.settled == len(part)
    assert [int(d.content) for d in got] == list(range(3000))
    assert [d.offset for d in got] == list(range(3000))
    assert max(sizes) == 300  # several messages per response, capped by max_batch
    call.cancel()


async def test_subscription_ends_when_channel_deleted(env: Env) -> None:
    s = env.stub
    await s.CreateQueue(pb.CreateQueueRequest(name="q"), metadata=MD)
    ch = await s.CreateChannel(pb.CreateChannelRequest(queue="q", name="c"), metadata=MD)
    call = s.Subscribe(pb.SubscribeRequest(channel_id=ch.id, prefetch=1), metadata=MD)
    await call.initial_metadata()
    await s.PushBatch(pb.PushBatchRequest(queue="q", messages=[pb.PushRequest(content=b"1"),
                                                                pb.PushRequest(content=b"2")]), metadata=MD)
    (d,) = await _next(call)
    r = await s.DeleteChannel(pb.DeleteChannelRequest(id=ch.id), metadata=MD)
    assert r.messages_dropped == 1  # "2" was waiting for credit
    assert await _code(asyncio.wait_for(call.read(), WAIT)) == grpc.StatusCode.NOT_FOUND
    ack = await s.Ack(pb.AckRequest(delivery_ids=[d.delivery_id]), metadata=MD)
    assert list(ack.unknown) == [d.delivery_id]
    q = env.broker.vhosts["/"].queues["q"]
    assert [c.name for c in q.channels] == [""] and len(q.default.ready) == 2
