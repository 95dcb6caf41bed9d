"""A throwaway PostgreSQL server for tests (and benchmarks).

Debian's server binaries (package ``postgresql-15``, pulled in by ``postgresql``)
live in /usr/lib/postgresql/15/bin. ``initdb`` refuses to run as root, so as root
the cluster is created and served by the ``postgres`` user in a temporary
directory that user owns; as any other user it runs as that user. The server
listens on a free loopback port with fsync off, is stopped with SIGINT (fast
shutdown) and its directory is removed afterwards.

Set ``LEVERET_TEST_POSTGRES_DSN`` to use an existing server instead (it must let
the test user create and drop databases).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from harness.ports import free_port

PG_BIN = Path(os.environ.get("LEVERET_PG_BIN", "/usr/lib/postgresql/15/bin"))
DSN_ENV = "LEVERET_TEST_POSTGRES_DSN"
SERVICE_USER = "postgres"
START_TIMEOUT = 30.0
STOP_TIMEOUT = 30.0


def postgres_unavailable() -> str | None:
    """Why a throwaway server cannot be started here, or None when it can."""
    for tool in ("initdb", "postgres"):
        if not os.access(PG_BIN / tool, os.X_OK):
            return (
                f"PostgreSQL server binaries not found ({PG_BIN / tool} is missing): "
                "install the Debian package postgresql-15 (apt-get install postgresql) "
                f"or set {DSN_ENV} to a server the tests may create databases on"
            )
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(SERVICE_USER)
        except KeyError:
            return f"running as root and there is no {SERVICE_USER!r} user to run initdb as (initdb refuses root)"
    return None



def _as_service_user() -> dict[str, Any]:
    """Popen arguments that drop root to the postgres user (nothing when not root)."""
    if os.geteuid() != 0:
        return {}
    pw = pwd.getpwnam(SERVICE_USER)
    return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(LC_ALL="C", LANG="C", HOME=str(home), TZ="UTC")
    return env


def _accepts(dsn: str) -> bool:
    try:
        with psycopg.connect(dsn, connect_timeout=2):
            return True
    except psycopg.OperationalError:
        return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)  # fast shutdown: disconnects clients, no waiting for them
    try:
        proc.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _start(pg_dir: Path, data: Path, log_path: Path, popen_user: dict[str, Any]) -> tuple[subprocess.Popen[bytes], str]:
    """Start the server on a free port; retry a few times in case the port was taken meanwhile."""
    last_log = ""
    for _attempt in range(3):
        port = free_port()
        dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [
                    str(PG_BIN / "postgres"),
                    "-D", str(data),
                    "-p", str(port),
                    "-k", str(pg_dir),
                    "-c", "listen_addresses=127.0.0.1",
                    # Tests need no crash safety of Postgres itself; benchmarks set LEVERET_PG_FSYNC=on.
                    "-c", f"fsync={os.environ.get('LEVERET_PG_FSYNC', 'off')}",
                    # With fsync on (benchmarks) a commit also waits for its WAL flush, as a
                    # confirm promises; LEVERET_PG_SYNCHRONOUS_COMMIT overrides it either way.
                    "-c", "synchronous_commit=" + os.environ.get(
                        "LEVERET_PG_SYNCHRONOUS_COMMIT", os.environ.get("LEVERET_PG_FSYNC", "off")),
                    "-c", "full_page_writes=off",
                    "-c", "max_connections=200",
                    # As docs/ARCHITECTURE.md advises operators: vacuum keeps up with deletes.
                    "-c", "autovacuum_naptime=1",
                ],
                cwd=pg_dir,
                env=_env(pg_dir),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                **popen_user,
            )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline and proc.poll() is None:
            if _accepts(dsn):
                return proc, dsn
            time.sleep(0.05)
        _stop(proc)
        last_log = log_path.read_text(errors="replace")[-3000:]
        if "could not bind" not in last_log and "already in use" not in last_log:
            break
    raise RuntimeError(f"throwaway postgres did not start; its log ends with:\n{last_log}")


@contextlib.contextmanager
def throwaway_postgres() -> Iterator[str]:
    """Yield the DSN of a fresh PostgreSQL server (superuser ``postgres``, trust auth, loopback only).

    Calls ``pytest.skip`` when no server can be started here.
    """
    external = os.environ.get(DSN_ENV)
    if external:
        yield external
        return
    reason = postgres_unavailable()
    if reason:
        if os.environ.get("CI"):
            # make test installs Postgres (scripts/bootstrap.sh); in CI a skip would hide a broken install.
            pytest.fail(reason)
        pytest.skip(reason)
    popen_user = _as_service_user()
    pg_dir = Path(tempfile.mkdtemp(prefix="leveret-pg-"))
    proc: subprocess.Popen[bytes] | None = None
    try:
        if popen_user:
            os.chown(pg_dir, popen_user["user"], popen_user["group"])
        os.chmod(pg_dir, 0o700)
        data = pg_dir / "data"
        log_path = pg_dir / "postgres.log"
        initdb = subprocess.run(
            [str(PG_BIN / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync", "--no-locale",
             "-E", "UTF8"],
            cwd=pg_dir,
            env=_env(pg_dir),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=120,
            **popen_user,
        )  # fmt: skip
        if initdb.returncode != 0:
            out = (initdb.stdout + initdb.stderr).decode(errors="replace")[-3000:]
            raise RuntimeError(f"initdb failed with exit code {initdb.returncode}:\n{out}")
        proc, dsn = _start(pg_dir, data, log_path, popen_user)
        yield dsn
    finally:
        if proc is not None:
            _stop(proc)
        shutil.rmtree(pg_dir, ignore_errors=True)


if __name__ == "__main__":  # manual check: python -m harness.pg
    with throwaway_postgres() as dsn:
        with psycopg.connect(dsn) as conn:
            row = conn.execute("SELECT version()").fetchone()
        print(dsn, row[0] if row else None)
