"""Unpaced publishers: does a broker hold back a producer that writes as fast as TCP allows?

The client of issue 14, identical for every broker: each producer writes
pre-encoded ``basic.publish`` frames (256 B bodies, delivery mode 1, no
confirms) in blocks of 256 KiB as fast as the socket takes them, with no
pacing of its own (``max_backlog`` 0); each queue has one consumer at
prefetch 1000 that acks ``multiple`` every 100 deliveries. A broker without
flow control accepts far more than it delivers and its queues (and RSS)
grow; one with flow control slows the producer through TCP.

Figures, over the measured window: delivered msg/s (all queues), accepted
publishes/s (what the producers' sockets took), the ready backlog the
broker reports (passive ``queue.declare``) right at the end, as a share of
what was published, and the broker's RSS at the start of the warm-up and at
the end. ``flood_pair`` has two producers and two queues, each producer to
its own queue: the fairness figure is the smaller queue's deliveries over
the larger's.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from pamqp import commands

from bench import loop
from bench.codec import encode_publish
from bench.connection import Connection
from bench.cpu import CpuWatch, broker_pid_of
from bench.memory import tree_rss_kb
from bench.ops import open_channel
from bench.results import Metric, RunOptions
from bench.scenarios.procs import CTX, Workers
from bench.scenarios.throughput import PLANS, SETUP_TIMEOUT, Plan, Topology, _cleanup, _declare
from bench.target import Target
from bench.workers import ConsumeSpec, PublishSpec, consumer_main, producer_main

BLOCK_BYTES = 256 * 1024
BODY = 256


def _per_block(routing_keys: tuple[str, ...], exchange: str) -> int:
    """Publishes in one 256 KiB write: whole cycles of the routing keys."""
    one = sum(len(encode_publish(1, exchange, k, bytes(BODY), delivery_mode=1)) for k in routing_keys)
    return max(1, BLOCK_BYTES // one) * len(routing_keys)


FLOOD_PLANS: dict[str, tuple[Plan, int]] = {
    # (plan, producers); batch and max_backlog are set per run below.
    "flood": (replace(PLANS["transient"], name="flood", keep_queues=True), 1),
    "flood_fanout": (replace(PLANS["fanout"], name="flood_fanout", keep_queues=True), 1),
    "flood_topic": (replace(PLANS["topic"], name="flood_topic", keep_queues=True), 1),
    "flood_pair": (replace(PLANS["transient"], name="flood_pair", queues=2, keep_queues=True), 2),
}


async def _ready_counts(target: Target, queues: tuple[str, ...]) -> list[int]:
    conn = await Connection.open(target.url)
    try:
        ch = await open_channel(conn)
        counts = []
        for q in queues:
            ok = await conn.rpc(ch, commands.Queue.Declare(queue=q, passive=True), timeout=SETUP_TIMEOUT)
            counts.append(int(getattr(ok, "message_count", 0)))
        return counts
    finally:
        await conn.close()


def run(name: str, target: Target, opts: RunOptions) -> tuple[list[Metric], dict[str, object]]:
    plan, producers = FLOOD_PLANS[name]
    pid = broker_pid_of(target)
    cpu = CpuWatch(pid)
    topo = loop.run(asyncio.wait_for(_declare(target, plan), SETUP_TIMEOUT))
    nq = len(topo.queues)
    workers = Workers()
    try:
        # counters: delivered per queue, then published per producer
        counters = CTX.RawArray("q", nq + producers)
        for i, q in enumerate(topo.queues):
            workers.start(consumer_main, ConsumeSpec(target.url, (q,), i, plan.prefetch, plan.ack_every), counters)
        specs = _publish_specs(plan, topo, producers, target)
        for spec in specs:
            workers.start(producer_main, spec, counters)
        workers.wait_ready(timeout=30)
        rss_start = tree_rss_kb(pid) if pid else 0
        start_at = time.monotonic() + 0.05
        warm_end = start_at + opts.warmup
        end_at = warm_end + opts.duration
        workers.go(start_at, end_at)
        workers.sleep_until(warm_end)
        cpu.start()
        t0, d0, p0 = time.monotonic(), list(counters[:nq]), list(counters[nq:])
        workers.sleep_until(end_at)
        t1, d1, p1 = time.monotonic(), list(counters[:nq]), list(counters[nq:])
        # The broker's own count, taken at once: a broker that starves new
        # connections shows it here as a slow answer, not a wrong count.
        asked = time.monotonic()
        backlog = loop.run(asyncio.wait_for(_ready_counts(target, topo.queues), SETUP_TIMEOUT))
        answer_s = time.monotonic() - asked
        rss_end = tree_rss_kb(pid) if pid else 0
        cpu_split = cpu.stop_dict()
        infos = workers.collect(timeout=30)
    finally:
        workers.stop()
        problems = loop.run(asyncio.wait_for(_cleanup(target, topo), SETUP_TIMEOUT))
    span = t1 - t0
    delivered = [b - a for a, b in zip(d0, d1, strict=True)]
    delivered_rate = sum(delivered) / span
    accepted_rate = (sum(p1) - sum(p0)) / span
    producer_infos = infos[nq:]
    published_total = sum(int(i["published"]) for i in producer_infos)
    routed_total = sum(sum(i["expected_per_queue"][:nq]) for i in producer_infos)
    metrics = [
        Metric("delivered", delivered_rate, "msg/s"),
        Metric("accepted", accepted_rate, "publish/s"),
        Metric("backlog at end", 100.0 * sum(backlog) / max(1, routed_total), "% of routed", "lower"),
        Metric("rss start", rss_start / 1024, "MiB", "lower"),
        Metric("rss end", rss_end / 1024, "MiB", "lower"),
    ]
    if producers > 1:
        metrics.append(Metric("fairness", min(delivered) / max(1, max(delivered)), "min/max"))
    notes: dict[str, object] = {
        "published": published_total,
        "routed": routed_total,
        "backlog_per_queue": backlog,
        "delivered_in_window_per_queue": delivered,
        "delivered_total_per_queue": [int(n) for i in infos[:nq] for n in i["delivered"]],
        "queue_declare_answer_s": round(answer_s, 3),
        "cpu": cpu_split,
    }
    if problems:
        notes["cleanup_problems"] = problems
    return metrics, notes


def _publish_specs(plan: Plan, topo: Topology, producers: int, target: Target) -> list[PublishSpec]:
    if producers == 1:
        groups = [(topo.routing_keys, topo.reach)]
    else:
        # One producer per queue, through the default exchange.
        groups = [((q,), ((i,),)) for i, q in enumerate(topo.queues[:producers])]
    nq = len(topo.queues)
    return [
        PublishSpec(target.url, topo.exchange, keys, reach, BODY, 1, _per_block(keys, topo.exchange),
                    max_backlog=0, confirm_window=0, published_counter=nq + i)
        for i, (keys, reach) in enumerate(groups)
    ]
