"""Inter-node forwarding of a cluster (DESIGN.md, "A cluster").

Every node routes every publish. A queue owned by another node is a ``Queue``
whose ``remote`` is a ``QueueRemote``: its ``enqueue`` forwards the message
over the internal gRPC stream (``leveret.internal.v1.Node/Forward``, batched
per event-loop turn) and the publisher's confirm waits for the owner's answer,
which comes after the owner committed. Consumers of such a queue attach to its
default channel as usual; the ``QueueRemote`` keeps one proxied subscription
on the owner (``Node/Session``) whose window is the sum of the local
consumers' prefetch, and settles there what they settle here. A stream
consumer gets a subscription of its own instead (core/stream_proxy.py): the
owner runs its reader.

``NodeService`` is the owner's side of both streams.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from core.cluster import internal_pb2 as pb
from core.cluster import internal_pb2_grpc as pb_grpc
from core.cluster.auth import PeerAuth
from core.engine import direct_reply, flow, publish
from core.engine.queue import Consumer, QueueChannel
from core.engine.stream import StreamQueue
from core.engine.stream_args import parse_reader
from core.model import properties
from core.model.clock import call_contained
from core.model.errors import BrokerError, NotFound, NotOwner
from core.model.fieldtable import decode_table
from core.model.message import Message, QueuedMessage
from core.model.ratelog import RateLimitedLog

if TYPE_CHECKING:
    from core.engine.broker import Broker
    from core.engine.queue import Queue
    from core.engine.stream_reader import LogChannel

log = logging.getLogger("leveret.cluster")

Forwarded = Callable[[bool], None]  # True: the owner accepted (and committed) the message

# A proxied subscription never asks the owner for more than this many
# unacked messages, whatever the local prefetch (0 = unlimited) says.
MAX_WINDOW = 8000
# A throughput consumer's window on the owner is this many times its
# prefetch. The window must cover the round trip owner -> this node ->
# client ack -> owner, which is long because each hop waits for a busy event
# loop (a 256 KiB read of publishes is ~10 ms of work): measured 42 ms at
# 48k msg/s, so 2 x 1000 capped the bench's forwarding scenario there with
# the forwarding node 70-80 % busy; with 4 x it is CPU-bound (85-95 %).
READ_AHEAD = 4
READ_AHEAD_FROM = 100
NO_LIMIT_WINDOW = 1000
# Publishes forwarded and not answered yet, per peer: past this the node
# stops reading from publishers (flow control), as for the memory alarm.
FORWARD_HIGH_WATER = 32 * 1024 * 1024
# How long acks to an owner wait to be sent together.
SETTLE_DELAY = 0.002
# Forward batches in flight per peer before the next one waits to grow.
MAX_INFLIGHT_BATCHES = 64
BATCH_BYTES = 4 * 1024 * 1024
# Forwarded messages enqueued per loop turn: a batch is up to BATCH_BYTES (~14k
# messages of 256 B, ~150 ms of work at ~10 µs each), which would keep the loop
# from every connection's acks and heartbeats; 512 is ~5 ms (docs/notes/flow.md).
FORWARD_SLICE = 512
# How long a publish to a queue without a live owner waits for one.
OWNERLESS_TIMEOUT = 15.0
# The node-to-node wire format (the packed records, the session's kinds). Every
# call names it; a peer that speaks another one is refused at the call, with the
# reason in the log, rather than having its bytes misread (a rolling upgrade
# across a change of this format is not supported: run one version everywhere).
INTERNAL_PROTOCOL = "2"
_PROTOCOL_KEY = "leveret-internal-protocol"
_PROTOCOL_MD = ((_PROTOCOL_KEY, INTERNAL_PROTOCOL),)
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 5000),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


class ProxiedMessage(QueuedMessage):
    """A message a non-owner node holds for its local consumers; the owner keeps it unacked."""

    __slots__ = ("link", "remote_id", "reject", "sub")

    def __init__(self, message: Message, offset: int, link: PeerLink, remote_id: int, sub: int,
                 redelivered: bool = False, delivery_count: int = 0) -> None:
        # QueuedMessage's fields set here rather than through its __init__: one
        # call less per proxied delivery (keep in step with QueuedMessage).
        self.message = message
        self.offset = offset
        self.redelivered = bool(redelivered)
        self.delivery_count = delivery_count
        self.expires_at = None
        self.persisted = False
        self.link = link
        self.remote_id = remote_id
        self.reject = False
        self.sub = sub


# Packed records (the hot path; see the proto's `packed` fields). All names
# are AMQP short strings (<= 255 bytes); message ids are our own (< 64 KiB).
#
# A record carries only what differs from the record before it in the same
# batch: a batch is mostly one queue's messages from one exchange and routing
# key with the same properties, so most records are a fixed head and a body.
# Both nodes then skip the per-message encode, decode and property scan of
# fields that repeat (py-spy: unpacking was 15 % of the forwarding node's time
# and 24 % of the owner's, a third of it property scans and name decodes).
# The first record of a batch carries every field.
NEW_QUEUE = 1  # vhost and queue follow (forwarded publishes)
NEW_ROUTE = 2  # exchange and routing key follow
NEW_PROPS = 4  # the properties follow
_FWD = struct.Struct(">BIHd")  # flags, body length, id length, timestamp
_DLV = struct.Struct(">QQBIdBIH")  # id, offset, redelivered, count, timestamp, flags, body length, id length
_DLV_FLAGS_AT = struct.calcsize(">QQBId")
_NAMES = struct.Struct(">BB")
_U32 = struct.Struct(">I")


class _Packer:
    """One batch of packed records being built, and the fields its last record had."""

    __slots__ = ("parts", "_vhost", "_queue", "_exchange", "_routing_key", "_props")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self._vhost: bytes | None = None
        self._queue: bytes | None = None
        self._exchange: str | None = None
        self._routing_key: str | None = None
        self._props: bytes | None = None

    def _changed(self, m: Message, flags: int) -> tuple[int, list[bytes]]:
        """The flags and packed fields of what differs from the last record (rarely anything)."""
        extra: list[bytes] = []
        if m.exchange != self._exchange or m.routing_key != self._routing_key:
            self._exchange, self._routing_key = m.exchange, m.routing_key
            ex, rk = m.exchange.encode(), m.routing_key.encode()
            extra += (_NAMES.pack(len(ex), len(rk)), ex, rk)
            flags |= NEW_ROUTE
        if m.props != self._props:
            self._props = m.props
            extra += (_U32.pack(len(m.props)), m.props)
            flags |= NEW_PROPS
        return flags, extra

    def forwarded(self, vhost: bytes, queue: bytes, m: Message) -> None:
        body = m.body
        mid = m._id
        if (queue is self._queue and vhost is self._vhost and m.props == self._props
                and m.routing_key == self._routing_key and m.exchange == self._exchange):
            if mid is None:
                self.parts += (_FWD.pack(0, len(body), 0, m.timestamp), body)
            else:
                mid_b = mid.encode()
                self.parts += (_FWD.pack(0, len(body), len(mid_b), m.timestamp), body, mid_b)
            return
        flags = 0
        extra: list[bytes] = []
        if queue is not self._queue or vhost is not self._vhost:
            self._vhost, self._queue = vhost, queue
            extra += (_NAMES.pack(len(vhost), len(queue)), vhost, queue)
            flags = NEW_QUEUE
        flags, more = self._changed(m, flags)
        mid_b = mid.encode() if mid is not None else b""
        self.parts.append(_FWD.pack(flags, len(body), len(mid_b), m.timestamp))
        self.parts += extra
        self.parts += more
        self.parts += (body, mid_b)

    def delivery(self, did: int, qm: QueuedMessage) -> None:
        m = qm.message
        body = m.body
        # The owner fixes the id (it is made lazily): the proxy's consumers must see the id the owner
        # stores, or a redelivery after a failover could not be told from a new message.
        mid_b = m.id.encode()
        if m.props == self._props and m.routing_key == self._routing_key and m.exchange == self._exchange:
            self.parts += (_DLV.pack(did, qm.offset, qm.redelivered, qm.delivery_count, m.timestamp, 0,
                                     len(body), len(mid_b)), body, mid_b)  # fmt: skip
            return
        flags, extra = self._changed(m, 0)
        self.parts.append(_DLV.pack(did, qm.offset, qm.redelivered, qm.delivery_count, m.timestamp, flags,
                                    len(body), len(mid_b)))  # fmt: skip
        self.parts += extra
        self.parts += (body, mid_b)

    def take(self) -> bytes:
        """The batch so far, packed; the next record starts a new batch."""
        data = b"".join(self.parts)
        self.parts = []
        self._vhost = self._queue = self._props = None
        self._exchange = self._routing_key = None
        return data


def _new_fields(
    data: bytes, pos: int, flags: int, exchange: str, rk: str, props: bytes, summary: properties.PropertySummary | None
) -> tuple[int, str, str, bytes, properties.PropertySummary | None]:
    """Read the route and properties a record carries (NEW_ROUTE, NEW_PROPS); the others stay as they were.

    Only records whose fields changed come here, so the common record pays no call.
    """
    if flags & NEW_ROUTE:
        lx, lr = _NAMES.unpack_from(data, pos)
        pos += 2
        exchange = data[pos : pos + lx].decode()
        pos += lx
        rk = data[pos : pos + lr].decode()
        pos += lr
    if flags & NEW_PROPS:
        (lp,) = _U32.unpack_from(data, pos)
        pos += 4
        props = data[pos : pos + lp]
        pos += lp
        summary = properties.scan(props)
    return pos, exchange, rk, props, summary


def _malformed(what: str) -> ValueError:
    return ValueError(f"malformed packed {what}: a batch must begin with a record carrying every field")


def unpack_forwarded(data: bytes, node: str) -> list[tuple[str, str, list[Message]]]:
    """The forwarded messages of a batch, as runs of messages to one (vhost, queue)."""
    runs: list[tuple[str, str, list[Message]]] = []
    if not data:
        return runs
    if data[0] != NEW_QUEUE | NEW_ROUTE | NEW_PROPS:
        raise _malformed("forwards")
    messages: list[Message] = []
    exchange = rk = ""
    props = b""
    summary = None
    pos = 0
    end = len(data)
    unpack = _FWD.unpack_from
    size = _FWD.size
    while pos < end:
        flags, lb, li, ts = unpack(data, pos)
        pos += size
        if flags:
            if flags & NEW_QUEUE:
                lv, lq = _NAMES.unpack_from(data, pos)
                pos += 2
                vhost = data[pos : pos + lv].decode()
                pos += lv
                queue = data[pos : pos + lq].decode()
                pos += lq
                messages = []
                runs.append((vhost, queue, messages))
            pos, exchange, rk, props, summary = _new_fields(data, pos, flags, exchange, rk, props, summary)
        body = data[pos : pos + lb]
        pos += lb
        m = Message(exchange, rk, props, body, summary, node, ts)
        if li:
            m._id = data[pos : pos + li].decode()
            pos += li
        messages.append(m)
    return runs


def unpack_deliveries(data: bytes, link: PeerLink, sub: int) -> list[ProxiedMessage]:
    """The owner's packed deliveries as the messages this node holds for them (``sub`` 0: a basic.get)."""
    out: list[ProxiedMessage] = []
    if not data:
        return out
    if data[_DLV_FLAGS_AT] != NEW_ROUTE | NEW_PROPS:
        raise _malformed("deliveries")
    exchange = rk = ""
    props = b""
    summary = None
    pos = 0
    end = len(data)
    unpack = _DLV.unpack_from
    size = _DLV.size
    node = link.node_id
    append = out.append
    while pos < end:
        did, offset, redelivered, count, ts, flags, lb, li = unpack(data, pos)
        pos += size
        if flags:
            pos, exchange, rk, props, summary = _new_fields(data, pos, flags, exchange, rk, props, summary)
        body = data[pos : pos + lb]
        pos += lb
        m = Message(exchange, rk, props, body, summary, node, ts)
        if li:
            m._id = data[pos : pos + li].decode()
            pos += li
        append(ProxiedMessage(m, offset, link, did, sub, redelivered, count))
    return out


# ============================================================== non-owner side
class Subscriber(Protocol):
    """What a proxied subscription delivers to: a ``QueueRemote`` or a ``RemoteStreamReader``."""

    @property
    def queue(self) -> Queue: ...

    def deliveries(self, link: PeerLink, sub: int, messages: list[ProxiedMessage]) -> None: ...

    def subscription_cancelled(self, link: PeerLink, sub: int, reason: str) -> None: ...

    def session_lost(self, link: PeerLink) -> None: ...


class PeerLink:
    """This node's streams to one peer node: forwarded publishes and a session."""

    def __init__(self, node_id: str, address: str, on_broken: Callable[[PeerLink], None], auth: PeerAuth) -> None:
        self.node_id = node_id
        self.address = address
        self._on_broken = on_broken
        self.auth = auth
        self.channel = auth.channel(address, GRPC_OPTIONS)
        self.stub = pb_grpc.NodeStub(self.channel)
        self.closed = False
        # -- forward
        self._seq = itertools.count(1)
        self._batch = _Packer()
        self._batch_count = 0
        self._batch_bytes = 0
        self._batch_cbs: list[tuple[int, Forwarded]] = []
        self._inflight: dict[int, tuple[list[tuple[int, Forwarded]], int, int]] = {}
        self.inflight_bytes = 0
        self._forward_q: asyncio.Queue[pb.ForwardBatch | None] | None = None
        self._forward_task: asyncio.Task[None] | None = None
        self._flush_scheduled = False
        self.on_congestion: Callable[[bool], None] | None = None
        self.congested = False
        self._barriers: list[tuple[int, asyncio.Future[None]]] = []
        # -- session
        self._sub_ids = itertools.count(1)
        self.subscriptions: dict[int, Subscriber] = {}
        self._control_q: asyncio.Queue[pb.SessionControl | None] | None = None
        self._session_task: asyncio.Task[None] | None = None
        self._acks: list[int] = []
        self._rejects: list[int] = []
        self._settle_scheduled = False
        self._gets: dict[int, asyncio.Future[tuple[ProxiedMessage | None, int]]] = {}

    def _md(self) -> tuple[tuple[str, str], ...]:
        """Every call's metadata: the protocol version and a fresh membership token."""
        return self.auth.metadata(_PROTOCOL_MD)

    # -- forwarding publishes ---------------------------------------------------
    def forward(self, vhost: bytes, queue: bytes, message: Message) -> None:
        self._batch.forwarded(vhost, queue, message)
        self._batch_count += 1
        self._batch_bytes += len(message.body)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def when_forwarded(self, done: Forwarded) -> None:
        """``done`` gets the owner's answer for the message forwarded last."""
        self._batch_cbs.append((self._batch_count - 1, done))

    def _flush(self, force: bool = False) -> None:
        self._flush_scheduled = False
        if not self._batch_count:
            return
        if self.closed:
            self._fail(self._batch_cbs)
            self._batch.take()
            self._batch_cbs, self._batch_bytes, self._batch_count = [], 0, 0
            return
        if len(self._inflight) >= MAX_INFLIGHT_BATCHES and not force and self._batch_bytes < BATCH_BYTES:
            # Busy: let the batch grow until an answer comes (as group commit
            # does); gRPC's cost is per stream message, not per byte.
            return
        seq = next(self._seq)
        batch = pb.ForwardBatch(seq=seq, packed=self._batch.take())
        self._inflight[seq] = (self._batch_cbs, self._batch_count, self._batch_bytes)
        self.inflight_bytes += self._batch_bytes
        self._batch_cbs, self._batch_bytes, self._batch_count = [], 0, 0
        if self._forward_q is None:
            self._forward_q = asyncio.Queue()
            self._forward_task = asyncio.get_running_loop().create_task(self._forward_loop(self._forward_q))
        self._forward_q.put_nowait(batch)
        if self.inflight_bytes > FORWARD_HIGH_WATER and not self.congested:
            self._set_congested(True)

    async def barrier(self) -> None:
        """Wait until everything forwarded so far was answered by the owner.

        basic.get, queue.purge and counts go over another stream; a client
        that publishes and then gets must see its message, as it would on
        the owner (RabbitMQ keeps that order between a channel and a queue).
        """
        if self._batch_count:
            self._flush(force=True)
        if not self._inflight:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._barriers.append((max(self._inflight), fut))
        await asyncio.wait_for(fut, 10)

    def _release_barriers(self, upto: int | None) -> None:
        keep = []
        for target, fut in self._barriers:
            if upto is None or target <= upto:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((target, fut))
        self._barriers = keep

    def _set_congested(self, value: bool) -> None:
        self.congested = value
        if self.on_congestion is not None:
            self.on_congestion(value)

    @staticmethod
    def _fail(cbs: list[tuple[int, Forwarded]]) -> None:
        for _, cb in cbs:
            call_contained(cb, False)

    async def _forward_loop(self, q: asyncio.Queue[pb.ForwardBatch | None]) -> None:
        async def requests() -> AsyncIterator[pb.ForwardBatch]:
            while (batch := await q.get()) is not None:
                yield batch

        try:
            call = self.stub.Forward(requests(), metadata=self._md())
            async for result in call:
                entry = self._inflight.pop(result.seq, None)
                if entry is None:
                    continue
                cbs, count, size = entry
                self.inflight_bytes -= size
                if self.congested and self.inflight_bytes < FORWARD_HIGH_WATER // 2:
                    self._set_congested(False)
                accepted = result.accepted
                for index, cb in cbs:
                    # Contained: one publisher's failing callback must not end this stream for all.
                    call_contained(cb, not result.error and index < len(accepted) and accepted[index])
                if self._barriers:
                    self._release_barriers(result.seq)
                if self._batch_count and not self._flush_scheduled:
                    self._flush()
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            if isinstance(exc, asyncio.CancelledError):
                raise
            log.warning("forward stream to peer lost", extra={"peer": self.node_id, "error": str(exc.details())})
        finally:
            # The owner's answer for these never came: they may or may not be
            # committed there, so the publishers get a nack (never a false ack).
            inflight, self._inflight = self._inflight, {}
            self.inflight_bytes = 0
            self._release_barriers(None)
            if self._batch_count:
                waiting = self._batch_cbs
                self._batch.take()
                self._batch_cbs, self._batch_bytes, self._batch_count = [], 0, 0
                self._fail(waiting)
            for cbs, _, _ in inflight.values():
                self._fail(cbs)
            if self._forward_q is q:
                self._forward_q = None
                self._forward_task = None
            if self.congested:
                self._set_congested(False)
        if not self.closed:
            self._on_broken(self)

    # -- proxied subscriptions ----------------------------------------------------
    def _control(self, msg: pb.SessionControl) -> None:
        if self.closed:
            return
        if self._control_q is None:
            self._control_q = asyncio.Queue()
            self._session_task = asyncio.get_running_loop().create_task(self._session_loop(self._control_q))
        self._control_q.put_nowait(msg)

    def watch(self) -> None:
        """Open the session stream now: its end tells at once that the peer's process is gone."""
        if self._control_q is None and not self.closed:
            self._control_q = asyncio.Queue()
            self._session_task = asyncio.get_running_loop().create_task(self._session_loop(self._control_q))

    def subscribe(self, remote: Subscriber, window: int, arguments: bytes = b"") -> int:
        sub = next(self._sub_ids)
        self.subscriptions[sub] = remote
        self._control(pb.SessionControl(kind=pb.SessionControl.SUBSCRIBE, sub=sub, vhost=remote.queue.vhost,
                                        queue=remote.queue.name, window=window, arguments=arguments))
        return sub

    def set_window(self, sub: int, window: int) -> None:
        self._control(pb.SessionControl(kind=pb.SessionControl.WINDOW, sub=sub, window=window))

    def unsubscribe(self, sub: int) -> None:
        if self.subscriptions.pop(sub, None) is not None:
            self._control(pb.SessionControl(kind=pb.SessionControl.UNSUBSCRIBE, sub=sub))

    def settle(self, qm: QueuedMessage) -> None:
        assert isinstance(qm, ProxiedMessage)
        if qm.link is not self or self.closed:
            return  # delivered by an earlier session: the owner requeued it already
        (self._rejects if qm.reject else self._acks).append(qm.remote_id)
        if not self._settle_scheduled:
            # Settlements only return credit, so they can wait a moment to
            # share one stream write (~100 us each in grpc.aio, py-spy).
            self._settle_scheduled = True
            asyncio.get_running_loop().call_later(SETTLE_DELAY, self._flush_settlements)

    def keeps(self, qm: QueuedMessage) -> bool:
        """May a requeued ``qm`` wait in the local ready list (its subscription still runs)?"""
        return not self.closed and getattr(qm, "sub", 0) in self.subscriptions

    def give_back(self, qm: QueuedMessage) -> None:
        assert isinstance(qm, ProxiedMessage)
        if qm.link is self and not self.closed:
            self.requeue([qm.remote_id])

    def reject_next(self, qm: QueuedMessage) -> None:
        """The coming ``settle`` of ``qm`` is a reject without requeue."""
        assert isinstance(qm, ProxiedMessage)
        qm.reject = True

    def requeue(self, ids: list[int]) -> None:
        if ids:
            self._control(pb.SessionControl(kind=pb.SessionControl.REQUEUE, ids=ids))

    def _flush_settlements(self) -> None:
        self._settle_scheduled = False
        if self._acks:
            self._control(pb.SessionControl(kind=pb.SessionControl.ACK, ids=self._acks))
            self._acks = []
        if self._rejects:
            self._control(pb.SessionControl(kind=pb.SessionControl.REJECT, ids=self._rejects))
            self._rejects = []

    async def get(self, vhost: str, queue: str, no_ack: bool) -> tuple[ProxiedMessage | None, int]:
        req = next(self._sub_ids)
        fut: asyncio.Future[tuple[ProxiedMessage | None, int]] = asyncio.get_running_loop().create_future()
        self._gets[req] = fut
        self._control(pb.SessionControl(kind=pb.SessionControl.GET, sub=req, vhost=vhost, queue=queue,
                                        no_ack=no_ack))
        if self.closed:
            raise NotOwner(f"node {self.node_id} is gone")
        return await asyncio.wait_for(fut, timeout=10)

    async def _session_loop(self, q: asyncio.Queue[pb.SessionControl | None]) -> None:
        async def requests() -> AsyncIterator[pb.SessionControl]:
            while (msg := await q.get()) is not None:
                yield msg

        try:
            call = self.stub.Session(requests(), metadata=self._md())
            async for event in call:
                self._on_event(event)
        except grpc.aio.AioRpcError as exc:
            log.warning("session stream to peer lost", extra={"peer": self.node_id, "error": str(exc.details())})
        finally:
            if self._control_q is q:
                self._control_q = None
                self._session_task = None
            subs, self.subscriptions = self.subscriptions, {}
            for fut in self._gets.values():
                if not fut.done():
                    fut.set_exception(NotOwner(f"node {self.node_id} is gone"))
            self._gets.clear()
            self._acks, self._rejects = [], []
            # Everything this session held unacked goes back to the owner's
            # queue (the owner requeues it when the stream ends); the local
            # copies are stale.
            self.closed = True
            for remote in subs.values():
                remote.session_lost(self)
        self._on_broken(self)

    def _on_event(self, event: pb.SessionEvent) -> None:
        kind = event.kind
        if kind == pb.SessionEvent.DELIVERIES:
            remote = self.subscriptions.get(event.sub)
            messages = unpack_deliveries(event.packed, self, event.sub)
            if remote is None:
                self.requeue([qm.remote_id for qm in messages])
                return
            remote.deliveries(self, event.sub, messages)
        elif kind == pb.SessionEvent.CANCELLED:
            remote = self.subscriptions.pop(event.sub, None)
            if remote is not None:
                remote.subscription_cancelled(self, event.sub, event.reason)
        elif kind in (pb.SessionEvent.GET_OK, pb.SessionEvent.GET_EMPTY, pb.SessionEvent.ERROR):
            fut = self._gets.pop(event.sub, None)
            if fut is None or fut.done():
                return
            if kind == pb.SessionEvent.ERROR:
                fut.set_exception(_error_of(event.code, event.reason))
            elif kind == pb.SessionEvent.GET_EMPTY:
                fut.set_result((None, 0))
            else:
                fut.set_result((unpack_deliveries(event.packed, self, 0)[0], event.remaining))

    async def purge(self, vhost: str, queue: str) -> int:
        result = await self.stub.Purge(pb.QueueRef(vhost=vhost, queue=queue), timeout=10, metadata=self._md())
        return int(result.purged)

    async def commit_offset(self, vhost: str, queue: str, group: str, offset: int) -> None:
        """Set a consumer group's committed offset in a stream the peer owns; returns once its store has it."""
        await self.stub.CommitOffset(pb.GroupOffset(vhost=vhost, queue=queue, group=group, offset=offset),
                                     timeout=10, metadata=self._md())

    async def stats(self, vhost: str, queue: str) -> tuple[int, int]:
        result = await self.stream_stats(vhost, queue)
        return int(result.messages), int(result.consumers)

    async def stream_stats(self, vhost: str, queue: str) -> pb.QueueStats:
        """The owner's figures of a queue (of a stream: its offsets, bytes and group commits too)."""
        return await self.stub.Stats(pb.QueueRef(vhost=vhost, queue=queue), timeout=10, metadata=self._md())

    async def close(self) -> None:
        self.closed = True
        if self._forward_q is not None:
            self._forward_q.put_nowait(None)
        if self._control_q is not None:
            self._control_q.put_nowait(None)
        for task in (self._forward_task, self._session_task):
            if task is not None:
                task.cancel()
        await self.channel.close()


def _error_of(code: int, reason: str) -> BrokerError:
    return NotFound(reason) if code == 404 else NotOwner(reason)


class QueueRemote:
    """A queue another node owns, as this node sees it: forward publishes, proxy consumers."""

    def __init__(self, queue: Queue, peers: Peers, owner: str | None) -> None:
        self.queue = queue
        self._vhost_b = queue.vhost.encode()
        self._name_b = queue.name.encode()
        self.peers = peers
        self.owner: str | None = None
        self.link: PeerLink | None = None
        self.sub = 0
        self.window = 0
        # Publishes waiting for an owner: [message, callbacks].
        self._held: list[tuple[Message, list[Forwarded]]] = []
        self._held_timer: asyncio.TimerHandle | None = None
        self._last_held = False
        self.detached = False
        self.set_owner(owner)

    # -- publishes --------------------------------------------------------------
    def forward(self, message: Message) -> None:
        link = self.link
        if link is not None and not link.closed:
            link.forward(self._vhost_b, self._name_b, message)
            self._last_held = False
            return
        self._held.append((message, []))
        self._last_held = True
        self._arm_held_timer()

    def _arm_held_timer(self) -> None:
        if self._held_timer is None:
            self._held_timer = asyncio.get_running_loop().call_later(OWNERLESS_TIMEOUT, self._held_expired)

    def reachable(self) -> bool:
        link = self.link
        return link is not None and not link.closed

    def open_stream_reader(self, name: str, arguments: dict[str, object]) -> LogChannel:
        # Imported here: stream_proxy builds on this module.
        from core.cluster.stream_proxy import RemoteStreamReader

        assert isinstance(self.queue, StreamQueue) and self.link is not None
        return RemoteStreamReader(self.queue, self.link, name, arguments)

    def when_forwarded(self, done: Forwarded) -> None:
        if self._last_held:
            self._held[-1][1].append(done)
        elif self.link is not None:
            self.link.when_forwarded(done)

    def _held_expired(self) -> None:
        self._held_timer = None
        held, self._held = self._held, []
        if held:
            log.warning("no owner for queue: publishes refused",
                        extra={"vhost": self.queue.vhost, "queue": self.queue.name, "messages": len(held)})
        for _, cbs in held:
            for cb in cbs:
                call_contained(cb, False)

    def _release_held(self) -> None:
        if self._held_timer is not None:
            self._held_timer.cancel()
            self._held_timer = None
        held, self._held = self._held, []
        self._last_held = False
        for message, cbs in held:
            self.forward(message)
            for cb in cbs:
                self.when_forwarded(cb)

    # -- ownership ----------------------------------------------------------------
    def set_owner(self, owner: str | None) -> None:
        """The owner changed (None: being taken over): move the proxy to it."""
        if owner == self.owner and self.link is not None and not self.link.closed:
            return
        self._drop_subscription()
        self.owner = owner
        self.link = self.peers.link(owner) if owner is not None else None
        if self.link is not None:
            self._release_held()
            self.consumers_changed(self.queue.default)

    def adopt(self, held: list[tuple[Message, list[Forwarded]]]) -> None:
        """Publishes an earlier stand-in held: send them on (or hold them here)."""
        if not held:
            return
        self._held.extend(held)
        if self.link is not None and not self.link.closed:
            self._release_held()
        else:
            self._arm_held_timer()

    def detach(self) -> list[tuple[Message, list[Forwarded]]]:
        """This node takes the queue over: stop proxying, hand back what waits for an owner."""
        self.detached = True
        self._drop_subscription()
        if self._held_timer is not None:
            self._held_timer.cancel()
            self._held_timer = None
        held, self._held = self._held, []
        return held

    def _drop_subscription(self) -> None:
        link, sub = self.link, self.sub
        self.sub = 0
        self.window = 0
        if link is not None and sub:
            # Ready copies from this subscription go back to the owner; the
            # local ready list then holds nothing of the old owner.
            back = self._take_ready(lambda qm: qm.link is link)
            link.requeue(back)
            link.unsubscribe(sub)

    def _take_ready(self, which: Callable[[QueuedMessage], bool]) -> list[int]:
        qch = self.queue.default
        keep: list[QueuedMessage] = []
        ids: list[int] = []
        for qm in qch.ready:
            if isinstance(qm, ProxiedMessage) and which(qm):
                ids.append(qm.remote_id)
                qch.ready_bytes -= len(qm.message.body)
            else:
                keep.append(qm)
        if ids:
            qch.ready.clear()
            for qm in keep:
                qch.ready.append(qm)
        return ids

    # -- proxied consumers ----------------------------------------------------------
    def consumers_changed(self, qch: QueueChannel) -> None:
        if qch is not self.queue.default or self.detached:
            return
        window = 0
        for c in qch.consumers:
            prefetch = NO_LIMIT_WINDOW if c.no_ack or not c.prefetch else c.prefetch
            # Throughput consumers (a large prefetch) get a read-ahead of
            # more prefetches, so the ack round trip through the owner does not
            # drain the pipeline; a small prefetch (work queues, prefetch 1)
            # is exact, so no node hoards tasks another node's worker could take.
            window += prefetch * READ_AHEAD if prefetch >= READ_AHEAD_FROM else prefetch
        window = min(window, MAX_WINDOW)
        link = self.link
        if link is None or link.closed:
            return
        if window == 0:
            if self.sub:
                self._drop_subscription()
            return
        if not self.sub:
            self.window = window
            self.sub = link.subscribe(self, window)
        elif window != self.window:
            self.window = window
            link.set_window(self.sub, window)

    def deliveries(self, link: PeerLink, sub: int, messages: list[ProxiedMessage]) -> None:
        if link is not self.link or sub != self.sub:
            link.requeue([qm.remote_id for qm in messages])
            return
        self.queue.default.push_many(messages)

    def subscription_cancelled(self, link: PeerLink, sub: int, reason: str) -> None:
        if link is self.link and sub == self.sub:
            self.sub = 0
            self._take_ready(lambda qm: qm.link is link)
            log.info("proxied subscription ended by the owner",
                     extra={"vhost": self.queue.vhost, "queue": self.queue.name, "reason": reason})

    def session_lost(self, link: PeerLink) -> None:
        """The owner's session broke: its deliveries here are stale (the owner or its successor redelivers)."""
        if link is not self.link:
            return
        self.sub = 0
        self._take_ready(lambda qm: qm.link is link)
        self.link = None  # a new link is made when the owner is known again


class LoadingGate(QueueRemote):
    """This node is taking the queue over: hold publishes until the backlog is loaded."""

    def __init__(self, queue: Queue, peers: Peers, held: list[tuple[Message, list[Forwarded]]] | None = None) -> None:
        super().__init__(queue, peers, None)
        # What an earlier stand-in held waits here too, without the ownerless timer:
        # the load decides, not OWNERLESS_TIMEOUT.
        self._held.extend(held or ())

    def reachable(self) -> bool:
        return False  # being loaded here: served once the take-over completes

    def set_owner(self, owner: str | None) -> None:
        self.owner = owner

    def consumers_changed(self, qch: QueueChannel) -> None:
        return


# ================================================================== peers
class Peers:
    """Links to the other nodes, by node id, made on first use."""

    def __init__(self, address_of: Callable[[str], str | None], on_broken: Callable[[str], None],
                 auth: PeerAuth | None = None) -> None:
        """``auth``: how this node proves membership to its peers; without it no peer is ever dialled."""
        self._address_of = address_of
        self._auth = auth
        self._on_broken = on_broken
        self.links: dict[str, PeerLink] = {}
        self.on_congestion: Callable[[bool], None] | None = None

    def link(self, node_id: str) -> PeerLink | None:
        link = self.links.get(node_id)
        if link is not None and not link.closed:
            return link
        address = self._address_of(node_id)
        if address is None:
            return None
        if self._auth is None:
            raise RuntimeError("no cluster credentials to dial a peer with (--cluster-secret-file or --cluster-tls-*)")
        link = PeerLink(node_id, address, self._broken, self._auth)
        link.on_congestion = self.on_congestion
        self.links[node_id] = link
        return link

    def _broken(self, link: PeerLink) -> None:
        link.closed = True
        if self.links.get(link.node_id) is link:
            del self.links[link.node_id]
            asyncio.get_running_loop().create_task(link.close())
            self._on_broken(link.node_id)

    def forget(self, node_id: str) -> None:
        link = self.links.pop(node_id, None)
        if link is not None:
            link.closed = True
            asyncio.get_running_loop().create_task(link.close())

    async def close(self) -> None:
        links, self.links = list(self.links.values()), {}
        for link in links:
            await link.close()


# ====================================================================== owner side
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
        self._pending: dict[int, _Packer] = {}
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
            batch = self._pending[sub] = _Packer()
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
        one = _Packer()
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
    theirs = dict(metadata).get(_PROTOCOL_KEY)
    if theirs == INTERNAL_PROTOCOL:
        return
    theirs = theirs or "1 (no version sent: an older node)"
    log.error("a peer node speaks another internal protocol: refused; run one Leveret version on every node",
              extra={"peer": context.peer(), "theirs": theirs, "ours": INTERNAL_PROTOCOL})
    await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                        f"internal protocol {theirs} is not this node's {INTERNAL_PROTOCOL}: run one Leveret "
                        "version on every node of a cluster")


async def released(call: flow.HeldCall) -> None:
    """Wait until no queue holds ``call`` (flow control: core/engine/flow.py)."""
    if call.held:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def free() -> None:
            if not done.done():
                done.set_result(None)

        call.on_free = free
        await done


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
        await released(call)
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
