"""Paging: a classic queue's ready messages beyond its memory budget wait in segment files.

A queue channel's ready list is a plain deque while its bodies fit its budget
(``Settings.queue_bytes``, ``--queue-memory-bytes``). When they pass it the
channel swaps the deque for a ``PagedReady``: the oldest messages stay in
memory (the window, at most the budget), every newer one is appended to the
channel's ``SegmentLog`` (append-only files under the data dir), and pages are
read back, oldest first, when the window runs dry. Order holds because a
message goes to the log whenever the log is not empty: the log only ever
holds messages newer than everything in the window, and a requeued message
(delivered from the window) is older than all of them.

In memory a paged message costs its offset (8 bytes, the persisted flag in
its low bit) and its body size (4 bytes) in two arrays: 12 bytes, plus the
arrays' over-allocation (measured in docs/notes/paging.md).

Segment files are a spill area, never a source of truth: persistent messages
of durable queues are in the store as well (restored from there after a
restart), and the node empties the directory at start (transient messages do
not survive a restart, as in RabbitMQ).

``x-max-priority`` queues stay in memory (their ready list is per priority).
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import struct
import sys
import tempfile
from array import array
from collections import deque
from collections.abc import Iterable, Iterator
from typing import IO, TYPE_CHECKING

from core.engine.ready import requeue_into, take_offsets
from core.model.message import Message, QueuedMessage

if TYPE_CHECKING:
    from core.engine.queue import QueueChannel

NEVER = sys.maxsize  # a channel's page_at when it never pages (or already does)


class Settings:
    """Set by the node from its configuration (leveret/config.py)."""

    queue_bytes = 64 * 1024 * 1024  # bodies one queue channel keeps in memory
    node_bytes = 1024 * 1024 * 1024  # bodies all ready lists of the node keep in memory (0: no cap)
    directory = ""  # where segment files go; "" -> a private temporary directory made on first use
    # A page read back: up to this many messages or bytes of bodies, whichever comes first.
    # 1 MiB keeps a read under a millisecond of the event loop for 1 KiB bodies (about 1000 records).
    page_count = 4096
    page_bytes = 1024 * 1024


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
        os.makedirs(directory, exist_ok=True)
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
        self.writer = open(self._path(self.write_no), "wb")  # noqa: SIM115 - kept open while written
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


class PagedReady:
    """A ready list whose newest messages wait on disk: the subset of deque's interface QueueChannel uses."""

    def __init__(self, mem: deque[QueuedMessage], mem_bytes: int, budget: int) -> None:
        self.mem = mem  # the window: the oldest ready messages, bodies in memory
        self.mem_bytes = mem_bytes
        self.budget = budget
        self.log = SegmentLog()
        # The spilled messages, oldest first from ``head``: offset*2 + persisted, body size.
        self.keys = array("q")
        self.sizes = array("I")
        self.head = 0
        self.paged = 0  # spilled messages still waiting (keys past head, less those taken)
        self.paged_bytes = 0
        self.taken: set[int] = set()  # spilled offsets removed by retention: skipped when read back
        self._spill_newest()

    def _spill_newest(self) -> None:
        """Move the newest of the window to the log until it fits the budget (only while the log is empty)."""
        if self.paged or self.mem_bytes <= self.budget:
            return
        out: list[QueuedMessage] = []
        mem = self.mem
        while mem and self.mem_bytes > self.budget:
            qm = mem.pop()
            self.mem_bytes -= len(qm.message.body)
            out.append(qm)
        for qm in reversed(out):
            self._spill(qm)

    def _spill(self, qm: QueuedMessage) -> None:
        self.log.write(qm)
        size = len(qm.message.body)
        self.keys.append(qm.offset * 2 + (1 if qm.persisted else 0))
        self.sizes.append(size)
        self.paged += 1
        self.paged_bytes += size

    def shrink(self, budget: int) -> None:
        """The node is over its cap: keep at most ``budget`` bytes in the window from now on."""
        self.budget = budget
        self._spill_newest()

    def append(self, qm: QueuedMessage) -> None:
        size = len(qm.message.body)
        if self.paged or self.mem_bytes + size > self.budget:
            self._spill(qm)
        else:
            self.mem.append(qm)
            self.mem_bytes += size

    def _page_in(self) -> None:
        keys, sizes, log, taken, mem = self.keys, self.sizes, self.log, self.taken, self.mem
        head = self.head
        n = 0
        size = 0
        limit_n, limit_bytes = settings.page_count, settings.page_bytes
        while self.paged and n < limit_n and size < limit_bytes:
            qm = log.read()
            s = sizes[head]
            head += 1
            if taken and qm.offset in taken:
                taken.discard(qm.offset)
                continue
            mem.append(qm)
            n += 1
            size += s
            self.paged -= 1
        self.paged_bytes -= size
        self.mem_bytes += size
        if head >= 65536 and head * 2 >= len(keys):
            del keys[:head]
            del sizes[:head]
            head = 0
        self.head = head
        if not self.paged:
            self._forget_spilled()

    def _forget_spilled(self) -> None:
        """Everything spilled was read back (or taken): skip what remains of the log, reset the index."""
        while self.log.segments and self.head < len(self.keys):
            self.log.read()  # only records taken by retention are left
            self.head += 1
        del self.keys[:]
        del self.sizes[:]
        self.head = 0
        self.paged_bytes = 0
        self.taken.clear()
        # Nothing left to read: close and remove the files now (a lazy queue that is idle holds
        # no file descriptor), the next spill starts a fresh segment.
        self.log.close()
        self.log = SegmentLog()

    def popleft(self) -> QueuedMessage:
        if not self.mem and self.paged:
            self._page_in()
        qm = self.mem.popleft()
        self.mem_bytes -= len(qm.message.body)
        return qm

    def __getitem__(self, index: int) -> QueuedMessage:
        if index != 0:
            raise IndexError("only the head of a paged ready list is addressable")
        if not self.mem and self.paged:
            self._page_in()
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
        self.mem.clear()
        self.mem_bytes = 0
        self.log.close()
        self.log = SegmentLog()
        del self.keys[:]
        del self.sizes[:]
        self.head = 0
        self.paged = 0
        self.paged_bytes = 0
        self.taken.clear()

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
                spilled.append((offset, bool(keys[i] & 1), self.sizes[i]))
        self.paged -= len(spilled)
        self.paged_bytes -= sum(s for _, _, s in spilled)
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
