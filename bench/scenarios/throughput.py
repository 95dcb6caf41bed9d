"""1 producer -> N queues -> N consumers throughput (transient, fanout, topic, persistent).

Method, identical for every broker:
* the parent declares the topology with unique names, then starts one
  consumer process (one connection + channel per queue, prefetch P, manual
  acks sent with multiple=true every A deliveries) and one producer process;
* the producer writes pre-encoded blocks of publishes as fast as the socket
  takes them, but never lets any queue's backlog (published and routed there
  minus delivered from it) exceed ``max_backlog``, so queues stay bounded
  whatever the broker's speed; persistent plans additionally keep a
  publisher-confirm window;
* the parent samples the shared delivered counters after the warm-up and at
  the end, so the figure is deliveries/s across all queues in steady state.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Literal

from bench import loop
from bench.connection import Connection
from bench.cpu import CpuWatch, broker_pid_of
from bench.ops import bind_queue, cleanup, declare_exchange, declare_queue, open_channel, unique_name
from bench.results import Metric, RunOptions
from bench.scenarios.procs import CTX, Workers
from bench.scenarios.routing import topic_matches
from bench.target import Target
from bench.workers import ConsumeSpec, PublishSpec, consumer_main, producer_main

MIB = 1 << 20
# Bounds for declaring and deleting the topology, so a hung broker can't stall the run.
SETUP_TIMEOUT = 30.0


@dataclass(frozen=True)
class Plan:
    name: str
    exchange_kind: Literal["default", "fanout", "topic"]
    queues: int
    body_size: int
    delivery_mode: int
    durable: bool
    prefetch: int
    ack_every: int
    batch: int
    max_backlog: int
    confirm_window: int = 0
    consumer_procs: int = 1  # queues are split evenly across this many consumer processes
    bindings: tuple[tuple[int, str], ...] = ()  # (queue index, binding key) for topic
    routing_keys: tuple[str, ...] = ()  # for topic
    # Non-durable queues are auto-delete unless this is set (the flood scenarios read
    # their depth after the consumers left); cleanup deletes them either way.
    keep_queues: bool = False


TOPIC_BINDINGS: tuple[tuple[int, str], ...] = (
    (0, "a.*.c"),
    (0, "a.b.#"),
    (1, "a.#"),
    (2, "*.b.*"),
    (2, "#.c"),
    (2, "x.#"),
    (3, "#.d"),
    (3, "*.*.z"),
    (3, "a.b.c"),
    (3, "x.*.c"),
)
TOPIC_KEYS = ("a.b.c", "a.x.c", "a.b.d", "x.b.c", "a.b.c.d", "x.y.z", "b.b.b", "q.r.c")

PLANS = {
    "transient": Plan("transient", "default", 1, 256, 1, False, prefetch=1000, ack_every=100, batch=100,
                      max_backlog=20_000),
    "fanout": Plan("fanout", "fanout", 4, 256, 1, False, prefetch=1000, ack_every=100, batch=50,
                   max_backlog=20_000),
    "topic": Plan("topic", "topic", 4, 256, 1, False, prefetch=1000, ack_every=100, batch=96,
                  max_backlog=20_000, bindings=TOPIC_BINDINGS, routing_keys=TOPIC_KEYS),
    "persistent": Plan("persistent", "default", 1, 256, 2, True, prefetch=1000, ack_every=100, batch=100,
                       max_backlog=20_000, confirm_window=2_000),
    "persistent_1mib": Plan("persistent_1mib", "default", 1, MIB, 2, True, prefetch=16, ack_every=4, batch=1,
                            max_backlog=64, confirm_window=16),
}


@dataclass(frozen=True)
class Topology:
    exchange: str
    queues: tuple[str, ...]
    routing_keys: tuple[str, ...]
    reach: tuple[tuple[int, ...], ...]


async def _declare(target: Target, plan: Plan) -> Topology:
    queues = tuple(unique_name(plan.name, f"q{i}") for i in range(plan.queues))
    exchange = "" if plan.exchange_kind == "default" else unique_name(plan.name, "x")
    conn = await Connection.open(target.url)
    try:
        ch = await open_channel(conn)
        if exchange:
            await declare_exchange(conn, ch, exchange, plan.exchange_kind)
        for q in queues:
            # Non-durable queues are also auto-delete as a safety net should cleanup not run.
            await declare_queue(conn, ch, q, durable=plan.durable, auto_delete=not (plan.durable or plan.keep_queues))
        keys: tuple[str, ...]
        reach: tuple[tuple[int, ...], ...]
        if plan.exchange_kind == "default":
            keys, reach = (queues[0],), ((0,),)
        elif plan.exchange_kind == "fanout":
            for q in queues:
                await bind_queue(conn, ch, q, exchange, "")
            keys, reach = ("",), (tuple(range(len(queues))),)
        else:
            for qi, pattern in plan.bindings:
                await bind_queue(conn, ch, queues[qi], exchange, pattern)
            keys = plan.routing_keys
            reach = tuple(
                tuple(sorted({qi for qi, pat in plan.bindings if topic_matches(pat, key)})) for key in keys
            )
    finally:
        await conn.close()
    return Topology(exchange, queues, keys, reach)


async def _cleanup(target: Target, topo: Topology) -> list[str]:
    conn = await Connection.open(target.url)
    try:
        return await cleanup(conn, queues=list(topo.queues), exchanges=[topo.exchange] if topo.exchange else [])
    finally:
        await conn.close()


def run_plan(plan: Plan, target: Target, opts: RunOptions) -> tuple[list[Metric], dict[str, object]]:
    cpu = CpuWatch(broker_pid_of(target))
    topo = loop.run(asyncio.wait_for(_declare(target, plan), SETUP_TIMEOUT))
    workers = Workers()
    try:
        counters = CTX.RawArray("q", len(topo.queues))
        per_proc = -(-len(topo.queues) // plan.consumer_procs)
        for first in range(0, len(topo.queues), per_proc):
            queues = topo.queues[first : first + per_proc]
            workers.start(consumer_main, ConsumeSpec(target.url, queues, first, plan.prefetch, plan.ack_every),
                          counters)
        publish = PublishSpec(
            target.url, topo.exchange, topo.routing_keys, topo.reach, plan.body_size, plan.delivery_mode,
            plan.batch, plan.max_backlog, plan.confirm_window,
        )
        workers.start(producer_main, publish, counters)
        workers.wait_ready(timeout=30)
        start_at = time.monotonic() + 0.05
        warm_end = start_at + opts.warmup
        end_at = warm_end + opts.duration
        workers.go(start_at, end_at)
        workers.sleep_until(warm_end)
        cpu.start()
        t0, c0 = time.monotonic(), sum(counters)
        workers.sleep_until(end_at)
        t1, c1 = time.monotonic(), sum(counters)
        cpu_split = cpu.stop_dict()
        *consumer_infos, producer_info = workers.collect(timeout=15)
    finally:
        workers.stop()
        problems = loop.run(asyncio.wait_for(_cleanup(target, topo), SETUP_TIMEOUT))
    rate = (c1 - c0) / (t1 - t0)
    if c1 == c0:
        raise RuntimeError(
            f"no messages were delivered in the measurement window (published {producer_info['published']}, "
            f"confirmed {producer_info['confirmed']}, delivered in all {sum(counters)})"
        )
    metrics = [Metric("delivered", rate, "msg/s")]
    if plan.body_size >= MIB:
        metrics.append(Metric("delivered", rate * plan.body_size / MIB, "MiB/s"))
    delivered = [n for info in consumer_infos for n in info["delivered"]]
    notes: dict[str, object] = {**producer_info, "delivered_per_queue": delivered, "cpu": cpu_split}
    if problems:
        notes["cleanup_problems"] = problems
    if mismatch := _routing_mismatch(plan, producer_info["expected_per_queue"], delivered):
        notes["routing_problem"] = mismatch
    return metrics, notes


def _routing_mismatch(plan: Plan, expected: list[int], delivered: list[int]) -> str | None:
    """Check each queue got what its bindings imply, give or take what was still in flight.

    The producer never lets a queue fall more than max_backlog (+ one block)
    behind, so a wrongly routing broker shows up as a queue with too many
    messages or one starved far beyond that slack.
    """
    slack = plan.max_backlog + plan.batch * 4
    for q, (want, got) in enumerate(zip(expected, delivered, strict=True)):
        if got > want or got < want - slack:
            return f"queue {q}: delivered {got}, bindings imply {want} (in-flight slack {slack})"
    return None
