"""Readers of a stream: a cursor over its log, the consumers reading through it, pages from the store.

A ``StreamReader`` is what a consumer (AMQP or gRPC) of a stream is attached
to: one per plain consumer, one per consumer group (members share it, one
active at a time, see core/stream.py). It delivers from the stream's
in-memory log by offset; when its cursor is older than what memory holds it
reads pages back from the store, the next page while half of the current
one is left. Acks only return credit, and advance a group's committed offset
over what the active member settled in order.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from core.engine.queue import Consumer, QueueChannel
from core.model import properties
from core.model.message import Message, QueuedMessage
from core.model.tasks import spawn
from core.ports.store import StoredMessage, StoreError

if TYPE_CHECKING:
    from core.engine.stream import StreamQueue
    from core.ports.storage import QueueStorage

log = logging.getLogger("leveret.core")

# Page reads under way (spawn holds them until done: the loop keeps only weak references).
_loads: set[asyncio.Task[Any]] = set()


def _queued(sm: StoredMessage) -> QueuedMessage:
    """A message read back from the store, at its offset."""
    props = sm.properties
    summary = properties.scan_cached(props)
    m = Message(sm.exchange, sm.routing_key, props, sm.body, summary)
    m.timestamp = sm.enqueued_at
    m.id = sm.message_id
    return QueuedMessage(m, sm.offset)


class LogChannel(QueueChannel):
    """What every reader of a stream shares, here or through the owner (core/cluster/stream_proxy.py).

    A log is read, not consumed: nothing is pushed into a reader, it has no
    ready list to get from or purge, and a reject, nack or requeue cannot
    take a message back, so it settles like an ack.
    """

    cursor: int  # offset of the next message to deliver (-1: the owner delivers, not local appends)

    def cancel_all(self) -> None:
        """The stream went away here (deleted, or rebuilt for a new owner): cancel every consumer."""
        raise NotImplementedError

    def push(self, qm: QueuedMessage) -> None:
        raise AssertionError("a stream reader reads the log; nothing is pushed into it")

    def get(self, no_ack: bool) -> QueuedMessage | None:
        return None

    def purge(self) -> int:
        return 0

    def discard(self, items: Iterable[tuple[QueuedMessage, Consumer | None]]) -> None:
        for qm, consumer in items:
            self.settle(qm, consumer)
        self.dispatch()

    def requeue(self, items: Iterable[tuple[QueuedMessage, Consumer | None]]) -> None:
        self.discard(items)


class StreamReader(LogChannel):
    """A cursor over a stream and the consumers reading through it.

    It overrides what the front ends call on a ``QueueChannel`` (dispatch,
    settle, requeue, discard, add/remove consumer), so an AMQP channel or a
    native subscription keeps its unacked deliveries the same way for both
    kinds of queue; its ready list stays empty.
    """

    queue: StreamQueue

    def __init__(
        self, stream: StreamQueue, name: str, cursor: int, group: str | None = None, commit_on_settle: bool = True
    ) -> None:
        super().__init__(stream, name)
        self.cursor = cursor  # offset of the next message to deliver
        self.group = group
        self.closed = False
        self._active: Consumer | None = None
        # Messages read back from the store for a cursor below the in-memory log.
        self._page: deque[QueuedMessage] = deque()
        self._loading = False
        self._seeks = 0  # a page loaded before a seek is stale
        self._ahead_at = 0  # read the next page once the current one is down to this many
        # Group offset tracking: offsets delivered to the active member in order,
        # and those of them settled out of order.
        self._track = group is not None and commit_on_settle
        self._inflight: deque[int] = deque()
        self._acked: set[int] = set()

    @property
    def lag(self) -> int:
        """Messages between the cursor and the end of the log."""
        return max(0, self.queue.next_offset - max(self.cursor, self.queue.first_offset))

    # -- delivery ----------------------------------------------------------------
    def dispatch(self) -> None:
        c = self._active
        if c is None or self._dispatching:
            return
        if not self.queue.lease_valid():
            return  # the node's lease ran out: the stream was just given up (Queue.guard)
        stream = self.queue
        self._dispatching = True
        try:
            sink = c.sink
            first = stream.first_offset  # retention cannot run while this loop does
            while sink.has_credit(c):
                page = self._page
                if page:
                    qm = page.popleft()
                    if qm.offset >= self.cursor and qm.offset >= first:
                        self._send(c, qm)
                    if len(page) == self._ahead_at and page[-1].offset + 1 < stream.mem_first:
                        self._fetch(page[-1].offset + 1)  # read ahead while half a page is left
                    continue
                if self.cursor < stream.mem_first:
                    self.cursor = max(self.cursor, stream.first_offset)
                    if self.cursor < stream.mem_first:
                        self._fetch(self.cursor)  # older than what memory holds: read a page from the store
                        break
                entries = stream.entries
                pos = stream.position(self.cursor)
                track = self._track
                while pos < len(entries) and sink.has_credit(c):
                    qm = entries[pos]
                    pos += 1
                    self.cursor = qm.offset + 1
                    self.unacked += 1
                    c.unacked += 1
                    if track:
                        self._inflight.append(qm.offset)
                    sink.deliver(c, qm)
                break
        finally:
            self._dispatching = False

    def _send(self, c: Consumer, qm: QueuedMessage) -> None:
        self.cursor = qm.offset + 1
        self.unacked += 1
        c.unacked += 1
        if self._track:
            self._inflight.append(qm.offset)
        c.sink.deliver(c, qm)

    def seek(self, offset: int) -> None:
        self.cursor = offset
        self._page.clear()
        self._seeks += 1

    # -- reading the store for what memory no longer holds ------------------------------
    def _fetch(self, start: int) -> None:
        """Load the page from ``start`` (the cursor, or just after the page being delivered)."""
        if self._loading:
            return
        storage = self.queue.storage
        if storage is None:  # nothing is evicted without a store; be safe anyway
            self.cursor = self.queue.mem_first
            return
        self._loading = True
        limit = self.queue.page_limit(start)
        spawn(self._load(storage, start, self.queue.mem_first, limit, self._seeks), _loads)

    async def _load(self, storage: QueueStorage, start: int, below: int, limit: int, seeks: int) -> None:
        rows = None
        try:
            rows = await storage.committer.store.load_range(storage.vhost, storage.name, start, below, limit)
        except StoreError as exc:
            log.warning("stream read from the store failed; retrying",
                        extra={"vhost": storage.vhost, "queue": storage.name, "error": str(exc)})
            await asyncio.sleep(1.0)
        finally:
            self._loading = False
        if self.closed or self.queue.deleted:
            return
        if rows is not None and seeks == self._seeks:  # not moved meanwhile (a group hand-over)
            if rows:
                self._page.extend(_queued(sm) for sm in rows)
                self._ahead_at = max(1, len(rows) // 2)
            elif not self._page and self.cursor == start:
                # Nothing stored in [start, below): removed by retention meanwhile, or a batch the
                # store refused (its publishers were nacked). Go on after the gap.
                self.cursor = below
        self.dispatch()

    # -- settlement: acks only move credit (and a group's committed offset) ---------
    def settle(self, qm: QueuedMessage, consumer: Consumer | None) -> None:
        self.queue.lease_valid()  # a late ack after the lease ran out commits no offset (the stream is given up first)
        self.unacked -= 1
        if consumer is not None:
            consumer.unacked -= 1
        if self._track and consumer is self._active:
            acked = self._acked
            acked.add(qm.offset)
            inflight = self._inflight
            last = -1
            while inflight and inflight[0] in acked:
                last = inflight.popleft()
                acked.discard(last)
            if last >= 0:
                self.queue.commit_offset(self.group, last)  # type: ignore[arg-type]

    # -- consumers -------------------------------------------------------------------
    def add_consumer(self, consumer: Consumer, dispatch: bool = True) -> None:
        self.consumers.append(consumer)
        self.queue.consumer_added()
        self._elect()
        if dispatch:
            self.dispatch()

    def remove_consumer(self, consumer: Consumer) -> None:
        try:
            self.consumers.remove(consumer)
        except ValueError:
            return
        self._elect()
        if not self.consumers:
            self.queue.reader_closed(self)
        self.queue.consumer_removed()
        self.dispatch()

    def _elect(self) -> None:
        """The active member: the only consumer, or member ``partition mod n`` of a group."""
        consumers = self.consumers
        new = consumers[self.queue.partition % len(consumers)] if consumers else None
        if new is self._active:
            return
        previous, self._active = self._active, new
        if previous is not None and self.group is not None:
            if self._track:
                if self._inflight:
                    # The previous active member's unacknowledged messages go to the next one.
                    self.seek(self._inflight[0])
            else:
                # Offsets are committed explicitly: the next member starts after the last commit.
                committed = self.queue.committed.get(self.group)
                if committed is not None:
                    self.seek(committed + 1)
        self._inflight.clear()
        self._acked.clear()

    @property
    def active(self) -> Consumer | None:
        return self._active

    def cancel_all(self) -> None:
        self.closed = True
        consumers = list(self.consumers)
        self.consumers.clear()
        self._active = None
        for c in consumers:
            c.sink.consumer_cancelled(c)
