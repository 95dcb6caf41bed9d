"""Native gRPC API throughput and latency, comparable with ``python -m bench --scenario transient / latency``.

    python -m bench.grpc_bench --target 127.0.0.1:50051 [--duration 5] [--warmup 1]

throughput: one producer process (PushBatch of 100 x 256 B, transient, a few
calls in flight, backlog bounded to 20,000) and one consumer process
(Subscribe, prefetch 1000, Ack every 100), as the AMQP transient plan;
deliveries/s are sampled after the warm-up.
latency: 1000 msg/s of 256 B pushes, received by a subscriber in the same
process (one clock); p50/p99 of push start -> message in the client.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import struct
import time
import uuid
from typing import Any

from leveret.client import AsyncClient

BODY = 256
BATCH = 500
MAX_BACKLOG = 20_000
_STAMP = struct.Struct(">Q")


def _loop_run(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)


async def _consume(target: str, queue: str, delivered: Any, stop: Any) -> None:
    async with AsyncClient(target) as c:
        sub = await c.subscribe(f"{queue}/", prefetch=1000, max_batch=512)
        delivered.value = -1  # subscribed
        pending: list[Any] = []
        while not stop.is_set():
            m = await sub.get(timeout=0.2)
            if m is None:
                continue
            batch = [m, *sub.poll()]
            pending.extend(batch)
            delivered.value += len(batch)
            if len(pending) >= 500:
                await sub.ack(pending)
                pending = []


def consumer_main(target: str, queue: str, delivered: Any, stop: Any) -> None:
    _loop_run(_consume(target, queue, delivered, stop))


async def _produce(target: str, queue: str, delivered: Any, stop: Any) -> None:
    body = bytes(BODY)
    published = 0
    async with AsyncClient(target) as c:
        async def one() -> None:
            nonlocal published
            while not stop.is_set():
                if published - max(delivered.value, 0) > MAX_BACKLOG:
                    await asyncio.sleep(0.001)
                    continue
                published += BATCH
                await c.push_many(queue, [body] * BATCH, persistent=False)

        await asyncio.gather(*(one() for _ in range(4)))


def producer_main(target: str, queue: str, delivered: Any, stop: Any) -> None:
    _loop_run(_produce(target, queue, delivered, stop))


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def throughput(target: str, duration: float, warmup: float, pid: int = 0) -> tuple[float, float]:
    """Deliveries/s, and the broker's CPUs busy meanwhile (0 without ``pid``)."""
    queue = f"grpc-bench-{uuid.uuid4().hex[:8]}"

    async def setup() -> None:
        async with AsyncClient(target) as c:
            await c.create_queue(queue)

    async def teardown() -> None:
        async with AsyncClient(target) as c:
            await c.delete_queue(queue)

    asyncio.run(setup())
    ctx = mp.get_context("spawn")
    delivered = ctx.Value("q", 0, lock=False)
    stop = ctx.Event()
    cons = ctx.Process(target=consumer_main, args=(target, queue, delivered, stop))
    cons.start()
    deadline = time.monotonic() + 30
    while delivered.value != -1 and time.monotonic() < deadline:
        time.sleep(0.01)
    delivered.value = 0
    prod = ctx.Process(target=producer_main, args=(target, queue, delivered, stop))
    prod.start()
    time.sleep(warmup)
    c0 = _cpu_seconds(pid) if pid else 0.0
    n0, t0 = delivered.value, time.monotonic()
    time.sleep(duration)
    n1, t1 = delivered.value, time.monotonic()
    c1 = _cpu_seconds(pid) if pid else 0.0
    stop.set()
    prod.join(10)
    cons.join(10)
    for p in (prod, cons):
        if p.is_alive():
            p.kill()
    asyncio.run(teardown())
    return (n1 - n0) / (t1 - t0), (c1 - c0) / (t1 - t0)


async def _latency(target: str, duration: float, warmup: float, rate: int = 1000) -> tuple[float, float, int]:
    queue = f"grpc-lat-{uuid.uuid4().hex[:8]}"
    samples: list[int] = []
    async with AsyncClient(target) as pub, AsyncClient(target) as con:
        await pub.create_queue(queue)
        sub = await con.subscribe(f"{queue}/", auto_ack=True)
        warm_ns = time.perf_counter_ns() + int(warmup * 1e9)
        padding = bytes(BODY - _STAMP.size)

        async def receive() -> None:
            async for m in sub:
                now = time.perf_counter_ns()
                sent = _STAMP.unpack_from(m.content)[0]
                if sent >= warm_ns:
                    samples.append(now - sent)

        task = asyncio.create_task(receive())
        start = time.monotonic()
        end = start + warmup + duration
        i = 0
        while time.monotonic() < end:
            i += 1
            await pub.push(queue, _STAMP.pack(time.perf_counter_ns()) + padding, persistent=False)
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        await asyncio.sleep(0.2)
        task.cancel()
        await sub.close()
        await pub.delete_queue(queue)
    samples.sort()
    return samples[len(samples) // 2] / 1e3, samples[int(len(samples) * 0.99)] / 1e3, len(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--pid", type=int, default=0, help="the broker's pid, to report its CPU use")
    args = ap.parse_args()
    rate, cpu = throughput(args.target, args.duration, args.warmup, args.pid)
    extra = f"; broker {cpu:.2f} CPUs, {cpu / rate * 1e6:.1f} us/msg" if args.pid and rate else ""
    print(f"grpc transient throughput: {rate:,.0f} msg/s (1 producer, 1 consumer, 256 B){extra}")
    p50, p99, n = _loop_run(_latency(args.target, args.duration, args.warmup))
    print(f"grpc latency at 1000 msg/s: p50 {p50:.0f} us, p99 {p99:.0f} us ({n} samples)")


if __name__ == "__main__":
    main()
