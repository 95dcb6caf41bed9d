"""Stream queues in the core, without sockets: offsets, readers, retention, groups, arguments."""

from __future__ import annotations

import asyncio
import datetime
import time
from pathlib import Path
from typing import Any

import pytest

from amqp_frontend.stream_consumer import with_stream_offset
from coordination.local import LocalCoordinator
from core.durable.durability import Durability
from core.durable.group_commit import GroupCommitter
from core.engine import partition
from core.engine.broker import Broker
from core.engine.queue import Consumer
from core.engine.stream import StreamQueue
from core.engine.stream_args import FIRST, LAST, NEXT, OffsetSpec, parse_age, parse_offset
from core.engine.vhost import VirtualHost
from core.model import properties
from core.model.clock import ManualScheduler
from core.model.errors import NotImplementedFeature, PreconditionFailed
from core.model.message import Message
from persistence.sqlite import SQLiteStore
from tests.test_queue import FakeSink


def stream(vh: VirtualHost, name: str = "s", **args: Any) -> StreamQueue:
    q = vh.declare_queue(name, None, durable=True, arguments={"x-queue-type": "stream", **args})
    assert isinstance(q, StreamQueue)
    return q


def publish(q: StreamQueue, n: int, size: int = 10, start: int = 0) -> None:
    for i in range(start, start + n):
        q.enqueue(Message("", "rk", properties.EMPTY, b"%d" % i + b"." * (size - len(b"%d" % i))))


def read(q: StreamQueue, spec: OffsetSpec, sink: FakeSink, tag: str = "c", group: str | None = None) -> Consumer:
    r = q.open_reader(spec, name=tag, group=group)
    c = Consumer(tag, r, sink, no_ack=False)
    r.add_consumer(c)
    return c


def offsets(sink: FakeSink, tag: str | None = None) -> list[int]:
    return [qm.offset for t, qm in sink.delivered if tag is None or t == tag]


@pytest.fixture
def vh() -> VirtualHost:
    return VirtualHost("/", scheduler=ManualScheduler(start=time.time()))


def test_arguments() -> None:
    assert parse_age("7D") == 7 * 86400
    assert parse_age("2h") == 7200
    assert parse_age("1Y") == 365 * 86400
    assert parse_age("10") is None and parse_age("1d") is None and parse_age(5) is None
    assert parse_offset(None) == NEXT
    assert parse_offset(b"first") == FIRST
    assert parse_offset(7) == OffsetSpec("offset", 7)
    when = datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC)
    assert parse_offset(when) == OffsetSpec("timestamp", when.timestamp())
    assert parse_offset("30m", now=10_000.0) == OffsetSpec("timestamp", 10_000.0 - 1800)
    for bad in (-1, True, "soon", 1.5):
        with pytest.raises(PreconditionFailed):
            parse_offset(bad)


def test_declare_rules(vh: VirtualHost) -> None:
    with pytest.raises(PreconditionFailed, match="non-durable"):
        vh.declare_queue("a", None, durable=False, arguments={"x-queue-type": "stream"})
    with pytest.raises(PreconditionFailed, match="not supported by stream queues"):
        vh.declare_queue("b", None, durable=True, arguments={"x-queue-type": "stream", "x-max-priority": 3})
    with pytest.raises(PreconditionFailed, match="x-stream-max-segment-size-bytes"):
        stream(vh, "c", **{"x-stream-max-segment-size-bytes": 4_000_000_000})
    q = stream(vh, **{"x-max-age": "1h", "x-max-length-bytes": 100})
    assert (q.args.max_age, q.args.max_length_bytes) == (3600, 100)
    with pytest.raises(NotImplementedFeature):
        q.purge()


def test_each_reader_has_its_own_cursor(vh: VirtualHost) -> None:
    q = stream(vh)
    publish(q, 5)
    a, b = FakeSink(), FakeSink({"b": 2})
    read(q, FIRST, a, "a")
    cb = read(q, OffsetSpec("offset", 3), b, "b")
    assert offsets(a) == [0, 1, 2, 3, 4]
    assert offsets(b) == [3, 4]
    publish(q, 2, start=5)
    assert offsets(a) == [0, 1, 2, 3, 4, 5, 6]
    assert offsets(b) == [3, 4]  # out of credit
    b.credit["b"] = 5
    cb.channel.dispatch()
    assert offsets(b) == [3, 4, 5, 6]
    assert q.message_count == 7  # reading removes nothing


def test_start_positions(vh: VirtualHost) -> None:
    q = stream(vh)
    assert q.resolve(FIRST) == q.resolve(LAST) == q.resolve(NEXT) == 0
    publish(q, 4)
    assert (q.resolve(FIRST), q.resolve(LAST), q.resolve(NEXT)) == (0, 3, 4)
    assert q.resolve(OffsetSpec("offset", 99)) == 99  # waits for it, as in RabbitMQ
    q.entries[2].message.timestamp = q.entries[3].message.timestamp = time.time() + 50
    assert q.resolve(OffsetSpec("timestamp", time.time() + 10)) == 2
    assert q.resolve(OffsetSpec("timestamp", time.time() + 100)) == 4


def test_size_retention_keeps_the_newest_and_truncates_the_store(vh: VirtualHost) -> None:
    q = stream(vh, **{"x-max-length-bytes": 50})
    truncated: list[int] = []

    class Storage:
        def append(self, qm: Any) -> None: ...

        def truncate(self, first_kept: int) -> None:
            truncated.append(first_kept)

    q.storage = Storage()  # type: ignore[assignment]
    publish(q, 8)
    assert (q.first_offset, q.message_count, q.log_bytes) == (3, 5, 50)
    assert truncated == [1, 2, 3]
    publish(q, 1, size=500, start=8)  # bigger than the limit: it alone stays
    assert (q.first_offset, q.message_count) == (8, 1)
    sink = FakeSink()
    read(q, OffsetSpec("offset", 0), sink)
    assert offsets(sink) == [8]


def test_age_retention_runs_on_a_timer(vh: VirtualHost) -> None:
    clock = vh.scheduler
    assert isinstance(clock, ManualScheduler)
    q = stream(vh, **{"x-max-age": "10s"})
    publish(q, 3)
    clock.advance(6)
    later = Message("", "rk", properties.EMPTY, b"later")
    later.timestamp = clock.now()
    q.enqueue(later)
    clock.advance(4.5)
    assert q.message_count == 1 and q.first_offset == 3
    clock.advance(10)
    assert q.message_count == 0 and q.first_offset == q.next_offset == 4


def test_log_compaction_keeps_offsets(vh: VirtualHost) -> None:
    q = stream(vh, **{"x-max-length-bytes": 1000})
    publish(q, 10_000)
    assert len(q.entries) < 10_000  # compacted
    sink = FakeSink()
    read(q, OffsetSpec("offset", 9_950), sink)
    assert offsets(sink) == list(range(9_950, 10_000))


def test_group_commits_in_order_and_resumes(vh: VirtualHost) -> None:
    q = stream(vh)
    publish(q, 6)
    sink = FakeSink({"a": 4})
    c = read(q, FIRST, sink, "a", group="g")
    reader = c.channel
    delivered = [qm for _, qm in sink.delivered]
    reader.settle(delivered[1], c)
    assert "g" not in q.committed  # 0 is still out
    reader.settle(delivered[0], c)
    assert q.committed["g"] == 1
    reader.remove_consumer(c)  # 2 and 3 were never acked
    assert q.groups == {}
    sink2 = FakeSink()
    read(q, FIRST, sink2, "b", group="g")
    assert offsets(sink2) == [2, 3, 4, 5]


def test_group_has_one_active_member_and_hands_over(vh: VirtualHost) -> None:
    q = stream(vh)
    sink = FakeSink({"a": 2})
    a = read(q, FIRST, sink, "a", group="g")
    b = read(q, FIRST, sink, "b", group="g")
    assert a.channel is b.channel
    publish(q, 4)
    assert offsets(sink, "a") == [0, 1] and offsets(sink, "b") == []
    a.channel.settle(sink.delivered[0][1], a)
    a.channel.remove_consumer(a)
    assert offsets(sink, "b") == [1, 2, 3]


def test_partition_index_picks_the_active_member(vh: VirtualHost) -> None:
    q = stream(vh, "orders-1")
    assert q.partition == 1
    sink = FakeSink()
    read(q, FIRST, sink, "a", group="g")
    read(q, FIRST, sink, "b", group="g")
    publish(q, 2)
    assert offsets(sink, "b") == [0, 1] and offsets(sink, "a") == []


def test_delete_cancels_readers(vh: VirtualHost) -> None:
    q = stream(vh)
    sink = FakeSink()
    read(q, FIRST, sink, "a")
    read(q, FIRST, sink, "b", group="g")
    publish(q, 2)
    vh.delete_queue("s", None)
    assert sorted(sink.cancelled) == ["a", "b"]
    assert q.readers == [] and q.message_count == 0


@pytest.mark.parametrize(
    "props",
    [
        properties.EMPTY,
        properties.encode({"content_type": "text/plain", "content_encoding": "gzip", "priority": 3}),
        properties.encode({"headers": {"a": 1, "x-stream-offset": -5}, "message_id": "m", "delivery_mode": 2}),
        properties.encode({"content_type": "a/b", "headers": {}, "timestamp": 12}),
    ],
)
def test_offset_header_splice(props: bytes) -> None:
    spliced = with_stream_offset(props, properties.scan(props), 2**40)
    before, after = properties.decode(props), properties.decode(spliced)
    headers = after.pop("headers")
    assert headers["x-stream-offset"] == 2**40
    assert {k: v for k, v in headers.items() if k != "x-stream-offset"} == {
        k: v for k, v in before.pop("headers", {}).items() if k != "x-stream-offset"
    }
    assert after == before


# -- partitioned streams ---------------------------------------------------------------------------
async def test_partition_choice_is_stable_and_balanced(vh: VirtualHost) -> None:
    queues = await partition.declare(LocalCoordinator(), vh, "orders", 4, partition.stream_arguments())
    assert [q.name for q in queues] == ["orders-0", "orders-1", "orders-2", "orders-3"]
    x = partition.exchange_of(vh, "orders")
    assert x is not None
    first = {f"key-{i}": x.partition_of(f"key-{i}") for i in range(4000)}
    assert all(x.partition_of(k) == p for k, p in first.items())  # stable
    counts = [list(first.values()).count(p) for p in range(4)]
    assert all(850 <= c <= 1150 for c in counts), counts  # balanced over keys (expected 1000 each)
    assert [x.partition_of("") for _ in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]  # round robin without a key


async def test_partitioned_publish_keeps_order_per_partition(vh: VirtualHost) -> None:
    await partition.declare(LocalCoordinator(), vh, "p", 3, partition.stream_arguments())
    x = vh.get_exchange("p")
    for i in range(60):
        m = Message("p", f"k{i % 7}", properties.EMPTY, b"%d" % i)
        for q in vh.route(x, m):
            q.enqueue(m)
    per_key: dict[str, list[int]] = {}
    for q in partition.resolve(vh, "p"):
        bodies = [int(qm.message.body) for qm in q.entries]
        assert bodies == sorted(bodies)
        for qm in q.entries:
            per_key.setdefault(qm.message.routing_key, []).append(int(qm.message.body))
            assert partition.resolve(vh, "p")[x.partition_of(qm.message.routing_key)] is q  # type: ignore[attr-defined]
    assert sum(len(v) for v in per_key.values()) == 60


async def test_partitioned_stream_declaration_rules(vh: VirtualHost) -> None:
    local = LocalCoordinator()
    await partition.declare(local, vh, "p", 2, partition.stream_arguments(max_age="1h"))
    assert len(await partition.declare(local, vh, "p", 2, partition.stream_arguments(max_age="1h"))) == 2  # idempotent
    with pytest.raises(PreconditionFailed, match="already exists as 2 partitions"):
        await partition.declare(local, vh, "p", 3, partition.stream_arguments())
    with pytest.raises(PreconditionFailed, match="between 1 and"):
        await partition.declare(local, vh, "q", 0, partition.stream_arguments())
    with pytest.raises(PreconditionFailed, match="partition index"):
        vh.bind("p", vh.queues["p-0"], "zero", None)
    vh.declare_queue("classic", None)
    with pytest.raises(PreconditionFailed, match="not a stream"):
        partition.resolve(vh, "classic")
    assert await partition.remove(local, vh, "p") == 0
    assert "p" not in vh.exchanges and "p-0" not in vh.queues


# -- the log beyond memory: read back from the store -------------------------------------------------
async def _durable_broker(path: Path) -> tuple[Broker, GroupCommitter, SQLiteStore]:
    store = SQLiteStore(str(path))
    await store.open()
    committer = GroupCommitter(store)
    broker = Broker()
    await Durability(store, committer).restore(broker)
    return broker, committer, store


async def _wait_for(predicate: Any, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_old_offsets_are_read_back_from_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(StreamQueue, "memory_limit", 1000)
    monkeypatch.setattr("core.engine.stream.PAGE", 7)  # several pages per read
    broker, committer, store = await _durable_broker(tmp_path / "s.sqlite3")
    vh = broker.vhosts["/"]
    q = stream(vh, **{"x-max-length-bytes": 5000})
    publish(q, 100, size=100)
    await committer.drain()
    # Retention keeps the newest 5000 bytes (offsets 50..99); memory holds the newest 1000 of them.
    assert (q.message_count, q.first_offset, q.mem_first, q.mem_bytes, q.log_bytes) == (50, 50, 90, 1000, 5000)
    sink = FakeSink()
    c = read(q, FIRST, sink, group="g")
    await _wait_for(lambda: len(sink.delivered) == 50)
    assert offsets(sink) == list(range(50, 100))
    assert [qm.message.body[:2] for _, qm in sink.delivered[:2]] == [b"50", b"51"]
    for _, qm in sink.delivered[:30]:
        c.channel.settle(qm, c)
    # A timestamp inside the store-only part, and a reader that retention overtakes while it reads.
    assert q.resolve(OffsetSpec("timestamp", q.stored.stamps[q.stored.head + 3])) <= 53
    slow = FakeSink({"s": 5})
    cs = read(q, OffsetSpec("offset", 55), slow, "s")
    await _wait_for(lambda: len(slow.delivered) == 5)
    publish(q, 30, size=100, start=100)  # retention now keeps 80..129
    slow.credit["s"] = None
    cs.channel.dispatch()
    await _wait_for(lambda: offsets(slow)[-1] == 129)
    assert offsets(slow) == [55, 56, 57, 58, 59, *range(80, 130)]
    await committer.drain()
    await store.close()

    # After a restart only the newest part is loaded into memory; the group resumes after 79.
    broker2, committer2, store2 = await _durable_broker(tmp_path / "s.sqlite3")
    q2 = broker2.vhosts["/"].queues["s"]
    assert isinstance(q2, StreamQueue)
    assert (q2.first_offset, q2.next_offset, q2.mem_bytes) == (80, 130, 1000)
    assert q2.committed == {"g": 79}
    again = FakeSink()
    read(q2, FIRST, again, group="g")
    await _wait_for(lambda: len(again.delivered) == 50)
    assert offsets(again) == list(range(80, 130))
    await store2.close()


async def test_pages_are_bounded_by_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(StreamQueue, "memory_limit", 500)
    monkeypatch.setattr("core.engine.stream.PAGE_BYTES", 250)
    broker, committer, store = await _durable_broker(tmp_path / "s.sqlite3")
    q = stream(broker.vhosts["/"])
    publish(q, 40, size=100)
    await committer.drain()
    assert (q.mem_first, len(q.stored)) == (35, 35)
    assert q.page_limit(0) == 3  # 300 bytes reach the 250-byte budget
    assert q.page_limit(34) == 1
    loads: list[int] = []
    real = store.load_range

    async def counting(vhost: str, queue: str, start: int, below: int | None, limit: int) -> Any:
        loads.append(limit)
        return await real(vhost, queue, start, below, limit)

    monkeypatch.setattr(store, "load_range", counting)
    sink = FakeSink()
    read(q, FIRST, sink)
    await _wait_for(lambda: len(sink.delivered) == 40)
    assert offsets(sink) == list(range(40))
    assert max(loads) == 3 and len(loads) >= 12
    await store.close()


async def test_a_fenced_stream_stops_serving(tmp_path: Path) -> None:
    """Another owner claimed the stream: the next group-offset write fails whole and the stream is dropped here."""
    store = SQLiteStore(str(tmp_path / "s.sqlite3"))
    await store.open()
    broker = Broker()
    fenced: list[tuple[str, str]] = []

    def on_fenced(queues: list[tuple[str, str]]) -> None:
        fenced.extend(queues)
        for vhost, name in queues:
            broker.vhosts[vhost].abandon_queue(name)

    committer = GroupCommitter(store, on_fenced=on_fenced)
    await Durability(store, committer).restore(broker)
    q = stream(broker.vhosts["/"])
    publish(q, 3)
    sink = FakeSink()
    c = read(q, FIRST, sink, group="g")
    await committer.drain()
    await store.claim("/", "s")  # a new owner
    c.channel.settle(sink.delivered[0][1], c)  # commits offset 0: fenced
    await committer.drain()
    assert fenced == [("/", "s")]
    assert sink.cancelled == ["c"] and "s" not in broker.vhosts["/"].queues
    assert await store.load_offsets("/", "s") == {}
    await store.close()
