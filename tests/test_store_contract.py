"""The MessageStore contract (core/store.py), run against every backend.

``postgres`` runs PostgresStore on a fresh database of a throwaway server
(harness/pg.py); ``sqlite`` runs SQLiteStore on a file in tmp_path and is skipped
while persistence.sqlite does not import.
"""

from __future__ import annotations

import asyncio
import datetime
import decimal
import random
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from core.ports.store import (
    Batch,
    BindingRecord,
    ExchangeRecord,
    Fenced,
    MessageStore,
    QueueRecord,
    StoredMessage,
    StoreError,
    Topology,
    TopologyWrite,
)
from harness.ports import free_port

StoreFactory = Callable[[], MessageStore]

VHOST = "/"
UTC = datetime.UTC


# -- fixtures --------------------------------------------------------------------------


@pytest.fixture(params=["postgres", "sqlite"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_store(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> StoreFactory:
    """Builds unopened stores that all point at the same (fresh) location."""
    if backend == "postgres":
        dsn = request.getfixturevalue("postgres_db")
        from persistence.postgres import PostgresStore

        return lambda: PostgresStore(dsn)
    try:
        from persistence.sqlite import SQLiteStore
    except ImportError as exc:
        pytest.skip(f"persistence.sqlite does not import yet: {exc}")
    path = str(tmp_path / "store" / "leveret.db")
    return lambda: SQLiteStore(path)


class Opened:
    """Opens stores for a test and closes whatever is still open at the end."""

    def __init__(self, make_store: StoreFactory) -> None:
        self.make_store = make_store
        self.open: list[MessageStore] = []

    async def __call__(self) -> MessageStore:
        store = self.make_store()
        await store.open()
        self.open.append(store)
        return store

    async def close(self, store: MessageStore) -> None:
        self.open.remove(store)
        await store.close()

    async def close_all(self) -> None:
        while self.open:
            await self.close(self.open[-1])


@pytest.fixture
async def opened(make_store: StoreFactory) -> AsyncIterator[Opened]:
    manager = Opened(make_store)
    try:
        yield manager
    finally:
        await manager.close_all()


@pytest.fixture
async def store(opened: Opened) -> MessageStore:
    return await opened()


# -- helpers ---------------------------------------------------------------------------


def message(
    queue: str,
    offset: int,
    *,
    vhost: str = VHOST,
    body: bytes | None = None,
    expires_at: float | None = None,
    delivery_count: int = 0,
) -> StoredMessage:
    return StoredMessage(
        vhost=vhost,
        queue=queue,
        offset=offset,
        message_id=f"msg-{queue}-{offset}",
        exchange="amq.direct",
        routing_key=f"key.{offset}",
        properties=b"\x80\x00" + offset.to_bytes(4, "big") + b"\x02",
        body=body if body is not None else f"body {offset}".encode(),
        enqueued_at=1_700_000_000.123456 + offset,
        expires_at=expires_at,
        delivery_count=delivery_count,
    )


async def claimed(store: MessageStore, *queues: str, vhost: str = VHOST) -> dict[tuple[str, str], int]:
    """Claim each queue (single-node style) and return the epochs a writer would carry."""
    return {(vhost, q): await store.claim(vhost, q) for q in queues}


async def offsets(store: MessageStore, queue: str, vhost: str = VHOST) -> list[int]:
    return [m.offset for m in await store.load_messages(vhost, queue)]


def sort_topology(t: Topology) -> Topology:
    return Topology(
        exchanges=sorted(t.exchanges, key=lambda r: (r.vhost, r.name)),
        queues=sorted(t.queues, key=lambda r: (r.vhost, r.name)),
        bindings=sorted(
            t.bindings,
            key=lambda r: (r.vhost, r.source, r.destination_kind, r.destination, r.routing_key, repr(r.arguments)),
        ),
    )



# Arguments of many AMQP types, including nested tables and arrays.
RICH_ARGUMENTS: dict[str, Any] = {
    "x-max-length": 10,
    "x-message-ttl": 60_000,
    "x-big": 2**40,
    "x-negative": -5,
    "x-queue-mode": "lazy",
    "x-dead-letter-exchange": "dlx",
    "flag": True,
    "off": False,
    "ratio": 0.25,
    "price": decimal.Decimal("12.34"),
    "when": datetime.datetime(2024, 5, 17, 12, 30, 0, tzinfo=UTC),
    "raw": bytearray(b"\x00\xff\x10"),
    "nothing": None,
    "nested": {"a": 1, "b": "two", "c": False, "deeper": {"list": [1, "x", True, {"k": "v"}]}},
    "list": [1, 2, 3],
    "unicode": "héllo ✓",
}


# -- open and migrations ---------------------------------------------------------------


async def test_open_twice_applies_migrations_once(opened: Opened) -> None:
    first = await opened()
    assert "password" not in first.description
    await first.save_queue(QueueRecord(VHOST, "kept"))
    await opened.close(first)

    second = await opened()  # migrations already applied: a no-op
    third = await opened()  # and a second store on the same location at the same time
    assert [q.name for q in (await second.load_topology()).queues] == ["kept"]
    assert [q.name for q in (await third.load_topology()).queues] == ["kept"]


async def test_concurrent_first_open_postgres(backend: str, opened: Opened) -> None:
    """Several nodes starting together on an empty database apply each migration once."""
    if backend != "postgres":
        pytest.skip("several processes opening one store at once is a cluster (postgres) concern")
    stores = await asyncio.gather(*(opened() for _ in range(4)))
    await stores[0].save_queue(QueueRecord(VHOST, "q"))
    assert [q.name for q in (await stores[3].load_topology()).queues] == ["q"]


async def test_runtime_parameters_round_trip_upsert_delete_and_reopen(opened: Opened) -> None:
    store = await opened()
    assert await store.load_parameters() == []
    shovel = {"src-uri": "amqp://", "src-queue": "a", "dest-uri": ["amqp://h1", "amqp://h2"], "src-delete-after": 5}
    await store.save_parameter(VHOST, "shovel", "s1", shovel)
    await store.save_parameter(VHOST, "other", "x", "a string")
    await store.save_parameter(VHOST, "shovel", "s1", {**shovel, "src-queue": "b"})  # an upsert
    await opened.close(store)
    store = await opened()
    assert await store.load_parameters() == [(VHOST, "other", "x", "a string"),
                                             (VHOST, "shovel", "s1", {**shovel, "src-queue": "b"})]
    assert await store.delete_parameter(VHOST, "shovel", "s1")
    assert not await store.delete_parameter(VHOST, "shovel", "s1")
    assert await store.load_parameters() == [(VHOST, "other", "x", "a string")]


# -- topology ------------------------------------------------------------------------------


async def test_topology_round_trip(opened: Opened) -> None:
    store = await opened()
    assert await store.load_topology() == Topology()
    exchanges = [
        ExchangeRecord(VHOST, "events", "topic", auto_delete=False, internal=False, arguments={}),
        ExchangeRecord(VHOST, "internal", "fanout", auto_delete=True, internal=True, arguments=RICH_ARGUMENTS),
        ExchangeRecord("other", "events", "headers", arguments={"alternate-exchange": "ae"}),
    ]
    queues = [
        QueueRecord(VHOST, "orders", auto_delete=False, arguments=RICH_ARGUMENTS),
        QueueRecord(VHOST, "tmp", auto_delete=True),
        QueueRecord("other", "orders"),
    ]
    bindings = [
        BindingRecord(VHOST, "events", "queue", "orders", "order.*"),
        BindingRecord(VHOST, "events", "exchange", "internal", "#"),
        # two bindings that differ only in their arguments (a headers exchange) are two bindings
        BindingRecord("other", "events", "queue", "orders", "", {"x-match": "all", "kind": "a"}),
        BindingRecord("other", "events", "queue", "orders", "", {"x-match": "any", "kind": "b", "n": 3}),
    ]
    for e in exchanges:
        await store.save_exchange(e)
    for q in queues:
        await store.save_queue(q)
    for b in bindings:
        await store.save_binding(b)
        await store.save_binding(b)  # saving twice stores it once
    expected = sort_topology(Topology(exchanges, queues, bindings))
    assert sort_topology(await store.load_topology()) == expected

    await opened.close(store)
    store = await opened()
    loaded = sort_topology(await store.load_topology())
    assert loaded == expected
    args = next(q for q in loaded.queues if q.name == "orders" and q.vhost == VHOST).arguments
    # AMQP types survive, not just equal values: bool stays bool, bytearray stays a byte array
    assert args["flag"] is True and args["off"] is False
    assert type(args["x-max-length"]) is int
    assert type(args["raw"]) is bytearray
    assert type(args["price"]) is decimal.Decimal
    assert args["nested"]["deeper"]["list"][2] is True


async def test_save_is_an_upsert(store: MessageStore) -> None:
    await store.save_exchange(ExchangeRecord(VHOST, "x", "direct"))
    await store.save_exchange(ExchangeRecord(VHOST, "x", "topic", auto_delete=True, arguments={"a": 1}))
    await store.save_queue(QueueRecord(VHOST, "q"))
    await store.save_queue(QueueRecord(VHOST, "q", auto_delete=True, arguments={"x-max-length": 5}))
    topology = await store.load_topology()
    assert topology.exchanges == [ExchangeRecord(VHOST, "x", "topic", auto_delete=True, arguments={"a": 1})]
    assert topology.queues == [QueueRecord(VHOST, "q", auto_delete=True, arguments={"x-max-length": 5})]


async def test_delete_binding_removes_only_that_binding(store: MessageStore) -> None:
    a = BindingRecord(VHOST, "hdr", "queue", "q", "", {"x-match": "all", "k": "a"})
    b = BindingRecord(VHOST, "hdr", "queue", "q", "", {"x-match": "all", "k": "b"})
    c = BindingRecord(VHOST, "hdr", "queue", "q", "other")
    for r in (a, b, c):
        await store.save_binding(r)
    await store.delete_binding(a)
    await store.delete_binding(BindingRecord(VHOST, "hdr", "queue", "q", "missing"))  # absent: no error
    assert sort_topology(await store.load_topology()).bindings == sort_topology(Topology(bindings=[b, c])).bindings


async def test_delete_queue_removes_its_bindings_messages_and_epoch(store: MessageStore) -> None:
    await store.save_exchange(ExchangeRecord(VHOST, "x", "direct"))
    for name in ("doomed", "kept"):
        await store.save_queue(QueueRecord(VHOST, name))
        await store.save_binding(BindingRecord(VHOST, "x", "queue", name, name))
    epochs = await claimed(store, "doomed", "kept")
    await store.commit(Batch(epochs=epochs, appends=[message("doomed", 1), message("doomed", 2), message("kept", 1)]))

    await store.delete_queue(VHOST, "doomed")

    topology = await store.load_topology()
    assert [q.name for q in topology.queues] == ["kept"]
    assert [b.destination for b in topology.bindings] == ["kept"]
    assert [e.name for e in topology.exchanges] == ["x"]
    assert await store.load_messages(VHOST, "doomed") == []
    assert await offsets(store, "kept") == [1]
    # the epoch row went too: the old owner's writes are refused, a new claim starts over
    with pytest.raises(Fenced):
        await store.commit(Batch(epochs={(VHOST, "doomed"): epochs[(VHOST, "doomed")]}, appends=[message("doomed", 3)]))
    assert await store.load_messages(VHOST, "doomed") == []
    assert await store.claim(VHOST, "doomed") == 1


async def test_delete_exchange_removes_bindings_from_and_to_it(store: MessageStore) -> None:
    for name in ("x", "upstream", "downstream", "unrelated"):
        await store.save_exchange(ExchangeRecord(VHOST, name, "topic"))
    await store.save_queue(QueueRecord(VHOST, "q"))
    keep = [
        BindingRecord(VHOST, "unrelated", "queue", "q", "k"),
        BindingRecord(VHOST, "upstream", "exchange", "downstream", "k"),
        BindingRecord("other", "x", "queue", "q", "k"),  # same names in another vhost
    ]
    drop = [
        BindingRecord(VHOST, "x", "queue", "q", "k"),
        BindingRecord(VHOST, "x", "exchange", "downstream", "k"),
        BindingRecord(VHOST, "upstream", "exchange", "x", "k"),
    ]
    for b in keep + drop:
        await store.save_binding(b)

    await store.delete_exchange(VHOST, "x")

    topology = sort_topology(await store.load_topology())
    assert sorted(e.name for e in topology.exchanges) == ["downstream", "unrelated", "upstream"]
    assert topology.bindings == sort_topology(Topology(bindings=keep)).bindings
    assert [q.name for q in topology.queues] == ["q"]


# -- claims ----------------------------------------------------------------------------------


async def test_claim_without_epoch_counts_up_across_reopen(opened: Opened) -> None:
    store = await opened()
    assert await store.claim(VHOST, "q") == 1
    await opened.close(store)
    store = await opened()
    assert await store.claim(VHOST, "q") == 2
    assert await store.claim(VHOST, "q") == 3
    assert await store.claim(VHOST, "other") == 1  # per queue
    assert await store.claim("vh2", "q") == 1  # per vhost


async def test_claim_with_epoch(store: MessageStore) -> None:
    assert await store.claim(VHOST, "q", 10) == 10  # no row yet: created at that epoch
    assert await store.claim(VHOST, "q", 10) == 10  # the same epoch again: idempotent
    assert await store.claim(VHOST, "q", 12) == 12  # newer: moves
    with pytest.raises(Fenced) as info:
        await store.claim(VHOST, "q", 11)  # older: refused
    assert info.value.queues == [(VHOST, "q")]
    # the refused claim changed nothing: epoch 12 still writes, 10 does not
    await store.commit(Batch(epochs={(VHOST, "q"): 12}, appends=[message("q", 1)]))
    with pytest.raises(Fenced):
        await store.commit(Batch(epochs={(VHOST, "q"): 10}, appends=[message("q", 2)]))
    assert await offsets(store, "q") == [1]
    assert await store.claim(VHOST, "q") == 13  # single-node bump continues from there


# -- commits ----------------------------------------------------------------------------------


async def test_appends_load_in_offset_order_with_every_field(opened: Opened) -> None:
    store = await opened()
    epochs = await claimed(store, "q", "other")
    messages = [
        message("q", 1, body=b""),
        message("q", 2, body=b"\xff\xfe\x00\x80 not utf-8 \xc3\x28", expires_at=1_700_000_500.5),
        message("q", 3, body=bytes(range(256)) * 1200, delivery_count=2),  # ~300 KiB
        message("q", 10, body="unicode ✓ text".encode()),
    ]
    messages[0].properties = b""
    messages[1].message_id = "id-✓-ünïcode"
    messages[1].routing_key = ""
    messages[1].exchange = ""
    shuffled = messages[:]
    random.Random(7).shuffle(shuffled)
    await store.commit(Batch(epochs=epochs, appends=[*shuffled, message("other", 1)]))

    assert await store.load_messages(VHOST, "q") == messages
    await opened.close(store)
    store = await opened()
    loaded = await store.load_messages(VHOST, "q")
    assert loaded == messages
    assert all(type(m.body) is bytes and type(m.properties) is bytes for m in loaded)
    assert loaded[0].expires_at is None and loaded[1].expires_at == 1_700_000_500.5
    assert await offsets(store, "other") == [1]
    assert await store.load_messages(VHOST, "never") == []


async def test_removals(store: MessageStore) -> None:
    epochs = await claimed(store, "q", "other")
    await store.commit(Batch(epochs=epochs, appends=[message("q", i) for i in range(1, 6)] + [message("other", 2)]))
    await store.commit(
        Batch(
            epochs=epochs,
            removals=[(VHOST, "q", 2), (VHOST, "q", 4), (VHOST, "q", 99)],  # 99 does not exist: ignored
        )
    )
    assert await offsets(store, "q") == [1, 3, 5]
    assert await offsets(store, "other") == [2]  # same offset numbers in another queue are untouched


async def test_delivery_counts(store: MessageStore) -> None:
    epochs = await claimed(store, "q")
    await store.commit(Batch(epochs=epochs, appends=[message("q", i) for i in range(1, 4)]))
    await store.commit(Batch(epochs=epochs, delivery_counts=[(VHOST, "q", 1, 1), (VHOST, "q", 3, 4)]))
    await store.commit(Batch(epochs=epochs, delivery_counts=[(VHOST, "q", 3, 5), (VHOST, "q", 42, 1)]))
    assert [m.delivery_count for m in await store.load_messages(VHOST, "q")] == [1, 0, 5]


async def test_purges(store: MessageStore) -> None:
    epochs = await claimed(store, "q", "other")
    epochs.update(await claimed(store, "q", vhost="vh2"))
    await store.commit(
        Batch(
            epochs=epochs,
            appends=[message("q", i) for i in range(1, 4)] + [message("other", 1), message("q", 1, vhost="vh2")],
        )
    )
    await store.commit(Batch(epochs={(VHOST, "q"): epochs[(VHOST, "q")]}, purges=[(VHOST, "q")]))
    assert await store.load_messages(VHOST, "q") == []
    assert await offsets(store, "other") == [1]
    assert await offsets(store, "q", vhost="vh2") == [1]
    # the queue goes on after a purge
    await store.commit(Batch(epochs=epochs, appends=[message("q", 4)]))
    assert await offsets(store, "q") == [4]


async def test_append_and_remove_in_one_batch(store: MessageStore) -> None:
    """Published and settled within one group commit: never stored."""
    epochs = await claimed(store, "q")
    await store.commit(
        Batch(
            epochs=epochs,
            appends=[message("q", 1), message("q", 2)],
            removals=[(VHOST, "q", 1)],
            delivery_counts=[(VHOST, "q", 2, 1)],
        )
    )
    loaded = await store.load_messages(VHOST, "q")
    assert [(m.offset, m.delivery_count) for m in loaded] == [(2, 1)]


async def test_retried_batch_is_idempotent(store: MessageStore) -> None:
    """A batch committed again (the caller did not learn the first outcome) succeeds and stores nothing twice."""
    epochs = await claimed(store, "q")
    await store.commit(Batch(epochs=epochs, appends=[message("q", 1)]))
    batch = Batch(epochs=epochs, appends=[message("q", 2), message("q", 3)], removals=[(VHOST, "q", 1)])
    await store.commit(batch)
    await store.commit(batch)
    assert await store.load_messages(VHOST, "q") == [message("q", 2), message("q", 3)]


async def test_fenced_batch_writes_nothing(store: MessageStore) -> None:
    epochs = await claimed(store, "moved", "stays")
    await store.commit(Batch(epochs=epochs, appends=[message("moved", 1), message("stays", 1), message("stays", 2)]))
    before_moved = await store.load_messages(VHOST, "moved")
    before_stays = await store.load_messages(VHOST, "stays")

    assert await store.claim(VHOST, "moved") == epochs[(VHOST, "moved")] + 1  # another owner took it

    batch = Batch(
        epochs=epochs,  # "moved" with its old epoch, "stays" with its current one
        appends=[message("moved", 2), message("stays", 3)],
        removals=[(VHOST, "stays", 1), (VHOST, "moved", 1)],
        delivery_counts=[(VHOST, "stays", 2, 7)],
        purges=[(VHOST, "stays")],
    )
    with pytest.raises(Fenced) as info:
        await store.commit(batch)
    assert info.value.queues == [(VHOST, "moved")]
    assert isinstance(info.value, StoreError)
    assert await store.load_messages(VHOST, "moved") == before_moved
    assert await store.load_messages(VHOST, "stays") == before_stays  # nothing of the batch, for any queue

    # the queue that is still ours writes fine on its own
    await store.commit(Batch(epochs={(VHOST, "stays"): epochs[(VHOST, "stays")]}, appends=[message("stays", 3)]))
    assert await offsets(store, "stays") == [1, 2, 3]


async def test_fenced_names_every_stale_queue(store: MessageStore) -> None:
    epochs = await claimed(store, "a", "b", "c")
    await store.claim(VHOST, "a")
    await store.claim(VHOST, "c", epochs[(VHOST, "c")] + 5)
    epochs[(VHOST, "never-claimed")] = 1  # no epoch row at all: fenced too
    with pytest.raises(Fenced) as info:
        await store.commit(Batch(epochs=epochs, appends=[message("b", 1)]))
    assert sorted(info.value.queues) == [(VHOST, "a"), (VHOST, "c"), (VHOST, "never-claimed")]
    assert await store.load_messages(VHOST, "b") == []


async def test_large_batch(store: MessageStore, capsys: pytest.CaptureFixture[str]) -> None:
    epochs = await claimed(store, "big")
    n = 10_000
    body = bytes(range(256))
    appends = [message("big", i, body=body, expires_at=None if i % 2 else 1e9 + i) for i in range(n)]
    t0 = time.perf_counter()
    await store.commit(Batch(epochs=epochs, appends=appends))
    t_append = time.perf_counter() - t0
    t0 = time.perf_counter()
    loaded = await store.load_messages(VHOST, "big")
    t_load = time.perf_counter() - t0
    assert len(loaded) == n and loaded[0] == appends[0] and loaded[-1] == appends[-1]
    assert [m.offset for m in loaded] == list(range(n))
    t0 = time.perf_counter()
    await store.commit(Batch(epochs=epochs, removals=[(VHOST, "big", i) for i in range(0, n, 2)]))
    t_remove = time.perf_counter() - t0
    assert len(await store.load_messages(VHOST, "big")) == n // 2
    with capsys.disabled():
        print(
            f"\n[{store.description.split()[0]}] {n} appends of 256 B: commit {t_append * 1000:.0f} ms,"
            f" load {t_load * 1000:.0f} ms, {n // 2} removals: commit {t_remove * 1000:.0f} ms"
        )


# -- failures ------------------------------------------------------------------------------


async def test_unreachable_store_raises_store_error(backend: str, tmp_path: Path) -> None:
    if backend == "postgres":
        from persistence.postgres import PostgresStore

        port = free_port()  # nothing listens there
        secret = "s3cr3t-Pa55"
        for dsn in (
            f"postgresql://leveret:{secret}@127.0.0.1:{port}/leveret?connect_timeout=2",
            f"host=127.0.0.1 port={port} user=leveret password={secret} dbname=leveret connect_timeout=2",
        ):
            store: MessageStore = PostgresStore(dsn)
            assert secret not in store.description
            t0 = time.monotonic()
            with pytest.raises(StoreError) as info:
                await store.open()
            assert time.monotonic() - t0 < 15, "an unreachable server must fail fast, not hang"
            text = str(info.value)
            assert "127.0.0.1" in text and str(port) in text, text
            assert secret not in text and secret not in repr(info.value)
            await store.close()
    else:
        from persistence.sqlite import SQLiteStore

        blocker = tmp_path / "a-file"
        blocker.write_text("not a directory")
        path = str(blocker / "leveret.db")
        store = SQLiteStore(path)
        with pytest.raises(StoreError) as info:
            await store.open()
        assert path in str(info.value)
        await store.close()


# -- postgres only -----------------------------------------------------------------------------


async def test_postgres_unresponsive_server_times_out() -> None:
    """A server that accepts TCP but never answers: open() gives up after the connect timeout."""
    from persistence.postgres import PostgresStore

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)  # the kernel completes handshakes; nobody ever reads
        port = listener.getsockname()[1]
        store = PostgresStore(f"postgresql://u:pw-xyz@127.0.0.1:{port}/db?connect_timeout=2")
        t0 = time.monotonic()
        with pytest.raises(StoreError) as info:
            await store.open()
        elapsed = time.monotonic() - t0
    assert elapsed < 15, elapsed
    assert str(port) in str(info.value) and "pw-xyz" not in str(info.value)


async def test_postgres_lost_connections_become_store_errors(postgres_db: str) -> None:
    import psycopg

    from persistence.postgres import PostgresStore

    store = PostgresStore(postgres_db, pool_size=1)
    await store.open()
    try:
        epochs = await claimed(store, "q")
        with psycopg.connect(postgres_db, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        with pytest.raises(StoreError) as info:
            await store.commit(Batch(epochs=epochs, appends=[message("q", 1)]))
        assert not isinstance(info.value, Fenced)
        assert "postgres" in str(info.value)
        # the pool replaces the broken connection; the retry goes through
        await store.commit(Batch(epochs=epochs, appends=[message("q", 1)]))
        assert await offsets(store, "q") == [1]
    finally:
        await store.close()


async def test_postgres_batch_must_name_the_epoch_of_every_queue_it_writes(postgres_db: str) -> None:
    from persistence.postgres import PostgresStore

    store = PostgresStore(postgres_db)
    await store.open()
    try:
        epochs = await claimed(store, "a")
        with pytest.raises(ValueError, match="/b"):
            await store.commit(Batch(epochs=epochs, appends=[message("a", 1), message("b", 1)]))
        assert await store.load_messages(VHOST, "a") == []
    finally:
        await store.close()


async def test_postgres_connections_fail_when_the_server_stops_answering(postgres_db: str) -> None:
    """libpq's TCP timeouts are set unless the DSN sets them (a silent server fails the commit: nacks)."""
    from persistence.postgres import PostgresStore

    for dsn, expected in ((postgres_db, "10000"), (postgres_db + " tcp_user_timeout=2500", "2500")):
        store = PostgresStore(dsn)
        await store.open()
        try:
            async with store._connection() as conn:
                params = conn.info.get_parameters()
            assert params["tcp_user_timeout"] == expected and params["keepalives_idle"] == "5"
        finally:
            await store.close()


async def test_postgres_schema_matches_the_spec(postgres_db: str) -> None:
    """The column names the SQLite schema mirrors and the Spark jobs read."""
    import psycopg

    from persistence.postgres import PostgresStore

    store = PostgresStore(postgres_db)
    await store.open()
    await store.close()
    with psycopg.connect(postgres_db) as conn:
        rows = conn.execute(
            "SELECT table_name, column_name FROM information_schema.columns"
            " WHERE table_schema = 'public' ORDER BY table_name, ordinal_position"
        ).fetchall()
        versions = conn.execute("SELECT version FROM schema_migrations").fetchall()
        indexes = conn.execute("SELECT indexdef FROM pg_indexes WHERE tablename = 'messages'").fetchall()
    columns: dict[str, list[str]] = {}
    for table, column in rows:
        columns.setdefault(table, []).append(column)
    expected = {
        "vhosts": ["name"],
        "exchanges": ["vhost", "name", "type", "auto_delete", "internal", "arguments"],
        "queues": ["vhost", "name", "auto_delete", "arguments"],
        "bindings": ["vhost", "source", "destination_kind", "destination", "routing_key", "arguments",
                     "arguments_key"],
        "queue_epochs": ["vhost", "queue", "epoch"],
        "messages": ["vhost", "queue", "offset", "message_id", "exchange", "routing_key", "properties", "body",
                     "enqueued_at", "expires_at", "size", "delivery_count", "state"],
        "schema_migrations": ["version", "applied_at"],
    }  # fmt: skip
    # Later migrations may add tables; these must stay as the retention jobs read them.
    assert {table: columns.get(table) for table in expected} == expected
    migrations_dir = Path(__file__).resolve().parent.parent / "persistence" / "migrations" / "postgres"
    assert [v for (v,) in versions] == sorted(int(p.name.split("_")[0]) for p in migrations_dir.glob("*.sql"))
    assert any("(enqueued_at)" in d for (d,) in indexes)


@pytest.mark.parametrize(
    ("dsn", "expected"),
    [
        ("postgresql://user:secret@db.example:5433/leveret", "postgresql://user@db.example:5433/leveret"),
        ("postgres://user:p%40ss@h/db?sslmode=require&password=secret", "postgres://user@h/db?sslmode=require"),
        ("postgresql://user:se@cr/et@h1:5432,h2:5433/db", "postgresql://user@h1:5432,h2:5433/db"),
        ("postgresql://:secret@h/db", "postgresql://h/db"),
        ("postgresql://user@h/db", "postgresql://user@h/db"),
        ("postgresql:///db?host=/tmp/sock", "postgresql:///db?host=/tmp/sock"),
        ("host=h port=5 password=secret dbname=db", "host=h port=5 dbname=db"),
        ("password='a secret with spaces' host=h", "host=h"),
        ("host=h password = 'it\\'s secret' user=u", "host=h user=u"),
    ],
)
def test_redact_dsn(dsn: str, expected: str) -> None:
    from persistence.postgres import redact_dsn

    assert redact_dsn(dsn) == expected


# -- streams: retention range deletes and consumer-group offsets --------------------------------


async def test_stream_truncations_and_group_offsets(opened: Opened) -> None:
    store = await opened()
    epochs = await claimed(store, "s", "other")
    await store.commit(Batch(epochs=epochs, appends=[message("s", i) for i in range(10)] + [message("other", 1)]))
    await store.commit(
        Batch(epochs=epochs, truncations=[(VHOST, "s", 3), (VHOST, "s", 4)], offsets={(VHOST, "s", "g1"): 3})
    )
    assert await offsets(store, "s") == list(range(4, 10))
    assert await offsets(store, "other") == [1]
    # A later commit moves an offset (upsert) and adds another group; an append and a
    # truncation above it in one batch leave nothing below the kept offset.
    await store.commit(
        Batch(
            epochs=epochs,
            appends=[message("s", 10)],
            truncations=[(VHOST, "s", 10)],
            offsets={(VHOST, "s", "g1"): 5, (VHOST, "s", "g2"): 0},
        )
    )
    assert await offsets(store, "s") == [10]
    assert await store.load_offsets(VHOST, "s") == {"g1": 5, "g2": 0}
    assert await store.load_offsets(VHOST, "other") == {}
    store = await opened()  # survives a reopen
    assert await store.load_offsets(VHOST, "s") == {"g1": 5, "g2": 0}
    await store.delete_queue(VHOST, "s")
    assert await store.load_offsets(VHOST, "s") == {}


async def test_fenced_batch_writes_no_group_offset(store: MessageStore) -> None:
    epochs = await claimed(store, "s")
    await store.commit(Batch(epochs=epochs, appends=[message("s", i) for i in range(3)],
                             offsets={(VHOST, "s", "g"): 0}))
    await store.claim(VHOST, "s")  # a new owner
    with pytest.raises(Fenced):
        await store.commit(Batch(epochs=epochs, truncations=[(VHOST, "s", 2)], offsets={(VHOST, "s", "g"): 2}))
    assert await offsets(store, "s") == [0, 1, 2]
    assert await store.load_offsets(VHOST, "s") == {"g": 0}


async def test_load_range_pages_in_offset_order(store: MessageStore) -> None:
    epochs = await claimed(store, "s", "other")
    await store.commit(Batch(epochs=epochs, appends=[message("s", i) for i in (3, 1, 2, 5, 8, 9)]
                             + [message("other", 4)]))
    assert [m.offset for m in await store.load_range(VHOST, "s", 0, None, 100)] == [1, 2, 3, 5, 8, 9]
    assert [m.offset for m in await store.load_range(VHOST, "s", 2, 9, 100)] == [2, 3, 5, 8]
    page = await store.load_range(VHOST, "s", 2, None, 2)
    assert page == [message("s", 2), message("s", 3)]  # every field, as stored
    assert await store.load_range(VHOST, "s", 10, None, 5) == []
async def test_large_bodies_split_over_connections_commit_whole(store: MessageStore) -> None:
    """Postgres commits a batch of large bodies as parallel parts; the outcome is that of one batch."""
    epochs = await claimed(store, "big")
    await store.commit(Batch(epochs=epochs, appends=[message("big", 0)]))
    mib = b"\xab" * (1 << 20)
    batch = Batch(
        epochs=epochs,
        appends=[message("big", off, body=mib) for off in range(1, 7)],
        removals=[(VHOST, "big", 0)],
        delivery_counts=[(VHOST, "big", 3, 2)],  # a requeue of a message appended in this same batch
    )
    await store.commit(batch)
    loaded = await store.load_messages(VHOST, "big")
    assert [m.offset for m in loaded] == [1, 2, 3, 4, 5, 6]
    assert all(m.body == mib for m in loaded)
    assert [m.delivery_count for m in loaded] == [0, 0, 2, 0, 0, 0]

    await store.claim(VHOST, "big")  # a new owner: every part must refuse
    with pytest.raises(Fenced):
        await store.commit(Batch(epochs=epochs, appends=[message("big", off, body=mib) for off in range(7, 13)]))
    assert await offsets(store, "big") == [1, 2, 3, 4, 5, 6]


# -- topology in a batch (the group committer's declarations) ------------------------------------------


async def test_batch_applies_topology_claims_then_messages_in_one_transaction(store: MessageStore) -> None:
    batch = Batch(
        topology=[
            TopologyWrite(ExchangeRecord(VHOST, "x", "direct")),
            TopologyWrite(QueueRecord(VHOST, "q", False, {"x-max-length": 10})),
            TopologyWrite(QueueRecord(VHOST, "gone")),
            TopologyWrite(BindingRecord(VHOST, "x", "queue", "q", "rk", {})),
            TopologyWrite(BindingRecord(VHOST, "x", "queue", "gone", "rk", {})),
            TopologyWrite(QueueRecord(VHOST, "gone"), delete=True),  # takes its binding with it
        ],
        claims=[(VHOST, "q")],
        appends=[message("q", 0)],  # no epoch given: the batch claims the queue itself
    )
    await store.commit(batch)
    assert batch.claimed == {(VHOST, "q"): 1}
    topo = await store.load_topology()
    assert [(x.name, x.type) for x in topo.exchanges] == [("x", "direct")]
    assert [(q.name, q.arguments) for q in topo.queues] == [("q", {"x-max-length": 10})]
    assert [(b.source, b.destination, b.routing_key) for b in topo.bindings] == [("x", "q", "rk")]
    assert [m.offset for m in await store.load_messages(VHOST, "q")] == [0]
    # The claimed epoch fences later writes like any claim.
    await store.commit(Batch(epochs={(VHOST, "q"): 1}, appends=[message("q", 1)]))
    with pytest.raises(Fenced):
        await store.commit(Batch(epochs={(VHOST, "q"): 0}, appends=[message("q", 2)]))
    later = Batch(topology=[TopologyWrite(BindingRecord(VHOST, "x", "queue", "q", "rk", {}), delete=True),
                            TopologyWrite(ExchangeRecord(VHOST, "x", ""), delete=True)],
                  claims=[(VHOST, "q")])
    await store.commit(later)
    assert later.claimed == {(VHOST, "q"): 2}
    topo = await store.load_topology()
    assert topo.exchanges == [] and topo.bindings == [] and [q.name for q in topo.queues] == ["q"]


async def test_a_failing_batch_leaves_no_topology_behind(store: MessageStore) -> None:
    await store.save_queue(QueueRecord(VHOST, "q"))
    epoch = await store.claim(VHOST, "q")
    batch = Batch(topology=[TopologyWrite(QueueRecord(VHOST, "new"))], claims=[(VHOST, "new")],
                  epochs={(VHOST, "q"): epoch + 1}, appends=[message("q", 0)])  # a stale epoch: fenced
    with pytest.raises(Fenced):
        await store.commit(batch)
    assert [q.name for q in (await store.load_topology()).queues] == ["q"]
