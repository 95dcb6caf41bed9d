"""The stores' schema, shared by the stores and the Spark jobs: where it is defined and how it is applied.

The schema is numbered SQL files (``NNN_name.sql``) under ``migrations/<backend>/``,
applied in order at start-up by whoever opens a store (a node, or a retention run).
Each applied file is recorded in ``schema_migrations(version, applied_at)``;
applying again is a no-op, and a file that fails leaves the ones before it applied.
This module imports nothing of the broker, so the Spark jobs can use it alone.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import psycopg

_FILE = re.compile(r"^(\d+)_[A-Za-z0-9_\-]+\.sql$")

SQLITE_MIGRATIONS = Path(__file__).resolve().parent / "migrations" / "sqlite"
POSTGRES_MIGRATIONS = Path(__file__).resolve().parent / "migrations" / "postgres"

# pg_advisory_xact_lock key: serialises nodes migrating the same database at once.
_PG_LOCK_KEY = 0x4C65766572657401  # "Leveret" + 1


def migration_files(directory: str | Path) -> list[tuple[int, Path]]:
    """(version, path) of every migration file in ``directory``, in version order."""
    found: dict[int, Path] = {}
    for path in Path(directory).iterdir():
        m = _FILE.match(path.name)
        if not m:
            continue
        version = int(m.group(1))
        if version in found:
            raise ValueError(f"two migrations with version {version}: {found[version].name} and {path.name}")
        found[version] = path
    return sorted(found.items())


async def apply_postgres(conn: psycopg.AsyncConnection[Any], directory: str | Path) -> list[int]:
    """Apply the missing migrations in ``directory`` over a psycopg AsyncConnection; return the versions applied.

    One transaction per file, each holding a transaction-scoped advisory lock, so
    several nodes starting on the same database apply every file exactly once.
    """
    applied: list[int] = []
    for version, path in migration_files(directory):
        script = path.read_text(encoding="utf-8")
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (_PG_LOCK_KEY,))
            await conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations ("
                "version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
            )
            cur = await conn.execute("SELECT 1 FROM schema_migrations WHERE version = %s", (version,))
            if await cur.fetchone() is not None:
                continue
            await conn.execute(script.encode("utf-8"))  # several statements, no parameters
            await conn.execute("INSERT INTO schema_migrations (version, applied_at) VALUES (%s, now())", (version,))
        applied.append(version)
    return applied


def apply_sqlite(db: sqlite3.Connection, directory: Path) -> list[int]:
    """Apply the numbered migrations (NNN_name.sql) not applied yet, in order; return them."""
    db.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, applied_at TEXT NOT NULL)")
    done = {row[0] for row in db.execute("SELECT version FROM schema_migrations")}
    found = migration_files(directory)
    applied = []
    for version, path in found:
        if version in done:
            continue
        try:
            db.executescript(
                f"BEGIN IMMEDIATE;\n{path.read_text()}\n"
                f"INSERT INTO schema_migrations VALUES ({version}, datetime('now'));\nCOMMIT;"
            )
        except sqlite3.Error:
            if db.in_transaction:
                db.rollback()
            raise
        applied.append(version)
    return applied
