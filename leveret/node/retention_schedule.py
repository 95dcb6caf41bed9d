"""Retention on a running node: apply the job's requests, and run the job every --retention-interval.

The job runs in a subprocess (``python -m leveret retention run``): Spark's
JVM never lives in the broker process, and the broker keeps serving. One run
at a time: the node waits for its child before scheduling the next, and the
child takes the store-level lease ``retention`` (a row of ``leases`` taken by
a conditional UPDATE), so runs also exclude each other across nodes sharing
Postgres and against a ``leveret retention run`` started by hand.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from leveret.node.retention_watch import RetentionWatch

if TYPE_CHECKING:
    from leveret.node.wiring import Node

log = logging.getLogger("leveret.retention")

LEASE_HELD_EXIT = 3  # spark/retention_job.py: another run holds the lease


class RetentionService:
    def __init__(self, node: Node, watch: RetentionWatch) -> None:
        self.node = node
        self.watch = watch
        self.runs = 0
        self._schedule: asyncio.Task[None] | None = None
        self._child: asyncio.subprocess.Process | None = None

    def schedule(self, interval: float) -> None:
        self._schedule = asyncio.create_task(self._every(interval))

    async def _every(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.run_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a failed run must not stop the schedule or the node
                log.error("scheduled retention run could not start", extra={"error": str(exc)})

    async def run_once(self) -> int:
        """One ``leveret retention run`` in a subprocess; its exit code."""
        cfg = self.node.config
        out_dir = Path(cfg.data_dir) / "retention"
        out_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env["LEVERET_STORE"] = cfg.store
        env["LEVERET_DATA_DIR"] = cfg.data_dir
        if cfg.postgres_dsn:
            env["LEVERET_POSTGRES_DSN"] = cfg.postgres_dsn  # not on the command line: ps shows that
        env.pop("LEVERET_CONFIG", None)
        started = time.monotonic()
        log.info("retention run starting", extra={"output": str(out_dir / "run.log")})
        with open(out_dir / "run.log", "ab") as output:
            self._child = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "leveret", "retention", "run", "--report", str(out_dir / "last-report.json"),
                stdin=asyncio.subprocess.DEVNULL, stdout=output, stderr=output, env=env,
            )  # fmt: skip
            code = await self._child.wait()
            self._child = None
        seconds = round(time.monotonic() - started, 1)
        if code == 0:
            self.runs += 1
            log.info("retention run finished", extra={"seconds": seconds, "report": str(out_dir / "last-report.json")})
        elif code == LEASE_HELD_EXIT:
            log.info("retention run skipped: another run holds the lease", extra={"seconds": seconds})
        else:
            log.error("retention run failed", extra={"exit_code": code, "seconds": seconds,
                                                     "output": str(out_dir / "run.log")})
        return code

    async def stop(self) -> None:
        if self._schedule is not None:
            self._schedule.cancel()
            try:
                await self._schedule
            except asyncio.CancelledError:
                pass
        child = self._child
        if child is not None and child.returncode is None:
            # A run killed midway is safe (docs/RETENTION.md, "Crashes"); the next one converges.
            child.terminate()
            try:
                await asyncio.wait_for(child.wait(), 10)
            except TimeoutError:
                child.kill()
                await child.wait()
        await self.watch.stop()


async def start_retention(node: Node) -> RetentionService | None:
    """The retention watch (always, with a store) and the schedule (with --retention-interval)."""
    cfg = node.config
    from persistence.retention_requests import PostgresRequests, RequestTable, SQLiteRequests

    table: RequestTable
    poll = 1.0
    if cfg.store == "postgres":
        table = PostgresRequests(cfg.postgres_dsn)
        poll = 5.0  # NOTIFY wakes it at once; this is the fallback
    else:
        table = SQLiteRequests(str(Path(cfg.data_dir) / "leveret.sqlite3"))
    watch = RetentionWatch(node.broker, table, poll)
    await watch.start()
    service = RetentionService(node, watch)
    if cfg.retention_interval > 0:
        service.schedule(cfg.retention_interval)
        log.info("retention scheduled", extra={"every_seconds": cfg.retention_interval})
    return service
