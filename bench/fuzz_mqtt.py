"""``python -m bench.fuzz_mqtt --seconds N``: mutated MQTT sessions against a live node, over sockets.

The long form of tests/test_mqtt_fuzz.py (the same seeds and mutations, from
harness/mqtt_fuzzing.py). Workers open connections and send mutated 3.1.1 and
5.0 sessions in random chunks; a canary (paho, QoS 1) keeps doing round trips
on its own connection throughout. The report: sessions sent, how the node
answered (CONNACK codes, DISCONNECT reasons, closes), internal errors in the
node's log (must be 0), whether the node survived, its RSS and open fds
before and after, the canary's round trips and failures.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import socket
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from harness import mqtt_fuzzing
from harness.node import NodeProcess

INTERNAL = ("internal error", "tick failed", "callback failed", "unhandled exception")


def worker(port: int, seed: int, deadline: float, ends: Counter[str], lock: threading.Lock) -> None:
    rng = random.Random(seed)
    seeds = mqtt_fuzzing.sessions()
    while time.monotonic() < deadline:
        data = mqtt_fuzzing.mutate(rng, rng.choice(seeds))
        how = "?"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.settimeout(2)
                for piece in mqtt_fuzzing.chunks(rng, data):
                    s.sendall(piece)
                got = b""
                try:
                    while chunk := s.recv(65536):
                        got += chunk
                        if len(got) > 1 << 20:
                            break
                    how = "closed by node"
                except TimeoutError:
                    how = "left open (waiting for more)"
                if got[:1] == b"\x20" and len(got) >= 4:
                    how += f", CONNACK {got[3]:#x}"
                disconnect = got.rfind(b"\xe0")
                if disconnect >= 0 and disconnect + 2 < len(got):
                    how += ", DISCONNECT sent"
        except ConnectionResetError:
            how = "reset"
        except OSError as exc:
            how = f"error {type(exc).__name__}"
        with lock:
            ends[how] += 1


def canary(port: int, deadline: float, tally: dict[str, Any]) -> None:
    got: queue.Queue[bytes] = queue.Queue()
    c = paho.Client(CallbackAPIVersion.VERSION2, client_id="fuzz-canary", protocol=paho.MQTTv5)
    c.username_pw_set("guest", "guest")
    c.on_message = lambda _c, _u, m: got.put(bytes(m.payload))
    c.connect("127.0.0.1", port)
    c.loop_start()
    c.subscribe("canary/#", qos=1)
    time.sleep(0.5)
    i = 0
    while time.monotonic() < deadline:
        body = b"%d" % i
        started = time.monotonic()
        try:
            c.publish("canary/x", body, qos=1).wait_for_publish(5)
            while got.get(timeout=5) != body:
                pass
            tally["ok"] += 1
            tally["latency"].append(time.monotonic() - started)
        except (queue.Empty, RuntimeError, ValueError):
            tally["failed"] += 1
        i += 1
        time.sleep(0.05)
    c.disconnect()
    c.loop_stop()


def proc_figures(pid: int) -> dict[str, int]:
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return {"rss_bytes": rss, "open_fds": len(os.listdir(f"/proc/{pid}/fd"))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="leveret-fuzz-mqtt-") as tmp:
        node = NodeProcess(Path(tmp) / "data", Path(tmp) / "logs", mqtt=True)
        node.start()
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    socket.create_connection(("127.0.0.1", node.mqtt_port), 0.5).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            before = proc_figures(node.pid)
            ends: Counter[str] = Counter()
            lock = threading.Lock()
            end = time.monotonic() + args.seconds
            tally: dict[str, Any] = {"ok": 0, "failed": 0, "latency": []}
            threads = [threading.Thread(target=worker, args=(node.mqtt_port, args.seed * 1000 + i, end, ends, lock))
                       for i in range(args.workers)]
            threads.append(threading.Thread(target=canary, args=(node.mqtt_port, end, tally)))
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            time.sleep(1)
            alive = node.running()
            after = proc_figures(node.pid) if alive else {}
            log = node.stderr_tail(10**8)
            internal = [line for line in log.splitlines() if any(k in line for k in INTERNAL)]
            lat = sorted(tally["latency"]) or [0.0]
            report = {
                "sessions": sum(ends.values()), "ends": dict(ends.most_common()),
                "internal_errors": len(internal), "first_internal_error": internal[0][:500] if internal else None,
                "node_alive": alive, "before": before, "after": after,
                "log_lines": len(log.splitlines()),
                "canary": {"ok": tally["ok"], "failed": tally["failed"],
                           "p50_ms": round(lat[len(lat) // 2] * 1000, 1), "max_ms": round(lat[-1] * 1000, 1)},
            }
            print(json.dumps(report, indent=2))
            return 0 if alive and not internal and not tally["failed"] else 1
        finally:
            node.cleanup()


if __name__ == "__main__":
    raise SystemExit(main())
