"""``python -m bench.backlog``: a backlog far larger than a queue's memory budget, beside RabbitMQ.

Starts a Leveret node (harness/node.py) with ``--queue-memory-bytes BUDGET`` on a
private data dir, then per scenario: declares the queue, publishes ``--messages`` bodies of
``--size`` bytes with confirms (4000 outstanding) and no consumer, then drains it with one pika
consumer (prefetch 2000, acks every 500), checking every message arrived in order. Reports the
publish and drain rates, the broker's RSS over time (sampled every 0.5 s) and what it wrote to
disk (``/proc/PID/io`` write_bytes: store, spill files and logs).

Scenarios: ``persistent`` (delivery mode 2, durable queue: pages back from the store, written
once) and ``transient`` (delivery mode 1, non-durable queue).

With ``--url amqp://...`` (and ``--rabbitmq-pid`` for its RSS: the beam.smp process) the same
runs go against that broker in the same invocation, one after the other.

The issue's full size is the default: 2 million 1 KiB messages, 256 MiB budget.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
from pathlib import Path
from urllib.parse import urlparse

import pika

from compat_tests.backlog import DrainRun, PublishRun, drain, publish_backlog, rss_bytes
from harness.node import NodeProcess

SCENARIOS = {"persistent": (2, True), "transient": (1, False)}


def _declare(url: str, queue: str, durable: bool, lazy: bool) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        ch.queue_delete(queue)
        ch.queue_declare(queue, durable=durable, arguments={"x-queue-mode": "lazy"} if lazy else None)
    finally:
        conn.close()


def _delete(url: str, queue: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        conn.channel().queue_delete(queue)
    finally:
        conn.close()


def _written(pid: int | None) -> int:
    """Bytes the process caused to be written to disk so far (/proc/PID/io), 0 where unreadable."""
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except (OSError, TypeError):
        pass
    return 0


def _rss_line(samples: list[tuple[float, int]], every: float) -> str:
    out = []
    next_at = 0.0
    for t, rss in samples:
        if t >= next_at:
            out.append(f"{t:.0f}s:{rss >> 20}")
            next_at = t + every
    return " ".join(out)


def run_one(broker: str, url: str, pid: int | None, scenario: str, messages: int, size: int, lazy: bool
            ) -> dict[str, object]:
    mode, durable = SCENARIOS[scenario]
    # Named after this process: two runs against one shared RabbitMQ must not delete each other's queue
    # (one did: a drain that got 110,100 of 2,000,000 messages, out of order).
    queue = f"backlog-{scenario}-{os.getpid()}"
    _declare(url, queue, durable, lazy)
    u = urlparse(url)
    idle = rss_bytes(pid) if pid else 0
    written = _written(pid)
    pub: PublishRun = asyncio.run(publish_backlog(u.port or 5672, queue, messages, size, mode, pid=pid,
                                                  user=u.username or "guest", password=u.password or "guest"))
    written_publish = _written(pid) - written
    got: DrainRun = drain(url, queue, messages, pid=pid)
    written_all = _written(pid) - written
    in_order = got.seqs == list(range(1, messages + 1))
    _delete(url, queue)
    rss = pub.rss + [(pub.seconds + t, r) for t, r in got.rss]
    result: dict[str, object] = {
        "broker": broker, "scenario": scenario, "messages": messages, "size": size,
        "confirmed": pub.confirmed, "publish_msg_s": round(pub.rate), "publish_s": round(pub.seconds, 1),
        "longest_confirm_wait_s": round(pub.longest_wait, 2), "blocked": pub.blocked,
        "close_reason": pub.close_reason,
        "received": len(got.seqs), "in_order": in_order, "drain_msg_s": round(got.rate),
        "drain_s": round(got.seconds, 1),
        # Disk writes of the broker (store, spill files, logs): what paging costs in I/O.
        "written_publish_mib": written_publish >> 20, "written_total_mib": written_all >> 20,
        "idle_rss_mib": idle >> 20, "peak_rss_mib": (max(r for _, r in rss) >> 20) if rss else None,
        "rss_mib_over_time": rss and _rss_line(rss, max(1.0, (pub.seconds + got.seconds) / 20)),
    }
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=2_000_000)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=256 * 1024 * 1024, help="Leveret's --queue-memory-bytes")
    parser.add_argument("--scenario", choices=[*SCENARIOS, "both"], default="both")
    parser.add_argument("--lazy", action="store_true", help="declare x-queue-mode: lazy on both brokers")
    parser.add_argument("--url", help="RabbitMQ to run the same scenarios against, e.g. amqp://guest:guest@"
                                      "127.0.0.1:25673/")
    parser.add_argument("--rabbitmq-pid", type=int, help="RabbitMQ's beam.smp process, for its RSS")
    parser.add_argument("--work-dir", help="Leveret's data and log dir (default: a fresh temporary one)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    scenarios = list(SCENARIOS) if args.scenario == "both" else [args.scenario]
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="leveret-backlog-"))
    node = NodeProcess(work / "data", work / "logs", ["--queue-memory-bytes", str(args.budget),
                                                      "--memory-high-watermark", str(4 * args.budget)])
    results = []
    node.start()
    try:
        for scenario in scenarios:
            results.append(run_one("leveret", node.url, node.pid, scenario, args.messages, args.size, args.lazy))
            if args.url:
                results.append(run_one("rabbitmq", args.url, args.rabbitmq_pid, scenario, args.messages,
                                       args.size, args.lazy))
    finally:
        node.terminate()
    print(f"node logs: {work / 'logs'}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
