"""The queue proxy the engine holds for a queue another node owns (``Queue.remote``).

Every node routes every publish. A queue owned by another node is a ``Queue``
whose ``remote`` is a ``QueueRemote`` (the port core/ports/remote.py
``RemoteQueue``): its ``forward`` sends the message over the peer's link
(core/cluster/link.py) and the publisher's confirm waits for the owner's
answer, which comes after the owner committed. Consumers of such a queue
attach to its default channel as usual; the ``QueueRemote`` keeps one proxied
subscription on the owner whose window is the sum of the local consumers'
prefetch, and settles there what they settle here. A stream consumer gets a
subscription of its own instead (core/cluster/stream_proxy.py): the owner runs
its reader. ``LoadingGate`` stands in while this node takes the queue over.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from core.cluster.link import PeerLink, Peers
from core.cluster.stream_proxy import RemoteStreamReader
from core.cluster.wire import ProxiedMessage
from core.engine.stream import StreamQueue
from core.model.clock import call_contained
from core.model.errors import NotOwner
from core.model.message import Message, QueuedMessage
from core.ports.remote import Forwarded, Held, StreamFigures

if TYPE_CHECKING:
    from core.engine.queue import Queue, QueueChannel
    from core.engine.stream_reader import LogChannel

log = logging.getLogger("leveret.cluster")

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
# How long a publish to a queue without a live owner waits for one.
OWNERLESS_TIMEOUT = 15.0


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
        self._held: Held = []
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
        assert isinstance(self.queue, StreamQueue) and self.link is not None
        return RemoteStreamReader(self.queue, self.link, name, arguments)

    def _live_link(self) -> PeerLink:
        link = self.link
        if link is None or link.closed:
            raise NotOwner(f"queue '{self.queue.name}' in vhost '{self.queue.vhost}' has no reachable owner right now")
        return link

    async def stream_figures(self) -> StreamFigures:
        try:
            s = await self._live_link().stream_stats(self.queue.vhost, self.queue.name)
        except grpc.aio.AioRpcError as exc:
            raise NotOwner(str(exc.details())) from exc
        return StreamFigures(s.first_offset, s.next_offset, s.messages, s.bytes, dict(s.committed))

    async def commit_offset(self, group: str, offset: int) -> None:
        try:
            await self._live_link().commit_offset(self.queue.vhost, self.queue.name, group, offset)
        except grpc.aio.AioRpcError as exc:
            raise NotOwner(str(exc.details())) from exc

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

    def adopt(self, held: Held) -> None:
        """Publishes an earlier stand-in held: send them on (or hold them here)."""
        if not held:
            return
        self._held.extend(held)
        if self.link is not None and not self.link.closed:
            self._release_held()
        else:
            self._arm_held_timer()

    def detach(self) -> Held:
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

    def __init__(self, queue: Queue, peers: Peers, held: Held | None = None) -> None:
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
