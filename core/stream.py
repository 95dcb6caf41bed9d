"""Stream queues: an append-only log read from an offset, kept until retention removes it.

A ``StreamQueue`` is a core queue (same name space, routing, durability) whose
messages are not moved out when delivered: each message stays in the log at
its offset, and every reader (``StreamReader``) has its own cursor over it.
Acknowledgements only return credit. Retention (``x-max-age``,
``x-max-length-bytes``) removes the oldest messages, in memory and, as one
range delete, in the store.

A consumer group is a named reader that several consumers share: one of them
is active (the others stand by, as with single active consumer), and what the
active one acknowledges in order becomes the group's committed offset, kept in
the store through the group committer, so a group that comes back resumes
after it. The active member of a group on partition ``p`` of a partitioned
stream is member ``p mod n`` (in order of joining), so the members of a group
split a partitioned stream's partitions between them.

The retained log is kept in memory (bounded by the stream's retention); the
store holds the same messages for restarts and failover.
"""

from __future__ import annotations

import bisect
import re
from collections import deque
from collections.abc import Iterable
from typing import Any

from core.clock import TimerHandle
from core.errors import NotImplementedFeature
from core.message import Message, QueuedMessage
from core.queue import Consumer, Queue, QueueChannel
from core.stream_args import OffsetSpec

# Compact the log list once this many retained-out entries sit at its front.
_COMPACT_AT = 4096
# Age retention runs at most this often (seconds), batching removals.
_AGE_SLACK = 0.05

_PARTITION = re.compile(r"-(\d+)$")


def _offset(qm: QueuedMessage) -> int:
    return qm.offset


def _timestamp(qm: QueuedMessage) -> float:
    return qm.message.timestamp


class StreamReader(QueueChannel):
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
        self._active: Consumer | None = None
        # Group offset tracking: offsets delivered to the active member in order,
        # and those of them settled out of order.
        self._track = group is not None and commit_on_settle
        self._inflight: deque[int] = deque()
        self._acked: set[int] = set()

    @property
    def lag(self) -> int:
        """Messages between the cursor and the end of the log."""
        return max(0, self.queue.next_offset - max(self.cursor, self.queue.first_offset))

    def push(self, qm: QueuedMessage) -> None:
        raise AssertionError("a stream reader reads the log; nothing is pushed into it")

    def get(self, no_ack: bool) -> QueuedMessage | None:
        return None

    def purge(self) -> int:
        return 0

    # -- delivery ----------------------------------------------------------------
    def dispatch(self) -> None:
        c = self._active
        if c is None or self._dispatching:
            return
        stream = self.queue
        self._dispatching = True
        try:
            entries = stream.entries
            pos = stream.position(self.cursor)
            sink = c.sink
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
        finally:
            self._dispatching = False

    # -- settlement: acks only move credit (and a group's committed offset) ---------
    def settle(self, qm: QueuedMessage, consumer: Consumer | None) -> None:
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

    def discard(self, items: Iterable[tuple[QueuedMessage, Consumer | None]]) -> None:
        """basic.reject/nack: a stream cannot take a message back; it counts as done."""
        for qm, consumer in items:
            self.settle(qm, consumer)
        self.dispatch()

    def requeue(self, items: Iterable[tuple[QueuedMessage, Consumer | None]]) -> None:
        self.discard(items)

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
                    self.cursor = self._inflight[0]
            else:
                # Offsets are committed explicitly: the next member starts after the last commit.
                committed = self.queue.committed.get(self.group)
                if committed is not None:
                    self.cursor = committed + 1
        self._inflight.clear()
        self._acked.clear()

    @property
    def active(self) -> Consumer | None:
        return self._active

    def cancel_all(self) -> None:
        consumers = list(self.consumers)
        self.consumers.clear()
        self._active = None
        for c in consumers:
            c.sink.consumer_cancelled(c)


class StreamQueue(Queue):
    """``x-queue-type: stream``: messages stay, readers move."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.entries: list[QueuedMessage] = []
        self.head = 0  # entries before it were removed by retention
        self.log_bytes = 0
        self.readers: list[StreamReader] = []
        self.groups: dict[str, StreamReader] = {}
        self.committed: dict[str, int] = {}
        self._age_timer: TimerHandle | None = None
        m = _PARTITION.search(self.name)
        self.partition = int(m.group(1)) if m else 0

    # -- the log -----------------------------------------------------------------------
    @property
    def first_offset(self) -> int:
        return self.entries[self.head].offset if self.head < len(self.entries) else self.next_offset

    def position(self, offset: int) -> int:
        """Index in ``entries`` of the first retained message at or after ``offset``."""
        entries = self.entries
        head = self.head
        n = len(entries)
        if head >= n:
            return n
        first = entries[head].offset
        if offset <= first:
            return head
        pos = head + offset - first
        if pos < n and entries[pos].offset == offset:
            return pos
        if entries[-1].offset < offset:
            return n
        # Offsets have a gap (a batch the store refused before a restart).
        return bisect.bisect_left(entries, offset, head, n, key=_offset)

    def resolve(self, spec: OffsetSpec) -> int:
        """The offset a new reader starts at."""
        kind = spec.kind
        if kind == "next":
            return self.next_offset
        if kind == "first":
            return self.first_offset
        if kind == "last":
            return self.entries[-1].offset if self.head < len(self.entries) else self.next_offset
        if kind == "offset":
            return min(max(int(spec.value), self.first_offset), self.next_offset)
        pos = bisect.bisect_left(self.entries, spec.value, self.head, len(self.entries), key=_timestamp)
        return self.entries[pos].offset if pos < len(self.entries) else self.next_offset

    def enqueue(self, message: Message) -> bool:
        offset = self.next_offset
        self.next_offset = offset + 1
        qm = QueuedMessage(message, offset)
        # Everything in a stream is stored, whatever its delivery mode (as in RabbitMQ).
        if self.storage is not None:
            qm.persisted = True
            self.storage.append(qm)
        self._append(qm)
        for r in self.readers:
            if r.cursor == offset:
                r.dispatch()
        return True

    def restore(self, message: Message, offset: int, expires_at: float | None, delivery_count: int) -> None:
        qm = QueuedMessage(message, offset)
        qm.persisted = True
        self.next_offset = max(self.next_offset, offset + 1)
        self._append(qm)

    def _append(self, qm: QueuedMessage) -> None:
        self.entries.append(qm)
        self.log_bytes += len(qm.message.body)
        a = self.args
        if a.max_length_bytes is not None and self.log_bytes > a.max_length_bytes:
            self._trim_to_bytes(a.max_length_bytes)
        if a.max_age is not None and self._age_timer is None:
            self._arm_age()

    # -- retention -----------------------------------------------------------------------
    def _trim_to_bytes(self, limit: int) -> None:
        entries = self.entries
        head = self.head
        last = len(entries) - 1
        # The newest message always stays (RabbitMQ never removes the segment being written).
        while head < last and self.log_bytes > limit:
            self.log_bytes -= len(entries[head].message.body)
            head += 1
        self._drop_to(head)

    def enforce_age(self) -> None:
        """Remove messages older than x-max-age."""
        max_age = self.args.max_age
        if max_age is None:
            return
        cutoff = self.scheduler.now() - max_age
        entries = self.entries
        head = self.head
        while head < len(entries) and entries[head].message.timestamp < cutoff:
            self.log_bytes -= len(entries[head].message.body)
            head += 1
        self._drop_to(head)

    def _drop_to(self, head: int) -> None:
        if head == self.head:
            return
        for qm in self.entries[self.head : head]:
            qm.persisted = False
        self.head = head
        if self.storage is not None:
            self.storage.truncate(self.first_offset)
        if head >= _COMPACT_AT and head * 2 >= len(self.entries):
            del self.entries[:head]
            self.head = 0

    def _arm_age(self) -> None:
        if self.head >= len(self.entries) or self.deleted or self.args.max_age is None:
            return
        due = self.entries[self.head].message.timestamp + self.args.max_age
        delay = max(0.0, due - self.scheduler.now()) + _AGE_SLACK
        self._age_timer = self.scheduler.call_later(delay, self._on_age_timer)

    def _on_age_timer(self) -> None:
        self._age_timer = None
        if self.deleted:
            return
        self.enforce_age()
        self._arm_age()

    # -- readers and groups ----------------------------------------------------------------
    def open_reader(self, spec: OffsetSpec, name: str = "", group: str | None = None,
                    commit_on_settle: bool = True) -> StreamReader:
        """A reader at ``spec``; a group's existing reader, or one at its committed offset + 1."""
        if group is not None:
            r = self.groups.get(group)
            if r is not None:
                return r
            committed = self.committed.get(group)
            start = committed + 1 if committed is not None else self.resolve(spec)
            r = StreamReader(self, name or group, start, group, commit_on_settle)
            self.groups[group] = r
        else:
            r = StreamReader(self, name, self.resolve(spec))
        self.readers.append(r)
        return r

    def reader_closed(self, reader: StreamReader) -> None:
        if reader in self.readers:
            self.readers.remove(reader)
        if reader.group is not None and self.groups.get(reader.group) is reader:
            del self.groups[reader.group]

    def commit_offset(self, group: str, offset: int) -> None:
        """The group has processed everything up to ``offset``: remember it (in the store when durable)."""
        if self.committed.get(group, -1) >= offset:
            return
        self.committed[group] = offset
        if self.storage is not None:
            self.storage.commit_offset(group, offset)

    def set_committed(self, group: str, offset: int) -> None:
        """An explicit commit (gRPC CommitOffset): may also move the group back."""
        self.committed[group] = offset
        if self.storage is not None:
            self.storage.commit_offset(group, offset)

    # -- what a classic queue does that a stream refuses or reports differently -----------------
    @property
    def message_count(self) -> int:
        return len(self.entries) - self.head

    @property
    def consumer_count(self) -> int:
        return sum(len(r.consumers) for r in self.readers)

    def purge(self) -> int:
        raise NotImplementedFeature(f"queue.purge not supported by stream queues queue '{self.name}' "
                                    f"in vhost '{self.vhost}'")

    def consumer_removed(self) -> None:
        # Streams are never auto-delete and have no x-expires: nothing to do.
        return

    def delete(self) -> int:
        self.deleted = True
        count = self.message_count
        if self._age_timer is not None:
            self._age_timer.cancel()
            self._age_timer = None
        readers, self.readers = self.readers, []
        self.groups.clear()
        for r in readers:
            r.cancel_all()
        self.entries = []
        self.head = 0
        self.log_bytes = 0
        return count
