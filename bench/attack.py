"""``python -m bench.attack``: every attack of issue #26 against a node, a bounded time each.

    .venv/bin/python -m bench.attack [--seconds 3] [--url amqp://127.0.0.1:PORT/ --http-port N
                                      --grpc-port N --mqtt-port N --pid PID]

Without ``--url`` it starts its own node on free ports (harness/node.py, MQTT on). One bystander
connection does basic.get round trips all along; per attack the table says the bystander's worst
round trip while it ran and the node's RSS (``VmRSS`` after, ``VmHWM`` the peak during it, reset
before each attack through /proc/PID/clear_refs) when the node is local (``--pid`` or its own).
The attacks log in as guest/guest (a node's default user). The login attacks come last: they leave
127.0.0.1 throttled (every later login from it waits up to 10 s) for five minutes.
The attacks themselves are bench/hostile.py's, which the tests of compat_tests/ also run.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from bench import hostile
from bench.fuzz import Tally, Worker
from bench.target import BrokerUrl
from harness.node import NodeProcess

MiB = 1024 * 1024


@dataclass(frozen=True)
class Target:
    host: str
    amqp_port: int
    http_port: int | None
    grpc_port: int | None
    mqtt_port: int | None
    pid: int | None


@dataclass
class Row:
    attack: str
    done: str  # what the attack managed (requests, publishes, status codes)
    worst_ms: float
    round_trips: int
    rss_mib: float | None
    peak_mib: float | None


# Each attack runs until the monotonic deadline it is given (or a bounded amount of work), returns
# a few words on what it did.
AttackFn = Callable[[Target, float], str]


def _regex(t: Target, until: float) -> str:
    assert t.http_port is not None
    return f"{hostile.regex_filter(t.http_port, 10_000, until)} requests"


def _topic(t: Target, until: float) -> str:
    return f"{hostile.topic_binding(t.amqp_port, 1_000_000, until)} publishes"


def _get_reject(t: Target, until: float) -> str:
    attacker = hostile.get_reject_without_reading(t.amqp_port)
    time.sleep(max(0.0, until - time.monotonic()))
    attacker.close_socket()
    return "150 get+reject pairs, 4 MiB message"


def _partial(t: Target, until: float) -> str:
    attacker = hostile.amqp_client(t.amqp_port)
    for ch in range(2, 8):
        attacker.open_channel(ch)
    sent = sum(hostile.send_partial(attacker.sock, ch, 120 * MiB, 100 * MiB, until=until) for ch in range(2, 8))
    attacker.close_socket()
    return f"{sent / MiB:.0f} MiB of 6x120 MiB bodies sent"


def _hostile_frames(t: Target, until: float) -> str:
    tally = Tally()
    url = BrokerUrl(t.host, t.amqp_port, "guest", "guest", "/")
    workers = [Worker(url, tally, seed, until, mode="hostile") for seed in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(until - time.monotonic() + 30)
    return f"{tally.frames_sent} frames, {tally.connections} connections"


def _grpc_push(t: Target, until: float) -> str:
    assert t.grpc_port is not None
    # In a process of its own: building and sending 480 MiB holds this one's GIL (and the bystander).
    script = "import sys; from bench.hostile import unauthenticated_pushes as p; print(*p(int(sys.argv[1])))"
    done = subprocess.run([sys.executable, "-c", script, str(t.grpc_port)], cwd=hostile.ROOT, capture_output=True,
                          text=True, timeout=120)
    codes = done.stdout.split() or [f"exit {done.returncode}"]
    return "4x120 MiB: " + ",".join(sorted(set(codes)))


def _logins(protocol: str, count: int) -> AttackFn:
    def attack(t: Target, until: float) -> str:
        port = {"amqp": t.amqp_port, "mqtt": t.mqtt_port, "grpc": t.grpc_port}[protocol]
        assert port is not None
        # At least 1.5 s: the script opens every connection and waits 0.5 s before the logins go out.
        hostile.run_for(hostile.wrong_logins(protocol, port, count), max(1.5, until - time.monotonic()))
        return f"{count} in parallel"
    return attack


# (name, issue item, the port it needs besides AMQP, the attack); the login attacks last (see above).
ATTACKS: list[tuple[str, str, str, AttackFn]] = [
    ("regex filter ^(a+)+$ over HTTP", "10", "http", _regex),
    ("topic binding #.*. x14, 255-char key", "11", "", _topic),
    ("get+reject(requeue), never reading", "13", "", _get_reject),
    ("unfinished bodies on 6 channels", "14", "", _partial),
    ("hostile well-formed frames (fuzzer)", "16", "", _hostile_frames),
    ("unauthenticated 120 MiB gRPC pushes", "15", "grpc", _grpc_push),
    ("wrong AMQP logins", "12", "", _logins("amqp", 100)),
    ("wrong MQTT logins", "12", "mqtt", _logins("mqtt", 50)),
    ("wrong gRPC logins", "12", "grpc", _logins("grpc", 50)),
]


def _reset_peak(pid: int | None) -> None:
    if pid is not None:
        with contextlib.suppress(OSError):
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM back to VmRSS


def run(target: Target, seconds: float, only: set[str] | None = None,
        out: Callable[[str], None] = print) -> list[Row]:
    rows: list[Row] = []
    bystander = hostile.Bystander(target.amqp_port, target.host)
    bystander.start()
    try:
        for name, item, needs, attack in ATTACKS:
            if only and not any(word in name for word in only):
                continue
            if needs and getattr(target, f"{needs}_port") is None:
                out(f"skipped (no --{needs}-port): {name}")
                continue
            _reset_peak(target.pid)
            time.sleep(0.2)
            mark = len(bystander.times)
            start = time.monotonic()
            try:
                done = attack(target, start + seconds)
            except Exception as exc:  # noqa: BLE001 - one attack's failure is a row, not the end
                done = f"attack failed: {type(exc).__name__}: {exc}"[:60]
            time.sleep(0.3)  # a stall that outlasts the attack is still its
            worst = bystander.worst_since(mark)
            pid = target.pid
            rows.append(Row(f"{name} (#{item})", done, worst * 1000, len(bystander.times) - mark,
                            hostile.rss(pid) / MiB if pid else None,
                            hostile.rss(pid, "VmHWM") / MiB if pid else None))
            if not bystander.is_alive():
                out("the bystander's connection failed; stopping")
                break
    finally:
        bystander.finish()
    return rows


def table(rows: list[Row]) -> str:
    def mib(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    head = f"| {'attack':<44} | {'what it did':<40} | worst RTT ms | RTTs | RSS MiB | peak MiB |"
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for r in rows:
        lines.append(f"| {r.attack:<44} | {r.done:<40} | {r.worst_ms:>12.0f} | {r.round_trips:>4} | "
                     f"{mib(r.rss_mib):>7} | {mib(r.peak_mib):>8} |")
    return "\n".join(lines)


@contextlib.contextmanager
def own_node() -> Iterator[Target]:
    root = Path(tempfile.mkdtemp(prefix="leveret-attack-"))
    node = NodeProcess(root / "data", root / "logs", mqtt=True)
    node.start()
    try:
        yield Target("127.0.0.1", node.amqp_port, node.management_port, node.grpc_port, node.mqtt_port, node.pid)
    finally:
        node.terminate()
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="how long each attack runs")
    parser.add_argument("--url", help="a running node's AMQP URL (loopback); default: start one")
    parser.add_argument("--http-port", type=int, help="with --url: its management port")
    parser.add_argument("--grpc-port", type=int, help="with --url: its gRPC port")
    parser.add_argument("--mqtt-port", type=int, help="with --url: its MQTT port")
    parser.add_argument("--pid", type=int, help="with --url: its process id, to read its RSS")
    parser.add_argument("--only", action="append", help="run the attacks whose name contains this")
    args = parser.parse_args(argv)
    only = set(args.only) if args.only else None
    if args.url:
        url = BrokerUrl.parse(args.url)
        target = Target(url.host, url.port, args.http_port, args.grpc_port, args.mqtt_port, args.pid)
        rows = run(target, args.seconds, only)
    else:
        with own_node() as target:
            rows = run(target, args.seconds, only)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
