"""``POST /api/leveret/backup``: a consistent copy of the node's embedded store, streamed as a tar.

A running node holds the store (its writer thread, the body segments' lock), so the copy is made by
the node (persistence/backup.py, on the store's thread) into a temporary file in the data directory
and streamed to the caller (``leveret ctl backup DIR``), then removed. One backup at a time (409).
A Postgres store is backed up with Postgres's own tools (400; docs/OPERATIONS.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from core.ports.store import StoreError
from leveret.http.errors import HttpError, bad_request
from persistence.backup import BackupError
from persistence.sqlite import SQLiteStore

if TYPE_CHECKING:
    from leveret.http.routing import Router
    from leveret.http.server import Call

log = logging.getLogger("leveret.http")

_CHUNK = 1024 * 1024
_running: set[int] = set()  # ids of the stores being backed up now


def register(r: Router) -> None:
    r.add("leveret/backup", POST=(backup, "administrator"))


async def backup(call: Call) -> web.StreamResponse:
    store = call.node.store
    if not isinstance(store, SQLiteStore):
        raise bad_request("backup copies the embedded (sqlite) store; back a Postgres store up with pg_dump or "
                          "pg_basebackup (docs/OPERATIONS.md)")
    if id(store) in _running:
        raise HttpError(409, "conflict", "a backup of this node is already running")
    _running.add(id(store))
    tar = Path(store.path).parent / f".backup-{time.time_ns()}.tar"
    loop = asyncio.get_running_loop()
    try:
        started = time.monotonic()
        try:
            manifest = await store.backup(tar)
        except (StoreError, BackupError, OSError) as exc:
            log.error("backup failed", extra={"error": str(exc)})
            raise HttpError(500, "backup_failed", str(exc)) from None
        size = tar.stat().st_size
        log.info("backup made", extra={"bytes": size, "messages": manifest["messages"],
                                       "segments": len(manifest["segments"]),
                                       "seconds": round(time.monotonic() - started, 3)})
        response = web.StreamResponse(headers={
            "Content-Type": "application/x-tar", "Content-Length": str(size),
            "X-Leveret-Backup": json.dumps({"messages": manifest["messages"], "queues": manifest["queues"]})})
        await response.prepare(call.request)
        with open(tar, "rb") as f:
            while chunk := await loop.run_in_executor(None, f.read, _CHUNK):
                await response.write(chunk)
        await response.write_eof()
        return response
    finally:
        _running.discard(id(store))
        await loop.run_in_executor(None, lambda: tar.unlink(missing_ok=True))
