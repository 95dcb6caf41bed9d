"""Topic routing with many bindings (issue 25): one binding per device, keys that rarely repeat.

A topic exchange carries N bindings ``dev.<i>.*``, binding i to queue
``i % 4`` of four queues (as an MQTT front end makes one binding per
subscription). Per broker, in turn:

1. **bind**: the N ``queue.bind`` on one channel, pipelined (at most
   ``WINDOW`` unanswered): binds/s.
2. **flood**: one unpaced producer (no confirms, 256 B, delivery mode 1)
   writes blocks of publishes as fast as the socket takes them; the keys are
   ``dev.<d>.k<j>`` for ``KEYS`` different j, so none repeats within 32,768
   publishes and a per-key cache of the size Leveret keeps (10,000) never
   hits; each key reaches exactly one queue, read by one consumer (prefetch
   1000, acks every 100): delivered msg/s and accepted publish/s.
3. **confirms**: one publisher that waits for each publish's confirm before
   the next (as pika's ``BlockingChannel`` with ``confirm_delivery``), the
   same keys, no consumers: confirmed msg/s.
4. **unbind**: the N bindings removed, pipelined: unbinds/s.

``bindings_100``, ``bindings_10k`` and ``bindings_100k`` differ only in N;
the goal of issue 25 is a publish rate at 10k and 100k at least
RabbitMQ's and within 2x of the rate at 100, and bind/unbind throughput at
least RabbitMQ's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection as Pipe
from typing import Any

from pamqp import commands
from pamqp.base import Frame

from bench import loop
from bench.codec import encode_publish, encode_queue_bind
from bench.connection import Connection
from bench.cpu import CpuWatch, broker_pid_of
from bench.ops import confirm_select, declare_exchange, declare_queue, open_channel, unique_name
from bench.results import Metric, RunOptions
from bench.scenarios.procs import CTX, Workers
from bench.scenarios.throughput import SETUP_TIMEOUT, Topology, _cleanup
from bench.target import BrokerUrl, Target
from bench.workers import ConsumeSpec, Counters, _await_go, _run_child, _sleep_until, consumer_main

QUEUES = 4
KEYS = 32_768  # distinct routing keys the publishers cycle through
CHUNK = 256  # publishes per socket write of the unpaced producer
WINDOW = 1_000  # unanswered queue.bind / queue.unbind at most
BODY = bytes(256)
SETTLE_TIMEOUT = 600.0
SIZES = {"bindings_100": 100, "bindings_10k": 10_000, "bindings_100k": 100_000}


def routing_keys(bindings: int) -> list[tuple[str, int]]:
    """(key, queue index) for each key the publishers send: every key matches exactly one binding."""
    out = []
    for j in range(KEYS):
        device = (j * 7919) % bindings  # a prime stride: consecutive keys land far apart in the bindings
        out.append((f"dev.{device}.k{j}", device % QUEUES))
    return out


async def _pipelined(conn: Connection, frames: Iterator[bytes], timeout: float) -> int:
    """Send synchronous methods on channel 1 keeping at most WINDOW unanswered; how many were sent."""
    pending: list[asyncio.Future[Frame]] = []
    sent = 0
    deadline = time.monotonic() + timeout
    batch: list[bytes] = []
    for raw in frames:
        batch.append(raw)
        if len(batch) == WINDOW // 2:
            pending.extend(conn.request_raw(1, b"".join(batch), len(batch)))
            sent += len(batch)
            batch = []
            if len(pending) >= WINDOW:
                await asyncio.wait_for(asyncio.gather(*pending[: WINDOW // 2]), deadline - time.monotonic())
                del pending[: WINDOW // 2]
    pending.extend(conn.request_raw(1, b"".join(batch), len(batch)))
    sent += len(batch)
    await asyncio.wait_for(asyncio.gather(*pending), max(0.001, deadline - time.monotonic()))
    return sent


def _binds(queues: tuple[str, ...], exchange: str, n: int, unbind: bool) -> Iterator[bytes]:
    for i in range(n):
        yield encode_queue_bind(1, queues[i % QUEUES], exchange, f"dev.{i}.*", unbind=unbind)


async def _declare(target: Target, name: str) -> Topology:
    exchange = unique_name(name, "x")
    queues = tuple(unique_name(name, f"q{i}") for i in range(QUEUES))
    conn = await Connection.open(target.url)
    try:
        ch = await open_channel(conn)
        await declare_exchange(conn, ch, exchange, "topic")
        for q in queues:
            await declare_queue(conn, ch, q)  # not auto-delete: the consumers leave before the confirms phase
    finally:
        await conn.close()
    return Topology(exchange, queues, (), ())


async def _bind_all(target: Target, topo: Topology, n: int, unbind: bool) -> float:
    """Bind (or unbind) the N device bindings; per second."""
    conn = await Connection.open(target.url)
    try:
        await open_channel(conn)
        start = time.monotonic()
        sent = await _pipelined(conn, _binds(topo.queues, topo.exchange, n, unbind), timeout=300.0)
        return sent / (time.monotonic() - start)
    finally:
        await conn.close()


@dataclass(frozen=True)
class FloodSpec:
    url: BrokerUrl
    exchange: str
    keys: tuple[str, ...]
    published_counter: int


def flood_main(spec: FloodSpec, counters: Counters, pipe: Pipe) -> None:
    _run_child(lambda: _flood(spec, counters, pipe), pipe)


async def _flood(spec: FloodSpec, counters: Counters, pipe: Pipe) -> dict[str, Any]:
    conn = await Connection.open(spec.url)
    ch = await open_channel(conn)
    chunks = [
        b"".join(encode_publish(ch, spec.exchange, k, BODY, delivery_mode=1, frame_max=conn.frame_max)
                 for k in spec.keys[i : i + CHUNK])
        for i in range(0, len(spec.keys), CHUNK)
    ]
    start_at, end_at = await _await_go(pipe)
    await _sleep_until(start_at)
    published = 0
    i = 0
    while time.monotonic() < end_at:
        conn.write(chunks[i])
        published += CHUNK
        counters[spec.published_counter] = published
        i = (i + 1) % len(chunks)
        await conn.drain()
        await asyncio.sleep(0)  # let the broker's answers (a close, say) be read
    await conn.close()
    return {"published": published, "chunks": i}


async def _settle(target: Target, queues: tuple[str, ...], timeout: float) -> float:
    """Wait until the broker has routed everything the unpaced phase sent; seconds it took.

    A broker that routes slower than the producer wrote still has the socket
    buffers' worth of publishes to route after the producer left (at 772
    msg/s, tens of seconds), and answers other connections meanwhile; the
    next phase must not start before it is done. Done: the queues' message
    counts (no consumers now) stay the same for a second.
    """
    start = time.monotonic()
    last = -1
    while True:
        try:
            conn = await Connection.open(target.url, timeout=10.0)
            try:
                ch = await open_channel(conn)
                while True:
                    total = 0
                    for q in queues:
                        ok = await conn.rpc(ch, commands.Queue.Declare(queue=q, passive=True), timeout=timeout)
                        total += int(getattr(ok, "message_count", 0))
                    if total == last:
                        return time.monotonic() - start - 1.0
                    if time.monotonic() - start > timeout:
                        raise TimeoutError(f"queues still growing after {timeout:.0f} s")
                    last = total
                    await asyncio.sleep(1.0)
            finally:
                await conn.close()
        except OSError:
            if time.monotonic() - start > timeout:
                raise


async def _confirmed_rate(target: Target, exchange: str, keys: list[str], opts: RunOptions) -> float:
    """Publish one at a time, each after the previous one's confirm; confirmed per second after the warm-up."""
    conn = await Connection.open(target.url)
    try:
        ch = await open_channel(conn)
        await confirm_select(conn, ch)
        frames = [encode_publish(ch, exchange, k, BODY, delivery_mode=1, frame_max=conn.frame_max) for k in keys]
        warm_end = time.monotonic() + opts.warmup
        end_at = warm_end + opts.duration
        n = 0
        counted_from = -1
        t0 = time.monotonic()
        while (now := time.monotonic()) < end_at:
            if counted_from < 0 and now >= warm_end:
                counted_from, t0 = n, now
            conn.write(frames[n % len(frames)])
            n += 1
            await conn.wait_confirmed(n, timeout=30.0)
        if counted_from < 0:
            raise RuntimeError(f"no publish was confirmed after the warm-up ({n} in all)")
        return (n - counted_from) / (time.monotonic() - t0)
    finally:
        await conn.close()


def run(name: str, target: Target, opts: RunOptions) -> tuple[list[Metric], dict[str, object]]:
    n = SIZES[name]
    keys = routing_keys(n)
    cpu = CpuWatch(broker_pid_of(target))
    topo = loop.run(asyncio.wait_for(_declare(target, name), SETUP_TIMEOUT))
    workers = Workers()
    notes: dict[str, object] = {"bindings": n, "distinct_keys": len(keys)}
    try:
        bind_rate = loop.run(_bind_all(target, topo, n, unbind=False))
        counters = CTX.RawArray("q", QUEUES + 1)  # delivered per queue, then published
        workers.start(consumer_main, ConsumeSpec(target.url, topo.queues, 0, 1000, 100), counters)
        workers.start(flood_main, FloodSpec(target.url, topo.exchange, tuple(k for k, _ in keys), QUEUES), counters)
        workers.wait_ready(timeout=30)
        start_at = time.monotonic() + 0.05
        warm_end = start_at + opts.warmup
        end_at = warm_end + opts.duration
        workers.go(start_at, end_at)
        workers.sleep_until(warm_end)
        cpu.start()
        t0, d0, p0 = time.monotonic(), sum(counters[:QUEUES]), counters[QUEUES]
        workers.sleep_until(end_at)
        t1, d1, p1 = time.monotonic(), sum(counters[:QUEUES]), counters[QUEUES]
        notes["cpu"] = cpu.stop_dict()
        consumer_info, producer_info = workers.collect(timeout=30)
        workers.stop()
        notes["settle_after_flood_s"] = round(loop.run(_settle(target, topo.queues, SETTLE_TIMEOUT)), 2)
        confirmed = loop.run(_confirmed_rate(target, topo.exchange, [k for k, _ in keys], opts))
        unbind_rate = loop.run(_bind_all(target, topo, n, unbind=True))
    finally:
        workers.stop()
        problems = loop.run(asyncio.wait_for(_cleanup(target, topo), SETUP_TIMEOUT))
    delivered = consumer_info["delivered"]
    # Every key reaches exactly one queue: a queue that got more than was sent its way routes wrongly.
    cycles, rest = divmod(int(producer_info["published"]), len(keys))
    sent_to = [0] * QUEUES
    for j, (_, q) in enumerate(keys):
        sent_to[q] += cycles + (j < rest)
    if any(got > want for got, want in zip(delivered, sent_to, strict=True)):
        notes["routing_problem"] = f"delivered per queue {delivered}, routed there at most {sent_to}"
    notes.update(published=producer_info["published"], delivered_per_queue=delivered)
    if problems:
        notes["cleanup_problems"] = problems
    metrics = [
        Metric("bind", bind_rate, "binds/s"),
        Metric("delivered", (d1 - d0) / (t1 - t0), "msg/s"),
        Metric("accepted", (p1 - p0) / (t1 - t0), "publish/s"),
        Metric("confirmed one by one", confirmed, "msg/s"),
        Metric("unbind", unbind_rate, "unbinds/s"),
    ]
    return metrics, notes
