"""Benchmark the retention job on a Postgres backup of N messages (default 1M, 256 B bodies).

    .venv/bin/python -m bench.retention [--messages 1000000] [--queues 10] [--archive DIR] [--dsn DSN]

Without --dsn it starts a throwaway Postgres (harness/pg.py: fsync off, loopback).
The backup: ``--queues`` queues, offsets 1..N/queues each, enqueued over the
last 10 days; queue arguments ``x-max-age: 5d`` on even queues and
``x-max-length: N/queues/4`` on odd ones, so about 60 % of the rows go. Prints
where the time goes (load, Spark start-up, JDBC read + compute, archive,
delete) and rows/s, and writes the job's JSON report with ``--report``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Iterator

import psycopg

from core.model.fieldtable import encode_table


def load(dsn: str, messages: int, queues: int, body_size: int, now: float) -> None:
    from spark.backend import Backend

    Backend("postgres", dsn=dsn).connect()  # applies the migrations
    per_queue = messages // queues
    body = b"x" * body_size
    props = b"\x10\x00\x02"  # delivery_mode 2
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE messages, queues, queue_epochs")
        for q in range(queues):
            arguments = {"x-max-age": "5d"} if q % 2 == 0 else {"x-max-length": per_queue // 4}
            conn.execute("INSERT INTO queues (vhost, name, auto_delete, arguments) VALUES ('/', %s, false, %s)",
                         (f"bench-{q}", encode_table(arguments)))  # fmt: skip
            conn.execute("INSERT INTO queue_epochs (vhost, queue, epoch) VALUES ('/', %s, 1)", (f"bench-{q}",))
        with conn.cursor() as cur:
            with cur.copy(
                'COPY messages (vhost, queue, "offset", message_id, exchange, routing_key, properties, body,'
                " enqueued_at, expires_at, size) FROM STDIN (FORMAT BINARY)"
            ) as copy:
                copy.set_types(["text", "text", "int8", "text", "text", "text", "bytea", "bytea", "float8",
                                "float8", "int4"])  # fmt: skip
                span = 10 * 86400.0
                for q in range(queues):
                    name = f"bench-{q}"
                    for o in range(1, per_queue + 1):
                        copy.write_row((
                            "/", name, o, f"{name}-{o}", "amq.direct", name, props, body,
                            now - span + span * o / per_queue, None, body_size,
                        ))  # fmt: skip
        conn.execute("ANALYZE messages")


@contextlib.contextmanager
def _postgres(dsn: str | None) -> Iterator[str]:
    if dsn:
        yield dsn
        return
    from harness.pg import throwaway_postgres

    with throwaway_postgres() as started:
        yield started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--queues", type=int, default=10)
    parser.add_argument("--body-size", type=int, default=256)
    parser.add_argument("--dsn", default=None, help="an existing Postgres (its messages table is TRUNCATED)")
    parser.add_argument("--archive", default=None, metavar="DIR", help="archive removed rows (all queues)")
    parser.add_argument("--master", default="local[*]")
    parser.add_argument("--partitions", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=20_000)
    parser.add_argument("--report", default=None)
    args = parser.parse_args(argv)

    from spark.backend import Backend
    from spark.policies import NamedPolicy
    from spark.retention_job import RunOptions, format_table, run

    now = time.time()
    with _postgres(args.dsn) as dsn:
        t = time.monotonic()
        load(dsn, args.messages, args.queues, args.body_size, now)
        load_s = time.monotonic() - t
        print(f"loaded {args.messages} messages of {args.body_size} B in {load_s:.1f}s", flush=True)
        backend = Backend("postgres", dsn=dsn)
        backend.connect()
        if args.archive:
            backend.set_policy(NamedPolicy("bench-archive", "^bench-", archive=True))
        t = time.monotonic()
        report = run(
            RunOptions(
                backend=backend, master=args.master, archive_dir=args.archive, partitions=args.partitions,
                batch_size=args.batch_size, now=now, report=args.report,
                progress=lambda line: print(f"  {time.monotonic() - t:6.1f}s {line}", flush=True),
            )
        )  # fmt: skip
        wall = time.monotonic() - t
        backend.close()
    print(format_table(report))
    timings = report["timings"]
    scanned = report["messages_scanned"]
    print(json.dumps({
        "messages": scanned, "removed": report["totals"]["removed_messages"], "wall_s": round(wall, 1),
        "rows_per_s": round(scanned / wall), "rows_per_s_without_spark_start":
        round(scanned / max(1e-9, wall - timings["spark_start_s"])), "partitions": report["partitions"],
        **timings,
    }, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
