"""Policies in both stores: round trip, upsert, delete, and the migration of the old retention policies."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from core.model.policy import Policy
from core.ports.store import MessageStore
from tests.test_store_contract import backend, make_store, opened, store  # noqa: F401 - fixtures


async def test_policies_round_trip(store: MessageStore) -> None:  # noqa: F811
    p = Policy.create("/", "limits", "^orders", {"max-length": 2, "dead-letter-exchange": "dlx"}, "queues", 3)
    op = Policy.create("/", "limits", ".*", {"max-length": 100}, operator=True)
    other = Policy.create("v2", "ae", "^in", {"alternate-exchange": "ae"}, "exchanges")
    for x in (p, op, other):
        await store.save_policy(x)
    assert sorted(await store.load_policies(), key=lambda x: (x.vhost, x.operator)) == [p, op, other]
    changed = Policy.create("/", "limits", "^orders", {"max-length": 5}, "all", 0)
    await store.save_policy(changed)  # same vhost, kind and name: replaced
    assert changed in await store.load_policies() and p not in await store.load_policies()
    assert await store.delete_policy("/", "limits", operator=True)
    assert not await store.delete_policy("/", "limits", operator=True)
    assert sorted(x.name for x in await store.load_policies()) == ["ae", "limits"]


async def test_old_retention_policies_become_policies(tmp_path: Path) -> None:
    from persistence.sqlite import SQLiteStore

    path = str(tmp_path / "leveret.sqlite3")
    s = SQLiteStore(path)
    await s.open()
    await s.close()
    # Back to the schema before migration 020, with two retention policies in it.
    db = sqlite3.connect(path)
    db.executescript("""
        DROP TABLE policies;
        DELETE FROM schema_migrations WHERE version = 20;
        CREATE TABLE retention_policies (name TEXT PRIMARY KEY, pattern TEXT NOT NULL, max_age_seconds REAL,
            max_bytes INTEGER, max_length INTEGER, archive INTEGER NOT NULL DEFAULT 0, created_at REAL NOT NULL);
        INSERT INTO retention_policies VALUES ('week', '^logs', 604800.0, NULL, NULL, 1, 1.0);
        INSERT INTO retention_policies VALUES ('small', '^tmp', NULL, 1000, 2, 0, 2.0);
    """)
    db.close()
    s = SQLiteStore(path)
    await s.open()
    try:
        found = {p.name: p for p in await s.load_policies()}
    finally:
        await s.close()
    assert found["week"] == Policy("/", "week", "^logs", {"max-age": "604800s", "archive": True}, "queues", 0)
    assert found["small"].definition == {"max-length-bytes": 1000, "max-length": 2, "archive": False}


@pytest.mark.usefixtures("postgres_db")
async def test_old_retention_policies_become_policies_postgres(postgres_db: str) -> None:
    import psycopg

    from persistence.postgres import PostgresStore

    s = PostgresStore(postgres_db)
    await s.open()
    await s.close()
    with psycopg.connect(postgres_db, autocommit=True) as conn:
        conn.execute("DROP TABLE policies")
        conn.execute("DELETE FROM schema_migrations WHERE version = 20")
        conn.execute("CREATE TABLE retention_policies (name text PRIMARY KEY, pattern text NOT NULL,"
                     " max_age_seconds double precision, max_bytes bigint, max_length bigint,"
                     " archive boolean NOT NULL DEFAULT false, created_at double precision NOT NULL)")
        conn.execute("INSERT INTO retention_policies VALUES ('week', '^logs', 604800.0, NULL, NULL, true, 1.0)")
    s = PostgresStore(postgres_db)
    await s.open()
    try:
        found = await s.load_policies()
    finally:
        await s.close()
    assert found == [Policy("/", "week", "^logs", {"max-age": "604800s", "archive": True}, "queues", 0)]


async def test_a_policy_set_on_a_vhost_is_stored_and_other_writes_are_picked_up(tmp_path: Path) -> None:
    from core.durable.durability import Durability
    from core.durable.group_commit import GroupCommitter
    from core.engine.broker import Broker
    from leveret.node.policy_watch import PolicyWatch
    from persistence.sqlite import SQLiteStore

    s = SQLiteStore(str(tmp_path / "leveret.sqlite3"))
    await s.open()
    try:
        committer = GroupCommitter(s)
        broker = Broker()
        broker.set_policy_writer(Durability(s, committer).policy_changed)
        watch = PolicyWatch(broker, s)
        await watch.start()
        try:
            vh = broker.vhosts["/"]
            mine = Policy.create("/", "mine", "^a", {"max-length": 1})
            vh.set_policy(mine)
            await committer.drain()
            assert await s.load_policies() == [mine]
            watch.apply_changes({("/", False, "mine"): mine})  # a read of the store: nothing to do
            assert vh.policies == {"mine": mine}
            # Another process writes the store: this node applies it on its next read.
            theirs = Policy.create("/", "theirs", "^b", {"max-length": 2}, priority=1)
            await s.save_policy(theirs)
            await s.delete_policy("/", "mine", False)
            watch.apply_changes({("/", False, "theirs"): theirs})
            assert vh.policies == {"theirs": theirs}
            # A local change whose write has not reached the store yet is not undone by a read.
            later = Policy.create("/", "later", "^c", {"max-length": 3})
            vh.set_policy(later)
            watch.apply_changes({("/", False, "theirs"): theirs})
            assert set(vh.policies) == {"theirs", "later"}
            await committer.drain()
        finally:
            await watch.stop()
    finally:
        await s.close()
