"""``python -m bench.chaos``: faults injected at random into a live three-node cluster, then checked.

Real etcd (harness/etcd.py), a real Postgres that can be restarted on its port
(harness/node.py::RestartablePostgres) and three nodes
(harness/cluster.py). Each node reaches etcd, Postgres and its
peers' cluster ports through fault-injecting TCP proxies on loopback
(bench/chaos_proxy.py; a node advertises its proxy's port with
``--advertise-cluster-port``), so a node can be cut off while clients still
reach it. A confirmed publisher and an acking consumer run on every node
(bench/chaos_load.py) while each cycle injects one fault:

* ``kill``: kill -9 of a node, restarted after 1-3 s;
* ``stop``: SIGSTOP of a node for twice the lease TTL (its queues move), SIGCONT;
* ``etcd``: etcd restarted (SIGTERM or kill -9 at random);
* ``pg``: Postgres restarted (fast shutdown) or unreachable (blackholed) for ``--pg-outage`` s;
* ``partition``: a node cut off from etcd and from its peers (both ways) for three lease TTLs;
* ``clock``: a node's wall clock stepped by +-1 h or +-1 day for three lease TTLs, then back
  (libfaketime, bench/chaos_clock.py; the monotonic clock stays real, as in an NTP step).

After each cycle the load runs ``--duration-per-cycle`` s without a fault. At the end
every fault is healed, publishing stops, consumers drain, and bench/chaos_check.py
checks what was seen; the report goes to stdout and (``--report``) is appended to
docs/RELIABILITY.md. Exit status 1 when there is a violation.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from psycopg.conninfo import make_conninfo

from bench import chaos_clock
from bench.chaos_check import Result, check, log_time, serving_intervals, worst_gap
from bench.chaos_disk import report_lines, run_disk
from bench.chaos_load import Load
from bench.chaos_pg import PgPair
from bench.chaos_proxy import Proxy
from harness.cluster import Cluster, ClusterNode

FAULTS = ("kill", "stop", "etcd", "pg", "partition", "clock", "promote", "disk")
CYCLE_FAULTS = FAULTS[:6]  # drawn at random each cycle
# promote (the Postgres primary replaced by its standby) runs once, after the cycles;
# disk is a single-node scenario of its own (bench/chaos_disk.py).
CLUSTER_FAULTS = FAULTS[:7]
QUEUES = [f"chaos-{i}" for i in range(6)]
REPORT = Path(__file__).resolve().parent.parent / "docs" / "RELIABILITY.md"
DRAIN_TIMEOUT = 60.0
T = TypeVar("T")


class Background:
    """An event loop in a thread: the proxies and the clients run there while faults are injected here."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="chaos-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], T]) -> T:
        async def wrap() -> T:
            return fn()

        return self.run(wrap())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class ChaosNode(ClusterNode):
    """A node whose etcd, Postgres and inbound cluster traffic go through its own proxies."""

    etcd_proxy: Proxy
    pg_proxy: Proxy
    peer_proxy: Proxy  # peers dial this to reach the node's cluster port
    clock: chaos_clock.FakeClock | None = None  # the node's wall clock, when the clock fault is on

    def command(self) -> list[str]:
        cmd = super().command()
        self.peer_proxy.target_port = self.cluster_port  # fresh each start
        cmd[cmd.index("--etcd") + 1] = f"http://127.0.0.1:{self.etcd_proxy.port}"
        standby = self.cluster.pg_server.standby  # type: ignore[attr-defined]
        if standby is None:
            dsn = make_conninfo(self.cluster.dsn, host="127.0.0.1", port=str(self.pg_proxy.port))
        else:  # both hosts: libpq takes the first that accepts writes (the standby once promoted)
            dsn = make_conninfo(self.cluster.dsn, host="127.0.0.1,127.0.0.1",
                                port=f"{self.pg_proxy.port},{standby.port}", target_session_attrs="read-write")
        cmd[cmd.index("--postgres-dsn") + 1] = dsn
        return [*cmd, "--advertise-cluster-port", str(self.peer_proxy.port)]


class ChaosCluster(Cluster):
    def __init__(self, bg: Background, pg_server: PgPair, fake_clocks: bool = False, **kw: Any) -> None:
        super().__init__(postgres_dsn=pg_server.dsn, **kw)
        self.bg = bg
        self.pg_server = pg_server
        self.proxies: list[Proxy] = []
        self.pids: set[int] = set()  # every node process ever started: who the peer proxies tell apart
        self.fake_clocks = fake_clocks

    def _proxy(self, name: str, target: int, attribute: bool) -> Proxy:
        async def make() -> Proxy:
            p = Proxy(name, target, self.pids if attribute else None)
            await p.start()
            return p

        proxy = self.bg.run(make())
        self.proxies.append(proxy)
        return proxy

    def add_node(self, region: str = "r1", start: bool = True, extra_args: Sequence[str] = ()) -> ClusterNode:
        node_id = f"n{len(self.nodes) + 1}"
        node = ChaosNode(node_id, region, self, [*self.node_args, *extra_args])
        node.etcd_proxy = self._proxy(f"etcd<-{node_id}", int(self.etcd.url.rsplit(":", 1)[1]), False)
        node.pg_proxy = self._proxy(f"pg<-{node_id}", self.pg_server.port, False)
        node.peer_proxy = self._proxy(f"peers->{node_id}", 0, True)
        if self.fake_clocks:
            node.clock = chaos_clock.FakeClock(self.workdir / f"{node_id}.faketime")
            node.extra_env = node.clock.env()
        self.nodes[node_id] = node
        if start:
            node.start()
            self.wait_members([node_id])
        return node


@dataclass
class Fault:
    kind: str
    node: str
    start: float
    end: float = 0.0
    variant: str = ""
    hold: float = 0.0  # seconds the fault lasted (down, stopped, cut off)


@dataclass
class Run:
    faults: list[Fault] = field(default_factory=list)
    pauses: list[tuple[str, float, float]] = field(default_factory=list)
    kills: dict[str, list[float]] = field(default_factory=dict)  # node -> when each of its processes ended
    crashes: list[str] = field(default_factory=list)
    recoveries: list[tuple[str, float]] = field(default_factory=list)  # fault kind, seconds to a healthy cluster


class Chaos:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.run = Run()
        self.bg = Background()
        self.pg = PgPair(standby="promote" in args.faults, sync_standby=args.sync_standby)
        self.cluster: ChaosCluster | None = None
        self.load: Load | None = None
        self.stepped_lines = 0  # node log lines stamped with a stepped wall clock: the step took effect

    def log(self, what: str) -> None:
        print(f"[chaos {time.strftime('%H:%M:%S')}] {what}", flush=True)

    # -- life cycle ----------------------------------------------------------------------------
    def setup(self) -> ChaosCluster:
        self.pg.create()
        c = ChaosCluster(self.bg, self.pg, fake_clocks="clock" in self.args.faults, size=3,
                         lease_ttl=self.args.lease_ttl, keep_workdir=self.args.keep)
        self.cluster = c
        c.start()
        for n in c.nodes.values():
            assert n.proc is not None
            self.run_pids_add(n)
        self._declare()
        return c

    def run_pids_add(self, node: ClusterNode) -> None:
        assert self.cluster is not None and node.proc is not None
        pid = node.proc.pid
        self.bg.call(lambda: self.cluster.pids.add(pid))  # type: ignore[union-attr]

    def _declare(self) -> None:
        import pika

        assert self.cluster is not None
        conn = pika.BlockingConnection(pika.URLParameters(self.cluster.url("n1")))
        try:
            ch = conn.channel()
            for q in QUEUES:
                ch.queue_declare(q, durable=True)
        finally:
            conn.close()

    def close(self) -> None:
        if self.load is not None:
            with contextlib.suppress(Exception):
                self.bg.run(self.load.close(), 30)
        if self.cluster is not None:
            for p in self.cluster.proxies:
                with contextlib.suppress(Exception):
                    self.bg.run(p.close(), 10)
            self.cluster.close()
        self.pg.close()
        self.bg.close()

    # -- faults --------------------------------------------------------------------------------
    def _node(self, node_id: str) -> ChaosNode:
        assert self.cluster is not None
        node = self.cluster.nodes[node_id]
        assert isinstance(node, ChaosNode)
        return node

    def inject(self, kind: str) -> Fault:
        c = self.cluster
        assert c is not None
        node_id = self.rng.choice(sorted(c.nodes))
        node = self._node(node_id)
        ttl = self.args.lease_ttl
        fault = Fault(kind, node_id if kind in ("kill", "stop", "partition", "clock") else "-", time.time())
        self.log(f"fault {kind} {fault.node}")
        if kind == "kill":
            node.kill()
            self.run.kills.setdefault(node_id, []).append(time.time())
            down = self.rng.uniform(1, 3)
            fault.variant, fault.hold = "kill -9, restart", down
            time.sleep(down)
            self._start(node)
        elif kind == "stop":
            hold = 2 * ttl + self.rng.uniform(0, 2)
            node.pause()
            time.sleep(hold)
            node.resume()
            self.run.pauses.append((node_id, fault.start, time.time()))
            fault.variant, fault.hold = "SIGSTOP, SIGCONT", hold
        elif kind == "etcd":
            hard = self.rng.random() < 0.5
            t0 = time.time()
            c.restart_etcd(kill=hard)
            fault.variant, fault.hold = ("kill -9, start" if hard else "SIGTERM, start"), time.time() - t0
        elif kind == "pg":
            mode = self.args.pg_mode
            if mode == "restart" or (mode == "both" and self.rng.random() < 0.5):
                self.pg.stop()
                down = self.rng.uniform(1, 3)
                time.sleep(down)
                self.pg.start()
                fault.variant, fault.hold = "fast shutdown, start", down
            else:
                proxies = [self._node(n).pg_proxy for n in c.nodes]
                self.bg.call(lambda: _each(proxies, lambda p: p.cut("blackhole")))
                time.sleep(self.args.pg_outage)
                self.bg.call(lambda: _each(proxies, Proxy.heal))
                fault.variant, fault.hold = "unreachable (blackholed)", self.args.pg_outage
        elif kind == "partition":
            hold = 3 * ttl + self.rng.uniform(0, 2)
            pid = node.pid
            others = [self._node(n).peer_proxy for n in c.nodes if n != node_id]

            def cut() -> None:
                node.etcd_proxy.cut("blackhole")
                node.peer_proxy.cut("blackhole")
                for p in others:
                    p.cut("blackhole", {pid})

            def heal() -> None:
                for p in (node.etcd_proxy, node.peer_proxy, *others):
                    p.heal()

            self.bg.call(cut)
            time.sleep(hold)
            self.bg.call(heal)
            fault.variant, fault.hold = "cut off from etcd and peers (blackholed)", hold
        elif kind == "clock":
            assert node.clock is not None
            offset = self.rng.choice(chaos_clock.STEPS)
            hold = 3 * ttl + self.rng.uniform(0, 2)
            node.clock.step(offset)
            time.sleep(chaos_clock.CACHE_S + 0.5)
            self._poke(node)  # a "connection opened" line stamped with the stepped clock: proof it took effect
            time.sleep(max(0.0, hold - chaos_clock.CACHE_S - 0.5))
            node.clock.step(0.0)  # stepped back, as NTP does once it sees the error
            fault.variant, fault.hold = f"wall clock {offset / 3600:+g} h, then back", hold
        elif kind == "promote":
            assert self.pg.standby is not None
            self.pg.primary.kill()
            time.sleep(1.0)  # an operator's (or a failover manager's) reaction time
            self.pg.standby.promote()
            fault.variant = "primary kill -9, standby promoted (" + (
                "synchronous_standby_names='*', synchronous_commit=on)" if self.pg.sync_standby
                else "asynchronous replication)")
            fault.hold = 1.0
        fault.end = time.time()
        self.run.faults.append(fault)
        return fault

    def _poke(self, node: ClusterNode) -> None:
        import pika

        with contextlib.suppress(Exception):
            pika.BlockingConnection(pika.URLParameters(node.url)).close()

    def _start(self, node: ClusterNode) -> None:
        """Start a node again; a start that fails (a port taken meanwhile) is retried on fresh ports."""
        for attempt in range(3):
            try:
                node.start()
                break
            except AssertionError as exc:
                self.log(f"{node.node_id} did not start (attempt {attempt + 1}): {str(exc)[:300]}")
                node.cleanup()
        self.run_pids_add(node)

    def healthy(self) -> bool:
        c = self.cluster
        assert c is not None
        try:
            return set(c.members()) == set(c.nodes) and all(c.owner(q) for q in QUEUES)
        except Exception:  # noqa: BLE001 - etcd restarting: not healthy yet
            return False

    def check_processes(self) -> None:
        """A node that exited without being killed is a crash: report it and start it again."""
        assert self.cluster is not None
        for node_id, node in self.cluster.nodes.items():
            if node.proc is not None and not node.running():
                self.run.crashes.append(f"{node_id} exited with {node.proc.returncode}: {node.stderr_tail(1500)}")
                self.run.kills.setdefault(node_id, []).append(time.time())
                self._start(node)

    # -- the run -------------------------------------------------------------------------------
    def main(self) -> Result:
        args = self.args
        c = self.setup()
        self.log(f"cluster up: {c.workdir}")
        load = Load(sorted(c.nodes), QUEUES, lambda n: c.nodes[n].url, rate=args.rate)
        self.load = load
        self.bg.call(load.start)
        started = time.time()
        time.sleep(args.duration_per_cycle)
        faults = [f for f in args.faults if f in CYCLE_FAULTS]
        for cycle in range(args.cycles if faults else 0):
            fault = self.inject(faults[cycle % len(faults)] if args.round_robin else self.rng.choice(faults))
            t0 = time.monotonic()
            while not self.healthy() and time.monotonic() - t0 < 60:
                time.sleep(0.2)
            self.run.recoveries.append((fault.kind, time.monotonic() - t0))
            self.check_processes()
            time.sleep(args.duration_per_cycle)
            self.log(f"cycle {cycle + 1}/{args.cycles} done: {len(load.record.confirmed)} confirmed, "
                     f"{len(load.record.deliveries)} delivered")
        if "promote" in args.faults:
            self.inject("promote")
            t0 = time.monotonic()
            while not self.healthy() and time.monotonic() - t0 < 60:
                time.sleep(0.2)
            self.run.recoveries.append(("promote", time.monotonic() - t0))
            time.sleep(args.duration_per_cycle)
        self.check_processes()
        self.bg.call(load.stop_publishing.set)
        stopped = time.time()
        self._drain(load)
        self.bg.run(load.close(), 60)
        ended = time.time()
        records = {n: node.log_records() for n, node in c.nodes.items()}  # type: ignore[attr-defined]
        for n, recs in records.items():
            clock = self._node(n).clock
            if clock is not None and clock.steps:  # the node logged its faked wall clock
                real = clock.real_times([log_time(str(r.get("ts", ""))) for r in recs])
                for r, t in zip(recs, real, strict=True):
                    r["real_ts"] = t
                    if abs(log_time(str(r.get("ts", ""))) - t) > 60:
                        self.stepped_lines += 1
        intervals = serving_intervals(records, self.run.kills, set(QUEUES), ended)
        result = check(load.record, intervals, self.run.pauses, self.run.crashes, grace=float(args.lease_ttl))
        gap = worst_gap(load.record, QUEUES, started, stopped)
        # Per fault: the longest silence of any queue from the fault's start to the next fault's.
        starts = [f.start for f in self.run.faults] + [stopped]
        self.fault_gaps: dict[str, float] = {}
        for f, until in zip(self.run.faults, starts[1:], strict=False):
            g = worst_gap(load.record, QUEUES, f.start, until)[0]
            self.fault_gaps[f.kind] = max(self.fault_gaps.get(f.kind, 0.0), g)
        result.figures.update(worst_gap_s=gap[0], seconds=ended - started, serving_spans=len(intervals))
        self.gap = gap
        self.log_counts = {n: _log_counts(r) for n, r in records.items()}
        self.client_errors = dict(load.record.client_errors)
        return result

    def _drain(self, load: Load) -> None:
        deadline = time.monotonic() + DRAIN_TIMEOUT
        while time.monotonic() < deadline:
            missing = self.bg.call(lambda: _undelivered(load))
            if not missing:
                return
            time.sleep(1)
        self.log(f"drain: {len(missing)} confirmed messages still undelivered after {DRAIN_TIMEOUT:.0f}s")


def _each(proxies: list[Proxy], fn: Callable[[Proxy], None]) -> None:
    for p in proxies:
        fn(p)


def _undelivered(load: Load) -> list[tuple[str, int]]:
    delivered = {(d.publisher, d.seq) for d in load.record.deliveries}
    return [k for k in load.record.confirmed if k not in delivered]


def _log_counts(records: list[dict[str, Any]]) -> dict[str, int]:
    counts = {"error": 0, "traceback": 0}
    for r in records:
        if r.get("level") in ("error", "critical"):
            counts["error"] += 1
        if "exc" in r:  # leveret/node/logs.py puts a record's traceback there
            counts["traceback"] += 1
    return counts


def report(chaos: Chaos, result: Result) -> str:
    a = chaos.args
    lines = [
        f"\n## Chaos run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n",
        f"`python -m bench.chaos --cycles {a.cycles} --seed {a.seed} --faults {','.join(a.faults)} "
        f"--duration-per-cycle {a.duration_per_cycle:g} --rate {a.rate:g} --lease-ttl {a.lease_ttl} "
        f"--pg-outage {a.pg_outage:g}{' --sync-standby' if a.sync_standby else ''}`:\n"
        f"3 nodes, real etcd and Postgres, {len(QUEUES)} durable queues, "
        f"a confirmed publisher and an acking consumer on every node; {result.figures['seconds']:.0f} s.\n",
        "| fault | count | how (count) | held (s) | worst recovery (s) | worst failover (s) |",
        "|---|---|---|---|---|---|",
    ]
    for kind in [k for k in a.faults if k in CLUSTER_FAULTS]:
        fs = [f for f in chaos.run.faults if f.kind == kind]
        rec = [r for k, r in chaos.run.recoveries if k == kind]
        how = ", ".join(f"{v} ({sum(1 for x in fs if x.variant == v)})" for v in sorted({x.variant for x in fs}))
        held = f"{min(x.hold for x in fs):.1f}-{max(x.hold for x in fs):.1f}" if fs else "-"
        lines.append(f"| {kind} | {len(fs)} | {how} | {held} | {max(rec) if rec else 0:.1f} | "
                     f"{chaos.fault_gaps.get(kind, 0.0):.1f} |")
    f = result.figures
    lines += [
        "",
        "Recovery: from the fault's end until every node is registered in etcd and every queue has an owner. "
        "Failover: the longest time any queue went without a delivery, from the fault's start to the next's.",
        "",
        f"- published {f['published']:.0f}, confirmed {f['confirmed']:.0f}, nacked {f['nacked']:.0f}, "
        f"unconfirmed (connection lost or timed out) {f['unconfirmed']:.0f}",
        f"- deliveries {f['delivered']:.0f} ({f['distinct_delivered']:.0f} distinct messages, "
        f"{f['duplicates']:.0f} duplicates, {f['redelivered']:.0f} with redelivered set)",
        f"- queue ownership spans seen in the node logs: {f['serving_spans']:.0f}",
        *([f"- node log lines stamped with a stepped wall clock (the step took effect): {chaos.stepped_lines}"]
          if "clock" in a.faults else []),
        f"- worst failover (longest time a queue had no delivery): {chaos.gap[0]:.1f} s ({chaos.gap[1]})",
        "- node log lines at level error: "
        + ", ".join(f"{n} {v['error']}" for n, v in sorted(chaos.log_counts.items()))
        + "; with a traceback: " + ", ".join(f"{n} {v['traceback']}" for n, v in sorted(chaos.log_counts.items())),
        "- client errors (reconnected): "
        + (", ".join(f"{k} {v}" for k, v in sorted(chaos.client_errors.items())) or "none"),
        f"- **violations: {result.total}**"
        + ("" if not result.total else " (" + ", ".join(f"{k} {len(v)}" for k, v in result.violations.items()) + ")"),
    ]
    for kind, items in result.violations.items():
        for item in items[:5]:
            lines.append(f"  - {kind}: {item}")
        if len(items) > 5:
            lines.append(f"  - ... and {len(items) - 5} more of {kind}")
    return "\n".join(lines) + "\n"


def _quiet_clients() -> None:
    """aiormq logs every failed reconnect with a traceback; the suite counts them instead."""
    for name in ("aiormq", "aio_pika", "pika"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n")[0])
    p.add_argument("--cycles", type=int, default=10)
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random, printed)")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, from {','.join(FAULTS)}")
    p.add_argument("--duration-per-cycle", type=float, default=8.0, help="seconds of load without a fault")
    p.add_argument("--rate", type=float, default=50.0, help="messages/s per publisher (3 publishers)")
    p.add_argument("--lease-ttl", type=int, default=2)
    p.add_argument("--pg-outage", type=float, default=10.0, help="seconds Postgres is unreachable (pg fault)")
    p.add_argument("--sync-standby", action="store_true",
                   help="promote: the primary waits for the standby before a commit returns")
    p.add_argument("--disk-limit-mb", type=float, default=16.0, help="file-size limit of the disk scenario")
    p.add_argument("--pg-mode", choices=("both", "restart", "outage"), default="both",
                   help="pg fault: a restart, an outage (blackholed), or either at random")
    p.add_argument("--round-robin", action="store_true", help="faults in turn instead of at random")
    p.add_argument("--report", action="store_true", help=f"append the report to {REPORT}")
    p.add_argument("--keep", action="store_true", help="keep the cluster's work directory (logs)")
    args = p.parse_args(argv)
    args.faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = set(args.faults) - set(FAULTS)
    if unknown or not args.faults:
        p.error(f"unknown faults {sorted(unknown)}; choose from {','.join(FAULTS)}")
    if args.seed is None:
        args.seed = random.randrange(1 << 30)
    return args


def run(args: argparse.Namespace) -> tuple[Result, str]:
    _quiet_clients()
    result, text = Result(), f"\n## Chaos run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n"
    if any(f in CLUSTER_FAULTS for f in args.faults):
        chaos = Chaos(args)
        try:
            result = chaos.main()
            text = report(chaos, result)
        finally:
            chaos.close()
    if "disk" in args.faults:
        with tempfile.TemporaryDirectory(prefix="leveret-chaos-disk-") as tmp:
            disk = run_disk(Path(tmp), args.disk_limit_mb)
        for v in disk.violations:
            result.add("disk", v)
        text += "\n".join(report_lines(disk)) + "\n"
    return result, text


def _stop_on_signals() -> None:
    """SIGTERM and SIGINT end the run through its clean-up (nodes, etcd, Postgres, temp dirs), even when
    started in the background, where a shell leaves SIGINT ignored."""

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    _stop_on_signals()
    result, text = run(args)
    print(text)
    if args.report:
        with REPORT.open("a") as f:
            f.write(text)
    return 1 if result.total else 0


if __name__ == "__main__":
    sys.exit(main())
