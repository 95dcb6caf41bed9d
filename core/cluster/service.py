"""The owner side of the inter-node transport: ``NodeService`` answers the peers' calls.

``Node/Forward`` enqueues forwarded batches through the one publish path
(core/engine/publish.py) and answers each batch after its commit;
``Node/Session`` runs a peer's proxied consumers (``_OwnerSession``) on the
queues this node owns, and its ``basic.get``; ``Purge``, ``CommitOffset`` and
``Stats`` answer for an owned queue. Every call is checked first: the caller is
of this cluster (core/cluster/auth.py) and speaks this node's wire format
(core/cluster/wire.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

from core.cluster import internal_pb2 as pb
from core.cluster import internal_pb2_grpc as pb_grpc
from core.cluster.auth import PeerAuth
from core.cluster.wire import INTERNAL_PROTOCOL, PROTOCOL_KEY, Packer, unpack_forwarded
from core.engine import direct_reply, flow, publish
from core.engine.queue import Consumer, QueueChannel
from core.engine.stream import StreamQueue
from core.engine.stream_args import parse_reader
from core.model.errors import BrokerError
from core.model.fieldtable import decode_table
from core.model.message import Message, QueuedMessage
from core.model.ratelog import RateLimitedLog

if TYPE_CHECKING:
    from core.engine.broker import Broker
    from core.engine.queue import Queue

log = logging.getLogger("leveret.cluster")

# Forwarded messages enqueued per loop turn: a batch is up to BATCH_BYTES (~14k
# messages of 256 B, ~150 ms of work at ~10 µs each), which would keep the loop
# from every connection's acks and heartbeats; 512 is ~5 ms (docs/notes/flow.md).
FORWARD_SLICE = 512

OwnedQueue = Callable[[str, str], Awaitable["Queue | None"]]


class _OwnerSession:
    """One peer's session on this node: its proxied consumers and their unacked deliveries."""

    def __init__(self, broker: Broker, owned: OwnedQueue, out: asyncio.Queue[pb.SessionEvent | None]) -> None:
        self.broker = broker
        self.owned = owned
        self.out = out
        self.ids = itertools.count(1)
        self.consumers: dict[int, Consumer] = {}
        self.sub_of: dict[int, int] = {}  # id(consumer) -> sub
        self.unacked: dict[int, tuple[QueuedMessage, Consumer | None, QueueChannel]] = {}
        self._pending: dict[int, Packer] = {}
        self._flush_scheduled = False

    # ConsumerSink
    def has_credit(self, consumer: Consumer) -> bool:
        return consumer.unacked < consumer.prefetch

    def deliver(self, consumer: Consumer, qm: QueuedMessage) -> None:
        did = next(self.ids)
        self.unacked[did] = (qm, consumer, consumer.channel)
        sub = self.sub_of[id(consumer)]
        batch = self._pending.get(sub)
        if batch is None:
            batch = self._pending[sub] = Packer()
        batch.delivery(did, qm)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def consumer_cancelled(self, consumer: Consumer) -> None:
        sub = self.sub_of.pop(id(consumer), None)
        if sub is None:
            return
        self.consumers.pop(sub, None)
        self._flush()
        self.out.put_nowait(pb.SessionEvent(kind=pb.SessionEvent.CANCELLED, sub=sub, reason="queue gone or moved"))

    def _flush(self) -> None:
        self._flush_scheduled = False
        pending, self._pending = self._pending, {}
        for sub, batch in pending.items():
            self.out.put_nowait(pb.SessionEvent(kind=pb.SessionEvent.DELIVERIES, sub=sub, packed=batch.take()))

    # controls
    async def handle(self, c: pb.SessionControl) -> None:
        kind = c.kind
        if kind == pb.SessionControl.ACK:
            self._settle(c.ids, "ack")
        elif kind == pb.SessionControl.REQUEUE:
            self._settle(c.ids, "requeue")
        elif kind == pb.SessionControl.REJECT:
            self._settle(c.ids, "reject")
        elif kind == pb.SessionControl.SUBSCRIBE:
            q = await self.owned(c.vhost, c.queue)
            if q is None:
                self.out.put_nowait(pb.SessionEvent(kind=pb.SessionEvent.CANCELLED, sub=c.sub,
                                                    reason="not the owner of this queue"))
                return
            try:
                if isinstance(q, StreamQueue):
                    # A stream consumer on another node: its own reader, here.
                    args = decode_table(c.arguments)[0] if c.arguments else {}
                    spec, group, commit = parse_reader(args)
                    qch: QueueChannel = q.open_reader(spec, name=f"proxy-{c.sub}", group=group,
                                                      commit_on_settle=commit)
                else:
                    args, qch = {}, q.default
                consumer = Consumer(f"proxy-{c.sub}", qch, self, no_ack=False, arguments=args,
                                    prefetch=max(1, c.window))
                self.consumers[c.sub] = consumer
                self.sub_of[id(consumer)] = c.sub
                qch.add_consumer(consumer)
            except BrokerError as exc:
                gone = self.consumers.pop(c.sub, None)
                if gone is not None:
                    self.sub_of.pop(id(gone), None)
                self.out.put_nowait(pb.SessionEvent(kind=pb.SessionEvent.CANCELLED, sub=c.sub, reason=str(exc)))
        elif kind == pb.SessionControl.WINDOW:
            current = self.consumers.get(c.sub)
            if current is not None:
                current.prefetch = max(1, c.window)
                current.channel.dispatch()
        elif kind == pb.SessionControl.UNSUBSCRIBE:
            gone = self.consumers.pop(c.sub, None)
            if gone is not None:
                self.sub_of.pop(id(gone), None)
                gone.channel.remove_consumer(gone)
        elif kind == pb.SessionControl.GET:
            await self._get(c)

    async def _get(self, c: pb.SessionControl) -> None:
        q = await self.owned(c.vhost, c.queue)
        if q is None:
            self.out.put_nowait(pb.SessionEvent(kind=pb.SessionEvent.ERROR, sub=c.sub, code=320,
                                                reason="not the owner of this queue"))
            return
        q.touch()
        qch = q.default
        qm = await qch.get_loaded(c.no_ack)  # waits if the head is being read from the store (core/engine/paging.py)
        if qm is None:
            self.out.put_nowait(pb.SessionEvent(kind=pb.SessionEvent.GET_EMPTY, sub=c.sub))
            return
        did = next(self.ids)
        if not c.no_ack:
            self.unacked[did] = (qm, None, qch)
        one = Packer()
        one.delivery(did, qm)
        self.out.put_nowait(pb.SessionEvent(kind=pb.SessionEvent.GET_OK, sub=c.sub, packed=one.take(),
                                            remaining=len(qch.ready)))

    def _settle(self, ids: Any, how: str) -> None:
        # Runs once per acked message of every proxied consumer (py-spy: 21 % of
        # the owner's time), so the queue channel's checks are made once per run
        # of ids on the same channel, and nothing is allocated per id.
        unacked = self.unacked
        ack = how == "ack"
        touched: dict[int, tuple[QueueChannel, list[tuple[QueuedMessage, Consumer | None]]]] = {}
        live: QueueChannel | None = None  # the channel of the id before, if its queue is still ours
        items: list[tuple[QueuedMessage, Consumer | None]] = []
        for did in ids:
            entry = unacked.pop(did, None)
            if entry is None:
                continue
            qm, consumer, qch = entry
            if qch is not live:
                queue = qch.queue
                if queue.deleted or queue.remote is not None:
                    continue  # the queue moved away: its new owner redelivers from the store
                live = qch
                group = touched.get(id(qch))
                if group is None:
                    group = touched[id(qch)] = (qch, [])
                items = group[1]
            if ack:
                qch.settle(qm, consumer)
            else:
                items.append((qm, consumer))
        for qch, items in touched.values():
            if how == "requeue":
                qch.requeue(items)
            elif how == "reject":
                qch.discard(items)
            else:
                qch.dispatch()

    def close(self) -> None:
        for consumer in list(self.consumers.values()):
            consumer.channel.remove_consumer(consumer)
        self.consumers.clear()
        self.sub_of.clear()
        self._settle(list(self.unacked), "requeue")


async def _check_peer(context: grpc.aio.ServicerContext, auth: PeerAuth, refused: RateLimitedLog) -> None:
    """A caller must prove it is of this cluster (core/cluster/auth.py) and speak this node's protocol."""
    metadata = context.invocation_metadata() or ()
    reason = auth.refusal(metadata)
    if reason is not None:
        refused.warning(context.peer().rpartition(":")[0],
                        "a call to the cluster port was refused: not a member of this cluster", reason=reason)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "not a member of this cluster")
    theirs = dict(metadata).get(PROTOCOL_KEY)
    if theirs == INTERNAL_PROTOCOL:
        return
    theirs = theirs or "1 (no version sent: an older node)"
    log.error("a peer node speaks another internal protocol: refused; run one Leveret version on every node",
              extra={"peer": context.peer(), "theirs": theirs, "ours": INTERNAL_PROTOCOL})
    await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                        f"internal protocol {theirs} is not this node's {INTERNAL_PROTOCOL}: run one Leveret "
                        "version on every node of a cluster")


async def _enqueue_fairly(q: Queue, messages: list[Message], outcome: publish.Outcome) -> list[bool]:
    """``publish.enqueue_batch`` in slices of FORWARD_SLICE, a loop turn apart, waiting while flow control holds.

    While the owner's queue is behind its consumers the next slice (and the next
    batch) waits, so the stream's gRPC window fills and the forwarding node's
    FORWARD_HIGH_WATER stops it reading its publishers.
    """
    call = flow.HeldCall()
    oks: list[bool] = []
    for start in range(0, len(messages), FORWARD_SLICE):
        if start:
            await asyncio.sleep(0)
            if q.deleted or q.remote is not None:  # gone, or handed over, while we yielded
                return oks + [False] * (len(messages) - start)
        previous = flow.swap(call)
        try:
            oks += publish.enqueue_batch(q, messages[start : start + FORWARD_SLICE], outcome)
        finally:
            flow.swap(previous)
        await flow.released(call)
    return oks


class NodeService(pb_grpc.NodeServicer):
    """The owner's side of forwarding and proxied subscriptions."""

    def __init__(self, broker: Broker, owned: OwnedQueue, auth: PeerAuth) -> None:
        self.broker = broker
        self.owned = owned
        self.auth = auth
        self._refused = RateLimitedLog(log)

    async def _enqueue_batch(self, batch: pb.ForwardBatch) -> asyncio.Future[pb.ForwardResult]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[pb.ForwardResult] = loop.create_future()
        accepted: list[bool] = []
        # One outcome for the whole batch: answered once the messages that the
        # confirm rule says wait for the commit (core/engine/publish.py) are committed.
        outcome = publish.Outcome()
        node = self.broker.node_id
        queues: dict[tuple[str, str], Queue | None] = {}
        for vhost, queue, messages in unpack_forwarded(batch.packed, node):
            if queue.startswith(direct_reply.PREFIX):
                # A reply to a requester connected here (direct reply-to across nodes).
                for message in messages:
                    accepted.append(self.broker.reply_to.deliver(queue, message))
                continue
            key = (vhost, queue)
            if key in queues:
                q = queues[key]
            else:
                q = queues[key] = await self.owned(vhost, queue)
            if q is None or q.remote is not None or q.deleted:
                accepted += [False] * len(messages)
                continue
            accepted += await _enqueue_fairly(q, messages, outcome)
        result = pb.ForwardResult(seq=batch.seq, accepted=accepted)

        def settled(ok: bool) -> None:
            if not ok:
                result.error = outcome.error or "store: not committed"
            if not fut.done():
                fut.set_result(result)

        outcome.seal(self.broker.committer).on_settled(settled)
        return fut

    async def Forward(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[pb.ForwardBatch], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ForwardResult]:
        await _check_peer(context, self.auth, self._refused)
        results: asyncio.Queue[asyncio.Future[pb.ForwardResult] | None] = asyncio.Queue()

        async def read() -> None:
            try:
                async for batch in request_iterator:
                    # A resource alarm here holds forwarded batches; the sending node's
                    # forwarding then backs up and its flow control holds its publishers.
                    await self.broker.alarms.wait_clear()
                    results.put_nowait(await self._enqueue_batch(batch))
            finally:
                results.put_nowait(None)

        reader = asyncio.get_running_loop().create_task(read())
        try:
            while (fut := await results.get()) is not None:
                yield await fut
        finally:
            reader.cancel()

    async def Session(  # noqa: N802
        self, request_iterator: AsyncIterator[pb.SessionControl], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SessionEvent]:
        await _check_peer(context, self.auth, self._refused)
        out: asyncio.Queue[pb.SessionEvent | None] = asyncio.Queue()
        session = _OwnerSession(self.broker, self.owned, out)

        async def read() -> None:
            try:
                async for control in request_iterator:
                    await session.handle(control)
            except Exception:  # a broken peer ends its session, never the node
                log.exception("session control failed")
            finally:
                out.put_nowait(None)

        reader = asyncio.get_running_loop().create_task(read())
        try:
            while (event := await out.get()) is not None:
                yield event
        finally:
            reader.cancel()
            session.close()

    async def Purge(self, request: pb.QueueRef, context: grpc.aio.ServicerContext) -> pb.PurgeResult:  # noqa: N802
        await _check_peer(context, self.auth, self._refused)
        q = await self.owned(request.vhost, request.queue)
        if q is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not the owner of this queue")
            raise AssertionError("unreachable")
        return pb.PurgeResult(purged=q.purge())

    async def CommitOffset(  # noqa: N802
        self, request: pb.GroupOffset, context: grpc.aio.ServicerContext
    ) -> pb.CommitResult:
        await _check_peer(context, self.auth, self._refused)
        q = await self.owned(request.vhost, request.queue)
        if not isinstance(q, StreamQueue):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not the owner of this stream")
            raise AssertionError("unreachable")
        q.set_committed(request.group, request.offset)
        committer = self.broker.committer
        if q.storage is not None and committer is not None:
            error = await committer.committed()
            if error is not None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"the store did not commit the offset: {error}")
        return pb.CommitResult()

    async def Stats(self, request: pb.QueueRef, context: grpc.aio.ServicerContext) -> pb.QueueStats:  # noqa: N802
        await _check_peer(context, self.auth, self._refused)
        q = await self.owned(request.vhost, request.queue)
        if q is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "not the owner of this queue")
            raise AssertionError("unreachable")
        stats = pb.QueueStats(messages=q.message_count, consumers=q.consumer_count)
        if isinstance(q, StreamQueue):
            stats.first_offset, stats.next_offset, stats.bytes = q.first_offset, q.next_offset, q.log_bytes
            stats.committed.update(q.committed)
        return stats
