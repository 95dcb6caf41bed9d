"""Core queues, their channels and consumers: delivery, credit, acks, requeue,
expiry, length limits and dead-lettering.

A queue is an ordered sequence of messages; every message gets the next
offset. Messages are read through a queue's channels: each channel sees every
message (that passes its filter) and has its own ready list, consumers and
unacknowledged set. AMQP uses one default channel per queue that all of the
queue's AMQP consumers share.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from core.engine import paging
from core.engine.flow import FLOW_HIGH, FLOW_LOW, QueueFlow
from core.engine.paging import MESSAGE_BYTES, NEVER, PagedReady, PageWait
from core.engine.queue_args import QueueArgs
from core.engine.ready import PriorityReady, requeue_into, take_offsets
from core.model import properties
from core.model.clock import AsyncioScheduler, Scheduler, TimerHandle
from core.model.errors import AccessRefused
from core.model.message import Message, QueuedMessage
from core.ports.remote import RemoteQueue

if TYPE_CHECKING:
    from core.engine.ownership import Lease
    from core.engine.stream_reader import LogChannel
    from core.ports.storage import QueueStorage

# What stands in for the owner of a queue another node owns (core/ports/remote.py), in this
# engine's channel types: the transport behind it (core/cluster/remote.py) is not named here.
Remote: TypeAlias = "RemoteQueue[QueueChannel, LogChannel]"

# Why a message left a queue without being acknowledged (x-death "reason").
REJECTED = "rejected"
EXPIRED = "expired"
MAXLEN = "maxlen"
DELIVERY_LIMIT = "delivery_limit"


class ConsumerSink(Protocol):
    """What receives deliveries: the AMQP channel, or a native subscription."""

    def has_credit(self, consumer: Consumer) -> bool:
        """May ``consumer`` take one more message now (prefetch, back-pressure)?"""
        ...

    def deliver(self, consumer: Consumer, qm: QueuedMessage) -> None: ...

    def consumer_cancelled(self, consumer: Consumer) -> None:
        """The broker ended the consumer (its queue went away)."""
        ...


class Consumer:
    __slots__ = ("tag", "channel", "sink", "no_ack", "exclusive", "arguments", "unacked", "prefetch", "priority")

    def __init__(
        self,
        tag: str,
        channel: QueueChannel,
        sink: ConsumerSink,
        no_ack: bool,
        exclusive: bool = False,
        arguments: dict[str, Any] | None = None,
        prefetch: int = 0,
        priority: int = 0,
    ) -> None:
        self.tag = tag
        self.channel = channel
        self.sink = sink
        self.no_ack = no_ack
        self.exclusive = exclusive
        self.arguments = arguments or {}
        self.unacked = 0
        self.prefetch = prefetch
        self.priority = priority

    @property
    def queue(self) -> Queue:
        return self.channel.queue


class QueueChannel:
    """A receiver end of a queue: ready messages, competing consumers, unacked."""

    def __init__(self, queue: Queue, name: str, topic_filter: Callable[[str], bool] | None = None) -> None:
        self.queue = queue
        self.name = name
        self.accepts = topic_filter
        max_priority = queue.args.max_priority
        self.ready: deque[QueuedMessage] | PriorityReady | PagedReady = (
            PriorityReady(max_priority) if max_priority else deque()
        )
        self.consumers: list[Consumer] = []
        self._next = 0  # round-robin position
        self._by_priority: list[list[Consumer]] | None = None  # set when consumer priorities differ
        self._next_in: dict[int, int] = {}
        self.unacked = 0
        self.ready_bytes = 0
        # Counters the management API reads (core/engine/stats.py): plain ints, one += each.
        self.delivered = 0  # deliveries and basic.get answers
        self.acked = 0  # deliveries settled (acked, or rejected without requeue)
        self.redelivered = 0  # of those, deliveries of a message delivered before
        self._dispatching = False
        self._expiry_timer: TimerHandle | None = None
        self._expiry_at = 0.0
        # Flow control (core/engine/flow.py): publishers held while consumers fall behind.
        self.flow = QueueFlow(self)
        # Paging (core/engine/paging.py): once ready_bytes passes page_at the deque becomes a
        # PagedReady whose window holds at most page_budget bytes (page_at is then NEVER).
        self.page_budget = NEVER
        self.page_at = NEVER
        self._page_waiters: list[asyncio.Future[None]] = []  # basic.get waiting for a page (get_loaded)
        self.set_paging()

    # -- arrival ---------------------------------------------------------------
    def push(self, qm: QueuedMessage) -> None:
        if self.consumers and not self.ready and not self._dispatching:
            # Nothing waits ahead of it: hand it straight to a consumer with
            # credit. Such a message is never expired, as in RabbitMQ, where a
            # TTL of 0 means "deliver now or never".
            c = self._pick()
            if c is not None:
                self._hand_over(c, qm)
                return
        ready = self.ready
        ready.append(qm)
        self.ready_bytes += len(qm.message.body)
        # The budget counts each message's memory, not only its body (paging.MESSAGE_BYTES).
        if self.ready_bytes + len(ready) * MESSAGE_BYTES > self.page_at:
            self._page_out()
            ready = self.ready
        if self.consumers:
            if not self._dispatching:
                self.dispatch()
            if len(ready) >= FLOW_HIGH:
                self.flow.over_high()
        if qm.expires_at is not None and ready:
            self._arm_expiry()

    def push_many(self, qms: Sequence[QueuedMessage]) -> None:
        """``push`` each of ``qms`` in order, trying the consumers once for all that wait.

        For batches from another node (core/cluster/service.py): once the consumers
        are out of credit, ``push`` would try them again for every message.
        """
        if self.queue.lease is not None and not self.queue.lease_valid():
            return  # the node's lease ran out: the queue was just given up, its new owner serves these
        start = 0
        if self.consumers:
            # As push: while nothing waits, straight to a consumer with credit.
            for qm in qms:
                if self.ready or self._dispatching:
                    break
                c = self._pick()
                if c is None:
                    break
                self._hand_over(c, qm)
                start += 1
        if start == len(qms):
            return
        ready = self.ready
        size = 0
        expiring = False
        for qm in qms[start:] if start else qms:
            ready.append(qm)
            size += len(qm.message.body)
            if qm.expires_at is not None:
                expiring = True
        self.ready_bytes += size
        if self.ready_bytes + len(ready) * MESSAGE_BYTES > self.page_at:
            self._page_out()
            ready = self.ready
        if self.consumers:
            if not self._dispatching:
                self.dispatch()
            if len(ready) >= FLOW_HIGH:
                self.flow.over_high()
        if expiring and self.ready:
            self._arm_expiry()

    # -- delivery --------------------------------------------------------------
    def _pick(self) -> Consumer | None:
        consumers = self.consumers
        n = len(consumers)
        if n == 1 or (self.queue.args.single_active_consumer and n):
            c = consumers[0]
            return c if c.sink.has_credit(c) else None
        if self._by_priority is not None:
            return self._pick_by_priority()
        start = self._next
        for i in range(n):
            c = consumers[(start + i) % n]
            if c.sink.has_credit(c):
                self._next = (start + i + 1) % n
                return c
        return None

    def _pick_by_priority(self) -> Consumer | None:
        """Highest consumer priority first; round robin among equals (x-priority)."""
        assert self._by_priority is not None
        for group in self._by_priority:
            n = len(group)
            key = group[0].priority
            start = self._next_in.get(key, 0) % n
            for i in range(n):
                c = group[(start + i) % n]
                if c.sink.has_credit(c):
                    self._next_in[key] = (start + i + 1) % n
                    return c
        return None

    def _regroup(self) -> None:
        priorities = {c.priority for c in self.consumers}
        if len(priorities) <= 1:
            self._by_priority = None
            return
        self._by_priority = [
            [c for c in self.consumers if c.priority == p] for p in sorted(priorities, reverse=True)
        ]

    def dispatch(self) -> None:
        """Hand ready messages to consumers that have credit, round robin."""
        if self._dispatching:
            return
        if self.queue.lease is not None and not self.queue.lease_valid():
            return  # see Queue.guard: the queue was just given up, nothing more is delivered here
        self._dispatching = True
        try:
            ready = self.ready
            queue = self.queue
            try:
                while ready and self.consumers:
                    c = self._pick()
                    if c is None:
                        break
                    qm = ready.popleft()
                    self.ready_bytes -= len(qm.message.body)
                    if qm.expires_at is not None and qm.expires_at <= queue.scheduler.now():
                        queue.drop([qm], EXPIRED)
                        continue
                    self._hand_over(c, qm)
            except PageWait:
                pass  # the next page is being read from the store: _page_landed dispatches again
            flow = self.flow
            if (flow.behind or flow.stalled) and len(ready) <= FLOW_LOW:
                flow.at_low()
            if (type(ready) is PagedReady and not ready.paged
                    and self.ready_bytes + len(ready) * MESSAGE_BYTES <= self.page_budget // 2):
                self._unpage(ready)  # drained: back to the plain deque of the in-memory hot path
        finally:
            self._dispatching = False

    def _hand_over(self, c: Consumer, qm: QueuedMessage) -> None:
        """Deliver ``qm`` to ``c``: unacked until settled, or gone at once for no-ack."""
        qm.delivery_count += 1
        self.delivered += 1
        if qm.redelivered:
            self.redelivered += 1
        if not c.no_ack:
            self.unacked += 1
            c.unacked += 1
        elif qm.persisted:
            self.queue.forget(qm)
        elif qm.link is not None:
            qm.link.settle(qm)
        c.sink.deliver(c, qm)

    def get(self, no_ack: bool) -> QueuedMessage | None:
        """basic.get: the next ready message that has not expired, or None."""
        if not self.queue.lease_valid():
            return None
        self.expire()
        if not self.ready:
            return None
        try:
            qm = self.ready.popleft()
        except PageWait:
            return None  # not empty: head_loading() says so, and get_loaded waits for the page
        self.ready_bytes -= len(qm.message.body)
        self.flow_recheck()
        qm.delivery_count += 1
        self.delivered += 1
        if qm.redelivered:
            self.redelivered += 1
        if not no_ack:
            self.unacked += 1
        elif qm.persisted:
            self.queue.forget(qm)
        elif qm.link is not None:
            qm.link.settle(qm)
        return qm

    # -- expiry ----------------------------------------------------------------
    def expire(self) -> None:
        """Drop (dead-letter) expired messages at the head, as RabbitMQ does."""
        ready = self.ready
        if not ready:
            return
        now = self.queue.scheduler.now()
        expired: list[QueuedMessage] = []
        while ready:
            try:
                head = ready[0]
            except PageWait:
                break  # expired ones at the head of the next page go when it lands
            if head.expires_at is None or head.expires_at > now:
                break
            ready.popleft()
            self.ready_bytes -= len(head.message.body)
            expired.append(head)
        if expired:
            self.queue.drop(expired, EXPIRED)
            self.flow_recheck()
        self._arm_expiry()

    def _arm_expiry(self) -> None:
        if not self.ready:
            return
        try:
            head = self.ready[0]
        except PageWait:
            return  # armed again when the page lands
        if head.expires_at is None:
            return
        if self._expiry_timer is not None:
            if self._expiry_at <= head.expires_at:
                return
            self._expiry_timer.cancel()
        self._expiry_at = head.expires_at
        scheduler = self.queue.scheduler
        self._expiry_timer = scheduler.call_later(head.expires_at - scheduler.now(), self._on_expiry_timer)

    def _on_expiry_timer(self) -> None:
        self._expiry_timer = None
        if not self.queue.deleted:
            try:
                self.expire()
            finally:
                # expire() pops what it drops before dropping it, so after a
                # failure (contained by the scheduler) the head has moved on:
                # arm for it, or this queue's TTLs would stop for good.
                self._arm_expiry()

    # -- settlement ------------------------------------------------------------
    def settle(self, qm: QueuedMessage, consumer: Consumer | None) -> None:
        """An unacked delivery is done with (acked, or rejected without requeue)."""
        if self.queue.lease is not None:
            # A late ack after the lease ran out: the check gives the queue up
            # first, so the ack reaches neither the store nor the consumers.
            self.queue.lease_valid()
        self.unacked -= 1
        self.acked += 1
        if consumer is not None:
            consumer.unacked -= 1
        if qm.persisted:
            self.queue.forget(qm)
        elif qm.link is not None:
            qm.link.settle(qm)
        if self.queue.retained:
            self.queue.retained.discard(qm.offset)

    def discard(self, items: Iterable[tuple[QueuedMessage, Consumer | None]]) -> None:
        """Rejected without requeue: settle, and dead-letter where the queue says so."""
        queue = self.queue
        if queue.at_least_once and queue.remote is None and not queue.deleted:
            # Dead-letter first, then settle: a message no queue took stays stored and waits.
            pairs = list(items)
            kept = queue.dead_letter_kept([qm for qm, _ in pairs], REJECTED)
            for qm, consumer in pairs:
                if id(qm) in kept:
                    stored, qm.persisted = qm.persisted, False  # settled, yet it stays in the store
                    self.settle(qm, consumer)
                    qm.persisted = stored
                else:
                    self.settle(qm, consumer)
            self.dispatch()
            return
        dropped = []
        for qm, consumer in items:
            if qm.link is not None:
                qm.link.reject_next(qm)  # the owner drops (and dead-letters) it
            self.settle(qm, consumer)
            dropped.append(qm)
        if dropped and not queue.deleted and queue.remote is None:
            queue.dead_letter(dropped, REJECTED)  # settle already removed them from the store
        self.dispatch()

    def requeue(self, items: Iterable[tuple[QueuedMessage, Consumer | None]]) -> None:
        """Put unacked deliveries back in their original order, marked redelivered."""
        self.queue.lease_valid()  # as settle: a queue given up takes nothing back
        back: list[QueuedMessage] = []
        over: list[QueuedMessage] = []  # returned more often than x-delivery-limit
        limit = self.queue.args.delivery_limit
        quorum = self.queue.args.quorum
        for qm, consumer in items:
            self.unacked -= 1
            if consumer is not None:
                consumer.unacked -= 1
            if self.queue.deleted or (self.queue.remote is not None and qm.link is None):
                # Gone, or delivered while this node owned a queue it no longer
                # does: the new owner redelivers it from the store.
                continue
            if qm.link is not None and not qm.link.keeps(qm):
                qm.link.give_back(qm)  # its proxied subscription ended: the owner requeues it
                continue
            if qm.offset in self.queue.retained:
                # Retention removed it while it was out: it is settled, never redelivered.
                self.queue.retained.discard(qm.offset)
                if qm.persisted:
                    self.queue.forget(qm)
                continue
            if limit is not None and qm.delivery_count > limit and self.queue.remote is None:
                over.append(qm)
                continue
            qm.redelivered = True
            if quorum:
                qm.message = with_delivery_count(qm.message, qm.delivery_count)
            back.append(qm)
            self.ready_bytes += len(qm.message.body)
            if qm.persisted:
                self.queue.storage.delivery_count(qm)  # type: ignore[union-attr]
        if over:
            self.queue.drop(over, DELIVERY_LIMIT)
        if not back:
            return
        back.sort(key=_offset)
        ready = self.ready
        if isinstance(ready, deque):
            requeue_into(ready, back)
        else:
            ready.requeue(back)  # a priority list, or a paged one (into its window)
        self.dispatch()
        self._arm_expiry()

    # -- consumers -------------------------------------------------------------
    def add_consumer(self, consumer: Consumer, dispatch: bool = True) -> None:
        if any(c.exclusive for c in self.consumers) or (consumer.exclusive and self.consumers):
            raise AccessRefused(
                f"queue '{self.queue.name}' in vhost '{self.queue.vhost}' in exclusive use"
            )
        self.consumers.append(consumer)
        self._regroup()
        self.queue.consumer_added()
        if self.queue.remote is not None:
            self.queue.remote.consumers_changed(self)
        if dispatch:
            self.dispatch()

    def remove_consumer(self, consumer: Consumer) -> None:
        try:
            self.consumers.remove(consumer)
        except ValueError:
            return
        if self._next >= len(self.consumers):
            self._next = 0
        self._regroup()
        self.flow_recheck()
        self.queue.consumer_removed()
        if self.queue.remote is not None:
            self.queue.remote.consumers_changed(self)
        if self.consumers and self.ready:
            # Single active consumer: the next one in line takes over.
            self.dispatch()

    def purge(self) -> int:
        ready = self.ready
        n = len(ready)
        storage = self.queue.storage
        if storage is not None:
            for qm in ready:
                if qm.persisted:
                    self.queue.forget(qm)
            if type(ready) is PagedReady:
                for offset in ready.spilled_persisted():
                    storage.remove_offset(offset)
        self.clear_ready()
        self.flow_recheck()
        return n

    def clear_ready(self) -> None:
        """Forget every ready message (and any segment file of this channel)."""
        ready = self.ready
        if type(ready) is PagedReady:
            ready.close()
            self.ready = deque()
            self.set_paging()
            waiters, self._page_waiters = self._page_waiters, []
            for fut in waiters:  # a basic.get waiting for a page: the queue is empty now
                if not fut.done():
                    fut.set_result(None)
        else:
            ready.clear()
        self.ready_bytes = 0

    def take_offsets(self, offsets: set[int]) -> list[QueuedMessage]:
        """Remove the ready messages with these offsets (retention) and return them."""
        ready = self.ready
        if isinstance(ready, PagedReady):
            taken, spilled = ready.take_offsets(offsets)
            for offset, persisted, size in spilled:
                # Spilled: not read back, so a stand-in carries what drop_offsets needs (offset, persisted).
                stand_in = QueuedMessage(_SPILLED, offset)
                stand_in.persisted = persisted
                taken.append(stand_in)
                self.ready_bytes -= size
        elif isinstance(ready, PriorityReady):
            taken = ready.take_offsets(offsets)
        else:
            taken = take_offsets(ready, offsets)
        for qm in taken:
            self.ready_bytes -= len(qm.message.body)
        return taken

    # -- paging (core/engine/paging.py) ---------------------------------------------
    @property
    def pageable(self) -> bool:
        return self.page_budget != NEVER

    @property
    def memory_bytes(self) -> int:
        """Bytes of ready bodies held in memory (the memory alarm's share of this channel)."""
        ready = self.ready
        return ready.mem_bytes + ready.held_bytes if type(ready) is PagedReady else self.ready_bytes

    def set_paging(self) -> None:
        """(Re)read the budget: the node's per-queue one, 0 for lazy queues; priority queues never page."""
        queue = self.queue
        if isinstance(self.ready, PriorityReady) or queue.args.queue_type != "classic":
            budget = NEVER
        elif queue.args.lazy:
            budget = 0
        else:
            budget = paging.settings.queue_bytes
        self.page_budget = budget
        ready = self.ready
        if type(ready) is PagedReady:
            ready.shrink(budget)
            self.page_at = NEVER
        else:
            self.page_at = budget
            if self.ready_bytes + len(ready) * MESSAGE_BYTES > budget:
                self._page_out()

    def _page_out(self) -> None:
        ready = self.ready
        if self._dispatching:
            return  # dispatch holds the deque (a dead-letter cycle back here): the next push pages
        if type(ready) is not deque or (self.queue.remote is not None and ready and ready[0].link is not None):
            # A proxy's ready copies belong to the owner's subscription: they stay in memory. (Behind
            # a loading gate the queue's own backlog is restored: that one pages.)
            return
        self.ready = PagedReady(ready, self.ready_bytes, self.page_budget, self.queue.storage, self._page_landed)
        self.page_at = NEVER

    def page_down(self, keep: int) -> None:
        """The node is over its cap: hold at most ``keep`` bytes of bodies in memory."""
        ready = self.ready
        if type(ready) is PagedReady:
            ready.shrink(min(keep, self.page_budget))
        elif type(ready) is deque and ready and ready[0].link is None:
            self.ready = PagedReady(ready, self.ready_bytes, min(keep, self.page_budget), self.queue.storage,
                                    self._page_landed)
            self.page_at = NEVER

    def _page_landed(self) -> None:
        """A page read from the store is in the window: what waited on the head goes on."""
        waiters, self._page_waiters = self._page_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
        queue = self.queue
        if queue.deleted:
            return
        if self.consumers:
            self.dispatch()
        self.expire()
        if queue._limited:
            queue._drop_over_limit()

    def head_loading(self) -> bool:
        """Is the head being read from the store (so the channel is not empty, only waiting)?"""
        ready = self.ready
        return type(ready) is PagedReady and ready.waiting

    async def get_loaded(self, no_ack: bool) -> QueuedMessage | None:
        """basic.get that waits for a page being read from the store rather than answer empty."""
        while True:
            qm = self.get(no_ack)
            if qm is not None or not self.head_loading():
                return qm
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._page_waiters.append(fut)
            await fut

    def _unpage(self, ready: PagedReady) -> None:
        if self.page_budget == 0:
            return  # lazy: stays paged
        self.ready = ready.mem
        ready.mem = deque()
        ready.close()
        self.page_at = self.page_budget

    def drop_head(self) -> QueuedMessage:
        qm = self.ready.popleft()
        self.ready_bytes -= len(qm.message.body)
        return qm

    def cancel_timers(self) -> None:
        if self._expiry_timer is not None:
            self._expiry_timer.cancel()
            self._expiry_timer = None
        self.flow.at_low()  # the channel or its queue is going away: nobody waits on it

    def flow_recheck(self) -> None:
        """Ready messages left other than by delivery (get, expiry, purge) or a consumer left."""
        flow = self.flow
        if (flow.behind or flow.stalled) and (len(self.ready) <= FLOW_LOW or not self.consumers):
            flow.at_low()


def _offset(qm: QueuedMessage) -> int:
    return qm.offset


# The message of a stand-in for a spilled message retention removed (see QueueChannel.take_offsets).
_SPILLED = Message("", "", b"\x00\x00", b"")

# Dead-letters ``messages``; returns those no queue took (ids), which at-least-once keeps.
DeadLetterFn = Callable[["Queue", list[QueuedMessage], str], "set[int]"]
# How often a quorum queue with at-least-once dead-lettering retries the messages
# no queue took (RabbitMQ's dead-letter worker retries on its own timer too).
DLX_RETRY_S = 1.0


def with_delivery_count(message: Message, count: int) -> Message:
    """``message`` with the ``x-delivery-count`` header a quorum queue's redeliveries carry.

    Only on redelivery (off the publish and first-delivery paths): one decode
    and encode of the properties per return.
    """
    headers = dict(message.headers)
    headers["x-delivery-count"] = count
    return Message(message.exchange, message.routing_key, properties.with_headers(message.props, headers),
                   message.body, node=message.node, timestamp=message.timestamp)


class Queue:
    """A named queue in a vhost: offsets, its channels, limits and lifecycle."""

    def __init__(
        self,
        name: str,
        vhost: str,
        durable: bool = False,
        exclusive_owner: object | None = None,
        auto_delete: bool = False,
        arguments: dict[str, Any] | None = None,
        args: QueueArgs | None = None,
        scheduler: Scheduler | None = None,
        on_unused: Callable[[Queue], None] | None = None,
        on_dead_letter: DeadLetterFn | None = None,
    ) -> None:
        self.name = name
        self.vhost = vhost
        self.durable = durable
        self.exclusive_owner = exclusive_owner
        self.auto_delete = auto_delete
        self.arguments = dict(arguments or {})
        self.args = args or QueueArgs()
        self.scheduler: Scheduler = scheduler or AsyncioScheduler()
        self.next_offset = 0
        self.default = QueueChannel(self, "")
        self.channels: list[QueueChannel] = [self.default]
        self.had_consumers = False
        self.deleted = False
        self._on_unused = on_unused
        self._on_dead_letter = on_dead_letter
        a = self.args
        self._ttl_ms = a.message_ttl
        self._limited = a.max_length is not None or a.max_length_bytes is not None
        self._expires_timer: TimerHandle | None = None
        # Set by core.durable.durability for durable queues when a store is configured.
        self.storage: QueueStorage | None = None
        # Cluster: set while another node owns the queue (or it is being taken
        # over); publishes go there and consumers are served through a proxy.
        # Set through set_remote (core/engine/ownership.py says when).
        self.remote: Remote | None = None
        # The lease this node serves the queue under, while it owns it in a
        # cluster (see guard); None when nothing can take the queue away.
        self.lease: Lease | None = None
        # Offsets retention removed while they may be delivered and unacked: such a
        # message is dropped instead of requeued (drop_offsets).
        self.retained: set[int] = set()
        self.published = 0  # messages enqueued: a counter the management API reads (core/engine/stats.py)
        # A quorum queue stores every message, persistent or not, as RabbitMQ's do.
        self._store_all = self.args.quorum
        # At-least-once dead-lettering: messages no queue took yet, still stored, retried.
        self.dlx_pending: list[tuple[QueuedMessage, str]] = []
        self._dlx_timer: TimerHandle | None = None
        self.touch()

    @property
    def exclusive(self) -> bool:
        return self.exclusive_owner is not None

    # -- publishing ------------------------------------------------------------
    def _expiry_of(self, message: Message) -> float | None:
        ttl = self._ttl_ms
        expiration = message.summary.expiration
        if expiration is not None:
            try:
                per_message = int(expiration)
            except ValueError:
                per_message = None  # refused at publish by the front end; be lenient here
            if per_message is not None and (ttl is None or per_message < ttl):
                ttl = per_message
        if ttl is None:
            return None
        return self.scheduler.now() + ttl / 1000.0

    def stores(self, message: Message) -> bool:
        """Whether this queue, having a store, writes ``message`` there (and so confirms it after the commit).

        A classic queue stores persistent messages only, a quorum queue every
        message; a stream overrides this.
        """
        return message.persistent or self._store_all

    def enqueue(self, message: Message) -> bool:
        """Add ``message``; False when the queue refused it (x-overflow reject-publish*)."""
        if self.lease is not None and not self.lease_valid() and self.deleted:
            return False  # the lease ran out and the queue went with it (nothing of it was stored)
        if self.remote is not None:
            self.remote.forward(message)
            return True
        if self._limited and self.args.overflow != "drop-head" and self._full(len(message.body)):
            if self.args.overflow == "reject-publish-dlx":
                self.dead_letter([QueuedMessage(message, -1)], MAXLEN)
            return False
        offset = self.next_offset
        self.next_offset = offset + 1
        qm = QueuedMessage(message, offset)
        self.published += 1
        if self._ttl_ms is not None or message.summary.expiration is not None:
            qm.expires_at = self._expiry_of(message)
        if self.storage is not None and (message.persistent or self._store_all):
            qm.persisted = True
            self.storage.append(qm)
        self._push_to_channels(qm)
        if self._limited:
            self._drop_over_limit()
        return True

    def enqueue_many(self, messages: list[Message]) -> list[bool]:
        """``enqueue`` each of ``messages`` in order (a batch another node forwarded)."""
        if not self.lease_valid():
            return [self.enqueue(m) for m in messages]  # given up just now: on to the new owner
        if (self.remote is not None or self._limited or len(self.channels) != 1
                or type(self).enqueue is not Queue.enqueue):  # limits, filters, a stream's own enqueue
            return [self.enqueue(m) for m in messages]
        offset = self.next_offset
        storage = self.storage
        timed = self._ttl_ms is not None
        qms = []
        for m in messages:
            qm = QueuedMessage(m, offset)
            offset += 1
            if timed or m.summary.expiration is not None:
                qm.expires_at = self._expiry_of(m)
            if storage is not None and (m.persistent or self._store_all):
                qm.persisted = True
                storage.append(qm)
            qms.append(qm)
        self.next_offset = offset
        self.published += len(qms)
        self.default.push_many(qms)
        return [True] * len(qms)

    def _full(self, incoming: int) -> bool:
        a = self.args
        ready = self.default
        if a.max_length is not None and len(ready.ready) >= a.max_length:
            return True
        return a.max_length_bytes is not None and ready.ready_bytes + incoming > a.max_length_bytes

    def _drop_over_limit(self) -> None:
        a = self.args
        for ch in self.channels:
            dropped = []
            try:
                while ch.ready and (
                    (a.max_length is not None and len(ch.ready) > a.max_length)
                    or (a.max_length_bytes is not None and ch.ready_bytes > a.max_length_bytes)
                ):
                    dropped.append(ch.drop_head())
            except PageWait:
                pass  # the head is being read from the store: the rest goes when it lands (_page_landed)
            if dropped:
                self.drop(dropped, MAXLEN)

    def apply_args(self, args: QueueArgs) -> None:
        """Policies changed what this queue enforces (core/engine/policy.py): from now on, as RabbitMQ.

        Limits apply at once (a queue over a new max-length drops its head now);
        a new message TTL applies to messages enqueued from now on.
        """
        if args == self.args:
            return
        old, self.args = self.args, args
        self._ttl_ms = args.message_ttl
        self._limited = args.max_length is not None or args.max_length_bytes is not None
        if args.expires != old.expires:
            self.cancel_expiry()
            self.touch()
        if self._limited and self.remote is None and not self.deleted:
            self._drop_over_limit()
        if args.lazy != old.lazy:
            for ch in self.channels:
                ch.set_paging()

    def forget(self, qm: QueuedMessage) -> None:
        """``qm`` left the queue for good: remove it from the store."""
        qm.persisted = False
        if self.storage is not None:
            self.storage.remove(qm)

    def drop(self, messages: list[QueuedMessage], reason: str) -> None:
        """Ready messages removed by the queue itself (expiry, overflow)."""
        if self.at_least_once:
            # Dead-letter first, then remove from the store: the target's write and
            # this removal share a commit (core/durable/group_commit.py), and should a
            # full batch split them, the copy is written before the original goes.
            kept = self.dead_letter_kept(messages, reason)
            for qm in messages:
                if qm.persisted and id(qm) not in kept:
                    self.forget(qm)
            return
        for qm in messages:
            if qm.persisted:
                self.forget(qm)
        self.dead_letter(messages, reason)

    def drop_offsets(self, offsets: Iterable[int]) -> int:
        """Retention removed these offsets: they are never delivered (again).

        Ready messages leave at once (no dead-lettering: retention is not a
        rejection), and their removal is queued in the store like an ack.
        Offsets not found ready may be delivered and unacked: an ack settles
        them as usual, a requeue drops them. Returns how many ready ones left.
        """
        wanted = set(offsets)
        if not wanted or self.deleted:
            return 0
        found: set[int] = set()
        for ch in self.channels:
            for qm in ch.take_offsets(wanted):
                found.add(qm.offset)
                if qm.persisted:
                    self.forget(qm)
        self.retained |= wanted - found
        return len(found)

    def restore(self, message: Message, offset: int, expires_at: float | None, delivery_count: int) -> None:
        """A message loaded from the store at start-up: back in place, redelivered."""
        qm = QueuedMessage(message, offset)
        qm.expires_at = expires_at
        qm.delivery_count = delivery_count
        qm.redelivered = True
        qm.persisted = True
        if delivery_count and self._store_all:
            qm.message = with_delivery_count(message, delivery_count)
        self.next_offset = max(self.next_offset, offset + 1)
        self._push_to_channels(qm)

    def _push_to_channels(self, qm: QueuedMessage) -> None:
        """Every channel whose filter passes the message gets it (its own copy past the first)."""
        channels = self.channels
        if len(channels) == 1:
            channels[0].push(qm)
            return
        for ch in channels:
            if ch.accepts is None or ch.accepts(qm.message.routing_key):
                ch.push(qm if ch is channels[0] else qm.copy())

    def dead_letter(self, messages: list[QueuedMessage], reason: str) -> None:
        """Messages leave without an ack: to the dead-letter exchange if there is one."""
        if self._on_dead_letter is not None and self.args.dead_letter_exchange is not None:
            self._on_dead_letter(self, messages, reason)

    @property
    def at_least_once(self) -> bool:
        """Quorum queue with ``x-dead-letter-strategy: at-least-once`` (and reject-publish, a DLX)."""
        return self.args.quorum and self.args.dead_letter_strategy == "at-least-once"

    def dead_letter_kept(self, messages: list[QueuedMessage], reason: str) -> set[int]:
        """At-least-once: dead-letter ``messages``; keep (stored, retried) those no queue took. Their ids."""
        if self._on_dead_letter is None:
            return set()
        kept = self._on_dead_letter(self, messages, reason)
        if kept:
            self.dlx_pending.extend((qm, reason) for qm in messages if id(qm) in kept)
            self._arm_dlx_retry()
        return kept

    def _arm_dlx_retry(self) -> None:
        if self._dlx_timer is None and self.dlx_pending and not self.deleted:
            self._dlx_timer = self.scheduler.call_later(DLX_RETRY_S, self._retry_dead_letters)

    def _retry_dead_letters(self) -> None:
        self._dlx_timer = None
        if self.deleted or self._on_dead_letter is None or self.remote is not None:
            return
        waiting = self.dlx_pending
        self.dlx_pending = []
        if not self.at_least_once:
            for qm, _reason in waiting:  # the strategy changed (a policy): at-most-once drops them now
                if qm.persisted:
                    self.forget(qm)
            return
        by_reason: dict[str, list[QueuedMessage]] = {}
        for qm, reason in waiting:
            by_reason.setdefault(reason, []).append(qm)
        for reason, group in by_reason.items():
            kept = self._on_dead_letter(self, group, reason)
            for qm in group:
                if id(qm) in kept:
                    self.dlx_pending.append((qm, reason))
                elif qm.persisted:
                    self.forget(qm)
        self._arm_dlx_retry()

    # -- extra channels (native API) -------------------------------------------
    def add_channel(self, name: str, topic_filter: Callable[[str], bool] | None = None) -> QueueChannel:
        """An extra receiver end: it sees every later message whose routing key ``topic_filter`` accepts."""
        ch = QueueChannel(self, name, topic_filter)
        self.channels.append(ch)
        return ch

    def remove_channel(self, ch: QueueChannel) -> int:
        """Remove a channel other than the default: cancel its consumers, drop its ready messages."""
        if ch is self.default or ch not in self.channels:
            return 0
        self.channels.remove(ch)
        ch.cancel_timers()
        consumers = list(ch.consumers)
        ch.consumers.clear()
        count = ch.purge()
        for c in consumers:
            c.sink.consumer_cancelled(c)
        if consumers:
            self.consumer_removed()
        return count

    # -- counts ----------------------------------------------------------------
    @property
    def message_count(self) -> int:
        return len(self.default.ready)

    @property
    def consumer_count(self) -> int:
        return len(self.default.consumers)

    # -- lifecycle -------------------------------------------------------------
    def touch(self) -> None:
        """The queue was used (declared, got from): restart its x-expires clock."""
        expires = self.args.expires
        if expires is None or self.deleted or self.remote is not None:
            return  # only the owner decides when its queue expires
        if self._expires_timer is not None:
            self._expires_timer.cancel()
            self._expires_timer = None
        if any(ch.consumers for ch in self.channels):
            return
        self._expires_timer = self.scheduler.call_later(expires / 1000.0, self._expired)

    def cancel_expiry(self) -> None:
        if self._expires_timer is not None:
            self._expires_timer.cancel()
            self._expires_timer = None

    def _expired(self) -> None:
        self._expires_timer = None
        if not self.deleted and not any(ch.consumers for ch in self.channels) and self._on_unused is not None:
            self._on_unused(self)

    def consumer_added(self) -> None:
        self.had_consumers = True
        if self._expires_timer is not None:
            self._expires_timer.cancel()
            self._expires_timer = None

    def consumer_removed(self) -> None:
        if any(ch.consumers for ch in self.channels):
            return
        if self.remote is not None:
            return  # the owner sees the proxy's subscription come and go, and decides
        if self.auto_delete and self.had_consumers and self._on_unused is not None:
            self._on_unused(self)
        else:
            self.touch()

    def purge(self) -> int:
        return sum(ch.purge() for ch in self.channels)

    # -- ownership (core/engine/ownership.py decides; a coordinator calls these) ----
    def guard(self, lease: Lease | None) -> None:
        """Serve only while ``lease`` holds (None: nothing to check); ``lease_valid`` is the check."""
        self.lease = lease

    def lease_valid(self) -> bool:
        """May this node serve the queue now? The one lease check, made before every enqueue,
        delivery, settlement and get (core/engine/ownership.py).

        Past the lease's deadline it gives the lease up first (``Lease.enforce``: every owned queue is
        lost, this one included) and answers False. One clock read, on queues a cluster node owns
        only: the hot paths (enqueue, dispatch, settle) test ``lease is not None`` before calling it,
        which keeps a queue without a lease (every queue of a single node) at one comparison.
        """
        lease = self.lease
        return lease is None or lease.enforce()

    def set_remote(self, remote: Remote | None) -> Remote | None:
        """What stands in for the owner from now on (a proxy, a loading gate; None: served here); the one before."""
        previous, self.remote = self.remote, remote
        if remote is not None:
            self.cancel_expiry()  # x-expires runs on the owner only
        return previous

    def attach_storage(self, storage: QueueStorage | None) -> None:
        """Write through ``storage`` (its epoch fences every write) from now on."""
        self.storage = storage

    def detach_storage(self) -> QueueStorage | None:
        """Stop writing to the store (what is stored stays for the next owner); the storage it had."""
        storage, self.storage = self.storage, None
        return storage

    def reset_ready(self) -> None:
        """Forget every ready message and its timers: a new owner's copy comes from the store."""
        for ch in self.channels:
            ch.cancel_timers()
            ch.clear_ready()

    def stop_serving(self) -> None:
        """This node no longer owns the queue: no lease, no store, nothing ready here.

        Unacked deliveries stay with their consumers; their acks then change
        nothing (the store is detached) and the next owner redelivers them.
        """
        self.lease = None
        self.storage = None
        self.dlx_pending = []  # still stored: the next owner loads them as ready
        self.reset_ready()

    def delete(self) -> int:
        """Mark deleted, cancel every consumer and timer; return the ready count dropped."""
        self.deleted = True
        count = self.message_count
        if self._dlx_timer is not None:
            self._dlx_timer.cancel()
            self._dlx_timer = None
        self.dlx_pending = []
        if self._expires_timer is not None:
            self._expires_timer.cancel()
            self._expires_timer = None
        for ch in self.channels:
            ch.cancel_timers()
            consumers = list(ch.consumers)
            ch.consumers.clear()
            ch.purge()
            for c in consumers:
                c.sink.consumer_cancelled(c)
        return count
