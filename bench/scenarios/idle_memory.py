"""Broker memory per idle connection: RSS delta after opening N connections, divided by N.

Each connection completes the handshake and opens one channel, then sits
idle.  RSS is summed over the broker PID and its descendants.  Allocators
and Erlang's GC make this approximate, hence a settle pause before sampling.
"""

from __future__ import annotations

import asyncio
import resource

from bench import loop
from bench.connection import Connection
from bench.memory import PROC, pid_listening_on, tree_rss_kb
from bench.ops import open_channel
from bench.results import Metric, RunOptions, Skipped
from bench.target import Target

CONCURRENCY = 50
# RSS is sampled until it stops moving: a broker still freeing memory from the
# previous scenario (or still growing after the opens) would skew the delta.
SETTLE_STEP = 0.5
SETTLE_TOLERANCE_KIB = 256
SETTLE_MAX_SECONDS = 15.0
# No real broker keeps an open connection + channel in under 1 KiB.
SUSPICIOUSLY_LOW_KIB = 1.0


def resolve_pid(target: Target) -> int:
    if target.pid is None:
        raise Skipped(f"needs --pid {target.name}=PID (or =auto)")
    if target.pid == "auto":
        pid = pid_listening_on(target.url.port)
        if pid is None:
            raise Skipped(f"--pid {target.name}=auto: no process found listening on port {target.url.port}")
        return pid
    pid = int(target.pid)
    if not (PROC / str(pid)).is_dir():
        raise Skipped(f"--pid {target.name}={pid}: no such process")
    return pid


def _raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(needed, hard), hard))


async def _settled_rss(pid: int) -> int:
    """RSS once two samples SETTLE_STEP apart agree within SETTLE_TOLERANCE_KIB (or after a cap)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_MAX_SECONDS
    last = tree_rss_kb(pid)
    while loop.time() < deadline:
        await asyncio.sleep(SETTLE_STEP)
        now = tree_rss_kb(pid)
        if abs(now - last) <= SETTLE_TOLERANCE_KIB:
            return now
        last = now
    return last


async def _run(target: Target, opts: RunOptions, pid: int) -> tuple[list[Metric], dict[str, object]]:
    count = opts.idle_connections
    _raise_fd_limit(count + 256)
    before = await _settled_rss(pid)
    conns: list[Connection] = []
    gate = asyncio.Semaphore(CONCURRENCY)

    async def open_one() -> None:
        async with gate:
            conn = await Connection.open(target.url)
            conns.append(conn)
            await open_channel(conn)

    async def close_all() -> None:
        async def close_one(conn: Connection) -> None:
            async with gate:
                await conn.close()

        await asyncio.gather(*(close_one(c) for c in conns), return_exceptions=True)

    try:
        await asyncio.wait_for(asyncio.gather(*(open_one() for _ in range(count))), opts.hard_timeout / 2)
        after = await _settled_rss(pid)
        if any(not c.is_open for c in conns):
            raise RuntimeError("some idle connections were closed by the broker")
    finally:
        await close_all()
    per_conn = (after - before) / count
    notes: dict[str, object] = {"pid": pid, "connections": count, "rss_before_kib": before, "rss_after_kib": after}
    if per_conn < SUSPICIOUSLY_LOW_KIB:
        notes["warning"] = (
            f"RSS barely moved ({after - before} KiB for {count} connections): the broker likely reused memory "
            "freed by earlier work; measure on a freshly started broker"
        )
    return [Metric("RSS per idle connection", per_conn, "KiB", "lower")], notes


def run(target: Target, opts: RunOptions) -> tuple[list[Metric], dict[str, object]]:
    pid = resolve_pid(target)
    return loop.run(asyncio.wait_for(_run(target, opts, pid), opts.hard_timeout))
