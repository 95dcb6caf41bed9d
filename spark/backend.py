"""Driver-side access to the message store for the retention jobs (sqlite3 or psycopg, synchronous).

The executors read the ``messages`` table over JDBC; everything else (queue
arguments, epochs, named policies, the fenced deletes) goes through this
module on the driver.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from persistence.policy_rows import stored_policy
from spark.policies import NamedPolicy, decode_arguments

POSTGRES_JAR = "/usr/share/java/postgresql.jar"
SQLITE_JAR = "/usr/share/java/sqlite-jdbc.jar"  # Debian's libxerial-sqlite-jdbc-java
MARKED = "retained-removed"  # messages.state of rows a --mark-only run chose (load_messages skips them)
SQLITE_FILE = "leveret.sqlite3"  # inside --data-dir, as leveret/node/wiring.py opens it

# One batch: several offset ranges of one queue, fenced on the epoch read at the job's start.
_PG_DELETE = (
    "DELETE FROM messages m USING unnest(%s::bigint[], %s::bigint[]) AS r(lo, hi)"
    ' WHERE m.vhost = %s AND m.queue = %s AND m."offset" BETWEEN r.lo AND r.hi'
    " AND EXISTS (SELECT 1 FROM queue_epochs e WHERE e.vhost = %s AND e.queue = %s AND e.epoch = %s)"
)
_SQLITE_DELETE = (
    'DELETE FROM messages WHERE vhost = ? AND queue = ? AND "offset" BETWEEN ? AND ?'
    " AND EXISTS (SELECT 1 FROM queue_epochs e WHERE e.vhost = ? AND e.queue = ? AND e.epoch = ?)"
)
_PG_MARK = (
    f"UPDATE messages m SET state = '{MARKED}' FROM unnest(%s::bigint[], %s::bigint[]) AS r(lo, hi)"
    ' WHERE m.vhost = %s AND m.queue = %s AND m."offset" BETWEEN r.lo AND r.hi'
    f" AND m.state <> '{MARKED}'"
    " AND EXISTS (SELECT 1 FROM queue_epochs e WHERE e.vhost = %s AND e.queue = %s AND e.epoch = %s)"
)
_SQLITE_MARK = (
    f"UPDATE messages SET state = '{MARKED}' WHERE vhost = ? AND queue = ? AND \"offset\" BETWEEN ? AND ?"
    f" AND state <> '{MARKED}'"
    " AND EXISTS (SELECT 1 FROM queue_epochs e WHERE e.vhost = ? AND e.queue = ? AND e.epoch = ?)"
)


class BackendError(RuntimeError):
    pass


class Backend:
    """One store (``sqlite`` file or ``postgres`` DSN), as the retention commands see it."""

    def __init__(self, kind: str, *, data_dir: str = "./leveret-data", dsn: str = "") -> None:
        if kind not in ("sqlite", "postgres"):
            raise BackendError(f"unknown store {kind!r} (sqlite or postgres)")
        if kind == "postgres" and not dsn:
            raise BackendError("--store postgres needs --postgres-dsn")
        self.kind = kind
        self.path = str(Path(data_dir) / SQLITE_FILE)
        self.dsn = dsn
        self._conn: Any = None

    def clone(self) -> Backend:
        """The same store over a connection of its own (for another thread)."""
        other = Backend(self.kind, dsn=self.dsn)
        other.path = self.path
        return other

    # -- connections -------------------------------------------------------------
    def connect(self) -> Any:
        if self._conn is not None:
            return self._conn
        if self.kind == "sqlite":
            if not Path(self.path).exists():
                raise BackendError(f"no store at {self.path} (is --data-dir right?)")
            db = sqlite3.connect(self.path, isolation_level=None, timeout=30.0)
            from persistence.schema import SQLITE_MIGRATIONS, apply_sqlite

            apply_sqlite(db, SQLITE_MIGRATIONS)
            self._conn = db
        else:
            import psycopg

            from persistence.schema import POSTGRES_MIGRATIONS as PG_MIGRATIONS
            from persistence.schema import apply_postgres

            async def migrate() -> None:
                aconn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
                async with aconn:
                    await apply_postgres(aconn, PG_MIGRATIONS)

            asyncio.run(migrate())
            self._conn = psycopg.connect(self.dsn, autocommit=True, application_name="leveret-retention")
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        conn = self.connect()
        if self.kind == "postgres":
            sql = sql.replace("?", "%s")
        return [tuple(r) for r in conn.execute(sql, params).fetchall()]

    def _execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        conn = self.connect()
        if self.kind == "postgres":
            sql = sql.replace("?", "%s")
        cur = conn.execute(sql, params)
        return int(cur.rowcount)

    # -- JDBC ----------------------------------------------------------------------
    def jdbc(self) -> tuple[str, dict[str, str]]:
        """(url, options) for ``spark.read.format("jdbc")``."""
        if self.kind == "sqlite":
            return f"jdbc:sqlite:{Path(self.path).resolve()}", {"driver": "org.sqlite.JDBC"}
        from psycopg.conninfo import conninfo_to_dict

        info = conninfo_to_dict(self.dsn)
        host = str(info.get("host") or "localhost")
        if host.startswith("/"):
            raise BackendError("JDBC cannot use a Unix socket: give --postgres-dsn a TCP host")
        port = str(info.get("port") or 5432)
        dbname = str(info.get("dbname") or info.get("user") or "postgres")
        options = {"driver": "org.postgresql.Driver", "fetchsize": "20000"}
        if info.get("user"):
            options["user"] = str(info["user"])
        if info.get("password"):
            options["password"] = str(info["password"])
        if info.get("sslmode"):
            options["sslmode"] = str(info["sslmode"])
        return f"jdbc:postgresql://{host}:{port}/{dbname}", options

    # -- reads ---------------------------------------------------------------------
    def queues(self) -> dict[tuple[str, str], dict[str, Any]]:
        """Every queue the store knows (declared or holding an epoch), with its decoded arguments."""
        out: dict[tuple[str, str], dict[str, Any]] = {}
        for vhost, queue in self._rows("SELECT vhost, queue FROM queue_epochs"):
            out[(vhost, queue)] = {}
        for vhost, name, arguments in self._rows("SELECT vhost, name, arguments FROM queues"):
            out[(vhost, name)] = decode_arguments(arguments)
        return out

    def epochs(self) -> dict[tuple[str, str], int]:
        return {(v, q): int(e) for v, q, e in self._rows("SELECT vhost, queue, epoch FROM queue_epochs")}

    def offset_bounds(self) -> tuple[int, int, int]:
        """(min offset, max offset, row count) of the messages table."""
        row = self._rows('SELECT MIN("offset"), MAX("offset"), COUNT(*) FROM messages')[0]
        return int(row[0] or 0), int(row[1] or 0), int(row[2] or 0)

    # -- policies (the shared table: core/model/policy.py) ------------------------------
    def policies(self) -> list[NamedPolicy]:
        """Every policy of every vhost, user and operator, as retention reads them."""
        return [
            NamedPolicy.from_policy(stored_policy(vhost, name, bool(operator), pattern, apply_to, int(priority),
                                                  definition), float(updated))
            for vhost, name, operator, pattern, apply_to, priority, definition, updated in self._rows(
                "SELECT vhost, name, operator, pattern, apply_to, priority, definition, updated_at"
                " FROM policies ORDER BY name, vhost, operator"
            )
        ]  # fmt: skip

    def set_policy(self, policy: NamedPolicy) -> None:
        """Store it where running nodes read it: they apply it to live queues within a second."""
        record = policy.to_policy()
        operator: Any = record.operator if self.kind == "postgres" else int(record.operator)
        self._execute(
            "INSERT INTO policies (vhost, name, operator, pattern, apply_to, priority, definition, updated_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (vhost, operator, name) DO UPDATE SET"
            " pattern = excluded.pattern, apply_to = excluded.apply_to, priority = excluded.priority,"
            " definition = excluded.definition, updated_at = excluded.updated_at",
            (record.vhost, record.name, operator, record.pattern, record.apply_to, record.priority,
             json.dumps(record.definition), policy.created_at or time.time()),
        )  # fmt: skip

    def delete_policy(self, name: str, vhost: str = "/") -> bool:
        return self._execute("DELETE FROM policies WHERE vhost = ? AND name = ? AND operator = ?",
                             (vhost, name, False if self.kind == "postgres" else 0)) > 0

    # -- fenced deletes ----------------------------------------------------------------
    def mark_batch(self, vhost: str, queue: str, epoch: int, ranges: Iterable[tuple[int, int]]) -> int | None:
        """As delete_batch, but set ``state = 'retained-removed'`` instead of deleting (a node's
        ``load_messages`` skips such rows; a later run deletes them)."""
        return self.delete_batch(vhost, queue, epoch, ranges, mark=True)

    def delete_batch(
        self, vhost: str, queue: str, epoch: int, ranges: Iterable[tuple[int, int]], *, mark: bool = False
    ) -> int | None:
        """Delete the messages of one queue whose offsets fall in ``ranges`` ((lo, hi), inclusive),
        if the queue's epoch is still ``epoch``; one transaction.

        The job only passes ranges that held no kept message when it read them
        (offsets only grow, so none can appear there later). Returns the number
        of rows deleted, or None when the queue is fenced (a new owner moved the
        epoch: nothing is deleted). Idempotent: rows gone already are not counted.
        """
        spans = sorted({(int(lo), int(hi)) for lo, hi in ranges})
        if not spans:
            return 0
        conn = self.connect()
        if self.kind == "postgres":
            with conn.transaction():
                # Locks the epoch row as the broker's commits do, so a claim waits for us
                # and a claim that committed first makes us delete nothing.
                row = conn.execute(
                    "SELECT epoch FROM queue_epochs WHERE vhost = %s AND queue = %s FOR SHARE", (vhost, queue)
                ).fetchone()
                if row is None or int(row[0]) != epoch:
                    return None
                los, his = [lo for lo, _ in spans], [hi for _, hi in spans]
                cur = conn.execute(_PG_MARK if mark else _PG_DELETE, (los, his, vhost, queue, vhost, queue, epoch))
                return int(cur.rowcount)
        conn.execute("BEGIN IMMEDIATE")  # the write lock: no claim can interleave
        try:
            row = conn.execute(
                "SELECT epoch FROM queue_epochs WHERE vhost = ? AND queue = ?", (vhost, queue)
            ).fetchone()
            if row is None or int(row[0]) != epoch:
                conn.execute("ROLLBACK")
                return None
            before = conn.total_changes
            statement = _SQLITE_MARK if mark else _SQLITE_DELETE
            conn.executemany(statement, [(vhost, queue, lo, hi, vhost, queue, epoch) for lo, hi in spans])
            deleted = conn.total_changes - before
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return int(deleted)

    # -- live brokers (docs/RETENTION.md, "Live brokers") ---------------------------------
    def live_watchers(self, now: float | None = None) -> list[str]:
        """Nodes that apply retention requests (their heartbeat row has not expired)."""
        now = time.time() if now is None else now
        return [str(r[0]) for r in self._rows("SELECT node FROM retention_watchers WHERE expires_at > ?", (now,))]

    def request(self, vhost: str, queue: str, run_id: str, epoch: int) -> None:
        """Ask the queue's owner to drop its marked rows from memory (NOTIFY on Postgres)."""
        self._execute(
            "INSERT INTO retention_requests (vhost, queue, run_id, epoch, state, created_at)"
            " VALUES (?, ?, ?, ?, 'pending', ?) ON CONFLICT (vhost, queue, run_id) DO UPDATE SET state = 'pending'",
            (vhost, queue, run_id, epoch, time.time()),
        )
        if self.kind == "postgres":
            from persistence.retention_requests import CHANNEL

            self._execute("SELECT pg_notify(?, ?)", (CHANNEL, f"{vhost}/{queue}"))

    def request_states(self, run_id: str) -> dict[tuple[str, str], str]:
        return {
            (v, q): str(s)
            for v, q, s in self._rows("SELECT vhost, queue, state FROM retention_requests WHERE run_id = ?", (run_id,))
        }

    def forget_applied_requests(self) -> int:
        return self._execute("DELETE FROM retention_requests WHERE state = 'applied'")

    def delete_marked(self, vhost: str, queue: str, epoch: int) -> int | None:
        """Delete the queue's marked rows (its owner dropped them already), fenced on ``epoch``."""
        conn = self.connect()
        fence = "EXISTS (SELECT 1 FROM queue_epochs e WHERE e.vhost = ? AND e.queue = ? AND e.epoch = ?)"
        sql = f"DELETE FROM messages WHERE vhost = ? AND queue = ? AND state = '{MARKED}' AND {fence}"
        params = (vhost, queue, vhost, queue, epoch)
        if self.kind == "postgres":
            with conn.transaction():
                row = conn.execute(
                    "SELECT epoch FROM queue_epochs WHERE vhost = %s AND queue = %s FOR SHARE", (vhost, queue)
                ).fetchone()
                if row is None or int(row[0]) != epoch:
                    return None
                return int(conn.execute(sql.replace("?", "%s"), params).rowcount)
        conn.execute("BEGIN IMMEDIATE")
        try:
            row = conn.execute(
                "SELECT epoch FROM queue_epochs WHERE vhost = ? AND queue = ?", (vhost, queue)
            ).fetchone()
            if row is None or int(row[0]) != epoch:
                conn.execute("ROLLBACK")
                return None
            n = int(conn.execute(sql, params).rowcount)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return n

    # -- the run lease (one run at a time, also across nodes sharing Postgres) -------------------
    def take_lease(self, name: str, holder: str, ttl: float) -> bool:
        from persistence.retention_requests import take_lease_sql

        return take_lease_sql(self._execute, name, holder, ttl)

    def lease_holder(self, name: str) -> tuple[str, float] | None:
        rows = self._rows("SELECT holder, expires_at FROM leases WHERE name = ?", (name,))
        if not rows or not rows[0][0]:
            return None
        return str(rows[0][0]), float(rows[0][1])

    def release_lease(self, name: str, holder: str) -> None:
        self._execute("UPDATE leases SET holder = '', expires_at = 0 WHERE name = ? AND holder = ?", (name, holder))
