"""Shared fixtures for the unit tests."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from harness.pg import throwaway_postgres
from leveret.node import passwords

# As a node does at start: argon2id for new passwords (26 ms a hash), not the
# core's PBKDF2 fallback (280 ms), which would slow every test making a Broker.
passwords.install()
# Nodes these tests start serve no Prometheus endpoint unless a test passes
# --prometheus-port: the default (15692) would collide between parallel runs.
os.environ.setdefault("LEVERET_PROMETHEUS_PORT", "0")


@pytest.fixture(scope="session")
def postgres_dsn() -> Iterator[str]:
    """A PostgreSQL server for the whole session (skips when none can be started here)."""
    with throwaway_postgres() as dsn:
        yield dsn


@pytest.fixture
def postgres_db(postgres_dsn: str) -> Iterator[str]:
    """The DSN of a database created for this test alone and dropped after it."""
    import psycopg
    from psycopg import sql
    from psycopg.conninfo import make_conninfo

    name = f"test_{uuid.uuid4().hex}"
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield make_conninfo(postgres_dsn, dbname=name)
    finally:
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
