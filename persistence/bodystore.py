"""Append-only segment files for large message bodies (the embedded store's body store).

SQLite writes every byte twice (its WAL, then the checkpoint into the main
file), which halved the rate of 1 MiB persistent messages. A body at or above
the threshold is appended here instead and the messages row keeps only a
reference: (segment, position, length, crc32). Files are
``<dir>/<segment:016x>.seg``, raw bodies back to back, no framing: every fact
about a body (where it is, how long, its checksum, which queue owns it) is in
the SQLite row, which commits after the bytes are fsynced (see sqlite.py).

This class only does file I/O and is not thread-safe: the SQLite store calls
it from its one worker thread, between its transactions. The caller decides
what is committed; after a crash, ``recover`` is told each segment's
committed end by SQLite and removes everything else.
"""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from core.model import private_files

log = logging.getLogger("leveret.store")

# A new segment after this many bytes. RabbitMQ's msg_store files are 16 MiB; a larger
# file means fewer file creations (each costs a directory fsync before the commit that
# first references it) and fewer fds; a smaller one frees disk sooner when one slow
# body keeps a file alive. Compaction bounds the waste either way.
SEGMENT_BYTES = 64 * 1024 * 1024

# writev takes at most IOV_MAX buffers (1024 on Linux).
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024

_SUFFIX = ".seg"
_SPARE = ".free"

# Emptied full-size segments kept (renamed ``<n>.free``) for the next segments to overwrite, as
# PostgreSQL recycles its WAL files: an fdatasync after writing into blocks the file already has
# needs no journal commit for a new size or new extents. Measured here, write+fdatasync of 4 MiB
# went at 280-570 MiB/s appending and 800-1,100 MiB/s overwriting (3 runs each, shared disk).
# Two spares are 128 MiB of disk; the bench's steady state (segments freed as fast as filled)
# never creates a new file after the first two.
MAX_SPARES = 2


Buffer = bytes | bytearray | memoryview


@dataclass
class Writes:
    """Writes ``place`` planned: (fd, position, buffers, bytes) per segment run; a new file among them."""

    directory: Path
    groups: list[tuple[int, int, list[Buffer], int]] = field(default_factory=list)
    new_dir_entry: bool = False  # fsync the directory too


class BodyRef(NamedTuple):
    """Where a body is: what the messages row keeps instead of the bytes."""

    segment: int
    position: int
    length: int
    crc: int


class CorruptBody(Exception):
    """A referenced body is missing or fails its checksum."""


@dataclass
class Recovery:
    """What ``recover`` found on open (logged by the store; tests read it)."""

    removed: list[int] = field(default_factory=list)  # segments no committed row references
    truncated: dict[int, int] = field(default_factory=dict)  # segment -> bytes cut past its committed end
    missing: list[int] = field(default_factory=list)  # committed segments whose file is gone


def segment_name(segment: int) -> str:
    return f"{segment:016x}{_SUFFIX}"


def read_body(directory: str | Path, ref: BodyRef) -> bytes:
    """One referenced body, read from its segment under ``directory`` with a read-only open, its
    checksum verified (CorruptBody otherwise): for readers outside the node, such as the retention
    job's archive, which see the rows but not the node's open files."""
    try:
        fd = os.open(Path(directory) / segment_name(ref.segment), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CorruptBody(f"segment {segment_name(ref.segment)} is missing") from None
    try:
        body = os.pread(fd, ref.length, ref.position)
    finally:
        os.close(fd)
    if len(body) != ref.length or zlib.crc32(body) != ref.crc:
        raise CorruptBody(f"segment {segment_name(ref.segment)} at {ref.position}+{ref.length}: "
                          "short or checksum mismatch")
    return body


class SegmentStore:
    def __init__(self, directory: str | Path, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.directory = Path(directory)
        self.segment_bytes = segment_bytes
        self._fds: dict[int, int] = {}  # open segments (read and write)
        self.active: int | None = None  # the segment appends go to
        self.active_end = 0  # its size: where the next append lands
        # Segments written since the last sync, and their ends before the first such write
        # (what ``rollback`` truncates back to).
        self._dirty: dict[int, int] = {}
        self._new_dir_entry = False  # a segment was created since the last sync
        self._next = 0  # the number of the next segment created
        self._spares: list[Path] = []  # emptied segment files to reuse
        self.rolls = 0  # segments started: the one before may be empty already (collect looks)

    # -- open and recovery ---------------------------------------------------------
    def recover(self, committed: dict[int, int]) -> Recovery:
        """Make the directory hold exactly what SQLite references; ``committed``: segment -> committed end.

        A file no committed row references is removed (an orphan: its rows were
        deleted, or compaction moved them, or the commit that would have referenced
        it never happened); bytes past a segment's committed end are cut (a batch
        written but never committed: the crash came between the fsync and the commit).
        """
        private_files.private_dir(self.directory)
        report = Recovery()
        present: set[int] = set()
        for path in sorted(self.directory.iterdir()):
            if path.name.endswith(_SPARE):
                if len(self._spares) < MAX_SPARES:
                    self._spares.append(path)
                else:
                    path.unlink()
                continue
            if not path.name.endswith(_SUFFIX):
                continue
            private_files.tighten(path)  # segments written before they were made 0600
            try:
                segment = int(path.name[: -len(_SUFFIX)], 16)
            except ValueError:
                continue
            present.add(segment)
            end = committed.get(segment)
            if end is None:
                path.unlink()
                report.removed.append(segment)
                continue
            size = path.stat().st_size
            if size > end:
                with open(path, "r+b") as f:
                    f.truncate(end)
                    os.fsync(f.fileno())
                report.truncated[segment] = size - end
        report.missing = sorted(set(committed) - present)
        if report.removed:
            _sync_dir(self.directory)
        # Appends continue in a fresh segment: the newest one may end in a torn or
        # cut write, and a new file keeps each segment's bytes those of one run.
        self._next = max([*committed, *present], default=-1) + 1
        self.active = None
        self.active_end = 0
        return report

    # -- writes (the caller syncs, then commits the references) --------------------------
    def place(self, bodies: Sequence[Buffer]) -> tuple[list[tuple[int, int]], Writes]:
        """(segment, position) of each body after the active segment's end (new segments as they fill),
        and the writes that put them there, not done yet: ``write_and_sync`` does them, on any thread,
        while the caller computes checksums and commits (see sqlite_bodies.py for why that is safe)."""
        places: list[tuple[int, int]] = []
        writes = Writes(self.directory)
        i = 0
        while i < len(bodies):
            if self.active is None or self.active_end >= self.segment_bytes:
                self._roll()
                writes.new_dir_entry = True
            assert self.active is not None
            segment, start = self.active, self.active_end
            group: list[Buffer] = []
            position = start
            while i < len(bodies) and len(group) < _IOV_MAX and (not group or position < self.segment_bytes):
                places.append((segment, position))
                group.append(bodies[i])
                position += len(bodies[i])
                i += 1
            self._dirty.setdefault(segment, start)
            writes.groups.append((self._fds[segment], start, group, position - start))
            self.active_end = position
        return places, writes

    @staticmethod
    def write_and_sync(writes: Writes) -> None:
        """Do ``place``'s writes (one pwritev per segment and up to IOV_MAX bodies, straight from the
        caller's buffers: no joined copy), then fdatasync each file (and the directory for a new one)."""
        for fd, position, buffers, total in writes.groups:
            _write_all(fd, buffers, position, total)
        for fd in dict.fromkeys(fd for fd, *_rest in writes.groups):
            os.fdatasync(fd)
        if writes.new_dir_entry:
            _sync_dir(writes.directory)

    def append(self, bodies: Sequence[Buffer]) -> list[BodyRef]:
        """Place and write ``bodies`` now (compaction, tests); durable after ``sync``."""
        places, writes = self.place(bodies)
        for fd, position, buffers, total in writes.groups:
            _write_all(fd, buffers, position, total)
        self._new_dir_entry = self._new_dir_entry or writes.new_dir_entry
        return [BodyRef(seg, pos, len(b), zlib.crc32(b)) for (seg, pos), b in zip(places, bodies, strict=True)]

    def sync(self) -> None:
        """fdatasync every segment written since the last ``synced`` (and the directory, for new files).

        The written ranges stay marked until ``synced`` (their references committed) or
        ``rollback`` (the commit failed).
        """
        for segment in self._dirty:
            os.fdatasync(self._fds[segment])
        if self._new_dir_entry:
            _sync_dir(self.directory)
            self._new_dir_entry = False

    def written_from(self) -> dict[int, int]:
        """Segment -> where the writes not yet committed begin in it (everything before is fsynced)."""
        return dict(self._dirty)

    def synced(self) -> None:
        """The references to what was synced are committed: nothing to roll back any more."""
        self._dirty.clear()

    def rollback(self) -> None:
        """The commit of the references failed: cut every segment back to where this write began."""
        for segment, end in self._dirty.items():
            fd = self._fds.get(segment)
            if fd is not None:
                os.ftruncate(fd, end)
            if segment == self.active:
                self.active_end = end
        self._dirty.clear()

    def _roll(self) -> None:
        """A new active segment: a spare renamed (its old bytes past the committed end are never read), or
        a new file. Either way a new directory entry, fsynced before the commit that references it."""
        segment = self._next
        self._next += 1
        self.rolls += 1
        path = self.directory / segment_name(segment)
        if self._spares:
            os.rename(self._spares.pop(), path)
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        self._fds[segment] = os.open(path, flags, private_files.FILE_MODE)
        self.active = segment
        self.active_end = 0


    # -- reads ---------------------------------------------------------------------
    def read(self, ref: BodyRef) -> bytes:
        """The body ``ref`` names, its checksum verified (CorruptBody otherwise)."""
        fd = self._fds.get(ref.segment)
        if fd is None:
            try:
                fd = os.open(self.directory / segment_name(ref.segment), os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
            except FileNotFoundError:
                raise CorruptBody(f"segment {segment_name(ref.segment)} is missing") from None
            self._fds[ref.segment] = fd
        body = os.pread(fd, ref.length, ref.position)
        if len(body) != ref.length:
            raise CorruptBody(f"segment {segment_name(ref.segment)} ends before {ref.position}+{ref.length}")
        crc = zlib.crc32(body)
        if crc != ref.crc:
            raise CorruptBody(
                f"checksum mismatch in segment {segment_name(ref.segment)} at {ref.position}+{ref.length}"
                f" (stored {ref.crc:#010x}, read {crc:#010x})"
            )
        return body

    # -- removal ---------------------------------------------------------------------
    def remove(self, segment: int) -> None:
        """Delete a segment no committed row references any more (never the active one)."""
        assert segment != self.active, "the active segment is never removed"
        fd = self._fds.pop(segment, None)
        if fd is not None:
            os.close(fd)
        path = self.directory / segment_name(segment)
        try:
            if len(self._spares) < MAX_SPARES and path.stat().st_size >= self.segment_bytes:
                spare = self.directory / f"{segment:016x}{_SPARE}"
                os.rename(path, spare)
                self._spares.append(spare)
            else:
                path.unlink()
        except FileNotFoundError:
            pass

    def seal(self) -> None:
        """Start the next append in a new segment (compaction must not write into the file it empties)."""
        self.active = None

    def close(self) -> None:
        if self.active is not None and not self._dirty:
            # A recycled active segment holds stale bytes past its end: cut them now, so that
            # the next open finds nothing to recover after a clean stop.
            os.ftruncate(self._fds[self.active], self.active_end)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self.active = None

    def spares(self) -> list[Path]:
        return list(self._spares)

    def segments_on_disk(self) -> list[int]:
        return sorted(
            int(p.name[: -len(_SUFFIX)], 16) for p in self.directory.iterdir() if p.name.endswith(_SUFFIX)
        )


def _sync_dir(directory: Path) -> None:
    """Make a created or removed file's directory entry durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, buffers: list[Buffer], position: int, total: int) -> None:
    """pwritev the buffers at ``position``; a short write (signals, a full disk) goes on where it stopped."""
    done = os.pwritev(fd, buffers, position)
    while done < total:
        rest: list[Buffer] = []
        skip = done
        for b in buffers:
            if skip >= len(b):
                skip -= len(b)
            else:
                rest.append(memoryview(b)[skip:] if skip else b)
                skip = 0
        n = os.pwritev(fd, rest[:_IOV_MAX], position + done)
        if n == 0:
            raise OSError(f"segment write made no progress at {position + done}")
        done += n
