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

The store holds every retained message (restarts, failover); memory holds
only the newest ``memory_limit`` bytes of a durable stream. A reader behind
that reads pages back from the store (``MessageStore.load_range``) and then
goes on from memory; the offsets, sizes and times of the store-only part are
kept in a compact index (core/stream_index.py) for retention and timestamp
lookups.
"""

from __future__ import annotations

import asyncio
import bisect
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from core.engine.queue import Queue
from core.engine.stream_args import OffsetSpec
from core.engine.stream_index import StoredIndex
from core.engine.stream_reader import LogChannel, StreamReader
from core.model.clock import TimerHandle
from core.model.errors import NotImplementedFeature
from core.model.message import Message, QueuedMessage

if TYPE_CHECKING:
    from core.engine.queue_args import QueueArgs

# A reader behind the in-memory log reads this many messages from the store at once,
# fewer when their bodies add up to PAGE_BYTES (1 MiB bodies: 4 a page, not 5000).
PAGE = 5000
PAGE_BYTES = 4 * 1024 * 1024

# Compact the log list once this many retained-out entries sit at its front.
_COMPACT_AT = 4096
# Age retention runs at most this often (seconds), batching removals.
_AGE_SLACK = 0.05

_PARTITION = re.compile(r"-(\d+)$")


def _offset(qm: QueuedMessage) -> int:
    return qm.offset


def _timestamp(qm: QueuedMessage) -> float:
    return qm.message.timestamp


class StreamQueue(Queue):
    """``x-queue-type: stream``: messages stay, readers move."""

    # Bytes of message bodies a durable stream keeps in memory (the newest ones);
    # older retained messages are read back from the store in pages. Set by the node
    # (--stream-memory-bytes).
    memory_limit = 64 * 1024 * 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._truncated = -1  # the first-kept offset last sent to the store
        self.entries: list[QueuedMessage] = []  # the newest part of the log, in memory
        self.head = 0  # entries before it were removed by retention or evicted to the store only
        self.stored = StoredIndex()  # retained but only in the store (oldest part)
        self.log_bytes = 0  # every retained message
        self.mem_bytes = 0  # those in memory
        # Readers here; on a node that does not own the stream, proxies of readers on its owner.
        self.readers: list[LogChannel] = []
        self.groups: dict[str, StreamReader] = {}
        self.committed: dict[str, int] = {}
        self._age_timer: TimerHandle | None = None
        m = _PARTITION.search(self.name)
        self.partition = int(m.group(1)) if m else 0

    # -- the log -----------------------------------------------------------------------
    @property
    def first_offset(self) -> int:
        """The oldest retained message (in memory or only in the store)."""
        if self.stored:
            return self.stored.first
        return self.mem_first

    @property
    def mem_first(self) -> int:
        """The oldest message held in memory."""
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

    def page_limit(self, start: int) -> int:
        """How many messages from ``start`` make a page: PAGE, or fewer within PAGE_BYTES (at least one)."""
        stored = self.stored
        sizes = stored.sizes
        pos = bisect.bisect_left(stored.offsets, start, stored.head)
        end = min(len(sizes), pos + PAGE)
        total = 0
        n = 0
        while pos < end:
            total += sizes[pos]
            n += 1
            pos += 1
            if total >= PAGE_BYTES:
                break
        return max(1, n) if n else PAGE

    def resolve(self, spec: OffsetSpec) -> int:
        """The offset a new reader starts at."""
        kind = spec.kind
        if kind == "next":
            return self.next_offset
        if kind == "first":
            return self.first_offset
        if kind == "last":
            if self.head < len(self.entries):
                return self.entries[-1].offset
            return self.stored.last if self.stored else self.next_offset
        if kind == "offset":
            # Past the end, the reader waits for that offset (as RabbitMQ's does).
            return max(int(spec.value), self.first_offset)
        if self.stored and self.stored.newest_stamp >= spec.value:
            found = self.stored.at_time(spec.value)
            if found is not None:
                return found
        pos = bisect.bisect_left(self.entries, spec.value, self.head, len(self.entries), key=_timestamp)
        return self.entries[pos].offset if pos < len(self.entries) else self.next_offset

    def stores(self, message: Message) -> bool:
        """Everything in a stream is stored, whatever its delivery mode (as in RabbitMQ)."""
        return True

    def enqueue(self, message: Message) -> bool:
        if not self.lease_valid() and self.deleted:
            return False  # the lease ran out: this copy of the stream is gone (Queue.enqueue)
        if self.remote is not None:  # cluster: another node owns the stream
            self.remote.forward(message)
            return True
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
        size = len(qm.message.body)
        self.log_bytes += size
        self.mem_bytes += size
        a = self.args
        if a.max_length_bytes is not None and self.log_bytes > a.max_length_bytes:
            self._trim_to_bytes(a.max_length_bytes)
        if a.max_age is not None and self._age_timer is None:
            self._arm_age()
        if self.mem_bytes > self.memory_limit and self.storage is not None:
            self._evict()

    def _evict(self) -> None:
        """Keep only the newest ``memory_limit`` bytes in memory; the rest is read from the store."""
        entries = self.entries
        head = self.head
        last = len(entries) - 1
        stored = self.stored
        limit = self.memory_limit
        while head < last and self.mem_bytes > limit:
            qm = entries[head]
            size = len(qm.message.body)
            stored.add(qm.offset, size, qm.message.timestamp)
            self.mem_bytes -= size
            head += 1
        self.head = head
        self._compact()

    # -- retention -----------------------------------------------------------------------
    def _trim_to_bytes(self, limit: int) -> None:
        stored = self.stored
        while stored and self.log_bytes > limit:
            self.log_bytes -= stored.pop_oldest()
        entries = self.entries
        head = self.head
        last = len(entries) - 1
        # The newest message always stays (RabbitMQ never removes the segment being written).
        while head < last and self.log_bytes > limit:
            size = len(entries[head].message.body)
            self.log_bytes -= size
            self.mem_bytes -= size
            head += 1
        self._drop_to(head)

    def apply_args(self, args: QueueArgs) -> None:
        """A policy changed the stream's retention (max-length-bytes, max-age): apply it now."""
        if args == self.args:
            return
        self.args = args
        if self.remote is not None or self.deleted:
            return
        if args.max_length_bytes is not None and self.log_bytes > args.max_length_bytes:
            self._trim_to_bytes(args.max_length_bytes)
        if self._age_timer is not None:
            self._age_timer.cancel()
            self._age_timer = None
        self.enforce_age()
        self._arm_age()

    def enforce_age(self) -> None:
        """Remove messages older than x-max-age."""
        max_age = self.args.max_age
        if max_age is None:
            return
        cutoff = self.scheduler.now() - max_age
        stored = self.stored
        while stored and stored.oldest_stamp < cutoff:
            self.log_bytes -= stored.pop_oldest()
        entries = self.entries
        head = self.head
        while head < len(entries) and entries[head].message.timestamp < cutoff:
            size = len(entries[head].message.body)
            self.log_bytes -= size
            self.mem_bytes -= size
            head += 1
        self._drop_to(head)

    def _drop_to(self, head: int) -> None:
        """Retention removed everything below ``head`` (and maybe some of the store-only part)."""
        first = self.first_offset
        if head == self.head and first == self._truncated:
            return
        for qm in self.entries[self.head : head]:
            qm.persisted = False
        self.head = head
        first = self.first_offset
        if self.storage is not None and first != self._truncated:
            self.storage.truncate(first)
        self._truncated = first
        self._compact()

    def _compact(self) -> None:
        head = self.head
        if head >= _COMPACT_AT and head * 2 >= len(self.entries):
            del self.entries[:head]
            self.head = 0

    def _arm_age(self) -> None:
        if self.deleted or self.args.max_age is None:
            return
        if self.stored:
            oldest = self.stored.oldest_stamp
        elif self.head < len(self.entries):
            oldest = self.entries[self.head].message.timestamp
        else:
            return
        due = oldest + self.args.max_age
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
        reader.closed = True
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
        return len(self.stored) + len(self.entries) - self.head

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
        self.stored.clear()
        self.log_bytes = self.mem_bytes = 0
        return count


def reachable(q: StreamQueue) -> bool:
    """Readable now: this node serves it, or its owner is known and reachable (not being taken over here)."""
    remote = q.remote
    return remote is None or remote.reachable()


async def until_reachable(current: Callable[[], Queue | None], timeout: float) -> None:
    """Wait while ``current()`` is a stream that is not ``reachable`` (a take-over or a failover).

    Returns as soon as it is reachable, gone, or no longer a stream (the
    caller looks at it again); TimeoutError after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        q = current()
        if not isinstance(q, StreamQueue) or reachable(q):
            return
        if time.monotonic() > deadline:
            raise TimeoutError
        await asyncio.sleep(0.05)
