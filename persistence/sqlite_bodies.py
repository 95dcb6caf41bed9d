"""The embedded store's large bodies: which go to segment files, and the SQLite side of their references.

Runs on the SQLite store's one worker thread, around its transactions:

- ``start`` (before the transaction): bodies at or above the threshold are
  placed after the active segment's end, and a second thread writes and
  fdatasyncs them while this one computes their checksums and runs the
  transaction, whose rows carry ``body = x''`` and the reference.
- ``finish`` (after it): waits for that write. The commit is reported done
  (and the publishes confirmed) only when both the transaction and the
  fdatasync are, so a confirm means "on disk, fsynced, in both". A failed
  transaction cuts the segments back, so no unreferenced bytes stay behind.

  Why running the two fsyncs side by side is as safe as body-then-row: a
  crash may leave a committed row whose body is not (wholly) on disk, but
  only for the last commit, whose publishes were never confirmed. Each
  transaction records, per segment it writes, where its writes begin
  (``synced_end``: everything before is fsynced, by an earlier commit that
  finished), and ``recover`` verifies the checksum of every body from there
  on, deleting the rows whose body did not make it (unconfirmed messages,
  which a publisher must resend anyway). Measured: side by side saves the
  smaller of the two fsyncs per commit (numbers in docs/notes/bodystore.md).
- ``collect``: segments whose every body is gone (counted from the rows
  themselves, whoever deleted them: acks, purges, the retention jobs) are
  dropped from ``body_segments`` and then unlinked; a segment whose live bytes fell under
  COMPACT_BELOW of its size has its live bodies copied to the active segment,
  its references moved in one transaction, and then is unlinked.
- ``recover`` (on open): the files are made to match ``body_segments``.

A crash between any two steps leaves either bytes no committed row names
(cut or removed by ``recover``) or a committed row naming fsynced bytes;
docs/notes/bodystore.md walks through each step.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
import time
import zlib
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.model import private_files
from core.ports.store import StoredMessage, StoreError
from persistence.bodystore import BodyRef, CorruptBody, Recovery, SegmentStore

log = logging.getLogger("leveret.store")

# Bodies of at least this many bytes go to segment files. Measured here (store alone, steady
# append+remove commits, docs/notes/bodystore.md "Threshold"): in busy commits segments win from
# 16 KiB on (16 KiB x64: 3.1-6.4x, 32 KiB x32: 2.6x, 64 KiB x16: 4.2-6.2x) and tie at 4 KiB;
# in lone one-message commits (a publisher waiting for each confirm) the second fsync costs
# more than the write saves below 32 KiB (16 KiB: 0.37-0.54x; 32 KiB: 0.61-1.44x, 64 KiB:
# 0.81-1.70x, noise of a shared disk). 32 KiB: never clearly worse, 2.6x when busy.
DEFAULT_THRESHOLD = 32 * 1024

# A sealed segment whose live bytes fall under this fraction of its size is compacted, once
# no body of it went for COMPACT_AFTER seconds: a queue draining in order empties its segments
# by itself, and copying bodies about to be consumed is wasted work (a first version did).
# at 0.5 a copy moves at most half a segment (32 MiB, ~0.1 s at this disk's 290 MiB/s
# of write+fdatasync) and the disk holds at most about twice the live bytes.
COMPACT_BELOW = 0.5
COMPACT_AFTER = 5.0

# Rows deleted by another connection (the retention jobs) are noticed this often.
COLLECT_EVERY = 10.0

# The count of what each segment holds is an index scan of the referenced rows: after every
# commit that deleted some while a scan takes under COLLECT_FREE seconds (the bench's ~100
# referenced rows: ~0.1 ms), else spending at most about 1/COLLECT_DUTY of the store thread
# on it (a store holding a million referenced rows scans for ~0.2 s).
COLLECT_DUTY = 20
COLLECT_FREE = 0.001


class BodyIndex:
    def __init__(self, directory: str | Path, threshold: int = DEFAULT_THRESHOLD,
                 segment_bytes: int | None = None) -> None:
        self.threshold = threshold
        self.segments = SegmentStore(directory) if segment_bytes is None else SegmentStore(directory, segment_bytes)
        self._segments_known = False  # body_segments has rows: deletions may free a segment
        self._last_collect = 0.0
        self._next_collect = 0.0  # the duty-cycle bound: no scan before this
        self._deleted = False  # rows were deleted since the last scan
        self._seen: dict[int, tuple[int, float]] = {}  # segment -> (live count at the last scan, since when)
        self._last_append = 0.0
        self._rolls_seen = 0
        self.removed_segments = 0
        self.compacted_segments = 0
        self._unreadable: set[int] = set()  # segments compaction gave up on (a corrupt body)
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="leveret-bodies")
        # Set when an fdatasync failed after its rows committed: from then on no large body is
        # accepted (their synced_end could no longer be trusted); a restart verifies and recovers.
        self.broken: str | None = None
        self.dropped_unsynced = 0  # rows recover deleted: bodies of an unconfirmed last commit
        self.owner = False  # holds bodies/LOCK: recovers, writes and removes (see recover)
        self._lock_fd: int | None = None

    # -- open ----------------------------------------------------------------------
    def recover(self, db: sqlite3.Connection) -> Recovery:
        """Take the body store for this process (its lock) and make the files match the committed rows.

        Another process may open the same SQLite file while the node runs (``leveret users``,
        ``leveret policies``): it must not take what the node wrote but has not committed yet for
        an orphan. So only the holder of ``bodies/LOCK`` recovers, writes large bodies and
        removes segments; any other opener only reads bodies (the lock goes with the process,
        kill -9 included).
        """
        private_files.private_dir(self.segments.directory)
        self._lock_fd = os.open(self.segments.directory / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                                private_files.FILE_MODE)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.owner = False
            log.info("body store: held by another process (a running node); reading bodies only",
                     extra={"directory": str(self.segments.directory)})
            return Recovery()
        self.owner = True
        committed = dict(db.execute("SELECT segment, end_position FROM body_segments").fetchall())
        report = self.segments.recover(committed)
        if report.removed or report.truncated:
            log.warning("body store recovered", extra={
                "orphan_segments_removed": len(report.removed), "torn_tails_cut": report.truncated})
        if report.missing:
            referenced = sum(
                db.execute("SELECT count(*) FROM messages WHERE body_segment = ?", (seg,)).fetchone()[0]
                for seg in report.missing
            )
            log.error("body store: committed segment files are missing", extra={
                "segments": report.missing, "messages_referencing_them": referenced})
        self._verify_unsynced(db, set(report.missing))
        self._segments_known = bool(committed)
        self.collect(db)
        return report

    def _verify_unsynced(self, db: sqlite3.Connection, missing: set[int]) -> None:
        """Check the bodies the last commit wrote beside its transaction; drop the rows whose body
        did not reach the disk (their publishes were never confirmed: the confirm waits for both)."""
        lost: list[tuple[str, str, int]] = []
        for segment, synced_end in db.execute(
            "SELECT segment, synced_end FROM body_segments WHERE synced_end < end_position"
        ).fetchall():
            for vhost, queue, offset, position, size, crc in db.execute(
                'SELECT vhost, queue, "offset", body_position, size, body_crc FROM messages'
                " WHERE body_segment = ? AND body_position >= ?", (segment, synced_end),
            ).fetchall():
                try:
                    self.segments.read(BodyRef(segment, position, size, crc))
                except CorruptBody:
                    lost.append((vhost, queue, offset))
        db.execute("BEGIN IMMEDIATE")
        try:
            db.executemany('DELETE FROM messages WHERE vhost = ? AND queue = ? AND "offset" = ?', lost)
            db.execute("UPDATE body_segments SET synced_end = end_position WHERE synced_end < end_position")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        if lost:
            self.dropped_unsynced += len(lost)
            log.warning("body store: dropped unconfirmed messages whose bodies were not on disk at the crash",
                        extra={"messages": len(lost), "first": lost[:5]})

    # -- the write path ----------------------------------------------------------------
    def start(self, appends: Sequence[StoredMessage]) -> BodyWrite | None:
        """Place the large bodies of ``appends`` and start writing and fsyncing them on the I/O thread;
        None when every body stays inline."""
        threshold = self.threshold
        large = [m.body for m in appends if len(m.body) >= threshold]
        if not large:
            return None
        if self.broken is not None:
            raise StoreError(f"body store: {self.broken}; restart the node")
        if not self.owner:
            raise StoreError("body store: held by a running node; only it writes large bodies")
        self._last_append = time.monotonic()
        places, writes = self.segments.place(large)
        future = self._io.submit(self.segments.write_and_sync, writes)
        crcs = [zlib.crc32(body) for body in large]  # beside the writes: zlib lets go of the GIL
        placed = iter(BodyRef(seg, pos, len(body), crc)
                      for (seg, pos), body, crc in zip(places, large, crcs, strict=True))
        refs = [next(placed) if len(m.body) >= threshold else None for m in appends]
        return BodyWrite(refs, future, self.segments.written_from())

    def account(self, db: sqlite3.Connection, write: BodyWrite) -> None:
        """Inside the commit's transaction: each written segment's new end, and where this commit's
        writes begin in it (synced_end)."""
        ends: dict[int, int] = {}
        for ref in write.refs:
            if ref is not None:
                ends[ref.segment] = max(ends.get(ref.segment, 0), ref.position + ref.length)
        _add(db, {seg: (end, write.starts.get(seg, 0)) for seg, end in ends.items()})
        self._segments_known = True

    def finish(self, write: BodyWrite, committed: bool) -> None:
        """After the transaction: wait for the bodies' write and fsync. Raises StoreError when they
        failed (the commit must not be reported done); cuts the segments back when nothing committed."""
        try:
            write.future.result()
        except OSError as exc:
            if committed:
                self.broken = f"fdatasync of the body segments failed after their rows committed: {exc}"
                log.error("body store: " + self.broken)
                raise StoreError(f"body store: {exc}") from exc
            self._cut()
            return
        if committed:
            self.segments.synced()
        else:
            self._cut()

    def _cut(self) -> None:
        try:
            self.segments.rollback()
        except OSError as exc:  # the next open cuts the tail instead
            log.error("body store: cannot cut back an uncommitted write", extra={"error": str(exc)})

    # -- reads ---------------------------------------------------------------------------
    def resolve(self, vhost: str, queue: str, rows: list[Any]) -> list[StoredMessage]:
        """Rows of (offset, message_id, exchange, routing_key, properties, body, enqueued_at, expires_at,
        delivery_count, body_segment, body_position, size, body_crc) as whole messages."""
        out: list[StoredMessage] = []
        read = self.segments.read
        for (offset, message_id, exchange, routing_key, properties, body, enqueued_at, expires_at, delivery_count,
             segment, position, size, crc) in rows:
            if segment is not None:
                try:
                    body = read(BodyRef(segment, position, size, crc))
                except CorruptBody as exc:
                    log.error("body store: a stored body cannot be read", extra={
                        "vhost": vhost, "queue": queue, "offset": offset, "error": str(exc)})
                    raise StoreError(f"message {offset} of {vhost}/{queue}: {exc}") from exc
            out.append(StoredMessage(vhost, queue, offset, message_id, exchange, routing_key,
                                     properties, body, enqueued_at, expires_at, delivery_count))
        return out

    # -- removal and compaction -------------------------------------------------------------
    def collect(self, db: sqlite3.Connection, deleted: bool = True) -> None:
        """Drop emptied segments and compact at most one sparse one; after a commit (``deleted``: it
        deleted rows), within the duty-cycle bound, and every COLLECT_EVERY seconds in any case."""
        if not self.owner:
            return
        now = time.monotonic()
        # A segment just sealed may hold nothing live any more (its bodies went while it was active).
        self._deleted = self._deleted or deleted or self.segments.rolls != self._rolls_seen
        self._rolls_seen = self.segments.rolls
        if now - self._last_collect < COLLECT_EVERY and (
            not self._segments_known or not self._deleted or now < self._next_collect
        ):
            return
        rows = db.execute("SELECT segment, end_position FROM body_segments").fetchall()
        live = {seg: (count, size) for seg, count, size in db.execute(
            "SELECT body_segment, count(*), sum(size) FROM messages WHERE body_segment IS NOT NULL"
            " GROUP BY body_segment"
        )}
        finished = time.monotonic()
        self._last_collect = finished
        self._next_collect = finished + COLLECT_DUTY * max(0.0, finished - now - COLLECT_FREE)
        self._deleted = False
        self._segments_known = bool(rows)
        active = self.segments.active
        if active is not None and active not in live and finished - self._last_append > COLLECT_EVERY:
            self.segments.seal()  # idle, and all it holds is gone: no file waits for the next write
            active = None
        seen = self._seen
        self._seen = {seg: (count, seen[seg][1] if seg in seen and seen[seg][0] == count else finished)
                      for seg, (count, _size) in live.items()}
        empty = [seg for seg, _end in rows if seg not in live and seg != active]
        if empty:
            db.execute("BEGIN IMMEDIATE")
            try:
                db.executemany("DELETE FROM body_segments WHERE segment = ?", [(s,) for s in empty])
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            for seg in empty:  # after the commit: a crash before the unlink leaves an orphan recover removes
                self.segments.remove(seg)
            self.removed_segments += len(empty)
        sparse = [
            (live[seg][1] / end, seg) for seg, end in rows
            if seg in live and seg != active and seg not in self._unreadable and live[seg][1] < COMPACT_BELOW * end
            and finished - self._seen[seg][1] >= COMPACT_AFTER
        ]
        if sparse and self.broken is None:
            self.compact(db, min(sparse)[1])

    def compact(self, db: sqlite3.Connection, segment: int) -> None:
        """Copy ``segment``'s live bodies to the active segment, move their references, remove it."""
        rows = db.execute(
            'SELECT vhost, queue, "offset", body_position, size, body_crc FROM messages WHERE body_segment = ?'
            " ORDER BY body_position", (segment,),
        ).fetchall()
        try:
            bodies = [self.segments.read(BodyRef(segment, pos, size, crc)) for _v, _q, _o, pos, size, crc in rows]
        except CorruptBody as exc:
            self._unreadable.add(segment)
            log.error("body store: not compacting a segment with an unreadable body",
                      extra={"segment": segment, "error": str(exc)})
            return
        refs = self.segments.append(bodies) if bodies else []
        try:
            self.segments.sync()
            db.execute("BEGIN IMMEDIATE")
            try:
                db.executemany(
                    'UPDATE messages SET body_segment = ?, body_position = ? WHERE vhost = ? AND queue = ?'
                    ' AND "offset" = ? AND body_segment = ?',
                    [(r.segment, r.position, v, q, o, segment)
                     for r, (v, q, o, *_rest) in zip(refs, rows, strict=True)],
                )
                ends: dict[int, int] = {}
                for r in refs:
                    ends[r.segment] = max(ends.get(r.segment, 0), r.position + r.length)
                _add(db, {seg: (end, end) for seg, end in ends.items()})  # synced before this commit
                db.execute("DELETE FROM body_segments WHERE segment = ?", (segment,))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        except BaseException:
            self._cut()
            raise
        self.segments.synced()
        self.segments.remove(segment)
        self.compacted_segments += 1

    def close(self) -> None:
        self._io.shutdown(wait=True)
        self.segments.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = None


def _add(db: sqlite3.Connection, ends: dict[int, tuple[int, int]]) -> None:
    """Per segment (end, synced): its committed end moves to ``end`` and its synced_end (where the
    writes not known fsynced begin) to ``synced``."""
    if ends:
        db.executemany(
            "INSERT INTO body_segments (segment, end_position, synced_end) VALUES (?, ?, ?)"
            " ON CONFLICT (segment) DO UPDATE SET end_position = max(end_position, excluded.end_position),"
            " synced_end = excluded.synced_end",
            [(seg, end, synced) for seg, (end, synced) in ends.items()],
        )


@dataclass
class BodyWrite:
    """One commit's large bodies: their references (None: inline), the write under way, and where
    it begins in each segment it starts writing."""

    refs: list[BodyRef | None]
    future: Future[None]
    starts: dict[int, int]
