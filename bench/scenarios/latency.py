"""End-to-end latency at a fixed, light publish rate.

Producer and consumer live in this one process (two connections) so both
ends read the same ``perf_counter_ns`` clock; at 1000 msg/s the client is
nowhere near busy enough for that to distort the figures.  Each 256-byte
body starts with the send timestamp; receive time is taken when the socket
read is handed to the client, before parsing.
"""

from __future__ import annotations

import asyncio
import struct
import time

from bench import loop
from bench.codec import encode_publish
from bench.connection import Connection
from bench.cpu import CpuWatch, broker_pid_of
from bench.ops import cleanup, consume, declare_queue, open_channel, qos, unique_name
from bench.results import Metric, RunOptions
from bench.stats import percentile
from bench.target import Target

RATE = 1000  # msg/s
BODY_SIZE = 256
_STAMP = struct.Struct(">Q")


async def _run(target: Target, opts: RunOptions) -> tuple[list[Metric], dict[str, object]]:
    queue = unique_name("latency")
    cons = await Connection.open(target.url, capture_bodies=True)
    pub = await Connection.open(target.url)
    try:
        ch = await open_channel(cons)
        await declare_queue(cons, ch, queue, auto_delete=True)
        await qos(cons, ch, 1000)
        samples: list[int] = []
        received = 0
        warm_ns = 0

        def on_bodies(bodies: list[bytes], recv_ns: int) -> None:
            nonlocal received
            for body in bodies:
                sent_ns = _STAMP.unpack_from(body)[0]
                if sent_ns >= warm_ns:
                    received += 1
                    samples.append(recv_ns - sent_ns)

        cons.on_bodies = on_bodies
        await consume(cons, ch, queue, ack_every=100)
        pch = await open_channel(pub)
        padding = bytes(BODY_SIZE - _STAMP.size)

        cpu = CpuWatch(broker_pid_of(target))
        start = time.monotonic()
        warm_ns = time.perf_counter_ns() + int(opts.warmup * 1e9)
        end = start + opts.warmup + opts.duration
        sent_measured = 0
        i = 0
        measuring = False
        while (now := time.monotonic()) < end:
            if not measuring and now >= start + opts.warmup:
                cpu.start()
                measuring = True
            # Catch up on every message due by now, so the average rate is exact
            # even though timers only have ~1 ms resolution.
            due = int((now - start) * RATE) + 1
            while i < due:
                stamp = time.perf_counter_ns()
                pub.write(encode_publish(pch, "", queue, _STAMP.pack(stamp) + padding, delivery_mode=1))
                if stamp >= warm_ns:
                    sent_measured += 1
                i += 1
            # uvloop fires sub-millisecond timers immediately; a shorter sleep would
            # busy-spin and steal CPU from the broker.
            await asyncio.sleep(max(0.001, start + i / RATE - time.monotonic()))
        cpu_split = cpu.stop_dict()
        await asyncio.sleep(0.5)  # let in-flight messages arrive
        for conn in (cons, pub):
            if conn.error is not None:
                raise conn.error
    finally:
        try:
            await cleanup(pub, queues=[queue], exchanges=[])
        finally:
            await asyncio.gather(pub.close(), cons.close())
    if not samples:
        raise RuntimeError("no messages received")
    samples.sort()
    ms = 1e-6
    metrics = [
        Metric("latency p50", percentile(samples, 50) * ms, "ms", "lower"),
        Metric("latency p99", percentile(samples, 99) * ms, "ms", "lower"),
        Metric("latency max", samples[-1] * ms, "ms", "lower"),
    ]
    return metrics, {"sent": sent_measured, "received": received, "rate": RATE, "cpu": cpu_split}


def run(target: Target, opts: RunOptions) -> tuple[list[Metric], dict[str, object]]:
    return loop.run(asyncio.wait_for(_run(target, opts), opts.hard_timeout))
