"""The caller side of the inter-node transport: this node's streams to each peer.

A ``PeerLink`` holds two gRPC streams to one peer: ``Node/Forward`` carries
forwarded publishes (batched per event-loop turn, packed by core/cluster/wire.py)
and their answers, ``Node/Session`` carries proxied subscriptions, their
deliveries and settlements, and ``basic.get``. ``Peers`` makes the links on
first use. What uses a link: the queue proxy (core/cluster/remote.py) and the
stream proxy (core/cluster/stream_proxy.py), both ``Subscriber``s.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from core.cluster import internal_pb2 as pb
from core.cluster import internal_pb2_grpc as pb_grpc
from core.cluster.auth import PeerAuth
from core.cluster.wire import PROTOCOL_MD, Packer, ProxiedMessage, unpack_deliveries
from core.model.clock import call_contained
from core.model.errors import BrokerError, NotFound, NotOwner
from core.model.message import Message, QueuedMessage
from core.model.tasks import spawn
from core.ports.remote import Forwarded

if TYPE_CHECKING:
    from core.engine.queue import Queue

log = logging.getLogger("leveret.cluster")

# Publishes forwarded and not answered yet, per peer: past this the node
# stops reading from publishers (flow control), as for the memory alarm.
FORWARD_HIGH_WATER = 32 * 1024 * 1024
# How long acks to an owner wait to be sent together.
SETTLE_DELAY = 0.002
# Forward batches in flight per peer before the next one waits to grow.
MAX_INFLIGHT_BATCHES = 64
BATCH_BYTES = 4 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 5000),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


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
        self._batch = Packer()
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
        return self.auth.metadata(PROTOCOL_MD)

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
            messages = unpack_deliveries(event.packed, self, self.node_id, event.sub)
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
                fut.set_result((unpack_deliveries(event.packed, self, self.node_id, 0)[0], event.remaining))

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
        self._closing: set[asyncio.Task[Any]] = set()  # links being closed (spawn holds them until done)

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
            spawn(link.close(), self._closing)
            self._on_broken(link.node_id)

    def forget(self, node_id: str) -> None:
        link = self.links.pop(node_id, None)
        if link is not None:
            link.closed = True
            spawn(link.close(), self._closing)

    async def close(self) -> None:
        links, self.links = list(self.links.values()), {}
        for link in links:
            await link.close()


