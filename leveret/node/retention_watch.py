"""Applies retention requests to the queues this node holds (docs/RETENTION.md, "Live brokers").

A retention run marks rows and writes a request per queue; this task finds
the requests (Postgres: LISTEN/NOTIFY, with a poll as fallback; SQLite: a
poll), drops the marked offsets from the in-memory queue through
``Queue.drop_offsets`` (ready ones leave without delivery, unacked ones are
never redelivered), waits for the group commit that carries those removals,
and only then marks the request applied: the job reports the queue's
messages removed after that, never before.
"""

from __future__ import annotations

import asyncio
import logging
import time

from core.engine.broker import Broker
from core.model.tasks import stop_task
from persistence.retention_requests import RequestTable

log = logging.getLogger("leveret.retention")

HEARTBEAT_TTL = 15.0  # a job treats a node silent for longer as gone


class RetentionWatch:
    def __init__(self, broker: Broker, table: RequestTable, poll: float = 1.0) -> None:
        self.broker = broker
        self.table = table
        self.poll = poll
        self.applied = 0
        self._open = False
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        await stop_task(self._task)
        if self._open:
            try:
                await self.table.leave(self.broker.node_id)
            except Exception as exc:  # noqa: BLE001 - best effort: the row expires anyway
                log.warning("could not remove the retention watcher row", extra={"error": str(exc)})
        await self._close()

    async def _close(self) -> None:
        self._open = False
        try:
            await self.table.close()
        except Exception:  # noqa: BLE001, S110 - closing a connection that is gone already
            pass

    async def _run(self) -> None:
        beat = 0.0
        failing = False
        while True:
            try:
                if not self._open:
                    await self.table.open()
                    self._open = True
                if time.monotonic() - beat > HEARTBEAT_TTL / 3:
                    await self.table.heartbeat(self.broker.node_id, HEARTBEAT_TTL)
                    beat = time.monotonic()
                await self.apply_pending()
                if failing:
                    log.info("retention requests available again")
                    failing = False
                await self.table.wait(self.poll)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the store may be down: keep serving, reconnect, retry
                if not failing:
                    log.warning("retention requests unavailable; retrying", extra={"error": str(exc)})
                    failing = True
                await self._close()
                beat = 0.0
                await asyncio.sleep(self.poll)

    async def apply_pending(self) -> int:
        """Apply every pending request for a queue held here; return how many were applied."""
        done = 0
        for vhost, name, run_id in await self.table.pending():
            vh = self.broker.vhosts.get(vhost)
            q = vh.queues.get(name) if vh is not None else None
            if q is None or q.storage is None:
                continue  # not a durable queue of this node: its owner applies it
            offsets = await self.table.marked_offsets(vhost, name)
            dropped = q.drop_offsets(offsets)  # synchronous: nothing is delivered in between
            if not await self._committed():
                continue  # retried on the next round; the job waits or reports it pending
            await self.table.applied(vhost, name, run_id, self.broker.node_id)
            done += 1
            self.applied += 1
            log.info("retention applied", extra={"queue": f"{vhost}/{name}", "run_id": run_id,
                                                 "marked": len(offsets), "dropped_ready": dropped})
        return done

    async def _committed(self) -> bool:
        committer = self.broker.committer
        if committer is None:
            return True
        error = await committer.committed()
        if error is not None:
            log.warning("retention removal not committed; retrying", extra={"error": str(error)})
        return error is None
