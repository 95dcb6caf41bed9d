"""Paging of durable queues: persistent messages page back from the store, not from spill files.

With an in-memory store (``MemoryStore``: the real group committer over a dict, with a gate to
hold a page read in flight) and with the real SQLite store.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordination.local import LocalCoordinator
from core.durable.durability import QueueStorage
from core.durable.group_commit import GroupCommitter
from core.engine import paging
from core.engine.paging import PagedReady
from core.engine.queue import EXPIRED, MAXLEN, DeadLetterFn, Queue, QueuedMessage
from core.engine.queue_args import parse_queue_args
from core.model import properties
from core.model.message import Message
from core.ports.store import Batch, QueueRecord, StoredMessage, StoreError
from persistence.sqlite import SQLiteStore
from tests.test_queue import FakeSink, consumer

BODY = 100  # bytes per test message; the budget below holds 10 of them
PERSISTENT = properties.encode({"delivery_mode": 2})


@pytest.fixture(autouse=True)
def small_budget(tmp_path: Path) -> Iterator[Path]:
    saved = (paging.settings.queue_bytes, paging.settings.node_bytes, paging.settings.directory,
             paging.settings.page_count, paging.settings.page_bytes)
    directory = tmp_path / "paging"
    paging.configure(10 * (BODY + paging.MESSAGE_BYTES), 0, str(directory))
    paging.settings.page_count = 7  # pages smaller than the window: several page-ins per test
    paging.settings.page_bytes = 7 * BODY
    yield directory
    (paging.settings.queue_bytes, paging.settings.node_bytes, paging.settings.directory,
     paging.settings.page_count, paging.settings.page_bytes) = saved


class MemoryStore:
    """The part of MessageStore the group committer and paging use, in a dict.

    ``gate``: while set to an unset event, ``load_range`` waits on it (a page read in flight);
    ``fail_commits``: commits raise StoreError.
    """

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], dict[int, StoredMessage]] = {}
        self.gate: asyncio.Event | None = None
        self.fail_commits = False
        self.reads = 0

    async def commit(self, batch: Batch) -> None:
        await asyncio.sleep(0)
        if self.fail_commits:
            raise StoreError("disk full")
        for sm in batch.appends:
            self.rows.setdefault((sm.vhost, sm.queue), {})[sm.offset] = sm
        for vhost, queue, offset in batch.removals:
            self.rows.get((vhost, queue), {}).pop(offset, None)
        for vhost, queue in batch.purges:
            self.rows.pop((vhost, queue), None)
        for key in batch.claims:
            batch.claimed[key] = 1

    async def load_range(self, vhost: str, queue: str, start: int, below: int | None, limit: int
                         ) -> list[StoredMessage]:
        self.reads += 1
        if self.gate is not None:
            await self.gate.wait()
        rows = self.rows.get((vhost, queue), {})
        return [rows[o] for o in sorted(rows) if o >= start and (below is None or o < below)][:limit]


def body(i: int) -> bytes:
    return (b"%05d" % i).ljust(BODY, b".")


def durable_queue(store: object, args: dict[str, object] | None = None) -> tuple[Queue, GroupCommitter]:
    committer = GroupCommitter(store)  # type: ignore[arg-type]
    q = Queue("dq", "/", durable=True, arguments=args, args=parse_queue_args(args or {}, "dq", "/"))
    q.attach_storage(QueueStorage("/", "dq", committer, 1))
    return q, committer


def publish(q: Queue, numbers: range, persistent: bool = True) -> None:
    for i in numbers:
        q.enqueue(Message("", "dq", PERSISTENT if persistent else properties.EMPTY, body(i)))


def numbers(sink: FakeSink) -> list[int]:
    return [int(qm.message.body[:5]) for _, qm in sink.delivered]


def spilled_bytes(directory: Path) -> int:
    return sum(os.path.getsize(directory / f) for f in os.listdir(directory)) if directory.exists() else 0


def recorder(dead: list[tuple[int, str]]) -> DeadLetterFn:
    def record(_q: Queue, msgs: list[QueuedMessage], reason: str) -> set[int]:
        dead.extend((qm.offset, reason) for qm in msgs)
        return set()
    return record


async def settle_loop(rounds: int = 20) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


async def test_persistent_messages_page_back_from_the_store_not_from_spill_files(small_budget: Path) -> None:
    store = MemoryStore()
    q, committer = durable_queue(store)
    publish(q, range(200))
    ready = q.default.ready
    assert isinstance(ready, PagedReady) and ready.paged == 190
    assert len(ready.held) == 190  # not committed yet: still in memory
    await committer.drain()
    assert ready.held == {} and ready.held_bytes == 0  # committed: only the index keeps them
    assert spilled_bytes(small_budget) == 0  # nothing written a second time
    sink = FakeSink()
    consumer(q, sink, "c", no_ack=True)
    while len(sink.delivered) < 200:
        await asyncio.sleep(0.001)
    assert numbers(sink) == list(range(200))
    assert store.reads >= 190 // 7
    assert type(q.default.ready) is not PagedReady or not q.default.ready.paged


async def test_transient_and_persistent_messages_of_one_queue_merge_by_offset(small_budget: Path) -> None:
    store = MemoryStore()
    q, committer = durable_queue(store)
    for i in range(120):
        publish(q, range(i, i + 1), persistent=i % 3 != 0)  # every third one transient: to the segment log
    await committer.drain()
    assert spilled_bytes(small_budget) > 0  # the transient ones
    assert spilled_bytes(small_budget) < 50 * (BODY + 64)  # ... and only those
    sink = FakeSink()
    consumer(q, sink, "c")
    while len(sink.delivered) < 120:
        await asyncio.sleep(0.001)
    assert numbers(sink) == list(range(120))
    assert [qm.persisted for _, qm in sink.delivered] == [i % 3 != 0 for i in range(120)]


async def test_an_empty_window_waits_for_the_page_and_dispatch_resumes_when_it_lands(small_budget: Path
                                                                                     ) -> None:
    store = MemoryStore()
    q, committer = durable_queue(store)
    publish(q, range(60))
    await committer.drain()
    store.gate = asyncio.Event()
    sink = FakeSink({"c": 10})
    consumer(q, sink, "c", no_ack=True)
    assert numbers(sink) == list(range(10))  # the window; the next page is being read
    ch = q.default
    assert ch.head_loading() and q.message_count == 50  # waiting, not empty
    assert ch.get(no_ack=True) is None
    got = asyncio.get_running_loop().create_task(ch.get_loaded(no_ack=True))
    await settle_loop()
    assert not got.done()
    store.gate.set()
    qm = await got
    assert qm is not None and qm.offset == 10  # basic.get takes the head once it lands
    sink.credit["c"] = None
    ch.dispatch()
    while len(sink.delivered) < 59:
        await asyncio.sleep(0.001)
    assert numbers(sink) == list(range(10)) + list(range(11, 60))


async def test_basic_get_through_the_coordinator_waits_for_the_page(small_budget: Path) -> None:
    store = MemoryStore()
    q, committer = durable_queue(store)
    publish(q, range(30))
    await committer.drain()
    store.gate = asyncio.Event()
    coordinator = LocalCoordinator("t")
    got = []
    for _ in range(10):  # the window, answered at once
        qm, _left = await coordinator.get(q, no_ack=True)
        assert qm is not None
        got.append(qm.offset)
    answer = asyncio.ensure_future(coordinator.get(q, no_ack=True))  # the next page is being read
    await settle_loop()
    assert not answer.done()  # not get-empty: the queue holds 20 more
    store.gate.set()
    qm, left = await answer
    assert qm is not None and got + [qm.offset] == list(range(11)) and left == 19


async def test_a_commit_that_failed_keeps_the_spilled_copy_in_memory(small_budget: Path) -> None:
    store = MemoryStore()
    store.fail_commits = True
    q, committer = durable_queue(store)
    publish(q, range(40))
    await committer.drain()
    ready = q.default.ready
    assert isinstance(ready, PagedReady) and len(ready.kept) == 30 and not ready.held
    sink = FakeSink()
    consumer(q, sink, "c", no_ack=True)
    assert numbers(sink) == list(range(40))  # from memory, synchronously: the store never had them
    assert store.reads == 0


async def test_purge_while_a_page_is_read_removes_the_spilled_ones_from_the_store(small_budget: Path) -> None:
    store = MemoryStore()
    q, committer = durable_queue(store)
    publish(q, range(50))
    await committer.drain()
    store.gate = asyncio.Event()
    sink = FakeSink()
    consumer(q, sink, "c", no_ack=True)
    assert q.default.head_loading()
    assert q.purge() == 40
    store.gate.set()
    await settle_loop()
    await committer.drain()
    assert numbers(sink) == list(range(10)) and q.message_count == 0
    assert store.rows[("/", "dq")] == {}
    publish(q, range(50, 53))  # and the queue goes on
    await settle_loop()
    assert numbers(sink)[-3:] == [50, 51, 52]


async def test_ttl_expiry_and_retention_at_the_head_of_a_page_read_from_the_store(small_budget: Path) -> None:
    store = MemoryStore()
    q, committer = durable_queue(store, {"x-message-ttl": 60_000, "x-dead-letter-exchange": "dlx"})
    dead: list[tuple[int, str]] = []
    q._on_dead_letter = recorder(dead)
    publish(q, range(40))
    await committer.drain()
    assert q.drop_offsets([10, 11]) == 2  # retention takes two spilled offsets without reading them
    store.gate = asyncio.Event()
    sink = FakeSink()
    consumer(q, sink, "c", no_ack=True)
    assert numbers(sink) == list(range(10)) and q.default.head_loading()
    q.default.remove_consumer(q.default.consumers[0])
    # every message expires before the page lands
    for sm in store.rows[("/", "dq")].values():
        sm.expires_at = 0.0
    q.default.expire()  # the head is not here yet: nothing to do, no error
    store.gate.set()
    await settle_loop()
    assert [o for o, _ in dead][:7] == [12, 13, 14, 15, 16, 17, 18]  # dropped at the head as it landed
    assert {r for _, r in dead} == {EXPIRED}


async def test_drop_head_over_max_length_waits_for_the_page(small_budget: Path) -> None:
    store = MemoryStore()
    q, committer = durable_queue(store)
    publish(q, range(40))
    await committer.drain()
    store.gate = asyncio.Event()
    sink = FakeSink({"c": 10})
    consumer(q, sink, "c", no_ack=True)
    sink.credit["c"] = 0
    q.default.dispatch()  # the window is empty: the next page is being read
    assert q.default.head_loading()
    dead: list[tuple[int, str]] = []
    q._on_dead_letter = recorder(dead)
    q.apply_args(parse_queue_args({"x-max-length": 25, "x-dead-letter-exchange": "dlx"}, "dq", "/"))
    assert q.message_count == 30  # over the limit until the head is here
    store.gate.set()
    await settle_loop()
    assert q.message_count == 25 and dead == [(o, MAXLEN) for o in range(10, 15)]


async def test_messages_restored_redelivered_keep_the_flag_through_the_store(small_budget: Path) -> None:
    store = MemoryStore()
    q, committer = durable_queue(store)
    for i in range(30):
        sm = StoredMessage("/", "dq", i, f"id-{i}", "", "dq", PERSISTENT, body(i), 1.0, None, 2)
        store.rows.setdefault(("/", "dq"), {})[i] = sm
        q.restore(Message("", "dq", PERSISTENT, body(i)), i, None, 2)
    await settle_loop()
    ready = q.default.ready
    assert isinstance(ready, PagedReady) and not ready.held  # restored: in the store already
    sink = FakeSink()
    consumer(q, sink, "c")
    while len(sink.delivered) < 30:
        await asyncio.sleep(0.001)
    assert numbers(sink) == list(range(30)) and all(sink.redelivered)
    assert {qm.delivery_count for _, qm in sink.delivered} == {3}
    assert sink.delivered[-1][1].message.id == "id-29"


async def test_with_the_sqlite_store(tmp_path: Path, small_budget: Path) -> None:
    store = SQLiteStore(str(tmp_path / "leveret.sqlite3"))
    await store.open()
    try:
        await store.save_queue(QueueRecord("/", "dq", False, {}))
        epoch = await store.claim("/", "dq")
        q, committer = durable_queue(store)
        q.storage.epoch = epoch  # type: ignore[union-attr]
        for i in range(300):
            publish(q, range(i, i + 1), persistent=i % 5 != 0)
        await committer.drain()
        ready = q.default.ready
        assert isinstance(ready, PagedReady) and not ready.held and not ready.kept and ready.paged == 290
        assert spilled_bytes(small_budget) < 60 * (BODY + 64)  # the 60 transient ones at most
        got = await q.default.get_loaded(no_ack=True)
        assert got is not None and got.offset == 0 and not got.persisted  # transient: from the window
        sink = FakeSink()
        c = consumer(q, sink, "c")
        while len(sink.delivered) < 299:
            await asyncio.sleep(0.001)
        assert numbers(sink) == list(range(1, 300))
        for _, qm in sink.delivered:
            q.default.settle(qm, c)
        await committer.drain()
        assert await store.load_messages("/", "dq") == []  # every persistent one acked
        assert ready.lost == 0
    finally:
        await store.close()
