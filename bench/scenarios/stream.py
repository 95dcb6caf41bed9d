"""Stream queue vs. classic queue in one run: publish, then read everything back.

Four phases, one after the other (so client and broker never compete with
another phase for the CPU), all with 256-byte persistent messages:

1. publish to a stream (``x-queue-type: stream``) for ``duration`` seconds
   with publisher confirms (window 2000): published msg/s;
2. publish the same number of messages to a durable classic queue, same
   window: published msg/s;
3. read the stream from ``x-stream-offset: first`` (prefetch 1000, ack with
   multiple=true every 100): msg/s from consume-ok to the last delivery;
4. consume the classic queue's backlog the same way: msg/s.

A stream read leaves the messages in place (acks only return credit); a
classic consume removes each message, in the store too. The target of the
stream work: reading a stream from the first offset at least as fast as
consuming a classic queue.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pamqp import commands

from bench import loop
from bench.codec import encode_publish
from bench.connection import Connection
from bench.cpu import CpuWatch, broker_pid_of
from bench.ops import cleanup, confirm_select, open_channel, qos, unique_name
from bench.results import Metric, RunOptions
from bench.target import Target

BODY_SIZE = 256
BLOCK = 100
CONFIRM_WINDOW = 2000
PREFETCH = 1000
ACK_EVERY = 100


async def _declare(conn: Connection, ch: int, name: str, arguments: dict[str, Any] | None) -> None:
    await conn.rpc(ch, commands.Queue.Declare(queue=name, durable=True, arguments=arguments))


async def _publish(target: Target, queue: str, *, seconds: float | None = None, count: int = 0) -> tuple[int, float]:
    """Publish for ``seconds`` or ``count`` messages (whole blocks), all confirmed: (messages, elapsed)."""
    conn = await Connection.open(target.url)
    try:
        ch = await open_channel(conn)
        await confirm_select(conn, ch)
        block = encode_publish(ch, "", queue, bytes(BODY_SIZE), delivery_mode=2, frame_max=conn.frame_max) * BLOCK
        published = 0
        start = time.monotonic()
        end = start + seconds if seconds is not None else float("inf")
        while (published < count or seconds is not None) and time.monotonic() < end:
            if published + BLOCK - conn.scanner.confirms.confirmed > CONFIRM_WINDOW:
                await conn.wait_confirmed(published + BLOCK - CONFIRM_WINDOW, timeout=30)
                continue
            conn.write(block)
            published += BLOCK
            await conn.drain()
            await asyncio.sleep(0)
        await conn.wait_confirmed(published, timeout=60)
        elapsed = time.monotonic() - start
        if conn.scanner.confirms.nacked:
            raise RuntimeError(f"{conn.scanner.confirms.nacked} publishes to {queue} were nacked")
        return published, elapsed
    finally:
        await conn.close()


async def _read(target: Target, queue: str, count: int, arguments: dict[str, Any] | None) -> float:
    """Consume ``count`` messages (prefetch, acks every 100): elapsed seconds from consume-ok."""
    conn = await Connection.open(target.url)
    try:
        ch = await open_channel(conn)
        await qos(conn, ch, PREFETCH)
        conn.ack_every = ACK_EVERY
        conn.ack_channel = ch
        await conn.rpc(ch, commands.Basic.Consume(queue=queue, consumer_tag="bench-read", arguments=arguments))
        start = time.monotonic()
        deadline = start + 120
        while conn.scanner.deliveries < count:
            if conn.error is not None:
                raise conn.error
            if time.monotonic() > deadline:
                raise RuntimeError(f"read {conn.scanner.deliveries} of {count} from {queue} in 120 s")
            await asyncio.sleep(0.001)
        return time.monotonic() - start
    finally:
        await conn.close()


async def _run(target: Target, opts: RunOptions) -> tuple[list[Metric], dict[str, object]]:
    stream, classic = unique_name("stream", "log"), unique_name("stream", "classic")
    warm = unique_name("stream", "warmup")
    cpu = CpuWatch(broker_pid_of(target))
    setup = await Connection.open(target.url)
    try:
        ch = await open_channel(setup)
        await _declare(setup, ch, stream, {"x-queue-type": "stream"})
        await _declare(setup, ch, classic, None)
        # Unmeasured: whichever phase ran first was ~15 % slower in either order (store warm-up).
        await _declare(setup, ch, warm, None)
        await _publish(target, warm, seconds=opts.warmup)
        await setup.rpc(ch, commands.Queue.Delete(queue=warm))
        cpu.start()  # over all four phases: the harness keeps the least disturbed run
        pid = broker_pid_of(target)
        busy: dict[str, float | None] = {}

        async def phase(name: str, work: Any) -> Any:
            # Broker CPU-seconds of the phase: per message it stands up to other processes' noise.
            watch = CpuWatch(pid)
            started = time.monotonic()
            result = await work
            broker = watch.stop_dict()["broker"]
            busy[name] = None if broker is None else broker * (time.monotonic() - started)
            return result

        n, stream_pub = await phase("stream publish", _publish(target, stream, seconds=opts.duration))
        n2, classic_pub = await phase("classic publish", _publish(target, classic, count=n))
        assert n2 == n
        stream_read = await phase("stream read from first", _read(target, stream, n, {"x-stream-offset": "first"}))
        classic_read = await phase("classic consume", _read(target, classic, n, None))
        cpu_split = cpu.stop_dict()
    finally:
        try:
            await cleanup(setup, queues=[stream, classic, warm], exchanges=[])
        finally:
            await setup.close()
    metrics = [
        Metric("stream publish", n / stream_pub, "msg/s"),
        Metric("classic publish", n / classic_pub, "msg/s"),
        Metric("stream read from first", n / stream_read, "msg/s"),
        Metric("classic consume", n / classic_read, "msg/s"),
    ]
    for name, seconds in busy.items():
        if seconds is not None:
            metrics.append(Metric(f"{name}: broker CPU", seconds / n * 1e6, "µs/msg", "lower"))
    return metrics, {"messages": n, "read_ratio_stream_over_classic": round(classic_read / stream_read, 3),
                     "cpu": cpu_split}


def run(target: Target, opts: RunOptions) -> tuple[list[Metric], dict[str, object]]:
    return loop.run(asyncio.wait_for(_run(target, opts), opts.hard_timeout + 4 * opts.duration))
