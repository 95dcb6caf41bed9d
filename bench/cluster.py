"""``python -m bench.cluster``: what clustering costs, on a cluster of node processes.

Starts one etcd, one PostgreSQL server with fsync on (``LEVERET_PG_FSYNC=on``)
and N nodes (harness/cluster.py), then measures:

* **forwarding**: the harness's ``transient`` scenario (bench/scenarios/
  throughput.py: 1 producer -> default exchange -> 1 queue -> 1 consumer,
  256 B, separate worker processes) with the queue owned by n1, once with
  producer and consumer connected to n1 (the owner) and once connected to n2
  (publishes forwarded to n1 over internal gRPC, deliveries through a proxy
  subscription). The queue is declared through n1, so it lives on n1
  (non-durable queues are placed on the declaring node); the harness checks
  etcd agrees before measuring. Figures: delivered msg/s and the ratio
  non-owner / owner (target >= 0.70).
* **failover**: a durable queue, a consumer (manual acks) on one node, a
  publisher (persistent, confirm mode, fixed rate) on another; the owner is
  killed with SIGKILL. The failover time is from the kill until the consumer
  receives the first message published after the kill (such a message can
  only come through the new owner). Also recorded: when etcd showed the new
  owner, and whether the consumer had to subscribe again. The killed node is
  restarted before the next run. Median, min and max over ``--runs``.
  ``--signal stop`` sends SIGSTOP instead (the stopped node still accepts
  connections, so only its lease expiry reveals it), then kills it.

Every process logs into the cluster's work directory (printed at the end).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import struct
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from pamqp import commands

from bench import loop
from bench.codec import encode_publish
from bench.connection import AmqpError, Connection
from bench.cpu import CpuWatch
from bench.ops import cleanup, confirm_select, consume, declare_queue, open_channel, qos, unique_name
from bench.results import RunOptions
from bench.scenarios.procs import CTX, Workers
from bench.scenarios.throughput import PLANS, SETUP_TIMEOUT, Plan, _cleanup, _declare
from bench.target import BrokerUrl, Target
from bench.workers import ConsumeSpec, PublishSpec, consumer_main, producer_main
from harness import pg
from harness.cluster import Cluster, owner_key
from harness.etcd import ETCDCTL_BIN, etcd_unavailable

FORWARDING_TARGET = 0.70
_BODY_HEAD = struct.Struct(">Qq")  # sequence number, time.monotonic_ns() at publish


# -- forwarding --------------------------------------------------------------------------------


@dataclass
class ForwardingRun:
    producer_on: str
    consumer_on: str
    owner: str
    delivered_per_s: float
    published: int
    cpu: dict[str, float | None]  # node id -> CPUs used by that node in the measured window
    cpu_client: float | None  # CPUs of the bench's own processes


def _target(cluster: Cluster, node_id: str) -> Target:
    return Target(node_id, BrokerUrl.parse(cluster.url(node_id)), str(cluster[node_id].pid))


def run_transient(cluster: Cluster, owner: str, producer_on: str, consumer_on: str, opts: RunOptions) -> ForwardingRun:
    """The transient plan as bench/scenarios/throughput.run_plan runs it, but declared through ``owner``
    and with the producer and the consumer connected to the nodes given."""
    plan: Plan = PLANS["transient"]
    owner_target = _target(cluster, owner)
    producer_url, consumer_url = _target(cluster, producer_on).url, _target(cluster, consumer_on).url
    topo = loop.run(asyncio.wait_for(_declare(owner_target, plan), SETUP_TIMEOUT))
    workers = Workers()
    try:
        placed = cluster.wait_owner(topo.queues[0], timeout=10)
        if placed != owner:
            raise RuntimeError(f"queue {topo.queues[0]} declared through {owner} is owned by {placed}")
        counters = CTX.RawArray("q", len(topo.queues))
        workers.start(consumer_main, ConsumeSpec(consumer_url, topo.queues, 0, plan.prefetch, plan.ack_every),
                      counters)  # fmt: skip
        publish = PublishSpec(
            producer_url, topo.exchange, topo.routing_keys, topo.reach, plan.body_size, plan.delivery_mode,
            plan.batch, plan.max_backlog, plan.confirm_window,
        )  # fmt: skip
        workers.start(producer_main, publish, counters)
        workers.wait_ready(timeout=30)
        # The nodes, etcd and Postgres are this process's children too: count only the bench's workers as client.
        workers_pids = [p.pid for p in workers.procs if p.pid is not None]
        watches = {n: CpuWatch(cluster[n].pid, workers_pids) for n in sorted({owner, producer_on, consumer_on})}
        start_at = time.monotonic() + 0.05
        warm_end = start_at + opts.warmup
        end_at = warm_end + opts.duration
        workers.go(start_at, end_at)
        workers.sleep_until(warm_end)
        for watch in watches.values():
            watch.start()
        t0, c0 = time.monotonic(), sum(counters)
        workers.sleep_until(end_at)
        t1, c1 = time.monotonic(), sum(counters)
        splits = {n: watch.stop_dict() for n, watch in watches.items()}
        _consumer_info, producer_info = workers.collect(timeout=15)
    finally:
        workers.stop()
        loop.run(asyncio.wait_for(_cleanup(owner_target, topo), SETUP_TIMEOUT))
    if c1 == c0:
        raise RuntimeError(f"nothing delivered in the measured window (producer: {producer_info})")
    return ForwardingRun(
        producer_on, consumer_on, owner, (c1 - c0) / (t1 - t0), int(producer_info["published"]),
        {n: split["broker"] for n, split in splits.items()}, splits[owner]["client"],
    )  # fmt: skip


def measure_forwarding(cluster: Cluster, opts: RunOptions, repeat: int, split: bool) -> dict[str, Any]:
    owner, other = "n1", "n2"
    placements = [(owner, owner), (other, other)]
    if split:  # which half costs: forwarded publishes only, proxied deliveries only
        placements += [(other, owner), (owner, other)]
    runs: list[ForwardingRun] = []
    for rep in range(repeat):
        for producer_on, consumer_on in placements:  # alternate so slow drifts hit all alike
            print(f"  forwarding: producer on {producer_on}, consumer on {consumer_on}, queue on {owner} "
                  f"({rep + 1}/{repeat}) ...", file=sys.stderr, flush=True)  # fmt: skip
            runs.append(run_transient(cluster, owner, producer_on, consumer_on, opts))
            time.sleep(1.0)
    rates = {
        f"{p}->{c}": statistics.median(r.delivered_per_s for r in runs if (r.producer_on, r.consumer_on) == (p, c))
        for p, c in placements
    }
    local, remote = rates[f"{owner}->{owner}"], rates[f"{other}->{other}"]
    return {
        "owner": owner,
        "non_owner": other,
        "owner_msg_s": local,
        "non_owner_msg_s": remote,
        "ratio": remote / local,
        "target": FORWARDING_TARGET,
        "median_msg_s": rates,  # "producer node->consumer node"
        "repeat": repeat,
        "runs": [asdict(r) for r in runs],
    }


# -- failover ----------------------------------------------------------------------------------


@dataclass
class FailoverRun:
    queue: str
    killed: str
    publisher_on: str
    consumer_on: str
    seconds: float | None  # kill -> first delivery of a message published after the kill
    etcd_seconds: float | None  # kill -> etcd shows another owner
    new_owner: str | None
    consumer_subscriptions: int
    publisher_connections: int
    delivered_before_kill: int
    nacked: int
    notes: list[str] = field(default_factory=list)


class _Consumer:
    """Consumes through one node with acks, timestamps each delivery, subscribes again when cut off."""

    def __init__(self, url: BrokerUrl, queue: str) -> None:
        self.url, self.queue = url, queue
        self.delivered = 0
        self.first_after_ns: int | None = None
        self.after_ns = 1 << 62  # deliveries of messages published after this instant count
        self.subscriptions = 0
        self.notes: list[str] = []
        self._conn: Connection | None = None

    def _on_bodies(self, bodies: list[bytes], _recv_ns: int) -> None:
        now = time.monotonic_ns()
        self.delivered += len(bodies)
        if self.first_after_ns is None:
            for body in bodies:
                if _BODY_HEAD.unpack_from(body)[1] > self.after_ns:
                    self.first_after_ns = now
                    break

    async def _subscribe(self) -> Connection:
        conn = await Connection.open(self.url, capture_bodies=True)
        conn.on_bodies = self._on_bodies
        ch = await open_channel(conn)
        await qos(conn, ch, 500)
        await consume(conn, ch, self.queue, ack_every=1)
        self.subscriptions += 1
        return conn

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                conn = self._conn = await self._subscribe()
            except (AmqpError, OSError, TimeoutError) as exc:
                self.notes.append(f"consumer subscribe: {exc}")
                await asyncio.sleep(0.1)
                continue
            while not stop.is_set() and conn.error is None:
                if any(isinstance(f, commands.Basic.Cancel | commands.Channel.Close) for _c, f in conn.unsolicited):
                    self.notes.append(f"consumer cut off: {conn.unsolicited[-1][1].name}")
                    break
                await asyncio.sleep(0.005)
            if conn.error is not None:
                self.notes.append(f"consumer connection: {conn.error}")
            await conn.close(timeout=1.0)


class _Publisher:
    """Persistent publishes in confirm mode at a fixed rate through one node; reconnects when cut off."""

    def __init__(self, url: BrokerUrl, queue: str, rate: int) -> None:
        self.url, self.queue, self.rate = url, queue, rate
        self.seq = 0
        self.connections = 0
        self.nacked = 0
        self.notes: list[str] = []

    async def run(self, stop: asyncio.Event) -> None:
        tick = 0.005
        per_tick = max(1, round(self.rate * tick))
        while not stop.is_set():
            try:
                conn = await Connection.open(self.url)
                ch = await open_channel(conn)
                await confirm_select(conn, ch)
            except (AmqpError, OSError, TimeoutError) as exc:
                self.notes.append(f"publisher open: {exc}")
                await asyncio.sleep(0.1)
                continue
            self.connections += 1
            try:
                next_at = time.monotonic()
                while not stop.is_set() and conn.error is None:
                    now_ns = time.monotonic_ns()
                    block = []
                    for _ in range(per_tick):
                        self.seq += 1
                        body = _BODY_HEAD.pack(self.seq, now_ns).ljust(64, b".")
                        block.append(encode_publish(ch, "", self.queue, body, delivery_mode=2))
                    conn.write(b"".join(block))
                    next_at += tick
                    await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            except AmqpError as exc:
                self.notes.append(f"publisher: {exc}")
            self.nacked += conn.scanner.confirms.nacked
            await conn.close(timeout=1.0)


class _OwnerWatch:
    """``etcdctl watch`` on the queue's owner key: when a new owner was written, to the event."""

    def __init__(self, cluster: Cluster, queue: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCDCTL")} | {"ETCDCTL_API": "3"}
        key = owner_key(cluster.name, queue)
        self.proc = subprocess.Popen(
            [str(ETCDCTL_BIN), "--endpoints", cluster.etcd.url, "watch", key],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        self.put: tuple[int, str] | None = None  # (monotonic ns, new owner) of the first PUT
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        lines = iter(self.proc.stdout)
        for line in lines:  # events: "PUT" key value / "DELETE" key
            if line.strip() == "PUT":
                at = time.monotonic_ns()
                next(lines, None)
                value = next(lines, "").strip()
                self.put = (at, value)
                return

    def wait(self, timeout: float) -> tuple[int, str] | None:
        self._thread.join(timeout)
        return self.put

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


async def _failover_once(cluster: Cluster, queue: str, owner: str, pub_on: str, con_on: str, rate: int,
                         warmup: float, timeout: float, sig: signal.Signals) -> FailoverRun:  # fmt: skip
    consumer = _Consumer(BrokerUrl.parse(cluster.url(con_on)), queue)
    publisher = _Publisher(BrokerUrl.parse(cluster.url(pub_on)), queue, rate)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(consumer.run(stop)), asyncio.create_task(publisher.run(stop))]
    watch = _OwnerWatch(cluster, queue)
    kill_ns = 0
    try:
        await asyncio.sleep(warmup)
        before = consumer.delivered
        if before == 0:
            raise RuntimeError(f"no deliveries before the kill: {consumer.notes[:3]} {publisher.notes[:3]}")
        kill_ns = time.monotonic_ns()
        consumer.after_ns = kill_ns
        os.kill(cluster[owner].pid, sig)
        deadline = time.monotonic() + timeout
        while consumer.first_after_ns is None and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        put = await asyncio.to_thread(watch.wait, 5.0)
        watch.close()
    first = consumer.first_after_ns
    return FailoverRun(
        queue=queue, killed=owner, publisher_on=pub_on, consumer_on=con_on,
        seconds=(first - kill_ns) / 1e9 if first else None,
        etcd_seconds=(put[0] - kill_ns) / 1e9 if put else None,
        new_owner=put[1] if put else cluster.owner(queue),
        consumer_subscriptions=consumer.subscriptions, publisher_connections=publisher.connections,
        delivered_before_kill=before, nacked=publisher.nacked, notes=(consumer.notes + publisher.notes)[:6],
    )  # fmt: skip


async def _declare_durable(url: BrokerUrl, queue: str) -> None:
    conn = await Connection.open(url)
    try:
        await declare_queue(conn, await open_channel(conn), queue, durable=True)
    finally:
        await conn.close()


async def _delete(url: BrokerUrl, queue: str) -> None:
    conn = await Connection.open(url)
    try:
        await cleanup(conn, queues=[queue], exchanges=[])
    finally:
        await conn.close()


def measure_failover(
    cluster: Cluster, runs: int, rate: int, warmup: float, timeout: float, sig: signal.Signals
) -> dict[str, Any]:
    results: list[FailoverRun] = []
    for i in range(runs):
        queue = unique_name("failover")
        loop.run(_declare_durable(BrokerUrl.parse(cluster.url("n1")), queue))
        owner = cluster.wait_owner(queue, timeout=10)
        assert owner is not None
        pub_on, con_on = cluster.others(owner)[:2]
        print(f"  failover {i + 1}/{runs}: {sig.name} to {owner} (publisher on {pub_on}, consumer on {con_on}) ...",
              file=sys.stderr, flush=True)  # fmt: skip
        run = loop.run(_failover_once(cluster, queue, owner, pub_on, con_on, rate, warmup, timeout, sig))
        results.append(run)
        cluster[owner].kill()  # reaps it (a stopped process too)
        try:
            loop.run(_delete(BrokerUrl.parse(cluster.url(con_on)), queue))
        except (AmqpError, OSError, TimeoutError) as exc:
            run.notes.append(f"delete: {exc}")
        cluster.restart_node(owner)
    times = [r.seconds for r in results if r.seconds is not None]
    etcd_times = [r.etcd_seconds for r in results if r.etcd_seconds is not None]
    return {
        "runs": [asdict(r) for r in results],
        "recovered": len(times),
        "median_s": statistics.median(times) if times else None,
        "min_s": min(times) if times else None,
        "max_s": max(times) if times else None,
        "etcd_median_s": statistics.median(etcd_times) if etcd_times else None,
        "lease_ttl_s": cluster.lease_ttl,
        "rate_msg_s": rate,
        "signal": sig.name,
    }


# -- output ------------------------------------------------------------------------------------


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def render(doc: dict[str, Any]) -> str:
    lines = [f"cluster of {doc['nodes']} nodes, lease TTL {doc['lease_ttl_s']} s, Postgres fsync on"]
    fwd = doc.get("forwarding")
    if fwd:
        verdict = "ok" if fwd["ratio"] >= fwd["target"] else "BELOW TARGET"
        owner = fwd["owner"]
        lines += [
            "",
            f"forwarding (transient, 256 B, queue on {owner}; median of {fwd['repeat']} run(s) each)",
            f"  {'producer':<10}{'consumer':<10}{'delivered msg/s':>16}",
        ]
        for placement, rate in fwd["median_msg_s"].items():
            p, c = placement.split("->")
            lines.append(f"  {p:<10}{c:<10}{rate:>16,.0f}")
        lines.append(f"  ratio non-owner / owner: {fwd['ratio']:.2f} (target >= {fwd['target']:.2f}: {verdict})")
        for r in fwd["runs"]:
            cpus = ", ".join(f"{n} {v}" for n, v in r["cpu"].items())
            lines.append(
                f"    run {r['producer_on']}->{r['consumer_on']}: {r['delivered_per_s']:,.0f} msg/s; "
                f"node CPUs: {cpus}; client {r['cpu_client']}"
            )
    fo = doc.get("failover")
    if fo:
        lines += [
            "",
            f"failover ({fo['signal']} to a durable queue's owner; {fo['rate_msg_s']} msg/s persistent, confirms)",
            f"  runs {len(fo['runs'])}, recovered {fo['recovered']}: median {_s(fo['median_s'])}, "
            f"min {_s(fo['min_s'])}, max {_s(fo['max_s'])}; new owner in etcd after {_s(fo['etcd_median_s'])} "
            "(median)",
        ]
        for r in fo["runs"]:
            lines.append(
                f"    killed {r['killed']} -> {r['new_owner']}: consumer again after {_s(r['seconds'])}, "
                f"etcd {_s(r['etcd_seconds'])}, consumer subscriptions {r['consumer_subscriptions']}, "
                f"publisher connections {r['publisher_connections']}, nacks {r['nacked']}"
                + (f"; {'; '.join(r['notes'])}" if r["notes"] else "")
            )
    lines += ["", f"logs: {doc['workdir']}"]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=3, help="cluster size (>= 3; default 3)")
    p.add_argument("--lease-ttl", type=int, default=2, help="node lease TTL in seconds (default 2)")
    p.add_argument("--only", choices=["failover", "forwarding"], help="run one of the two measurements")
    p.add_argument("--runs", type=int, default=5, help="failover runs (default 5)")
    p.add_argument("--rate", type=int, default=1000, help="failover stream, msg/s (default 1000)")
    p.add_argument(
        "--signal",
        choices=["kill", "stop"],
        default="kill",
        help="failover: SIGKILL the owner (default), or SIGSTOP it (its port still accepts "
        "connections, so only its lease expiry reveals it)",
    )
    p.add_argument("--failover-timeout", type=float, default=60.0, help="give up on a failover after S seconds")
    p.add_argument("--duration", type=float, default=5.0, help="forwarding: measured seconds per run (default 5)")
    p.add_argument("--warmup", type=float, default=1.0, help="forwarding: unmeasured seconds first (default 1)")
    p.add_argument("--repeat", type=int, default=1, help="forwarding: runs per placement, median kept (default 1)")
    p.add_argument(
        "--split", action="store_true", help="forwarding: also run producer-only and consumer-only on the non-owner"
    )
    p.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.nodes < 3 or args.runs < 1 or args.repeat < 1:
        _parser().error("--nodes >= 3, --runs >= 1, --repeat >= 1")
    for reason in (etcd_unavailable(), pg.postgres_unavailable()):
        if reason:
            print(f"cannot run: {reason}", file=sys.stderr)
            return 2
    os.environ["LEVERET_PG_FSYNC"] = "on"  # read by harness/pg.py when it starts the server
    print(f"  starting etcd, Postgres and {args.nodes} nodes ...", file=sys.stderr, flush=True)
    with Cluster(args.nodes, lease_ttl=args.lease_ttl, keep_workdir=True) as cluster:
        doc: dict[str, Any] = {"nodes": args.nodes, "lease_ttl_s": args.lease_ttl, "workdir": str(cluster.workdir),
                               "event_loop": loop.loop_name()}  # fmt: skip
        if args.only in (None, "forwarding"):
            opts = RunOptions(duration=args.duration, warmup=args.warmup)
            doc["forwarding"] = measure_forwarding(cluster, opts, args.repeat, args.split)
        if args.only in (None, "failover"):
            sig = signal.SIGKILL if args.signal == "kill" else signal.SIGSTOP
            doc["failover"] = measure_failover(cluster, args.runs, args.rate, 1.5, args.failover_timeout, sig)
    print(render(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
