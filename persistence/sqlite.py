"""The embedded store: one SQLite file in WAL mode, written from one thread.

SQLite calls block, so every call runs on a single worker thread (SQLite
allows one writer anyway) and the event loop only awaits it. Each commit is
fsynced (synchronous=FULL); the group committer makes one commit carry many
publishes, which is what makes that affordable.

Bodies at or above a threshold are kept out of SQLite, in append-only segment
files beside it (persistence/sqlite_bodies.py, docs/notes/bodystore.md): the
rows keep a reference, and every read here gives back whole bodies.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from core.model import private_files
from core.model.fieldtable import decode_table, encode_table
from core.model.policy import Policy
from core.ports.store import (
    Batch,
    BindingRecord,
    ExchangeRecord,
    Fenced,
    QueueRecord,
    StoredMessage,
    StoreError,
    Topology,
    TopologyWrite,
    UserRecord,
)
from persistence import backup
from persistence.policy_rows import stored_policy
from persistence.schema import SQLITE_MIGRATIONS, apply_sqlite
from persistence.sqlite_bodies import DEFAULT_THRESHOLD, BodyIndex, BodyWrite

T = TypeVar("T")

# A body store threshold at most this keeps SQLite's rows small enough for 4 KiB pages.
SMALL_PAGES_BELOW = 64 * 1024


def arguments_key(encoded: bytes) -> str:
    return hashlib.sha1(encoded).hexdigest()


# The message columns every reader selects: the row's fields, then the body's reference
# (segment, position, length, crc; segment NULL for a body kept inline).
_MESSAGE_COLUMNS = (
    '"offset", message_id, exchange, routing_key, properties, body, enqueued_at, expires_at, delivery_count,'
    " body_segment, body_position, size, body_crc"
)


class SQLiteStore:
    def __init__(self, path: str, body_threshold: int = DEFAULT_THRESHOLD,
                 body_segment_bytes: int | None = None) -> None:
        """``body_threshold``: bodies of at least this many bytes go to segment files in ``<dir>/bodies``."""
        self.path = path
        self.description = f"sqlite {path}"
        self._db: sqlite3.Connection | None = None
        self.bodies = BodyIndex(Path(path).parent / "bodies", body_threshold, body_segment_bytes)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="leveret-sqlite")
        self._lock = threading.Lock()

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def call() -> T:
            db = self._db
            if db is None:
                raise StoreError(f"{self.description}: store is not open")
            try:
                return fn(db)
            except (sqlite3.Error, OSError) as exc:  # OSError: the body segments (a full disk)
                if db.in_transaction:
                    db.rollback()
                raise StoreError(f"{self.description}: {exc}") from exc

        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    async def open(self) -> None:
        def connect() -> None:
            try:
                # Hashes, bodies and shovel URIs with passwords: 0700 directory, 0600 files.
                private_files.private_dir(Path(self.path).parent)
                private_files.private_file(self.path)
                for suffix in ("-wal", "-shm"):
                    private_files.tighten(self.path + suffix)  # a store made before they were 0600
                db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
                # The page size counts for a new file only. With large bodies in SQLite
                # (no body store), 64 KiB pages: a 1 MiB body is 16 overflow pages instead
                # of 256 (commits of 16 x 1 MiB went from 79 to 276 msg/s). With bodies of
                # 32 KiB and more in segment files, 4 KiB pages: a commit rewrites a few
                # small pages instead of a few 64 KiB ones in the WAL; measured here
                # (docs/notes/bodystore.md) lone 256 B commits 1,300-2,000 vs 1,000-1,100/s,
                # 64 x 1 KiB 47k vs 19k msg/s, 2,000 x 256 B per commit the same.
                db.execute(f"PRAGMA page_size={65536 if self.bodies.threshold > SMALL_PAGES_BELOW else 4096}")
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=FULL")
                apply_sqlite(db, SQLITE_MIGRATIONS)
                self.bodies.recover(db)
            except (sqlite3.Error, OSError) as exc:
                raise StoreError(f"cannot open {self.description}: {exc}") from exc
            self._db = db

        await asyncio.get_running_loop().run_in_executor(self._executor, connect)

    async def backup(self, out: Path) -> dict[str, Any]:
        """A consistent copy of the store as a tar at ``out`` (persistence/backup.py); its manifest.
        It runs on the store's thread: commits wait while the body segments are copied."""
        data_dir = Path(self.path).parent

        def run(db: sqlite3.Connection) -> dict[str, Any]:
            with open(out, "wb") as f:
                return backup.snapshot(db, data_dir, f)

        return await self._run(run)

    async def close(self) -> None:
        def close() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None
            self.bodies.close()

        await asyncio.get_running_loop().run_in_executor(self._executor, close)
        self._executor.shutdown(wait=True)

    # -- topology ----------------------------------------------------------------
    async def load_topology(self) -> Topology:
        def load(db: sqlite3.Connection) -> Topology:
            topo = Topology()
            for vhost, name, type_, auto_delete, internal, args in db.execute(
                "SELECT vhost, name, type, auto_delete, internal, arguments FROM exchanges ORDER BY vhost, name"
            ):
                topo.exchanges.append(
                    ExchangeRecord(vhost, name, type_, bool(auto_delete), bool(internal), decode_table(args)[0])
                )
            for vhost, name, auto_delete, args in db.execute(
                "SELECT vhost, name, auto_delete, arguments FROM queues ORDER BY vhost, name"
            ):
                topo.queues.append(QueueRecord(vhost, name, bool(auto_delete), decode_table(args)[0]))
            for vhost, source, kind, dest, rk, args in db.execute(
                "SELECT vhost, source, destination_kind, destination, routing_key, arguments FROM bindings"
                " ORDER BY vhost, source, destination_kind, destination, routing_key"
            ):
                topo.bindings.append(BindingRecord(vhost, source, kind, dest, rk, decode_table(args)[0]))
            return topo

        return await self._run(load)

    async def save_exchange(self, record: ExchangeRecord) -> None:
        await self._run(lambda db: _save_exchange(db, record))

    async def delete_exchange(self, vhost: str, name: str) -> None:
        def delete(db: sqlite3.Connection) -> None:
            with _transaction(db):
                _delete_exchange(db, vhost, name)

        await self._run(delete)

    async def save_queue(self, record: QueueRecord) -> None:
        await self._run(lambda db: _save_queue(db, record))

    async def delete_queue(self, vhost: str, name: str) -> None:
        def delete(db: sqlite3.Connection) -> None:
            with _transaction(db):
                _delete_queue(db, vhost, name)
            self.bodies.collect(db)

        await self._run(delete)

    async def save_binding(self, record: BindingRecord) -> None:
        await self._run(lambda db: _save_binding(db, record))

    async def delete_binding(self, record: BindingRecord) -> None:
        await self._run(lambda db: _delete_binding(db, record))

    # -- users and vhosts ------------------------------------------------------------
    async def load_users(self) -> list[UserRecord]:
        def load(db: sqlite3.Connection) -> list[UserRecord]:
            return [
                UserRecord(name, bytes(salt), bytes(digest), json.loads(tags), json.loads(vhosts), bool(loopback),
                           json.loads(perms))
                for name, salt, digest, tags, vhosts, loopback, perms in db.execute(
                    "SELECT name, salt, password_hash, tags, vhosts, loopback_only, permissions"
                    " FROM users ORDER BY name"
                )
            ]

        return await self._run(load)

    async def save_user(self, record: UserRecord) -> None:
        await self._run(
            lambda db: db.execute(
                "INSERT OR REPLACE INTO users (name, salt, password_hash, tags, vhosts, loopback_only, permissions)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (record.name, record.salt, record.password_hash, json.dumps(record.tags), json.dumps(record.vhosts),
                 int(record.loopback_only), json.dumps(record.permissions)),
            )
        )

    async def delete_user(self, name: str) -> bool:
        return await self._run(lambda db: db.execute("DELETE FROM users WHERE name = ?", (name,)).rowcount > 0)

    async def load_policies(self) -> list[Policy]:
        def load(db: sqlite3.Connection) -> list[Policy]:
            return [
                stored_policy(vhost, name, bool(operator), pattern, apply_to, int(priority), definition)
                for vhost, name, operator, pattern, apply_to, priority, definition in db.execute(
                    "SELECT vhost, name, operator, pattern, apply_to, priority, definition FROM policies"
                    " ORDER BY vhost, operator, name"
                )
            ]

        return await self._run(load)

    async def save_policy(self, policy: Policy) -> None:
        await self._run(
            lambda db: db.execute(
                "INSERT OR REPLACE INTO policies (vhost, name, operator, pattern, apply_to, priority, definition,"
                " updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (policy.vhost, policy.name, int(policy.operator), policy.pattern, policy.apply_to, policy.priority,
                 json.dumps(policy.definition), time.time()),
            )
        )

    async def delete_policy(self, vhost: str, name: str, operator: bool) -> bool:
        return await self._run(lambda db: db.execute(
            "DELETE FROM policies WHERE vhost = ? AND name = ? AND operator = ?", (vhost, name, int(operator))
        ).rowcount > 0)

    async def load_parameters(self) -> list[tuple[str, str, str, Any]]:
        return await self._run(lambda db: [
            (vhost, component, name, json.loads(value)) for vhost, component, name, value in db.execute(
                "SELECT vhost, component, name, value FROM runtime_parameters ORDER BY vhost, component, name")])

    async def save_parameter(self, vhost: str, component: str, name: str, value: Any) -> None:
        await self._run(lambda db: db.execute(
            "INSERT OR REPLACE INTO runtime_parameters (vhost, component, name, value) VALUES (?, ?, ?, ?)",
            (vhost, component, name, json.dumps(value))))

    async def delete_parameter(self, vhost: str, component: str, name: str) -> bool:
        return await self._run(lambda db: db.execute(
            "DELETE FROM runtime_parameters WHERE vhost = ? AND component = ? AND name = ?", (vhost, component, name)
        ).rowcount > 0)

    async def load_vhosts(self) -> list[str]:
        return await self._run(lambda db: [r[0] for r in db.execute("SELECT name FROM vhosts ORDER BY name")])

    async def save_vhost(self, name: str) -> None:
        await self._run(lambda db: db.execute("INSERT OR IGNORE INTO vhosts (name) VALUES (?)", (name,)))

    async def load_vhost_limits(self) -> dict[str, dict[str, int]]:
        def load(db: sqlite3.Connection) -> dict[str, dict[str, int]]:
            rows = db.execute("SELECT vhost, limits FROM vhost_limits ORDER BY vhost")
            return {name: json.loads(limits) for name, limits in rows}

        return await self._run(load)

    async def save_vhost_limits(self, name: str, limits: dict[str, int]) -> None:
        def save(db: sqlite3.Connection) -> None:
            if limits:
                db.execute("INSERT OR REPLACE INTO vhost_limits (vhost, limits) VALUES (?, ?)",
                           (name, json.dumps(limits)))
            else:
                db.execute("DELETE FROM vhost_limits WHERE vhost = ?", (name,))

        await self._run(save)

    async def delete_vhost(self, name: str) -> bool:
        def delete(db: sqlite3.Connection) -> bool:
            with _transaction(db):
                found = db.execute("DELETE FROM vhosts WHERE name = ?", (name,)).rowcount > 0
                for table in ("exchanges", "queues", "bindings", "messages", "queue_epochs"):
                    db.execute(f"DELETE FROM {table} WHERE vhost = ?", (name,))
            self.bodies.collect(db)
            return found

        return await self._run(delete)

    # -- ownership and messages --------------------------------------------------
    async def claim(self, vhost: str, queue: str, epoch: int | None = None) -> int:
        def claim(db: sqlite3.Connection) -> int:
            with _transaction(db):
                return _claim(db, vhost, queue, epoch)

        return await self._run(claim)

    async def load_messages(self, vhost: str, queue: str) -> list[StoredMessage]:
        def load(db: sqlite3.Connection) -> list[StoredMessage]:
            rows = db.execute(
                f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE vhost = ? AND queue = ? AND state = 'ready'"
                ' ORDER BY "offset"',
                (vhost, queue),
            ).fetchall()
            return self.bodies.resolve(vhost, queue, rows)

        return await self._run(load)

    async def commit(self, batch: Batch) -> None:
        bodies = self.bodies

        def commit(db: sqlite3.Connection) -> dict[tuple[str, str], int]:
            # The large bodies are written and fsynced on the body store's thread meanwhile;
            # the commit is done when both are (sqlite_bodies.py says why that order is safe).
            write = bodies.start(batch.appends) if batch.appends else None
            try:
                claimed = write_rows(db, write)
            except BaseException:
                if write is not None:
                    bodies.finish(write, committed=False)
                raise
            if write is not None:
                bodies.finish(write, committed=True)
            bodies.collect(db, bool(batch.removals or batch.truncations or batch.purges or batch.topology))
            return claimed

        def write_rows(db: sqlite3.Connection, write: BodyWrite | None) -> dict[tuple[str, str], int]:
            with _transaction(db):
                _apply_topology(db, batch.topology)
                claimed = {key: _claim(db, key[0], key[1], None) for key in dict.fromkeys(batch.claims)}
                stale = []
                for (vhost, queue), epoch in batch.epochs.items():
                    if (vhost, queue) in claimed:
                        continue  # fenced by this very transaction
                    row = db.execute(
                        "SELECT epoch FROM queue_epochs WHERE vhost = ? AND queue = ?", (vhost, queue)
                    ).fetchone()
                    if row is None or row[0] != epoch:
                        stale.append((vhost, queue))
                if stale:
                    raise Fenced(stale)
                if batch.purges:
                    db.executemany("DELETE FROM messages WHERE vhost = ? AND queue = ?", batch.purges)
                if write is not None:
                    db.executemany(
                        'INSERT OR REPLACE INTO messages (vhost, queue, "offset", message_id, exchange, routing_key,'
                        " properties, body, enqueued_at, expires_at, size, delivery_count, body_segment,"
                        " body_position, body_crc) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        [
                            (m.vhost, m.queue, m.offset, m.message_id, m.exchange, m.routing_key, m.properties,
                             m.body, m.enqueued_at, m.expires_at, len(m.body), m.delivery_count, None, None, None)
                            if r is None else
                            (m.vhost, m.queue, m.offset, m.message_id, m.exchange, m.routing_key, m.properties,
                             b"", m.enqueued_at, m.expires_at, r.length, m.delivery_count, r.segment, r.position,
                             r.crc)
                            for m, r in zip(batch.appends, write.refs, strict=True)
                        ],
                    )
                    bodies.account(db, write)
                elif batch.appends:
                    db.executemany(
                        'INSERT OR REPLACE INTO messages (vhost, queue, "offset", message_id, exchange, routing_key,'
                        " properties, body, enqueued_at, expires_at, size, delivery_count)"
                        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        [
                            (m.vhost, m.queue, m.offset, m.message_id, m.exchange, m.routing_key, m.properties,
                             m.body, m.enqueued_at, m.expires_at, len(m.body), m.delivery_count)
                            for m in batch.appends
                        ],
                    )
                if batch.delivery_counts:
                    db.executemany(
                        'UPDATE messages SET delivery_count = ? WHERE vhost = ? AND queue = ? AND "offset" = ?',
                        [(n, v, q, o) for v, q, o, n in batch.delivery_counts],
                    )
                if batch.removals:
                    db.executemany(
                        'DELETE FROM messages WHERE vhost = ? AND queue = ? AND "offset" = ?', batch.removals
                    )
                if batch.truncations:
                    db.executemany(
                        'DELETE FROM messages WHERE vhost = ? AND queue = ? AND "offset" < ?', batch.truncations
                    )
                if batch.offsets:
                    db.executemany(
                        'INSERT INTO stream_offsets (vhost, queue, grp, "offset") VALUES (?, ?, ?, ?)'
                        ' ON CONFLICT (vhost, queue, grp) DO UPDATE SET "offset" = excluded."offset"',
                        [(v, q, g, o) for (v, q, g), o in batch.offsets.items()],
                    )
                return claimed

        batch.claimed = await self._run(commit)

    async def load_range(self, vhost: str, queue: str, start: int, below: int | None, limit: int
                         ) -> list[StoredMessage]:
        def load(db: sqlite3.Connection) -> list[StoredMessage]:
            rows = db.execute(
                f'SELECT {_MESSAGE_COLUMNS} FROM messages WHERE vhost = ? AND queue = ? AND "offset" >= ?'
                ' AND "offset" < ? AND state = \'ready\' ORDER BY "offset" LIMIT ?',
                (vhost, queue, start, below if below is not None else 2**63 - 1, limit),
            ).fetchall()
            return self.bodies.resolve(vhost, queue, rows)

        return await self._run(load)

    async def load_offsets(self, vhost: str, queue: str) -> dict[str, int]:
        def load(db: sqlite3.Connection) -> dict[str, int]:
            rows = db.execute(
                'SELECT grp, "offset" FROM stream_offsets WHERE vhost = ? AND queue = ?', (vhost, queue)
            )
            return {grp: int(offset) for grp, offset in rows}

        return await self._run(load)


class _transaction:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on any exception."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.db.execute("COMMIT")
        else:
            self.db.execute("ROLLBACK")


def _save_exchange(db: sqlite3.Connection, record: ExchangeRecord) -> None:
    db.execute(
        "INSERT OR REPLACE INTO exchanges (vhost, name, type, auto_delete, internal, arguments)"
        " VALUES (?, ?, ?, ?, ?, ?)",
        (record.vhost, record.name, record.type, int(record.auto_delete), int(record.internal),
         encode_table(record.arguments)),
    )


def _delete_exchange(db: sqlite3.Connection, vhost: str, name: str) -> None:
    db.execute("DELETE FROM exchanges WHERE vhost = ? AND name = ?", (vhost, name))
    db.execute(
        "DELETE FROM bindings WHERE vhost = ? AND (source = ? OR (destination_kind = 'exchange' AND destination = ?))",
        (vhost, name, name),
    )


def _save_queue(db: sqlite3.Connection, record: QueueRecord) -> None:
    db.execute(
        "INSERT OR REPLACE INTO queues (vhost, name, auto_delete, arguments) VALUES (?, ?, ?, ?)",
        (record.vhost, record.name, int(record.auto_delete), encode_table(record.arguments)),
    )


def _delete_queue(db: sqlite3.Connection, vhost: str, name: str) -> None:
    db.execute("DELETE FROM queues WHERE vhost = ? AND name = ?", (vhost, name))
    db.execute("DELETE FROM messages WHERE vhost = ? AND queue = ?", (vhost, name))
    db.execute("DELETE FROM queue_epochs WHERE vhost = ? AND queue = ?", (vhost, name))
    db.execute("DELETE FROM stream_offsets WHERE vhost = ? AND queue = ?", (vhost, name))
    db.execute("DELETE FROM bindings WHERE vhost = ? AND destination_kind = 'queue' AND destination = ?", (vhost, name))


def _save_binding(db: sqlite3.Connection, record: BindingRecord) -> None:
    encoded = encode_table(record.arguments)
    db.execute(
        "INSERT OR REPLACE INTO bindings (vhost, source, destination_kind, destination, routing_key,"
        " arguments, arguments_key) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (record.vhost, record.source, record.destination_kind, record.destination, record.routing_key,
         encoded, arguments_key(encoded)),
    )


def _delete_binding(db: sqlite3.Connection, record: BindingRecord) -> None:
    db.execute(
        "DELETE FROM bindings WHERE vhost = ? AND source = ? AND destination_kind = ? AND destination = ?"
        " AND routing_key = ? AND arguments_key = ?",
        (record.vhost, record.source, record.destination_kind, record.destination, record.routing_key,
         arguments_key(encode_table(record.arguments))),
    )


def _apply_topology(db: sqlite3.Connection, writes: list[TopologyWrite]) -> None:
    """Inside the caller's transaction, in order: 50,000 declarations are one fsync, not 50,000."""
    for w in writes:
        r = w.record
        if isinstance(r, ExchangeRecord):
            if w.delete:
                _delete_exchange(db, r.vhost, r.name)
            else:
                _save_exchange(db, r)
        elif isinstance(r, QueueRecord):
            if w.delete:
                _delete_queue(db, r.vhost, r.name)
            else:
                _save_queue(db, r)
        elif w.delete:
            _delete_binding(db, r)
        else:
            _save_binding(db, r)


def _claim(db: sqlite3.Connection, vhost: str, queue: str, epoch: int | None) -> int:
    row = db.execute("SELECT epoch FROM queue_epochs WHERE vhost = ? AND queue = ?", (vhost, queue)).fetchone()
    current = row[0] if row else 0
    if epoch is None:
        new = current + 1
    elif epoch >= current:
        new = epoch
    else:
        raise Fenced([(vhost, queue)])
    db.execute(
        "INSERT INTO queue_epochs (vhost, queue, epoch) VALUES (?, ?, ?)"
        " ON CONFLICT (vhost, queue) DO UPDATE SET epoch = excluded.epoch",
        (vhost, queue, new),
    )
    return new
