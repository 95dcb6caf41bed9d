"""``python -m bench.fuzz --minutes N``: mutated and hostile AMQP frames against a live node, for minutes.

The long form of tests/test_fuzz.py (same seeds and mutations, from
harness/fuzzing.py), over real sockets. Workers open connections and send
bursts of mutated frames, and (``--mode``) bursts of hostile but well-formed
ones (``fuzzing.hostile``: topic bindings with runs of ``#`` and ``*`` and
255-byte routing keys, large and deep argument tables and headers, odd
names, get/reject pairs, partial bodies): a byte fuzzer breaks frames and
never reaches what valid input can do to routing or memory. One canary client keeps doing publish/get round
trips on its own connection throughout. The report: frames sent, the close
codes the node answered with, internal errors (541 on the wire or an
internal-error line in the node's log: must be 0), crashes (0), the node's
RSS and open fds before and after, the log volume, the canary's round trips.
Internal errors raised in core/model/fieldtable.py or properties.py are
counted apart: those decoders belong to the "publish" work.

Without ``--url`` it starts a node of its own on free loopback ports (its log
in a temporary directory); with ``--url`` it needs ``--pid`` and
``--log`` for the figures that read the node's process and log.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import struct
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pamqp import commands, frame
from pamqp.body import ContentBody
from pamqp.header import ContentHeader

from bench.target import BrokerUrl
from compat_tests.raw_amqp import RawAMQP
from harness import fuzzing
from harness.node import NodeProcess

SEEDS = fuzzing.seeds()
CONNECTION_CLOSE = b"\x00\x0a\x00\x32"
CONNECTION_CLOSE_OK = b"\x00\x0a\x00\x33"
CHANNEL_CLOSE = b"\x00\x14\x00\x28"
INTERNAL_MESSAGES = ("internal error", "callback failed", "unhandled exception in the event loop",
                     "tick failed", "cluster operation failed")


@dataclass
class Tally:
    """What the workers saw; one lock, updated once per burst."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    frames_sent: int = 0
    bytes_sent: int = 0
    connections: int = 0
    close_codes: Counter[str] = field(default_factory=Counter)
    ends: Counter[str] = field(default_factory=Counter)  # how connections ended, from the client's side
    canary_ok: int = 0
    canary_failed: int = 0
    canary_latency: list[float] = field(default_factory=list)

    def add(self, frames: int, sent: int) -> None:
        with self.lock:
            self.frames_sent += frames
            self.bytes_sent += sent


class Reader:
    """Frames from the node as (type, channel, payload), tolerant of content it relays."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def frames(self, wait: float) -> tuple[list[tuple[int, int, bytes]], bool]:
        """What arrives within ``wait`` seconds; True once the node closed (EOF or reset)."""
        out: list[tuple[int, int, bytes]] = []
        deadline = time.monotonic() + wait
        eof = False
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self.sock.settimeout(remaining)
            try:
                chunk = self.sock.recv(262144)
            except TimeoutError:
                break
            if not chunk:
                eof = True
                break
            self.buf += chunk
            if self.buf.startswith(b"AMQP"):  # the node's answer to a bad protocol header
                self.buf = self.buf[8:]
            while len(self.buf) >= 8:
                ftype, channel, size = fuzzing.FRAME_HEAD.unpack_from(self.buf, 0)
                if len(self.buf) < size + 8:
                    break
                out.append((ftype, channel, self.buf[7 : 7 + size]))
                self.buf = self.buf[size + 8 :]
        return out, eof


class Worker(threading.Thread):
    def __init__(self, url: BrokerUrl, tally: Tally, seed: int, deadline: float, mode: str = "both") -> None:
        super().__init__(daemon=True)
        self.mode = mode
        self.url = url
        self.tally = tally
        self.rnd = random.Random(seed)
        self.deadline = deadline

    def run(self) -> None:
        while time.monotonic() < self.deadline:
            try:
                self.session()
            except (ConnectionResetError, BrokenPipeError):
                self.end("reset")
            except (OSError, AssertionError) as exc:
                self.end(f"client error: {type(exc).__name__}")

    def end(self, how: str) -> None:
        with self.tally.lock:
            self.tally.ends[how] += 1

    def session(self) -> None:
        rnd = self.rnd
        with self.tally.lock:
            self.tally.connections += 1
        mode = rnd.random()
        if mode < 0.1:
            self.garbage_handshake()
            return
        client = RawAMQP(self.url.host, self.url.port)
        try:
            client.handshake(self.url.user, self.url.password, self.url.vhost)
            client.open_channel(1)
            sock = client.sock
            reader = Reader(sock)
            reader.buf = client.buffer
            setup = b"".join(frame.marshal(m, 1) for m in fuzzing.SETUP)
            sock.sendall(setup)
            hostile = self.mode == "hostile" or (self.mode == "both" and rnd.random() < 0.5)
            for _ in range(rnd.randint(1, 30)):
                if hostile:
                    frames = [fuzzing.hostile(rnd) for _ in range(rnd.randint(1, 3))]
                else:
                    frames = [rnd.choice(SEEDS) for _ in range(rnd.randint(1, 8))]
                    for _ in range(rnd.choice((0, 1, 1, 1, 2, 3))):
                        j = rnd.randrange(len(frames))
                        frames[j] = fuzzing.mutate(rnd, frames[j])
                data = b"".join(frames)
                sock.sendall(data)
                self.tally.add(len(fuzzing.split_frames(data)) or 1, len(data))
                if rnd.random() < 0.02:
                    self.end("dropped by the client")
                    return  # abrupt: the socket closes without a close
                if self.answer(reader, sock, rnd.choice((0.001, 0.01, 0.05))):
                    return
            sock.sendall(frame.marshal(
                commands.Connection.Close(reply_code=200, reply_text="fuzz done", class_id=0, method_id=0), 0))
            if not self.answer(reader, sock, 5.0, closing=True):
                # A mutated size field can make the node wait for the rest of a
                # "frame" that swallows our close: the client's fault, as on any broker.
                self.end("no close-ok in 5 s")
        finally:
            client.close_socket()

    def answer(self, reader: Reader, sock: socket.socket, wait: float, closing: bool = False,
               phase: str = "") -> bool:
        """Read the node's replies, answer its closes; True once the connection is over."""
        deadline = time.monotonic() + wait
        while True:
            frames, eof = reader.frames(max(0.0, deadline - time.monotonic()))
            for ftype, channel, payload in frames:
                if ftype != 1:
                    continue
                head = payload[:4]
                if head == CONNECTION_CLOSE:
                    code = struct.unpack_from(">H", payload, 4)[0]
                    self.code(f"connection {code}")
                    sock.sendall(frame.marshal(commands.Connection.CloseOk(), 0))
                    self.finish(reader, phase)
                    return True
                if head == CONNECTION_CLOSE_OK:
                    self.finish(reader, phase)
                    return True
                if head == CHANNEL_CLOSE:
                    code = struct.unpack_from(">H", payload, 4)[0]
                    self.code(f"channel {code}")
                    sock.sendall(frame.marshal(commands.Channel.CloseOk(), channel)
                                 + frame.marshal(commands.Channel.Open(), channel))
            if eof:
                self.end(phase + "node closed without a close frame")
                return True
            if not closing or time.monotonic() >= deadline:
                return False

    def finish(self, reader: Reader, phase: str) -> None:
        """After the close handshake the node must end with a FIN (lingering close), not a reset."""
        try:
            _, eof = reader.frames(6.0)
        except ConnectionResetError:
            self.end(phase + "reset after close")
            return
        self.end(phase + ("clean close" if eof else "node kept the socket open"))

    def code(self, text: str) -> None:
        with self.tally.lock:
            self.tally.close_codes[text] += 1

    def garbage_handshake(self) -> None:
        rnd = self.rnd
        sock = socket.create_connection((self.url.host, self.url.port), timeout=5)
        try:
            if rnd.random() < 0.5:
                data = rnd.randbytes(rnd.randint(1, 64))
            else:
                start_ok = commands.Connection.StartOk(
                    client_properties={"product": "fuzz"}, mechanism=rnd.choice(["PLAIN", "AMQPLAIN", "X"]),
                    response=f"\0{self.url.user}\0{self.url.password}")
                data = fuzzing.PROTOCOL_HEADER + fuzzing.mutate(rnd, frame.marshal(start_ok, 0))
            sock.sendall(data)
            self.tally.add(1, len(data))
            reader = Reader(sock)
            # A partial header waits for the 10 s handshake timeout; do not wait that long.
            if not self.answer(reader, sock, 2.0, closing=True, phase="handshake garbage: "):
                self.end("handshake garbage: still open after 2 s")
        finally:
            sock.close()


class Canary(threading.Thread):
    """Round trips (publish, then get it back) on a well-behaved connection, all along."""

    def __init__(self, url: BrokerUrl, tally: Tally, deadline: float) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.tally = tally
        self.deadline = deadline

    def run(self) -> None:
        while time.monotonic() < self.deadline:
            try:
                self.loop()
            except Exception:  # noqa: BLE001 - any failure is a failed round trip, then reconnect
                with self.tally.lock:
                    self.tally.canary_failed += 1
                time.sleep(0.5)

    def loop(self) -> None:
        client = RawAMQP(self.url.host, self.url.port)
        try:
            client.handshake(self.url.user, self.url.password, self.url.vhost)
            client.open_channel(1)
            queue = client.rpc(commands.Queue.Declare(queue="", exclusive=True)).queue
            n = 0
            while time.monotonic() < self.deadline:
                n += 1
                body = f"canary {n}".encode()
                started = time.monotonic()
                client.sock.sendall(
                    frame.marshal(commands.Basic.Publish(exchange="", routing_key=queue), 1)
                    + frame.marshal(ContentHeader(0, len(body), commands.Basic.Properties()), 1)
                    + frame.marshal(ContentBody(body), 1))
                got = client.rpc(commands.Basic.Get(queue=queue, no_ack=True))
                assert isinstance(got, commands.Basic.GetOk), got
                _hdr, received = client.read_content()
                assert received == body, (received, body)
                with self.tally.lock:
                    self.tally.canary_ok += 1
                    self.tally.canary_latency.append(time.monotonic() - started)
                time.sleep(0.02)
        finally:
            client.close()


# ------------------------------------------------------------------ the node's side
def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def read_log(path: Path) -> dict[str, Any]:
    """Lines, bytes and internal errors (by kind) in the node's JSON log."""
    internal: Counter[str] = Counter()
    by_message: Counter[str] = Counter()
    suppressed = 0
    lines = 0
    raw = path.read_bytes() if path.exists() else b""
    for line in raw.splitlines():
        lines += 1
        try:
            record = json.loads(line)
        except ValueError:
            continue
        msg = str(record.get("msg", ""))
        like = str(record.get("like", ""))
        kind = str(record.get("error_kind", "")) or msg
        by_message[msg] += 1
        # Lines the rate limit held back: reported on a summary line, or on
        # the next line of the same kind as ``suppressed_before``.
        held = int(record.get("suppressed_before", 0))
        suppressed += held
        if msg == "log lines suppressed":
            suppressed += int(record.get("suppressed", 0))
            if like.startswith(INTERNAL_MESSAGES):
                internal[kind] += int(record.get("suppressed", 0))
        elif msg.startswith(INTERNAL_MESSAGES):
            internal[kind] += 1 + held
    publish_owned = {k: v for k, v in internal.items() if any(p in k for p in fuzzing.PUBLISH_OWNED_FILES)}
    ours = {k: v for k, v in internal.items() if k not in publish_owned}
    return {"bytes": len(raw), "lines": lines, "suppressed_lines_reported": suppressed,
            "lines_by_message": dict(by_message.most_common(8)),
            "internal_errors": ours, "publish_owned_internal_errors": publish_owned}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    node: NodeProcess | None = None
    workdir: tempfile.TemporaryDirectory[str] | None = None
    if args.url:
        url = BrokerUrl.parse(args.url)
        pid = args.pid
        log_path = Path(args.log) if args.log else None
    else:
        workdir = tempfile.TemporaryDirectory(prefix="leveret-fuzz-")
        root = Path(workdir.name)
        node = NodeProcess(root / "data", root / "logs")
        node.start()
        url = BrokerUrl.parse(node.url)
        pid = node.pid
        log_path = node.stderr_path
    log_before = log_path.stat().st_size if log_path and log_path.exists() else 0
    try:
        report = _measure(args, url, pid, node)
        if node is not None:
            # Stopped before its log is read: at shutdown it reports the lines its rate limit still held.
            report["node_exit_code"] = node.terminate()
        log = read_log(log_path) if log_path else {}
        if log:
            log["bytes_during_run"] = log["bytes"] - log_before
        report["log"] = log
        report["internal_errors_in_log"] = sum(log["internal_errors"].values()) if log else None
        return report
    finally:
        if node is not None and node.running():
            node.terminate()
        if workdir is not None:
            workdir.cleanup()


def _measure(args: argparse.Namespace, url: BrokerUrl, pid: int | None, node: NodeProcess | None) -> dict[str, Any]:
    tally = Tally()
    time.sleep(1.0)  # let the node settle before the first sample
    before = {"rss": rss_bytes(pid), "fds": open_fds(pid)} if pid else {}
    started = time.monotonic()
    deadline = started + args.minutes * 60
    threads: list[threading.Thread] = [Canary(url, tally, deadline)]
    threads += [Worker(url, tally, args.seed * 1000 + i, deadline, args.mode) for i in range(args.workers)]
    for t in threads:
        t.start()
    crashed = False
    samples: list[tuple[int, int, int]] = []  # (second, RSS MiB, fds) every 30 s: flat or growing?
    while time.monotonic() < deadline:
        time.sleep(1.0)
        if node is not None and not node.running():
            crashed = True
            break
        elapsed = int(time.monotonic() - started)
        if pid and elapsed // 30 > len(samples) - 1:
            samples.append((elapsed, rss_bytes(pid) >> 20, open_fds(pid)))
        if args.progress:
            with tally.lock:
                print(f"\r{time.monotonic() - started:6.0f}s frames {tally.frames_sent} "
                      f"connections {tally.connections} canary {tally.canary_ok}", end="", file=sys.stderr)
    for t in threads:
        t.join(timeout=20)
    if args.progress:
        print(file=sys.stderr)
    time.sleep(args.settle)  # lingering closes end; fds must come back
    after = {"rss": rss_bytes(pid), "fds": open_fds(pid)} if pid and not crashed else {}
    wire_541 = sum(v for k, v in tally.close_codes.items() if k.endswith(" 541"))
    return {
        "minutes": args.minutes,
        "mode": args.mode,
        "workers": args.workers,
        "frames_sent": tally.frames_sent,
        "bytes_sent": tally.bytes_sent,
        "connections": tally.connections,
        "close_codes": dict(sorted(tally.close_codes.items())),
        "connection_ends": dict(tally.ends),
        "internal_errors_on_wire_541": wire_541,
        "crashes": int(crashed),
        "node_before": before,
        "node_after": after,
        "node_samples_s_rss_mib_fds": samples,
        "canary": {
            "round_trips": tally.canary_ok,
            "failures": tally.canary_failed,
            "p50_ms": round(percentile(tally.canary_latency, 0.5) * 1000, 2),
            "p99_ms": round(percentile(tally.canary_latency, 0.99) * 1000, 2),
            "max_ms": round(max(tally.canary_latency, default=0.0) * 1000, 2),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--url", help="a running node (loopback only); default: start one on free ports")
    parser.add_argument("--pid", type=int, help="with --url: the node's pid, for RSS and fds")
    parser.add_argument("--log", help="with --url: the node's JSON log file, for log volume and internal errors")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--mode", choices=("mutate", "hostile", "both"), default="both",
                        help="mutated frames, hostile well-formed frames (harness/fuzzing.py: hostile), or both "
                        "(half the connections each)")
    parser.add_argument("--settle", type=float, default=6.0, help="seconds between the run and the after-sample")
    parser.add_argument("--json", help="also write the report here")
    parser.add_argument("--progress", action="store_true")
    args = parser.parse_args(argv)
    report = run(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    # Every internal error also closes its connection with 541; those in the
    # publish work's decoders are reported apart and do not fail the run.
    publish_owned = sum(report["log"].get("publish_owned_internal_errors", {}).values()) if report["log"] else 0
    ours = report["internal_errors_in_log"] or 0
    ok = report["crashes"] == 0 and ours == 0 and report["internal_errors_on_wire_541"] <= publish_owned
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
