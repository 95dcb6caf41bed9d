"""Paging: a classic queue's ready messages beyond its memory budget wait on disk.

A queue channel's ready list is a plain deque while its bodies fit its budget
(``Settings.queue_bytes``, ``--queue-memory-bytes``). When they pass it the
channel swaps the deque for a ``PagedReady``: the oldest messages stay in
memory (the window, at most the budget), every newer one waits on disk, and
pages are read back, oldest first, ahead of the consumers (from when the
window drops under two pages). Order holds because a message is spilled
whenever something is spilled already: the spilled part only ever holds
messages newer than everything in the window, and a requeued message
(delivered from the window) is older than all of them.

Where a spilled message waits: a persistent message of a durable queue is in
the store already, so only its offset is kept and it pages back from the
store (``MessageStore.load_range``, asynchronously) -- once its commit is
done; until then it stays in memory (``held``). Every other message is
appended to the channel's ``SegmentLog`` (append-only files under the data
dir) and read back synchronously. A page merges both by offset. While a page
is being read from the store with the window empty, ``popleft``/``[0]`` raise
``PageWait`` and the channel looks again when ``on_page`` says it landed.

In memory a paged message costs its offset (8 bytes, the persisted flag in
its low bit) and its body size (4 bytes, the redelivered flag in its top bit)
in two arrays: 12 bytes, plus the arrays' over-allocation (measured in
docs/notes/paging.md).

Segment files are a spill area, never a source of truth: the node empties
the directory at start (transient messages do not survive a restart, as in
RabbitMQ; persistent ones are restored from the store).

``x-max-priority`` queues stay in memory (their ready list is per priority).
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import os
import shutil
import struct
import sys
import tempfile
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import IO, TYPE_CHECKING

from core.engine.ready import requeue_into, take_offsets
from core.model import private_files, properties
from core.model.message import Message, QueuedMessage
from core.ports.store import StoredMessage

if TYPE_CHECKING:
    from core.engine.queue import QueueChannel
    from core.ports.storage import QueueStorage

log = logging.getLogger("leveret.core")

NEVER = sys.maxsize  # a channel's page_at when it never pages (or already does)
# What a message held in memory costs beyond its body's len(): measured with tracemalloc (100,000
# queued 1 KiB messages with a content type and a delivery mode, no store): 372 bytes (the
# Message, its property summary, the QueuedMessage, the ready deque's slot) plus 33 for the header
# of the body's bytes object. A queue's memory budget counts it with the bodies (a window of
# 1 KiB messages held 28 % more than its budget without it: 538-552 MiB of RSS for a 256 MiB
# budget), and the memory alarm counts it for every message held (leveret/node/resources.py).
MESSAGE_BYTES = 405
# A message paged to disk keeps its key and size in two arrays (PagedReady.keys, .sizes): 12.7 B
# measured with tracemalloc; counted as 13.
PAGED_INDEX_BYTES = 13


class Settings:
    """Set by the node from its configuration (leveret/node/config.py)."""

    queue_bytes = 64 * 1024 * 1024  # bodies one queue channel keeps in memory
    node_bytes = 1024 * 1024 * 1024  # bodies all ready lists of the node keep in memory (0: no cap)
    directory = ""  # where segment files go; "" -> a private temporary directory made on first use
    # A page read back: up to this many messages or bytes of bodies, whichever comes first.
    # 1 MiB keeps a read under a millisecond of the event loop for 1 KiB bodies (about 1000 records).
    page_count = 4096
    page_bytes = 1024 * 1024
    # A page of a queue that pages from the store may carry this many times page_bytes: its store
    # part is read off the event loop, and each read may wait behind a group commit in the store's
    # one thread, so fewer, larger reads keep up better (see docs/notes/paging.md).
    store_page_factor = 4


settings = Settings()

SEGMENT_BYTES = 16 * 1024 * 1024  # a segment is removed once every record in it was read back
_HEADER = struct.Struct("<qBIddHHHHII")
_REDELIVERED, _PERSISTED, _EXPIRES = 1, 2, 4
_ids = itertools.count(1)
_temp: list[str] = []


def configure(queue_bytes: int, node_bytes: int, directory: str) -> None:
    """Node start: budgets, and a fresh segment directory (what a previous run left is never reloaded)."""
    settings.queue_bytes = queue_bytes
    settings.node_bytes = node_bytes
    if directory:
        shutil.rmtree(directory, ignore_errors=True)
        private_files.private_dir(directory)  # paged-out message bodies: the node's user only
    settings.directory = directory


def _directory() -> str:
    if settings.directory:
        return settings.directory
    if not _temp:
        _temp.append(tempfile.mkdtemp(prefix="leveret-paging-"))
        atexit.register(shutil.rmtree, _temp[0], True)
    return _temp[0]


class SegmentLog:
    """One ready list's spilled messages, in append-only segment files, read back oldest first."""

    def __init__(self) -> None:
        self.id = next(_ids)
        self.dir = _directory()
        self.segments: deque[list[int]] = deque()  # [segment number, records not yet read back]
        self.writer: IO[bytes] | None = None
        self.write_no = -1
        self.written = 0  # bytes in the segment being written
        self.unflushed = False
        self.reader: IO[bytes] | None = None
        self.read_no = -1

    def _path(self, no: int) -> str:
        return os.path.join(self.dir, f"{self.id}-{no}.seg")

    def _rotate(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
            if self.segments and self.segments[-1][1] == 0:
                self._drop_first()  # read back entirely (so every older one is gone too)
        self.write_no += 1
        # Kept open while written (SIM115); 0600, as everything under the data directory.
        self.writer = open(self._path(self.write_no), "wb", opener=private_files.opener)  # noqa: SIM115
        self.written = 0
        self.segments.append([self.write_no, 0])

    def write(self, qm: QueuedMessage) -> None:
        if self.writer is None or self.written >= SEGMENT_BYTES:
            self._rotate()
        assert self.writer is not None
        m = qm.message
        exchange = m.exchange.encode()
        key = m.routing_key.encode()
        mid = m.id.encode()
        node = m.node.encode()
        flags = (_REDELIVERED if qm.redelivered else 0) | (_PERSISTED if qm.persisted else 0)
        expires = qm.expires_at
        if expires is not None:
            flags |= _EXPIRES
        record = b"".join((
            _HEADER.pack(qm.offset, flags, qm.delivery_count, expires or 0.0, m.timestamp, len(exchange),
                         len(key), len(mid), len(node), len(m.props), len(m.body)),
            exchange, key, mid, node, m.props, m.body,
        ))
        self.writer.write(record)
        self.written += len(record)
        self.unflushed = True
        self.segments[-1][1] += 1

    def read(self) -> QueuedMessage:
        """The oldest record not yet read back (the caller knows one is there)."""
        seg = self.segments[0]
        if self.read_no != seg[0]:
            if self.reader is not None:
                self.reader.close()
            self.reader = open(self._path(seg[0]), "rb")  # noqa: SIM115 - kept open while read
            self.read_no = seg[0]
        if seg[0] == self.write_no and self.unflushed:
            assert self.writer is not None
            self.writer.flush()
            self.unflushed = False
        reader = self.reader
        assert reader is not None
        (offset, flags, count, expires, stamp, lx, lk, li, ln, lp, lb) = _HEADER.unpack(reader.read(_HEADER.size))
        rest = reader.read(lx + lk + li + ln + lp + lb)
        a = lx + lk
        b = a + li
        c = b + ln
        d = c + lp
        m = Message(rest[:lx].decode(), rest[lx:a].decode(), rest[c:d], rest[d:], node=rest[b:c].decode(),
                    timestamp=stamp)
        m.id = rest[a:b].decode()
        qm = QueuedMessage(m, offset)
        qm.redelivered = bool(flags & _REDELIVERED)
        qm.persisted = bool(flags & _PERSISTED)
        qm.delivery_count = count
        if flags & _EXPIRES:
            qm.expires_at = expires
        seg[1] -= 1
        if seg[1] == 0 and seg[0] != self.write_no:
            self._drop_first()
        return qm

    def _drop_first(self) -> None:
        no = self.segments.popleft()[0]
        if self.read_no == no and self.reader is not None:
            self.reader.close()
            self.reader = None
            self.read_no = -1
        if no == self.write_no and self.writer is not None:
            self.writer.close()
            self.writer = None
        try:
            os.unlink(self._path(no))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Forget everything spilled: close and remove every segment."""
        while self.segments:
            self._drop_first()
        for f in (self.reader, self.writer):
            if f is not None:
                f.close()
        self.reader = self.writer = None

    def files(self) -> list[str]:
        return [self._path(no) for no, _ in self.segments]


class PageWait(Exception):
    """The head of a paged ready list is being read from the store: look again when the page lands.

    Raised by ``PagedReady.popleft`` and ``[0]`` only (never on the in-memory path); the channel
    catches it where it looks at its head, and ``on_page`` tells it when to look again.
    """


# A spilled message's size word: the body size, and this bit when it was delivered before (the
# store keeps no redelivered flag; a spill file record does).
_SIZE_REDELIVERED = 1 << 31
_SIZE = _SIZE_REDELIVERED - 1


def from_store(sm: StoredMessage, redelivered: bool) -> QueuedMessage:
    """A message paged back from the store (as ``Durability.load`` restores one)."""
    props = sm.properties
    summary = properties.scan_cached(props)
    m = Message(sm.exchange, sm.routing_key, props, sm.body, summary, timestamp=sm.enqueued_at)
    m.id = sm.message_id
    qm = QueuedMessage(m, sm.offset)
    qm.redelivered = redelivered
    qm.delivery_count = sm.delivery_count
    qm.expires_at = sm.expires_at
    qm.persisted = True
    return qm


class PagedReady:
    """A ready list whose newest messages wait on disk: the subset of deque's interface QueueChannel uses.

    With ``storage`` (a durable queue), persistent messages are not written again: they page
    back from the store (``load_range``, asynchronously) once their commit is done, and only
    transient ones go to the segment log; a page merges both in offset order.
    """

    def __init__(self, mem: deque[QueuedMessage], mem_bytes: int, budget: int,
                 storage: QueueStorage | None = None, on_page: Callable[[], None] | None = None) -> None:
        self.mem = mem  # the window: the oldest ready messages, bodies in memory
        self.mem_bytes = mem_bytes
        self.budget = budget
        self.log = SegmentLog()
        self.storage = storage
        self.on_page = on_page  # told when a page read from the store has landed in the window
        # The spilled messages, oldest first from ``head``: offset*2 + persisted, body size.
        self.keys = array("q")
        self.sizes = array("I")
        self.head = 0
        self.paged = 0  # spilled messages still waiting (keys past head, less those taken)
        self.paged_bytes = 0
        self.taken: set[int] = set()  # spilled offsets removed by retention: skipped when read back
        # Persistent messages spilled before their commit is known done: still in memory (the
        # store may not have them yet), dropped when the commit ends; ``kept`` when it failed.
        self.held: dict[int, QueuedMessage] = {}
        self.held_order: deque[int] = deque()  # held offsets, oldest first (popping a dict's first key
        # again and again is quadratic: CPython skips the deleted slots from the start each time)
        self.held_bytes = 0
        self.kept: dict[int, QueuedMessage] = {}
        self._commit_wait = False
        # A page being read from the store: the keys [head, loading) are in it, still counted paged.
        self.loading = 0
        self._task: asyncio.Task[None] | None = None
        self.gen = 0  # bumped by clear: what a read or commit callback started before is void
        self.lost = 0  # spilled persistent messages the store no longer had when paged back
        self._spill_newest()

    def _spill_newest(self) -> None:
        """Move the newest of the window to disk until it fits the budget (only while nothing is spilled)."""
        mem = self.mem
        if self.paged or self.mem_bytes + len(mem) * MESSAGE_BYTES <= self.budget:
            return
        out: list[QueuedMessage] = []
        while mem and self.mem_bytes + len(mem) * MESSAGE_BYTES > self.budget:
            qm = mem.pop()
            self.mem_bytes -= len(qm.message.body)
            out.append(qm)
        for qm in reversed(out):
            self._spill(qm)

    def _spill(self, qm: QueuedMessage) -> None:
        size = len(qm.message.body)
        if qm.persisted and self.storage is not None:
            # In the store already (or in its commit): only the index keeps it, once committed.
            self.held[qm.offset] = qm
            self.held_order.append(qm.offset)
            self.held_bytes += size
            if not self._commit_wait:
                self._await_commit()
            self.sizes.append(size | _SIZE_REDELIVERED if qm.redelivered else size)
        else:
            self.log.write(qm)
            self.sizes.append(size)
        self.keys.append(qm.offset * 2 + (1 if qm.persisted else 0))
        self.paged += 1
        self.paged_bytes += size

    def _await_commit(self) -> None:
        """Release the held messages up to the newest once everything appended so far is committed.

        One callback at a time, not one per message: commits end in order, so a callback
        registered after a message's append and spill covers it and everything older.
        """
        assert self.storage is not None
        self._commit_wait = True
        upto = self.held_order[-1]
        gen = self.gen
        self.storage.committer.when_committed(lambda error: self._committed(gen, upto, error))

    def _committed(self, gen: int, upto: int, error: BaseException | None) -> None:
        if gen != self.gen:
            return
        self._commit_wait = False
        held, order = self.held, self.held_order
        if error is not None:
            # Not in the store (their publishers are nacked): they stay in memory. All of them, not
            # only those up to ``upto``: a batch that failed is gone from the committer, so a later
            # callback could not tell the newer ones in it from committed ones.
            self.kept.update(held)
            held.clear()
            order.clear()
            self.held_bytes = 0
            return
        while order and order[0] <= upto:
            qm = held.pop(order.popleft(), None)  # None: paged in or taken meanwhile
            if qm is not None:
                self.held_bytes -= len(qm.message.body)
        if held:
            self._await_commit()

    def shrink(self, budget: int) -> None:
        """The node is over its cap: keep at most ``budget`` bytes in the window from now on."""
        self.budget = budget
        self._spill_newest()

    def append(self, qm: QueuedMessage) -> None:
        size = len(qm.message.body)
        if self.paged or self.mem_bytes + size + (len(self.mem) + 1) * MESSAGE_BYTES > self.budget:
            self._spill(qm)
        else:
            self.mem.append(qm)
            self.mem_bytes += size

    # -- reading back -------------------------------------------------------------------
    def _low(self) -> bool:
        """Under the low-water mark: read the next page now, ahead of the consumers.

        Two pages, or a quarter of the budget up to 16 pages: a store read may wait behind a
        commit (tens of ms on a loaded machine), and consumers drain 1 KiB messages at 50-75k/s.
        """
        page = settings.page_bytes * (settings.store_page_factor if self.storage is not None else 1)
        low = max(2 * page, min(self.budget // 4, 16 * page))
        return self.mem_bytes < low and len(self.mem) < 8 * settings.page_count

    def _page_in(self) -> None:
        """Start on the next page: landed at once when it needs nothing from the store, else read."""
        if self.loading or not self.paged:
            return
        keys, sizes, log, taken, held, kept = self.keys, self.sizes, self.log, self.taken, self.held, self.kept
        store = self.storage is not None
        i = self.head
        end = len(keys)
        n = 0
        size = 0
        limit_n = settings.page_count
        limit_bytes = settings.page_bytes * (settings.store_page_factor if store else 1)
        # (offset, message or None: to read from the store, size word); taken ones are left out
        items: list[tuple[int, QueuedMessage | None, int]] = []
        need_first = need_last = -1
        while i < end and n < limit_n and size < limit_bytes:
            key = keys[i]
            offset = key >> 1
            word = sizes[i]
            i += 1
            if key & 1 and store:
                qm = held.pop(offset, None)
                if qm is not None:
                    self.held_bytes -= len(qm.message.body)
                else:
                    qm = kept.pop(offset, None)
                if offset in taken:
                    taken.discard(offset)
                    continue
                if qm is None:
                    if need_first < 0:
                        need_first = offset
                    need_last = offset
            else:
                qm = log.read()
                if taken and offset in taken:
                    taken.discard(offset)
                    continue
            items.append((offset, qm, word))
            n += 1
            size += word & _SIZE
        if need_first < 0:
            self.head = i
            self._land(items, None)
            return
        self.loading = i
        assert self.storage is not None
        # Kept: the loop holds tasks weakly.
        self._task = asyncio.get_running_loop().create_task(
            self._read(self.storage, need_first, need_last + 1, items, self.gen))

    async def _read(self, storage: QueueStorage, start: int, below: int,
                    items: list[tuple[int, QueuedMessage | None, int]], gen: int) -> None:
        """The store's part of a page (every row in [start, below) is this queue's; some were taken)."""
        failures = 0
        while True:
            try:
                rows = await storage.committer.store.load_range(storage.vhost, storage.name, start, below,
                                                                 below - start)
                break
            except Exception as exc:  # noqa: BLE001 - a store failing (StoreError, or a driver's own
                # error) must not leave the queue waiting for a page forever: retry, logged once
                if gen != self.gen:
                    return
                if not failures:
                    log.warning("paging: reading a page from the store failed; retrying",
                                extra={"vhost": storage.vhost, "queue": storage.name, "error": str(exc)})
                failures += 1
                await asyncio.sleep(min(5.0, 0.2 * 2 ** failures))
        self._task = None
        if gen != self.gen:
            return  # cleared meanwhile (purge, delete, given up)
        self.head = self.loading
        self.loading = 0
        taken = self.taken
        if taken:  # taken by retention while the page was read
            kept_items = []
            for item in items:
                if item[0] in taken:
                    taken.discard(item[0])
                else:
                    kept_items.append(item)
            items = kept_items
        self._land(items, {sm.offset: sm for sm in rows})
        if self.on_page is not None:
            self.on_page()

    def _land(self, items: list[tuple[int, QueuedMessage | None, int]],
              rows: dict[int, StoredMessage] | None) -> None:
        mem = self.mem
        size = 0
        lost = 0
        for offset, qm, word in items:
            if qm is None:
                sm = rows.get(offset) if rows is not None else None
                if sm is None:
                    # Not in the store any more: removed there meanwhile. Counted, never invented.
                    self.lost += 1
                    lost += word & _SIZE
                    continue
                qm = from_store(sm, bool(word & _SIZE_REDELIVERED))
            mem.append(qm)
            size += word & _SIZE
        self.paged -= len(items)
        self.paged_bytes -= size + lost
        self.mem_bytes += size
        head = self.head
        if head >= 65536 and head * 2 >= len(self.keys):
            del self.keys[:head]
            del self.sizes[:head]
            self.head = 0
        if not self.paged:
            self._forget_spilled()

    def _forget_spilled(self) -> None:
        """Everything spilled was read back (or taken): drop the rest of the log, reset the index."""
        del self.keys[:]
        del self.sizes[:]
        self.head = 0
        self.paged_bytes = 0
        self.taken.clear()
        self.held.clear()
        self.held_order.clear()
        self.held_bytes = 0
        self.kept.clear()
        # Nothing left to read (what remains of the log was taken by retention): close and
        # remove the files now (a lazy queue that is idle holds no file descriptor), the next
        # spill starts a fresh segment.
        self.log.close()
        self.log = SegmentLog()

    @property
    def waiting(self) -> bool:
        """Is the head being read from the store (the window empty, spilled messages left)?"""
        return not self.mem and self.paged > 0

    def popleft(self) -> QueuedMessage:
        mem = self.mem
        if not mem and self.paged:
            self._page_in()
            if not mem:
                raise PageWait
        qm = mem.popleft()
        self.mem_bytes -= len(qm.message.body)
        if self.paged and not self.loading and self._low():
            self._page_in()
        return qm

    def __getitem__(self, index: int) -> QueuedMessage:
        if index != 0:
            raise IndexError("only the head of a paged ready list is addressable")
        if not self.mem and self.paged:
            self._page_in()
            if not self.mem:
                raise PageWait
        return self.mem[0]

    def __len__(self) -> int:
        return len(self.mem) + self.paged

    def __bool__(self) -> bool:
        return bool(self.mem) or self.paged > 0

    def __iter__(self) -> Iterator[QueuedMessage]:
        """The window only: spilled messages are reached by paging (see spilled_persisted for purge)."""
        return iter(self.mem)

    def spilled_persisted(self) -> Iterable[int]:
        """Offsets of the spilled messages that are in the store too (purge removes them there)."""
        taken = self.taken
        for i in range(self.head, len(self.keys)):
            key = self.keys[i]
            if key & 1 and (key >> 1) not in taken:
                yield key >> 1

    def clear(self) -> None:
        self.gen += 1  # a page being read or a commit awaited is void now
        self.loading = 0
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._commit_wait = False
        self.mem.clear()
        self.mem_bytes = 0
        self.paged = 0
        self._forget_spilled()

    def close(self) -> None:
        self.clear()
        self.log.close()

    def requeue(self, back: list[QueuedMessage]) -> None:
        """Back into the window: each is older than every spilled message (it was delivered from the window)."""
        requeue_into(self.mem, back)
        self.mem_bytes += sum(len(qm.message.body) for qm in back)

    def take_offsets(self, offsets: set[int]) -> tuple[list[QueuedMessage], list[tuple[int, bool, int]]]:
        """Retention: remove these offsets; the window's messages, and (offset, persisted, size) of spilled ones."""
        taken = take_offsets(self.mem, offsets)
        self.mem_bytes -= sum(len(qm.message.body) for qm in taken)
        spilled: list[tuple[int, bool, int]] = []
        keys = self.keys
        for i in range(self.head, len(keys)):
            offset = keys[i] >> 1
            if offset in offsets and offset not in self.taken:
                self.taken.add(offset)
                spilled.append((offset, bool(keys[i] & 1), self.sizes[i] & _SIZE))
                held = self.held.pop(offset, None)
                if held is not None:
                    self.held_bytes -= len(held.message.body)
                else:
                    self.kept.pop(offset, None)
        self.paged -= len(spilled)
        self.paged_bytes -= sum(s for _, _, s in spilled)
        if self.paged and not self.loading and self._low():
            self._page_in()
        return taken, spilled


def enforce_node_cap(channels: Iterable[QueueChannel], cap: int) -> int:
    """Page out the largest windows until the node's in-memory ready bodies fit ``cap``; bytes held after.

    Called by the node with its memory check (twice a second), not per message.
    """
    chs = [ch for ch in channels if ch.pageable]
    held = sum(ch.memory_bytes for ch in chs)
    if cap <= 0 or held <= cap:
        return held
    for ch in sorted(chs, key=lambda c: c.memory_bytes, reverse=True):
        before = ch.memory_bytes
        ch.page_down(max(0, before - (held - cap)))
        held -= before - ch.memory_bytes
        if held <= cap:
            break
    return held
