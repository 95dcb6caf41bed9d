"""``python -m bench.mqtt_bench``: MQTT throughput and idle-connection memory beside RabbitMQ and mosquitto.

One run measures every broker it can reach, in turn, with the same load:

- ``qos0-1pub``, ``qos0-100pub``, ``qos1-1pub``, ``qos1-100pub``: one or 100
  publishers (clean sessions, 256-byte bodies, as fast as TCP takes them; QoS 1
  with a window of 100 unacknowledged publishes each) fanning into one
  subscriber of the same QoS; the figure is what the subscriber received per
  second over ``--duration`` seconds after ``--warmup``;
- ``idle``: ``--idle`` connected clients (keep-alive 600 s) and the broker
  process's RSS growth per connection.

The clients are raw asyncio sockets speaking MQTT 3.1.1 with packets encoded
once (mqtt_frontend/codec.py), so the load generator costs little beside the
broker; the publishers run in one process and the subscriber in another.

Brokers: Leveret is started here on free ports (``leveret serve``, its
defaults), mosquitto too (Debian's ``/usr/sbin/mosquitto`` with a config file:
``listener PORT 127.0.0.1`` and ``allow_anonymous true``), and RabbitMQ's MQTT
plugin is used where something listens on ``--rabbitmq-port`` (1883; enable it
with ``rabbitmq-plugins enable rabbitmq_mqtt``; guest/guest). ``--only`` picks
brokers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mqtt_frontend import codec

BODY = b"x" * 256
SCENARIOS = (("qos0-1pub", 0, 1), ("qos0-100pub", 0, 100), ("qos1-1pub", 1, 1), ("qos1-100pub", 1, 100))


def connect_packet(client_id: str, keep_alive: int = 60) -> bytes:
    flags = 0x02 | 0x80 | 0x40
    body = codec.utf8("MQTT") + bytes((4, flags)) + keep_alive.to_bytes(2, "big")
    body += codec.utf8(client_id) + codec.utf8("guest") + codec.binary(b"guest")
    return codec.packet(codec.CONNECT, 0, body)


async def open_client(port: int, client_id: str, keep_alive: int = 60) -> tuple[asyncio.StreamReader,
                                                                                 asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    writer.write(connect_packet(client_id, keep_alive))
    ack = await asyncio.wait_for(reader.readexactly(4), 10)
    if ack[0] != 0x20 or ack[3] != 0:
        raise RuntimeError(f"CONNACK refused: {ack!r}")
    return reader, writer


async def read_packets(reader: asyncio.StreamReader, buf: bytearray) -> list[tuple[int, int, bytes]]:
    """Whatever whole packets the next read completes: (type, flags, body)."""
    data = await reader.read(1 << 18)
    if not data:
        raise ConnectionError("closed by the broker")
    buf += data
    out = []
    pos = 0
    while True:
        if len(buf) - pos < 2:
            break
        got = codec.decode_remaining(buf, pos + 1)
        if got is None:
            break
        size, start = got
        if start + size > len(buf):
            break
        out.append((buf[pos] >> 4, buf[pos] & 0x0F, bytes(buf[start:start + size])))
        pos = start + size
    del buf[:pos]
    return out


# ----------------------------------------------------------------- subscriber
def subscriber(port: int, topic: str, qos: int, warmup: float, duration: float, ready: Any, result: Any) -> None:
    async def run() -> None:
        reader, writer = await open_client(port, f"bench-sub-{os.getpid()}")
        sub = codec.packet(codec.SUBSCRIBE, 2, b"\x00\x01" + codec.utf8(topic) + bytes((qos,)))
        writer.write(sub)
        buf = bytearray()
        while True:
            if any(k == codec.SUBACK for k, _, _ in await read_packets(reader, buf)):
                break
        ready.set()
        count = 0
        started = time.monotonic()
        measure_from = started + warmup
        end = measure_from + duration
        at_start = -1
        while True:
            try:
                packets = await asyncio.wait_for(read_packets(reader, buf), max(0.01, end - time.monotonic()))
            except TimeoutError:
                packets = []
            acks = []
            for kind, flags, body in packets:
                if kind == codec.PUBLISH:
                    count += 1
                    if (flags >> 1) & 3:
                        n = int.from_bytes(body[:2], "big")
                        pid = body[2 + n:4 + n]
                        acks.append(b"\x40\x02" + pid)
            if acks:
                writer.write(b"".join(acks))
            now = time.monotonic()
            if at_start < 0 and now >= measure_from:
                at_start = count
            if now >= end:
                break
        result.put((count - max(at_start, 0)) / duration)
        writer.close()

    asyncio.run(run())


# ----------------------------------------------------------------- publishers
def publishers(port: int, topic: str, qos: int, n: int, stop_at: float, result: Any) -> None:
    async def one(i: int) -> int:
        reader, writer = await open_client(port, f"bench-pub-{os.getpid()}-{i}")
        sent = 0
        buf = bytearray()
        if qos == 0:
            packet = codec.publish(topic, BODY, 0, False, False, 0, codec.V311)
            batch = packet * 50
            while time.monotonic() < stop_at:
                writer.write(batch)
                sent += 50
                await writer.drain()
            writer.close()
            return sent
        window = 100
        inflight = 0
        next_id = 0
        while time.monotonic() < stop_at:
            chunk = []
            while inflight < window:
                next_id = next_id % 65535 + 1
                chunk.append(codec.publish(topic, BODY, 1, False, False, next_id, codec.V311))
                inflight += 1
            if chunk:
                writer.write(b"".join(chunk))
                sent += len(chunk)
            try:
                packets = await asyncio.wait_for(read_packets(reader, buf), 1.0)
            except TimeoutError:
                continue
            inflight -= sum(1 for k, _, _ in packets if k == codec.PUBACK)
        writer.close()
        return sent

    async def run() -> None:
        counts = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
        errors = [repr(c) for c in counts if isinstance(c, BaseException)]
        result.put((sum(c for c in counts if isinstance(c, int)), errors[:3]))

    asyncio.run(run())


def throughput(port: int, pid: int, qos: int, n: int, warmup: float, duration: float) -> dict[str, Any]:
    # A topic of its own: what an earlier scenario's publishers left in the broker's socket buffers
    # routes nowhere; and the broker is let go idle first, so that backlog costs this run no CPU.
    topic = f"bench/{qos}/{n}/{os.urandom(4).hex()}"
    settle(pid)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    got: Any = ctx.Queue()
    sent: Any = ctx.Queue()
    sub = ctx.Process(target=subscriber, args=(port, topic, qos, warmup, duration, ready, got))
    sub.start()
    if not ready.wait(20):
        sub.terminate()
        raise RuntimeError("subscriber did not subscribe")
    stop_at = time.monotonic() + warmup + duration + 0.5
    pub = ctx.Process(target=publishers, args=(port, topic, qos, n, stop_at, sent))
    pub.start()
    rate = got.get(timeout=warmup + duration + 60)
    total, errors = sent.get(timeout=60)
    pub.join(30)
    sub.join(30)
    return {"msgs_per_s": round(rate), "published": total, "errors": errors}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def settle(pid: int, limit: float = 120.0) -> None:
    """Until the broker uses under 5 % of a core for half a second (or ``limit`` passes)."""
    if not pid:
        time.sleep(2)
        return
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        before = cpu_seconds(pid)
        time.sleep(0.5)
        if cpu_seconds(pid) - before < 0.025:
            return


# --------------------------------------------------------------------- idle
def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def fd_room(pid: int) -> int:
    """Half the file descriptors the broker process may still open: a shared RabbitMQ started with the
    default soft limit (1024) loses its memory monitor when it runs out (seen with 2,000 idle clients)."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft = int(line.split()[3])
            return max(0, (soft - len(os.listdir(f"/proc/{pid}/fd"))) // 2)
    return 0


def idle(port: int, pid: int, wanted: int) -> dict[str, Any]:
    count = min(wanted, fd_room(pid))

    async def run() -> dict[str, Any]:
        settle(pid)
        before = rss(pid)
        conns = []
        for i in range(0, count, 200):
            conns += await asyncio.gather(*(open_client(port, f"bench-idle-{i + j}", 600)
                                            for j in range(min(200, count - i))))
        await asyncio.sleep(2)
        after = rss(pid)
        for _, w in conns:
            w.close()
        return {"connections": count, "rss_before_mib": round(before / 2**20, 1),
                "rss_after_mib": round(after / 2**20, 1),
                "kib_per_connection": round((after - before) / max(1, count) / 1024, 1),
                "capped_by_fd_limit": count < wanted}

    return asyncio.run(run())


# ------------------------------------------------------------------ brokers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return True
        except OSError:
            time.sleep(0.1)
    return False


def listener_pid(port: int) -> int:
    out = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True).stdout
    for part in out.split("pid=")[1:]:
        return int(part.split(",")[0])
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--idle", type=int, default=10_000,
                    help="idle clients for the memory figure (0: skip); at most half the fds a broker has left")
    ap.add_argument("--rabbitmq-port", type=int, default=1883)
    ap.add_argument("--only", action="append", choices=("leveret", "rabbitmq", "mosquitto"))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    wanted = set(args.only or ("leveret", "rabbitmq", "mosquitto"))
    tmp = Path(tempfile.mkdtemp(prefix="mqtt-bench-"))
    procs: list[subprocess.Popen[bytes]] = []
    brokers: dict[str, tuple[int, int]] = {}  # name -> (port, pid)
    try:
        if "leveret" in wanted:
            port = free_port()
            repo = Path(__file__).resolve().parent.parent
            env = {k: v for k, v in os.environ.items() if not k.startswith("LEVERET_")}
            cmd = [sys.executable, "-m", "leveret", "serve", "--bind", "127.0.0.1", "--amqp-port", str(free_port()),
                   "--grpc-port", str(free_port()), "--management-port", "0", "--prometheus-port", "0",
                   "--mqtt-port", str(port), "--mqtt-ws-port", "0", "--data-dir", str(tmp / "leveret"),
                   "--log-level", "warning"]
            with open(tmp / "leveret.log", "wb") as log:
                procs.append(subprocess.Popen(cmd, cwd=repo, env=env, stdout=log, stderr=log))
            if wait_port(port):
                brokers["leveret"] = (port, procs[-1].pid)
        if "rabbitmq" in wanted and wait_port(args.rabbitmq_port, 1):
            brokers["rabbitmq"] = (args.rabbitmq_port, listener_pid(args.rabbitmq_port))
        mosquitto = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        if "mosquitto" in wanted and Path(mosquitto).exists():
            port = free_port()
            conf = tmp / "mosquitto.conf"
            conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\nmax_queued_messages 0\n")
            procs.append(subprocess.Popen([mosquitto, "-c", str(conf)], stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
            if wait_port(port):
                brokers["mosquitto"] = (port, procs[-1].pid)
        results: dict[str, dict[str, Any]] = {name: {} for name in brokers}
        if args.idle:  # first, on brokers that have not served a load yet
            for name, (port, pid) in brokers.items():
                try:
                    results[name]["idle"] = idle(port, pid, args.idle) if pid else {"error": "no pid"}
                except Exception as exc:  # noqa: BLE001
                    results[name]["idle"] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"{'idle':12} {name:10} {results[name]['idle']}", flush=True)
        for scenario, qos, n in SCENARIOS:
            for name, (port, pid) in brokers.items():
                try:
                    results[name][scenario] = throughput(port, pid, qos, n, args.warmup, args.duration)
                except Exception as exc:  # noqa: BLE001 - one broker's failure is a figure too
                    results[name][scenario] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"{scenario:12} {name:10} {results[name][scenario]}", flush=True)
        print()
        names = list(brokers)
        print(f"{'msg/s':14}" + "".join(f"{n:>12}" for n in names))
        for scenario, _, _ in SCENARIOS:
            print(f"{scenario:14}" + "".join(f"{results[n][scenario].get('msgs_per_s', 'error'):>12}" for n in names))
        if args.idle:
            print(f"{'KiB/idle conn':14}" + "".join(
                f"{results[n]['idle'].get('kib_per_connection', 'error'):>12}" for n in names))
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
