"""The node's side of retention on a live broker: requests, watcher heartbeats, leases.

A retention run marks rows ``state = 'retained-removed'`` and writes one row
per queue in ``retention_requests``; the owning node reads the marked offsets,
drops them from memory (core ``Queue.drop_offsets``), and once that removal is
committed sets the request ``applied``. These tables are small, so the node
uses its own connection (not the message store's writer) and plain SQL.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from typing import Any, Protocol

MARKED = "retained-removed"
CHANNEL = "leveret_retention"  # Postgres NOTIFY channel; the payload is "<vhost>/<queue>"


class RequestTable(Protocol):
    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def heartbeat(self, node: str, ttl: float) -> None:
        """This node applies requests: keep its watcher row alive ``ttl`` seconds more."""
        ...

    async def leave(self, node: str) -> None: ...

    async def pending(self) -> list[tuple[str, str, str]]:
        """(vhost, queue, run id) of every request not applied yet."""
        ...

    async def marked_offsets(self, vhost: str, queue: str) -> list[int]: ...

    async def applied(self, vhost: str, queue: str, run_id: str, node: str) -> None: ...

    async def wait(self, timeout: float) -> None:
        """Return after ``timeout`` or earlier when a job announces a request."""
        ...

    async def take_lease(self, name: str, holder: str, ttl: float) -> bool:
        """Take or renew lease ``name`` when it is free, expired or ours already."""
        ...

    async def release_lease(self, name: str, holder: str) -> None: ...


_PENDING = "SELECT vhost, queue, run_id FROM retention_requests WHERE state = 'pending' ORDER BY created_at"
_MARKED = f"SELECT \"offset\" FROM messages WHERE vhost = ? AND queue = ? AND state = '{MARKED}' ORDER BY \"offset\""
_APPLIED = (
    "UPDATE retention_requests SET state = 'applied', applied_at = ?, applied_by = ?"
    " WHERE vhost = ? AND queue = ? AND run_id = ?"
)
_HEARTBEAT = (
    "INSERT INTO retention_watchers (node, expires_at) VALUES (?, ?)"
    " ON CONFLICT (node) DO UPDATE SET expires_at = excluded.expires_at"
)
# The lease row is created once (free, expired at 0), then taken only by a
# conditional UPDATE: of two takers at once, one updates the row, the other none.
_LEASE_ROW = "INSERT INTO leases (name, holder, expires_at) VALUES (?, '', 0) ON CONFLICT (name) DO NOTHING"
_LEASE_TAKE = (
    "UPDATE leases SET holder = ?, expires_at = ? WHERE name = ? AND (holder = ? OR expires_at < ?)"
)
_LEASE_RELEASE = "UPDATE leases SET holder = '', expires_at = 0 WHERE name = ? AND holder = ?"


def take_lease_sql(execute: Any, name: str, holder: str, ttl: float, now: float | None = None) -> bool:
    """The lease protocol over any DB-API-like ``execute(sql, params) -> rowcount`` (autocommit)."""
    now = time.time() if now is None else now
    execute(_LEASE_ROW, (name,))
    return bool(execute(_LEASE_TAKE, (holder, now + ttl, name, holder, now)) == 1)


class SQLiteRequests:
    def __init__(self, path: str) -> None:
        self.path = path
        self._db: sqlite3.Connection | None = None

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            # Own connection; waits up to 10 s for the store's writer (a commit holds the lock briefly).
            self._db = sqlite3.connect(self.path, isolation_level=None, timeout=10.0, check_same_thread=False)
        return self._db

    def _exec(self, sql: str, params: tuple[Any, ...] = ()) -> int:
        return int(self._conn().execute(sql, params).rowcount)

    def _rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in self._conn().execute(sql, params).fetchall()]

    async def open(self) -> None:
        await asyncio.to_thread(self._conn)

    async def close(self) -> None:
        if self._db is not None:
            db, self._db = self._db, None
            await asyncio.to_thread(db.close)

    async def heartbeat(self, node: str, ttl: float) -> None:
        await asyncio.to_thread(self._exec, _HEARTBEAT, (node, time.time() + ttl))

    async def leave(self, node: str) -> None:
        await asyncio.to_thread(self._exec, "DELETE FROM retention_watchers WHERE node = ?", (node,))

    async def pending(self) -> list[tuple[str, str, str]]:
        return [(str(v), str(q), str(r)) for v, q, r in await asyncio.to_thread(self._rows, _PENDING)]

    async def marked_offsets(self, vhost: str, queue: str) -> list[int]:
        return [int(r[0]) for r in await asyncio.to_thread(self._rows, _MARKED, (vhost, queue))]

    async def applied(self, vhost: str, queue: str, run_id: str, node: str) -> None:
        await asyncio.to_thread(self._exec, _APPLIED, (time.time(), node, vhost, queue, run_id))

    async def wait(self, timeout: float) -> None:
        await asyncio.sleep(timeout)  # SQLite has no notifications: the caller polls

    async def take_lease(self, name: str, holder: str, ttl: float) -> bool:
        return await asyncio.to_thread(take_lease_sql, self._exec, name, holder, ttl)

    async def release_lease(self, name: str, holder: str) -> None:
        await asyncio.to_thread(self._exec, _LEASE_RELEASE, (name, holder))


class PostgresRequests:
    """Over one autocommit connection, which also LISTENs on ``leveret_retention``."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._conn: Any = None
        self._listen_conn: Any = None
        self._notified = asyncio.Event()
        self._listener: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    async def open(self) -> None:
        import psycopg

        self._conn = await psycopg.AsyncConnection.connect(
            self.dsn, autocommit=True, application_name="leveret-retention-watch"
        )
        self._listen_conn = await psycopg.AsyncConnection.connect(
            self.dsn, autocommit=True, application_name="leveret-retention-listen"
        )
        await self._listen_conn.execute(f"LISTEN {CHANNEL}")
        self._listener = asyncio.create_task(self._listen())

    async def _listen(self) -> None:
        async for _ in self._listen_conn.notifies():
            self._notified.set()

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            try:
                await self._listener
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the connection may be gone already
                pass
            self._listener = None
        for conn in (self._listen_conn, self._conn):
            if conn is not None:
                await conn.close()
        self._conn = self._listen_conn = None

    async def _exec(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        async with self._lock:
            return await self._conn.execute(sql.replace("?", "%s"), params)

    async def heartbeat(self, node: str, ttl: float) -> None:
        await self._exec(_HEARTBEAT, (node, time.time() + ttl))

    async def leave(self, node: str) -> None:
        await self._exec("DELETE FROM retention_watchers WHERE node = ?", (node,))

    async def pending(self) -> list[tuple[str, str, str]]:
        cur = await self._exec(_PENDING)
        return [(str(v), str(q), str(r)) for v, q, r in await cur.fetchall()]

    async def marked_offsets(self, vhost: str, queue: str) -> list[int]:
        cur = await self._exec(_MARKED, (vhost, queue))
        return [int(r[0]) for r in await cur.fetchall()]

    async def applied(self, vhost: str, queue: str, run_id: str, node: str) -> None:
        await self._exec(_APPLIED, (time.time(), node, vhost, queue, run_id))

    async def wait(self, timeout: float) -> None:
        # NOTIFY wakes the node at once; the timeout is the poll fallback (a
        # notification sent while the listener was reconnecting is not lost for long).
        try:
            await asyncio.wait_for(self._notified.wait(), timeout)
        except TimeoutError:
            pass
        self._notified.clear()

    async def take_lease(self, name: str, holder: str, ttl: float) -> bool:
        now = time.time()
        await self._exec(_LEASE_ROW, (name,))
        cur = await self._exec(_LEASE_TAKE, (holder, now + ttl, name, holder, now))
        return bool(cur.rowcount == 1)

    async def release_lease(self, name: str, holder: str) -> None:
        await self._exec(_LEASE_RELEASE, (name, holder))
