"""The Postgres DSN's TLS options reach libpq unchanged (docs/SECURITY.md): sslmode=verify-full with
sslrootcert works against a server with a certificate of that CA, and a CA that did not sign it is refused."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import trustme

from core.ports.store import StoreError
from harness.pg import throwaway_postgres
from persistence.postgres import PostgresStore


@pytest.fixture(scope="module")
def tls_postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    """A throwaway server switched to TLS (ALTER SYSTEM + reload); the DSN, its CA and another CA."""
    if os.getuid() != 0:
        pytest.skip("writing the server's key into its data directory (owned by postgres) needs root here")
    ca, other = trustme.CA(), trustme.CA()
    root = tmp_path_factory.mktemp("pg-tls")
    (root / "ca.pem").write_bytes(ca.cert_pem.bytes())
    (root / "other.pem").write_bytes(other.cert_pem.bytes())
    with throwaway_postgres() as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute("SHOW data_directory").fetchone()
            assert row is not None
            data = Path(row[0])
            leaf = ca.issue_cert("127.0.0.1")
            leaf.cert_chain_pems[0].write_to_path(str(data / "tls.crt"))
            leaf.private_key_pem.write_to_path(str(data / "tls.key"))
            owner = data.stat().st_uid
            for name in ("tls.crt", "tls.key"):
                os.chown(data / name, owner, -1)
                os.chmod(data / name, 0o600)
            conn.execute("ALTER SYSTEM SET ssl_cert_file = 'tls.crt'")
            conn.execute("ALTER SYSTEM SET ssl_key_file = 'tls.key'")
            conn.execute("ALTER SYSTEM SET ssl = on")
            conn.execute("SELECT pg_reload_conf()")
        yield dsn, root / "ca.pem", root / "other.pem"


async def _open_close(dsn: str) -> None:
    store = PostgresStore(dsn)
    await store.open()
    await store.close()


def test_sslmode_and_root_certificate_pass_through(tls_postgres: tuple[str, Path, Path]) -> None:
    dsn, ca, other = tls_postgres
    verified = f"{dsn}?sslmode=verify-full&sslrootcert={ca}"
    for _ in range(50):  # the reload is asynchronous
        try:
            with psycopg.connect(verified) as conn:
                row = conn.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone()
                assert row == (True,)
            break
        except psycopg.OperationalError:
            asyncio.run(asyncio.sleep(0.1))
    asyncio.run(_open_close(verified))  # the store connects with verification
    with pytest.raises(StoreError, match="certificate verify failed"):
        asyncio.run(_open_close(f"{dsn}?sslmode=verify-full&sslrootcert={other}"))
