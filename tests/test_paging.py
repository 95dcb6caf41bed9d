"""Paging (core/engine/paging.py): ready messages past the memory budget wait in segment files."""

from __future__ import annotations

import os
import tracemalloc
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.durable.durability import Durability
from core.durable.group_commit import GroupCommitter
from core.engine import paging
from core.engine.broker import Broker
from core.engine.paging import PagedReady
from core.engine.policy import effective_queue_args
from core.engine.queue import EXPIRED, MAXLEN, Queue, QueuedMessage
from core.engine.queue_args import QueueArgs, parse_queue_args
from core.model import properties
from core.model.clock import ManualScheduler
from core.model.errors import PreconditionFailed
from core.model.policy import Policy
from core.ports.store import Batch, QueueRecord, StoredMessage
from persistence.sqlite import SQLiteStore
from tests.test_queue import FakeSink, consumer, message

BODY = 100  # bytes per test message; the budget below holds 10 of them (each also costs paging.MESSAGE_BYTES)


@pytest.fixture(autouse=True)
def small_budget(tmp_path: Path) -> Iterator[Path]:
    saved = (paging.settings.queue_bytes, paging.settings.node_bytes, paging.settings.directory,
             paging.settings.page_count)
    directory = tmp_path / "paging"
    paging.configure(10 * (BODY + paging.MESSAGE_BYTES), 0, str(directory))
    paging.settings.page_count = 7  # pages smaller than the window: several page-ins per test
    yield directory
    (paging.settings.queue_bytes, paging.settings.node_bytes, paging.settings.directory,
     paging.settings.page_count) = saved


def body(i: int) -> bytes:
    return (b"%05d" % i).ljust(BODY, b".")


def fill(q: Queue, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        q.enqueue(message(body(i)))


def numbers(sink: FakeSink) -> list[int]:
    return [int(qm.message.body[:5]) for _, qm in sink.delivered]


def segment_files(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def test_a_queue_within_its_budget_keeps_the_plain_deque(small_budget: Path) -> None:
    q = Queue("q", "/")
    fill(q, 10)
    assert type(q.default.ready) is deque
    assert segment_files(small_budget) == []


def test_past_the_budget_the_newest_wait_on_disk_and_come_back_in_order(small_budget: Path) -> None:
    q = Queue("q", "/")
    fill(q, 500)
    ch = q.default
    assert isinstance(ch.ready, PagedReady)
    assert ch.memory_bytes <= 10 * BODY
    assert q.message_count == 500 and ch.ready_bytes == 500 * BODY
    assert segment_files(small_budget)
    sink = FakeSink()
    consumer(q, sink, "c", no_ack=True)
    assert numbers(sink) == list(range(500))
    assert type(ch.ready) is deque  # drained: back on the in-memory path
    assert segment_files(small_budget) == []
    fill(q, 3, 500)  # and it goes on delivering
    assert numbers(sink)[-3:] == [500, 501, 502]


def test_messages_published_while_paging_follow_the_paged_ones(small_budget: Path) -> None:
    q = Queue("q", "/")
    fill(q, 100)
    sink = FakeSink({"c": 30})
    consumer(q, sink, "c", no_ack=True)
    fill(q, 100, 100)
    sink.credit["c"] = None
    q.default.dispatch()
    assert numbers(sink) == list(range(200))


def test_requeue_across_the_boundary_keeps_offset_order_and_marks_redelivered(small_budget: Path) -> None:
    q = Queue("q", "/")
    fill(q, 200)
    sink = FakeSink({"c": 25})
    c = consumer(q, sink, "c")
    assert numbers(sink) == list(range(25))
    out = [qm for _, qm in sink.delivered]
    sink.delivered.clear()
    sink.redelivered.clear()
    q.default.requeue([(qm, c) for qm in reversed(out[::2])])  # every other one, in any order
    sink.credit["c"] = None
    q.default.dispatch()
    expected = list(range(0, 25, 2)) + list(range(25, 200))
    assert numbers(sink) == expected
    assert sink.redelivered == [True] * 13 + [False] * 175


def test_the_redelivered_flag_and_delivery_count_survive_a_trip_to_disk(small_budget: Path) -> None:
    q = Queue("q", "/")
    for i in range(50):
        q.restore(message(body(i)), i, None, 3)  # as the store restores: redelivered
    assert isinstance(q.default.ready, PagedReady) and q.default.ready.paged
    sink = FakeSink()
    consumer(q, sink, "c", no_ack=True)
    assert numbers(sink) == list(range(50))
    assert sink.redelivered == [True] * 50
    assert {qm.delivery_count for _, qm in sink.delivered} == {4}


def test_ttl_expires_paged_messages_and_dead_letters_them_in_order(small_budget: Path) -> None:
    clock = ManualScheduler()
    dead: list[tuple[list[int], str]] = []
    q = Queue("q", "/", args=QueueArgs(message_ttl=1000, dead_letter_exchange="dlx"), scheduler=clock,
              on_dead_letter=lambda _q, qms, why: dead.append(([qm.offset for qm in qms], why)))
    fill(q, 100)
    clock.advance(0.5)
    fill(q, 50, 100)  # these live longer
    clock.advance(0.6)
    q.default.expire()
    assert [o for offsets, _ in dead for o in offsets] == list(range(100))
    assert {why for _, why in dead} == {EXPIRED}
    assert q.message_count == 50
    sink = FakeSink()
    consumer(q, sink, "c", no_ack=True)
    assert numbers(sink) == list(range(100, 150))


def test_an_expired_paged_message_is_not_delivered(small_budget: Path) -> None:
    clock = ManualScheduler()
    q = Queue("q", "/", args=QueueArgs(message_ttl=1000), scheduler=clock)
    fill(q, 100)
    clock.advance(2)
    fill(q, 5, 100)
    sink = FakeSink()
    consumer(q, sink, "c", no_ack=True)
    assert numbers(sink) == list(range(100, 105))


def test_max_length_drops_the_head_across_the_boundary(small_budget: Path) -> None:
    dead: list[int] = []
    q = Queue("q", "/", args=QueueArgs(max_length=100, dead_letter_exchange="dlx"),
              on_dead_letter=lambda _q, qms, why: dead.extend(qm.offset for qm in qms if why == MAXLEN))
    fill(q, 300)
    assert q.message_count == 100
    assert dead == list(range(200))
    sink = FakeSink()
    consumer(q, sink, "c", no_ack=True)
    assert numbers(sink) == list(range(200, 300))


def test_reject_publish_counts_paged_messages(small_budget: Path) -> None:
    q = Queue("q", "/", args=QueueArgs(max_length_bytes=50 * BODY, overflow="reject-publish"))
    accepted = [q.enqueue(message(body(i))) for i in range(60)]
    assert accepted == [True] * 50 + [False] * 10
    assert isinstance(q.default.ready, PagedReady)


def test_purge_and_delete_remove_segment_files(small_budget: Path) -> None:
    q = Queue("q", "/")
    fill(q, 300)
    assert segment_files(small_budget)
    assert q.purge() == 300
    assert q.message_count == 0 and q.default.ready_bytes == 0
    assert segment_files(small_budget) == []
    fill(q, 300)
    assert segment_files(small_budget)
    assert q.delete() == 300
    assert segment_files(small_budget) == []


def test_retention_takes_spilled_offsets_without_delivering_them(small_budget: Path) -> None:
    q = Queue("q", "/")
    fill(q, 100)
    assert q.drop_offsets(range(5, 95, 2)) == 45
    assert q.message_count == 55
    sink = FakeSink()
    consumer(q, sink, "c", no_ack=True)
    assert numbers(sink) == [i for i in range(100) if not (5 <= i < 95 and i % 2)]
    assert segment_files(small_budget) == []


def test_basic_get_reads_paged_messages(small_budget: Path) -> None:
    q = Queue("q", "/")
    fill(q, 40)
    got = [q.default.get(no_ack=True) for _ in range(41)]
    assert [int(qm.message.body[:5]) for qm in got if qm is not None] == list(range(40))
    assert got[-1] is None


def test_lazy_queues_page_from_the_first_message(small_budget: Path) -> None:
    args = parse_queue_args({"x-queue-mode": "lazy"}, "q", "/")
    q = Queue("q", "/", args=args)
    fill(q, 1)
    assert isinstance(q.default.ready, PagedReady) and q.default.memory_bytes == 0
    with pytest.raises(PreconditionFailed):
        parse_queue_args({"x-queue-mode": "eager"}, "q", "/")


def test_the_queue_mode_policy_pages_a_queue_live_and_the_argument_wins(small_budget: Path) -> None:
    q = Queue("q", "/")
    fill(q, 5)
    policy = Policy.create("/", "lazy", ".*", {"queue-mode": "lazy"})
    q.apply_args(effective_queue_args(q.args, {}, policy, None))
    assert q.args.lazy and isinstance(q.default.ready, PagedReady) and q.default.memory_bytes == 0
    sink = FakeSink()
    consumer(q, sink, "c", no_ack=True)
    assert numbers(sink) == list(range(5))
    declared = {"x-queue-mode": "default"}
    assert not effective_queue_args(parse_queue_args(declared, "q", "/"), declared, policy, None).lazy


def test_priority_queues_stay_in_memory(small_budget: Path) -> None:
    q = Queue("q", "/", args=QueueArgs(max_priority=5))
    fill(q, 300)
    assert not q.default.pageable and q.default.memory_bytes == 300 * BODY
    assert segment_files(small_budget) == []


def test_the_node_cap_pages_the_largest_queues_out(small_budget: Path) -> None:
    paging.settings.queue_bytes = 1000 * BODY
    big, small = Queue("big", "/"), Queue("small", "/")
    fill(big, 800)
    fill(small, 100)
    held = paging.enforce_node_cap(big.channels + small.channels, 500 * BODY)
    assert held <= 500 * BODY
    assert isinstance(big.default.ready, PagedReady) and type(small.default.ready) is deque
    sink = FakeSink()
    consumer(big, sink, "c", no_ack=True)
    assert numbers(sink) == list(range(800))


def test_the_index_costs_a_few_bytes_per_paged_message(small_budget: Path) -> None:
    q = Queue("q", "/")
    fill(q, 20)
    n = 20_000
    payload = body(0)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(n):
        q.enqueue(message(payload))  # the message is freed once spilled: only the index stays
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    per_message = (after - before) / n
    # Offset and size in two arrays (12 bytes) plus their over-allocation; a QueuedMessage in
    # memory costs ~100 bytes before its body, its Message ~200.
    assert per_message < 24, per_message


async def test_a_durable_backlog_restores_paged_and_purge_removes_spilled_ones_from_the_store(
        tmp_path: Path) -> None:
    path = str(tmp_path / "leveret.sqlite3")
    store = SQLiteStore(path)
    await store.open()
    await store.save_queue(QueueRecord("/", "dq", False, {}))
    epoch = await store.claim("/", "dq")
    props = properties.encode({"delivery_mode": 2})
    await store.commit(Batch(epochs={("/", "dq"): epoch}, appends=[
        StoredMessage("/", "dq", i, f"id-{i}", "", "dq", props, body(i), 1.0, None, 1) for i in range(300)]))
    try:
        broker = Broker(node_id="t")
        committer = GroupCommitter(store)
        _, loaded = await Durability(store, committer).restore(broker)
        assert loaded == 300
        q = broker.vhosts["/"].queues["dq"]
        ready = q.default.ready
        assert isinstance(ready, PagedReady) and ready.paged > 250
        sink = FakeSink({"c": 3})
        c = consumer(q, sink, "c")
        assert numbers(sink) == [0, 1, 2] and all(sink.redelivered)
        q.default.settle(sink.delivered[0][1], c)  # acked: removed from the store
        assert q.purge() == 297
        await committer.drain()
        assert [m.offset for m in await store.load_messages("/", "dq")] == [1, 2]  # still unacked
    finally:
        await store.close()


def _qm(i: int) -> QueuedMessage:
    return QueuedMessage(message(body(i)), i)


def test_segments_rotate_and_are_removed_as_they_are_read(small_budget: Path, monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setattr(paging, "SEGMENT_BYTES", 10 * BODY)
    ready = PagedReady(deque(), 0, 0)
    for i in range(100):
        ready.append(_qm(i))
    written = len(segment_files(small_budget))
    assert written >= 9
    got = [ready.popleft().offset for _ in range(60)]
    assert got == list(range(60))
    assert len(segment_files(small_budget)) <= written // 2  # those read back entirely are gone
    got += [ready.popleft().offset for _ in range(40)]
    assert got == list(range(100)) and not ready
    ready.close()
    assert segment_files(small_budget) == []


def test_the_node_start_empties_what_a_previous_run_spilled(small_budget: Path) -> None:
    q = Queue("q", "/")
    fill(q, 300)
    assert segment_files(small_budget)
    # As a restarted node does: never reloaded.
    paging.configure(10 * (BODY + paging.MESSAGE_BYTES), 0, str(small_budget))
    assert segment_files(small_budget) == []


def test_a_lazy_queue_read_back_entirely_holds_no_file(small_budget: Path) -> None:
    q = Queue("q", "/", args=QueueArgs(lazy=True))
    fill(q, 30)
    assert segment_files(small_budget)
    sink = FakeSink()
    consumer(q, sink, "c", no_ack=True)
    assert numbers(sink) == list(range(30))
    assert isinstance(q.default.ready, PagedReady) and segment_files(small_budget) == []
    fill(q, 3, 30)  # and it goes on
    assert numbers(sink)[-3:] == [30, 31, 32]
