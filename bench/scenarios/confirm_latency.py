"""Publisher-confirm round trip of a lone publisher (window 1) for persistent messages.

One durable queue with no consumer, so every confirm waits for the broker to
make the message durable rather than for a consumer ack.
"""

from __future__ import annotations

import asyncio
import time

from bench import loop
from bench.codec import encode_publish
from bench.connection import Connection
from bench.ops import cleanup, confirm_select, declare_queue, open_channel, unique_name
from bench.results import Metric, RunOptions
from bench.stats import percentile
from bench.target import Target

BODY_SIZE = 256


async def _run(target: Target, opts: RunOptions) -> tuple[list[Metric], dict[str, object]]:
    queue = unique_name("persistent", "lone")
    conn = await Connection.open(target.url)
    samples: list[int] = []
    try:
        ch = await open_channel(conn)
        await declare_queue(conn, ch, queue, durable=True)
        await confirm_select(conn, ch)
        message = encode_publish(ch, "", queue, bytes(BODY_SIZE), delivery_mode=2, frame_max=conn.frame_max)
        start = time.monotonic()
        warm_end = start + opts.warmup
        end = warm_end + opts.duration
        sent = 0
        while (now := time.monotonic()) < end:
            t0 = time.perf_counter_ns()
            conn.write(message)
            sent += 1
            await conn.wait_confirmed(sent, timeout=max(1.0, end - now))
            if now >= warm_end:
                samples.append(time.perf_counter_ns() - t0)
        nacked = conn.scanner.confirms.nacked
    finally:
        try:
            await cleanup(conn, queues=[queue], exchanges=[])
        finally:
            await conn.close()
    if not samples:
        raise RuntimeError("no confirms received")
    samples.sort()
    return [
        Metric("confirm p50 (window 1)", percentile(samples, 50) * 1e-6, "ms", "lower"),
        Metric("confirm p99 (window 1)", percentile(samples, 99) * 1e-6, "ms", "lower"),
    ], {"lone_confirms": len(samples), "lone_nacked": nacked}


def run(target: Target, opts: RunOptions) -> tuple[list[Metric], dict[str, object]]:
    return loop.run(asyncio.wait_for(_run(target, opts), opts.hard_timeout))
