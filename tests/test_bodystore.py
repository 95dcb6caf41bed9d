"""The body store: segment files (persistence/bodystore.py) and the SQLite store's references to them.

Real files in tmp_path and a real SQLite store with a small threshold and
small segments, so a few KiB exercise rolling, removal and compaction.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from core.ports.store import Batch, Fenced, StoredMessage, StoreError
from persistence import sqlite_bodies
from persistence.bodystore import MAX_SPARES, BodyRef, CorruptBody, SegmentStore, segment_name
from persistence.sqlite import SQLiteStore

VHOST = "/"
QUEUE = "q"


# -- the segment files alone ------------------------------------------------------------


def test_append_sync_read_round_trip_and_rolls_segments(tmp_path: Path) -> None:
    seg = SegmentStore(tmp_path, segment_bytes=1000)
    seg.recover({})
    bodies = [bytes([i]) * 400 for i in range(6)]
    refs = seg.append([memoryview(b) for b in bodies[:3]]) + seg.append(bodies[3:])
    seg.sync()
    seg.synced()
    # 400 + 400 + 400 passes 1000 after the third: a segment holds three, the next starts anew.
    assert [r.segment for r in refs] == [0, 0, 0, 1, 1, 1]
    assert [r.position for r in refs] == [0, 400, 800, 0, 400, 800]
    assert [seg.read(r) for r in refs] == bodies
    assert seg.segments_on_disk() == [0, 1]


def test_rollback_cuts_an_uncommitted_write(tmp_path: Path) -> None:
    seg = SegmentStore(tmp_path, segment_bytes=1 << 20)
    seg.recover({})
    kept = seg.append([b"a" * 100])
    seg.sync()
    seg.synced()
    seg.append([b"b" * 100, b"c" * 50])
    seg.sync()
    seg.rollback()
    assert (tmp_path / segment_name(0)).stat().st_size == 100
    again = seg.append([b"d" * 10])  # the next write lands where the cut one began
    assert again[0].position == 100
    assert seg.read(kept[0]) == b"a" * 100


def test_recover_removes_orphans_and_cuts_torn_tails(tmp_path: Path) -> None:
    seg = SegmentStore(tmp_path, segment_bytes=1000)
    seg.recover({})
    refs = seg.append([b"x" * 600, b"y" * 600, b"z" * 100])
    seg.sync()
    seg.close()
    # Committed: segment 0 up to 600 (its second body was written, never committed),
    # segment 1 not at all (its rows were deleted); a stray non-segment file stays.
    (tmp_path / "notes.txt").write_text("keep me")
    seg = SegmentStore(tmp_path, segment_bytes=1000)
    report = seg.recover({0: 600})
    assert report.removed == [1]
    assert report.truncated == {0: 600}
    assert seg.segments_on_disk() == [0]
    assert (tmp_path / "notes.txt").exists()
    assert seg.read(refs[0]) == b"x" * 600
    # New appends go to a fresh segment, numbered after every one seen.
    assert seg.append([b"n"])[0].segment == 2


def test_emptied_segments_are_recycled_up_to_a_limit(tmp_path: Path) -> None:
    seg = SegmentStore(tmp_path, segment_bytes=1000)
    seg.recover({})
    refs = seg.append([b"a" * 1000, b"b" * 1000, b"c" * 1000, b"d" * 10])
    seg.sync()
    seg.synced()
    inodes = {r.segment: (tmp_path / segment_name(r.segment)).stat().st_ino for r in refs}
    for s in (0, 1, 2):
        seg.remove(s)
    assert len(seg.spares()) == MAX_SPARES == 2  # the third was unlinked
    assert seg.segments_on_disk() == [3]
    # The next segments overwrite the spares' blocks: same inodes, old bytes never read.
    seg.seal()
    again = seg.append([b"e" * 1000, b"f" * 5])
    assert [r.segment for r in again] == [4, 5]
    assert (tmp_path / segment_name(4)).stat().st_ino in {inodes[0], inodes[1]}
    assert seg.read(again[1]) == b"f" * 5 and not seg.spares()
    seg.close()
    # A restart keeps spares it finds (up to the limit) and never mistakes them for segments.
    (tmp_path / "00000000000000aa.free").write_bytes(b"x")
    (tmp_path / "00000000000000ab.free").write_bytes(b"x")
    (tmp_path / "00000000000000ac.free").write_bytes(b"x")
    seg = SegmentStore(tmp_path, segment_bytes=1000)
    report = seg.recover({3: 10, 4: 1000, 5: 5})
    assert report.removed == [] and len(seg.spares()) == 2
    assert len(list(tmp_path.glob("*.free"))) == 2


def test_recover_reports_committed_segments_that_are_missing(tmp_path: Path) -> None:
    report = SegmentStore(tmp_path).recover({3: 10})
    assert report.missing == [3]


def test_a_corrupt_or_short_body_is_refused(tmp_path: Path) -> None:
    seg = SegmentStore(tmp_path)
    seg.recover({})
    ref = seg.append([b"hello world" * 10])[0]
    seg.sync()
    with open(tmp_path / segment_name(0), "r+b") as f:
        f.seek(5)
        f.write(b"J")
    with pytest.raises(CorruptBody, match="checksum mismatch in segment 0000000000000000.seg at 0\\+110"):
        seg.read(ref)
    with pytest.raises(CorruptBody, match="ends before"):
        seg.read(BodyRef(0, 100, 100, 0))
    with pytest.raises(CorruptBody, match="missing"):
        seg.read(BodyRef(9, 0, 1, 0))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(st.lists(st.binary(min_size=0, max_size=700), max_size=6), max_size=6),
       segment_bytes=st.integers(min_value=1, max_value=2000), cut=st.booleans())
def test_any_appends_read_back_after_a_reopen(tmp_path: Path, batches: list[list[bytes]], segment_bytes: int,
                                              cut: bool) -> None:
    directory = tmp_path / os.urandom(6).hex()
    seg = SegmentStore(directory, segment_bytes=segment_bytes)
    seg.recover({})
    written: list[tuple[BodyRef, bytes]] = []
    for batch in batches:
        refs = seg.append(batch)
        seg.sync()
        seg.synced()
        written += zip(refs, batch, strict=True)
    committed: dict[int, int] = {}
    for ref, _ in written:
        committed[ref.segment] = max(committed.get(ref.segment, 0), ref.position + ref.length)
    if cut:  # a write after the last commit: recovery must cut it
        seg.append([b"torn" * 50])
        seg.sync()
    seg.close()
    seg = SegmentStore(directory, segment_bytes=segment_bytes)
    report = seg.recover(committed)
    assert not report.missing
    assert [seg.read(ref) for ref, _ in written] == [body for _, body in written]
    for s in seg.segments_on_disk():
        assert (directory / segment_name(s)).stat().st_size == committed[s]


# -- the SQLite store's references ------------------------------------------------------------


def _message(offset: int, body: bytes) -> StoredMessage:
    return StoredMessage(VHOST, QUEUE, offset, f"m{offset}", "", QUEUE, b"\x00\x00", body, 1.0, None, 0)


def _store(tmp_path: Path) -> SQLiteStore:
    # Bodies of 1 KiB and more go to segments of 8 KiB: three 3 KiB bodies seal one.
    return SQLiteStore(str(tmp_path / "leveret.sqlite3"), body_threshold=1024, body_segment_bytes=8 * 1024)


async def _open(tmp_path: Path) -> tuple[SQLiteStore, int]:
    store = _store(tmp_path)
    await store.open()
    epoch = await store.claim(VHOST, QUEUE)
    return store, epoch


def _bodies_dir(tmp_path: Path) -> Path:
    return tmp_path / "bodies"


def _body(i: int, size: int = 3 * 1024) -> bytes:
    return (f"{i:08d}".encode() * (size // 8 + 1))[:size]


async def test_large_bodies_go_to_segments_and_every_reader_gets_them_whole(tmp_path: Path) -> None:
    store, epoch = await _open(tmp_path)
    messages = [_message(i, _body(i) if i % 2 else b"small %d" % i) for i in range(10)]
    await store.commit(Batch(epochs={(VHOST, QUEUE): epoch}, appends=messages))
    assert [m.body for m in await store.load_messages(VHOST, QUEUE)] == [m.body for m in messages]
    page = await store.load_range(VHOST, QUEUE, 3, 8, 3)
    assert [(m.offset, m.body) for m in page] == [(m.offset, m.body) for m in messages[3:6]]
    assert page[0] == messages[3]
    db = sqlite3.connect(store.path)
    inline, referenced = db.execute(
        "SELECT sum(body_segment IS NULL), sum(body_segment IS NOT NULL AND length(body) = 0) FROM messages"
    ).fetchone()
    assert (inline, referenced) == (5, 5)
    db.close()
    assert _bodies_dir(tmp_path).is_dir() and store.bodies.segments.segments_on_disk()
    await store.close()


async def test_acked_segments_are_removed_and_sparse_ones_compacted(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sqlite_bodies, "COMPACT_AFTER", 0.0)  # compact as soon as a segment is sparse
    store, epoch = await _open(tmp_path)
    fence = {(VHOST, QUEUE): epoch}
    await store.commit(Batch(epochs=fence, appends=[_message(i, _body(i)) for i in range(9)]))
    # 3 KiB bodies in 8 KiB segments: 0-2 in segment 0, 3-5 in 1, 6-8 in 2 (the active one).
    assert store.bodies.segments.segments_on_disk() == [0, 1, 2]
    await store.commit(Batch(epochs=fence, removals=[(VHOST, QUEUE, o) for o in (0, 1, 2)]))
    assert store.bodies.segments.segments_on_disk() == [1, 2]  # every body of segment 0 gone: the file too
    await store.commit(Batch(epochs=fence, removals=[(VHOST, QUEUE, o) for o in (3, 4)]))
    # Segment 1 keeps 3 KiB of 9: compacted into the active segment, then removed.
    assert store.bodies.compacted_segments == 1
    assert 1 not in store.bodies.segments.segments_on_disk()
    assert [(m.offset, m.body) for m in await store.load_messages(VHOST, QUEUE)] == [
        (o, _body(o)) for o in (5, 6, 7, 8)]
    await store.close()
    # And after a restart the moved references still resolve.
    store, epoch = await _open(tmp_path)
    assert [m.body for m in await store.load_range(VHOST, QUEUE, 0, None, 10)] == [_body(o) for o in (5, 6, 7, 8)]
    await store.commit(Batch(epochs={(VHOST, QUEUE): epoch}, purges=[(VHOST, QUEUE)]))
    assert store.bodies.segments.segments_on_disk() == []
    await store.close()


async def test_a_segment_still_draining_is_not_compacted_and_an_idle_empty_active_one_goes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store, epoch = await _open(tmp_path)
    fence = {(VHOST, QUEUE): epoch}
    await store.commit(Batch(epochs=fence, appends=[_message(i, _body(i)) for i in range(6)]))
    await store.commit(Batch(epochs=fence, removals=[(VHOST, QUEUE, o) for o in (0, 1)]))
    # Segment 0 holds 3 of 9 KiB, but it lost a body just now: a consumer is draining it.
    assert store.bodies.compacted_segments == 0 and 0 in store.bodies.segments.segments_on_disk()
    await store.commit(Batch(epochs=fence, removals=[(VHOST, QUEUE, o) for o in (2, 3, 4, 5)]))
    assert store.bodies.segments.segments_on_disk() == [1]  # drained: removed, nothing copied
    assert store.bodies.compacted_segments == 0
    # The active segment, empty, goes once no large body came for COLLECT_EVERY.
    monkeypatch.setattr(sqlite_bodies, "COLLECT_EVERY", 0.0)
    await store.commit(Batch(epochs=fence, appends=[_message(9, b"small")], removals=[(VHOST, QUEUE, 9)]))
    assert store.bodies.segments.segments_on_disk() == []
    await store.close()


async def test_deleting_the_queue_or_vhost_frees_its_segments(tmp_path: Path) -> None:
    store, epoch = await _open(tmp_path)
    await store.commit(Batch(epochs={(VHOST, QUEUE): epoch}, appends=[_message(i, _body(i)) for i in range(6)]))
    assert store.bodies.segments.segments_on_disk() == [0, 1]
    await store.delete_queue(VHOST, QUEUE)
    assert store.bodies.segments.segments_on_disk() == [1]  # the active one stays until the next segment
    await store.close()
    store = _store(tmp_path)
    await store.open()
    assert store.bodies.segments.segments_on_disk() == []
    await store.close()


async def test_a_failed_commit_leaves_no_body_behind(tmp_path: Path) -> None:
    store, epoch = await _open(tmp_path)
    await store.commit(Batch(epochs={(VHOST, QUEUE): epoch}, appends=[_message(0, _body(0))]))
    size = (_bodies_dir(tmp_path) / segment_name(0)).stat().st_size
    with pytest.raises(Fenced):
        await store.commit(Batch(epochs={(VHOST, QUEUE): epoch - 1}, appends=[_message(1, _body(1))]))
    assert (_bodies_dir(tmp_path) / segment_name(0)).stat().st_size == size
    assert [m.offset for m in await store.load_messages(VHOST, QUEUE)] == [0]
    await store.close()


async def test_open_cuts_a_torn_tail_and_removes_orphans(tmp_path: Path) -> None:
    store, epoch = await _open(tmp_path)
    await store.commit(Batch(epochs={(VHOST, QUEUE): epoch}, appends=[_message(i, _body(i)) for i in range(2)]))
    await store.close()
    # What kill -9 can leave: a body written and fsynced whose commit never happened (the
    # tail), and a whole segment that no committed row references.
    with open(_bodies_dir(tmp_path) / segment_name(0), "ab") as f:
        f.write(b"torn" * 300)
    (_bodies_dir(tmp_path) / segment_name(7)).write_bytes(b"orphan" * 100)
    store = _store(tmp_path)
    await store.open()
    assert store.bodies.segments.segments_on_disk() == [0]
    assert (_bodies_dir(tmp_path) / segment_name(0)).stat().st_size == 2 * 3 * 1024
    assert [m.body for m in await store.load_messages(VHOST, QUEUE)] == [_body(0), _body(1)]
    # Appends after the restart go to a segment numbered past every file seen.
    epoch = await store.claim(VHOST, QUEUE)
    await store.commit(Batch(epochs={(VHOST, QUEUE): epoch}, appends=[_message(2, _body(2))]))
    assert store.bodies.segments.segments_on_disk() == [0, 8]
    await store.close()


async def test_a_corrupt_body_is_reported_with_its_queue_and_offset(tmp_path: Path) -> None:
    store, epoch = await _open(tmp_path)
    await store.commit(Batch(epochs={(VHOST, QUEUE): epoch}, appends=[_message(4, _body(4))]))
    with open(_bodies_dir(tmp_path) / segment_name(0), "r+b") as f:
        f.write(b"!")
    with pytest.raises(StoreError, match="message 4 of //q: checksum mismatch in segment 0000000000000000.seg"):
        await store.load_range(VHOST, QUEUE, 0, None, 10)
    await store.close()


async def test_rows_deleted_by_another_connection_free_their_segment(tmp_path: Path) -> None:
    """The retention jobs delete rows over their own connection: the trigger keeps the counts."""
    store, epoch = await _open(tmp_path)
    await store.commit(Batch(epochs={(VHOST, QUEUE): epoch}, appends=[_message(i, _body(i)) for i in range(4)]))
    other = sqlite3.connect(store.path, isolation_level=None)
    other.execute('DELETE FROM messages WHERE "offset" < 3')
    other.close()
    await store.close()
    store = _store(tmp_path)
    await store.open()
    assert store.bodies.segments.segments_on_disk() == [1]
    assert [m.offset for m in await store.load_messages(VHOST, QUEUE)] == [3]
    await store.close()


async def test_replacing_a_row_counts_the_body_it_replaces(tmp_path: Path) -> None:
    store, epoch = await _open(tmp_path)
    fence = {(VHOST, QUEUE): epoch}
    await store.commit(Batch(epochs=fence, appends=[_message(0, _body(0))]))
    await store.commit(Batch(epochs=fence, appends=[_message(0, b"now small")]))
    assert [m.body for m in await store.load_messages(VHOST, QUEUE)] == [b"now small"]
    await store.close()


async def test_open_drops_only_the_last_commit_bodies_that_missed_the_disk(tmp_path: Path) -> None:
    """The last commit's fsync ran beside its transaction: a crash can leave its rows without their
    bodies. Those publishes were never confirmed; open drops exactly them and keeps the rest."""
    store, epoch = await _open(tmp_path)
    fence = {(VHOST, QUEUE): epoch}
    await store.commit(Batch(epochs=fence, appends=[_message(0, _body(0)), _message(1, _body(1))]))
    await store.commit(Batch(epochs=fence, appends=[_message(2, _body(2, 1500))]))
    await store.close()
    # Body 2 (the last commit's) half on disk, as when the crash beat its fdatasync.
    path = _bodies_dir(tmp_path) / segment_name(0)
    os.truncate(path, 2 * 3 * 1024 + 700)
    store = _store(tmp_path)
    await store.open()
    assert store.bodies.dropped_unsynced == 1
    assert [m.offset for m in await store.load_messages(VHOST, QUEUE)] == [0, 1]
    await store.close()
    # A body before synced_end is one a confirm was given for: never dropped, reported.
    with open(path, "r+b") as f:
        f.write(b"?")
    store = _store(tmp_path)
    await store.open()
    assert store.bodies.dropped_unsynced == 0
    with pytest.raises(StoreError, match="message 0 of //q: checksum mismatch"):
        await store.load_messages(VHOST, QUEUE)
    await store.close()


async def test_a_second_opener_reads_bodies_and_never_recovers_or_writes_them(tmp_path: Path) -> None:
    """``leveret users`` may open the store of a running node: the node's uncommitted bytes stay."""
    node, epoch = await _open(tmp_path)
    await node.commit(Batch(epochs={(VHOST, QUEUE): epoch}, appends=[_message(0, _body(0))]))
    # Bytes the node wrote and has not committed yet (as between its fsync and its commit).
    with open(_bodies_dir(tmp_path) / segment_name(0), "ab") as f:
        f.write(b"in flight" * 100)
    size = (_bodies_dir(tmp_path) / segment_name(0)).stat().st_size
    other = _store(tmp_path)
    await other.open()
    assert not other.bodies.owner and node.bodies.owner
    assert (_bodies_dir(tmp_path) / segment_name(0)).stat().st_size == size
    assert [m.body for m in await other.load_messages(VHOST, QUEUE)] == [_body(0)]
    with pytest.raises(StoreError, match="held by a running node"):
        await other.commit(Batch(appends=[_message(5, _body(5))]))
    await other.close()
    await node.close()
    # The node gone, the next opener owns the store and cuts the uncommitted tail.
    again = _store(tmp_path)
    await again.open()
    assert again.bodies.owner
    assert (_bodies_dir(tmp_path) / segment_name(0)).stat().st_size == 3 * 1024
    await again.close()


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.lists(st.sampled_from([0, 700, 1024, 3000, 5000]), min_size=1, max_size=6)),
        st.tuples(st.just("remove"), st.lists(st.integers(min_value=0, max_value=30), min_size=1, max_size=6)),
        st.tuples(st.just("purge"), st.just([])),
        st.tuples(st.just("reopen"), st.just([])),
    ),
    max_size=14,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
@example(ops=[("append", [3000] * 9), ("remove", [0, 1, 3, 4]), ("reopen", []), ("remove", [2, 5, 6]),
              ("append", [5000, 700]), ("purge", []), ("reopen", [])])  # compaction, then removal
async def test_any_appends_removals_purges_and_restarts_keep_every_body_and_no_dead_segment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ops: list[tuple[str, list[int]]]) -> None:
    """Against a model: readers give back exactly the live messages, and once collected, every
    segment on disk but the active one holds a live body."""
    monkeypatch.setattr(sqlite_bodies, "COMPACT_AFTER", 0.0)
    directory = tmp_path / os.urandom(6).hex()
    store, epoch = await _open(directory)
    model: dict[int, bytes] = {}
    offset = 0
    try:
        for op, args in ops:
            fence = {(VHOST, QUEUE): epoch}
            if op == "append":
                appends = []
                for size in args:
                    model[offset] = _body(offset, size)
                    appends.append(_message(offset, model[offset]))
                    offset += 1
                await store.commit(Batch(epochs=fence, appends=appends))
            elif op == "remove":
                gone = sorted({o for o in args if o in model})
                for o in gone:
                    del model[o]
                await store.commit(Batch(epochs=fence, removals=[(VHOST, QUEUE, o) for o in gone]))
            elif op == "purge":
                model.clear()
                await store.commit(Batch(epochs=fence, purges=[(VHOST, QUEUE)]))
            else:
                await store.close()
                store, epoch = await _open(directory)
            got = await store.load_range(VHOST, QUEUE, 0, None, 1000)
            assert [(m.offset, m.body) for m in got] == sorted(model.items())
            db = sqlite3.connect(store.path)
            live = {seg for (seg,) in db.execute("SELECT DISTINCT body_segment FROM messages WHERE body_segment"
                                                 " IS NOT NULL")}
            db.close()
            on_disk = set(store.bodies.segments.segments_on_disk())
            assert live <= on_disk, "a referenced segment is gone"
            assert on_disk - live <= {store.bodies.segments.active}, "a segment holds only dead bodies"
    finally:
        await store.close()
