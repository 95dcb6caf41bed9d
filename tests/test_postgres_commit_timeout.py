"""A Postgres that accepts TCP but never answers: the store's commit fails in time, then recovers.

Through bench/chaos_proxy.py's blackhole (bytes held, every segment ACKed, no
reset), against a throwaway server (harness/pg.py): libpq's tcp_user_timeout and
keepalives never fire there, so before the commit timeout a commit (and every
publish confirm behind it) waited for the whole outage.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from bench.chaos_proxy import Proxy
from core.ports.store import Batch, StoredMessage, StoreError
from persistence import postgres
from persistence.postgres import PostgresStore

VHOST = "/"
TIMEOUT = 1.0


def message(offset: int) -> StoredMessage:
    return StoredMessage(vhost=VHOST, queue="q", offset=offset, message_id=f"m{offset}", exchange="",
                         routing_key="q", properties=b"\x00\x00", body=b"body", enqueued_at=1_700_000_000.0,
                         expires_at=None, delivery_count=0)


@pytest.fixture
async def proxied(postgres_db: str) -> AsyncIterator[tuple[Proxy, str]]:
    proxy = Proxy("pg", int(conninfo_to_dict(postgres_db).get("port") or 5432))
    await proxy.start()
    try:
        yield proxy, make_conninfo(postgres_db, host="127.0.0.1", port=str(proxy.port))
    finally:
        await proxy.close()


async def test_commit_to_a_silent_server_fails_within_the_timeout_and_the_store_recovers(
        proxied: tuple[Proxy, str]) -> None:
    proxy, dsn = proxied
    store = PostgresStore(dsn, pool_size=1, commit_timeout=TIMEOUT)
    await store.open()
    try:
        epochs = {(VHOST, "q"): await store.claim(VHOST, "q")}
        await store.commit(Batch(epochs=epochs, appends=[message(1)]))

        proxy.cut("blackhole")
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="did not finish within 1s"):
            await asyncio.wait_for(store.commit(Batch(epochs=epochs, appends=[message(2)])), 30)
        took = time.monotonic() - t0
        assert TIMEOUT <= took < TIMEOUT + 2.0, f"the commit failed after {took:.1f}s"

        proxy.heal()
        # The timed-out connection was dropped; the pool makes a new one (its first
        # attempt may still be held in the proxy until the heal): commits succeed again.
        deadline = time.monotonic() + 30
        while True:
            try:
                await store.commit(Batch(epochs=epochs, appends=[message(3)]))
                break
            except StoreError:
                assert time.monotonic() < deadline, "the store did not recover within 30s of the heal"
                await asyncio.sleep(0.2)
        # The commit given up on ended too (held until then, never collected while pending).
        while postgres._ABANDONED:
            assert time.monotonic() < deadline, f"{len(postgres._ABANDONED)} abandoned commits still pending"
            await asyncio.sleep(0.1)
        stored = {m.offset for m in await store.load_messages(VHOST, "q")}
        # Message 2's outcome is unknown by nature (its bytes were held, then may have
        # reached the server); 1 and 3 were confirmed and must be there.
        assert {1, 3} <= stored <= {1, 2, 3}
    finally:
        await store.close()


async def test_commit_timeout_zero_means_no_limit(postgres_db: str) -> None:
    store = PostgresStore(postgres_db, pool_size=1, commit_timeout=0)
    await store.open()
    try:
        epochs = {(VHOST, "q"): await store.claim(VHOST, "q")}
        await store.commit(Batch(epochs=epochs, appends=[message(1)]))
        assert [m.offset for m in await store.load_messages(VHOST, "q")] == [1]
    finally:
        await store.close()
    with pytest.raises(ValueError):
        PostgresStore(postgres_db, commit_timeout=-1)


async def test_a_frozen_loop_does_not_time_out_commits_the_server_finished(postgres_db: str) -> None:
    """A node resumed after a pause (SIGSTOP) finds the timeout overdue before it has read the answers."""
    store = PostgresStore(postgres_db, pool_size=4, commit_timeout=0.3)
    await store.open()
    try:
        epochs = {(VHOST, "q"): await store.claim(VHOST, "q")}
        offsets = iter(range(1, 1000))

        async def freeze() -> None:
            await asyncio.sleep(0.005)  # the commits are on the wire
            time.sleep(0.5)  # noqa: ASYNC251 - the point: the loop stands still past the timeout

        for _ in range(4):
            await asyncio.gather(freeze(), *(store.commit(Batch(epochs=epochs, appends=[message(next(offsets))]))
                                             for _ in range(6)))
        assert len(await store.load_messages(VHOST, "q")) == 24
    finally:
        await store.close()
