"""PostgreSQL servers for the chaos suite: a primary that can be restarted on its port, and its
streaming-replication standby that can be promoted.

Like harness/pg.py (same binaries, same drop to the ``postgres`` user as root,
loopback only, trust auth), but the settings that decide what a confirm means
are the suite's: ``synchronous_commit`` on, and with ``sync_standby`` the primary
waits for the standby (``synchronous_standby_names = '*'``) before a commit
returns, which is what PostgreSQL's documentation says a failover without loss
of committed transactions needs ("High Availability, Load Balancing, and
Replication", 27.2.8 Synchronous Replication).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from harness import pg
from harness.ports import free_port


class PgServer:
    """One postgres process on a data directory and a fixed port."""

    def __init__(self, base: Path, name: str, port: int | None = None) -> None:
        self.dir = base / name
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.user: dict[str, Any] = pg._as_service_user()
        self.options: list[str] = []

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *cmd: str) -> None:
        done = subprocess.run(list(cmd), cwd=self.dir.parent, env=pg._env(self.dir.parent), stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=120, **self.user)
        if done.returncode != 0:
            raise RuntimeError(f"{cmd[0]} failed: {(done.stdout + done.stderr).decode(errors='replace')[-2000:]}")

    def initdb(self) -> None:
        self._run(str(pg.PG_BIN / "initdb"), "-D", str(self.dir), "-A", "trust", "-U", "postgres", "--no-sync",
                  "--no-locale", "-E", "UTF8")

    def basebackup_of(self, primary: PgServer) -> None:
        """A standby of ``primary``: its data directory copied over the replication protocol, set to follow it."""
        self._run(str(pg.PG_BIN / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres",
                  "-D", str(self.dir), "-R", "-X", "stream", "--no-sync")

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None
        with open(self.dir.parent / f"{self.dir.name}.log", "ab") as log:
            self.proc = subprocess.Popen(
                [str(pg.PG_BIN / "postgres"), "-D", str(self.dir), "-p", str(self.port), "-k", str(self.dir.parent),
                 "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "full_page_writes=off",
                 "-c", "max_connections=200", "-c", "autovacuum_naptime=1", *self.options],
                cwd=self.dir.parent, env=pg._env(self.dir.parent), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, **self.user,
            )  # fmt: skip
        deadline = time.monotonic() + pg.START_TIMEOUT
        while time.monotonic() < deadline and self.proc.poll() is None:
            if pg._accepts(self.dsn):
                return
            time.sleep(0.05)
        pg._stop(self.proc)
        raise RuntimeError(f"postgres {self.dir.name} did not start on {self.port}: {self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None:
            pg._stop(self.proc)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def promote(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_promote(true, 30)")

    def log_tail(self) -> str:
        try:
            return (self.dir.parent / f"{self.dir.name}.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""


class PgPair:
    """A primary (restartable on its port) and, when asked, a streaming standby of it."""

    def __init__(self, standby: bool = False, sync_standby: bool = False) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="leveret-chaos-pg-"))
        self.primary = PgServer(self.base, "primary")
        self.standby: PgServer | None = PgServer(self.base, "standby") if standby else None
        self.sync_standby = sync_standby

    # RestartablePostgres's interface, which the cluster faults use
    @property
    def port(self) -> int:
        return self.primary.port

    @property
    def dsn(self) -> str:
        return self.primary.dsn

    def create(self) -> None:
        reason = pg.postgres_unavailable()
        if reason:
            raise RuntimeError(reason)
        if self.primary.user:
            os.chown(self.base, self.primary.user["user"], self.primary.user["group"])
        os.chmod(self.base, 0o700)
        self.primary.initdb()
        self.primary.options = ["-c", "synchronous_commit=on"]
        if self.standby is not None and self.sync_standby:
            self.primary.options += ["-c", "synchronous_standby_names=*"]
        self.primary.start()
        if self.standby is not None:
            self.standby.basebackup_of(self.primary)
            self.standby.start()

    def start(self) -> None:
        self.primary.start()

    def stop(self) -> None:
        self.primary.stop()

    def close(self) -> None:
        for s in (self.primary, self.standby):
            if s is not None:
                s.kill()
        shutil.rmtree(self.base, ignore_errors=True)
