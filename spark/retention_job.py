"""The retention job: read the message backup over JDBC, apply each queue's limits,
archive what goes to Parquet, delete it (fenced by epoch), report.

Run it as ``leveret retention run ...`` or ``spark-submit spark/retention_job.py ...``
(same options). Order of the phases, and why a crash anywhere is safe:

1. plan (driver): queues, their arguments, named policies and each queue's
   epoch, read once at the start;
2. compute (executors): a partitioned JDBC read of ``messages`` (split on
   ``offset``), then per queue, newest first, a window that numbers the
   messages and sums their sizes; a row goes when it expired
   (``expires_at < now``), is older than max-age, or falls beyond max-length
   / max-bytes (counted over what the time limits keep);
3. archive: removed rows of archiving queues to Parquet under
   ``<archive-dir>/vhost=/queue=/day=/run-<run id>-<n>.parquet``, written to a
   staging directory first and then renamed, so a file is either whole or
   absent and a rerun with the same run id replaces, never doubles;
4. delete (driver): batches of offset ranges per queue (runs of removed rows
   with no kept row between them, at most --batch-size rows a batch), each in a transaction that
   checks the queue's epoch is still the one read at start
   (``DELETE ... AND EXISTS (SELECT 1 FROM queue_epochs ...)``); deleting a
   row twice is a no-op;
5. report: JSON, a table on stdout, a PNG chart.

A crash before 4 leaves the store untouched; during 4, some batches are done
and a rerun recomputes from what is left. A row archived by a run that died
before deleting it is archived again by the next run (another run id): readers
of the archive (``replay``) drop duplicates by (vhost, queue, offset).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if not __package__:  # spark-submit spark/retention_job.py: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spark.backend import MARKED, POSTGRES_JAR, SQLITE_JAR, Backend, BackendError  # noqa: E402
from spark.policies import QueueLimits, effective_limits, format_bytes, format_duration  # noqa: E402

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

Progress = Callable[[str], None]

ARCHIVE_COLUMNS = [
    "vhost", "queue", "offset", "message_id", "exchange", "routing_key", "properties", "body",
    "enqueued_at", "expires_at", "size", "delivery_count", "state",
]  # fmt: skip
# The embedded store's reference to a body kept in a segment file (persistence/bodystore.py).
BODY_REF_COLUMNS = ["body_segment", "body_position", "body_crc"]


def _stderr(line: str) -> None:
    print(f"retention: {line}", file=sys.stderr, flush=True)


def build_session(master: str | None = "local[*]", app_name: str = "leveret-retention") -> SparkSession:
    """A SparkSession on loopback with both JDBC drivers (Debian's jars, offline).

    ``master`` None: spark-submit's ``--master`` when run under spark-submit, else ``local[*]``.
    """
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    if master is None and "PYSPARK_GATEWAY_PORT" not in os.environ:  # not under spark-submit
        master = "local[*]"
    jars = ",".join(j for j in (POSTGRES_JAR, SQLITE_JAR) if Path(j).exists())
    builder = SparkSession.builder
    if master:
        builder = builder.master(master)
    builder = (
        builder.appName(app_name)
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        # Archive partition values are queue names: never read "123" back as a number.
        .config("spark.sql.sources.partitionColumnTypeInference.enabled", "false")
        .config("spark.sql.shuffle.partitions", "8")
    )
    if jars:
        builder = builder.config("spark.jars", jars)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


@dataclass
class RunOptions:
    backend: Backend
    master: str | None = None  # None: spark-submit's --master, else local[*]
    archive_dir: str | None = None
    report: str | None = None
    chart: str | None = None
    dry_run: bool = False
    mark_only: bool = False  # mark rows state='retained-removed' instead of deleting them (docs/RETENTION.md)
    partitions: int = 0  # 0: from the row count and the cores
    batch_size: int = 10_000
    run_id: str = ""
    apply_timeout: float = 30.0  # seconds a live owner has to drop the marked messages
    now: float = 0.0
    progress: Progress = _stderr
    timings: dict[str, float] = field(default_factory=dict)


def _limits_frame(spark: SparkSession, limits: dict[tuple[str, str], QueueLimits], epochs: dict[tuple[str, str], int]
                  ) -> DataFrame:  # fmt: skip
    from pyspark.sql.types import (
        BooleanType,
        DoubleType,
        LongType,
        StringType,
        StructField,
        StructType,
    )

    schema = StructType([
        StructField("vhost", StringType(), False),
        StructField("queue", StringType(), False),
        StructField("max_age", DoubleType(), True),
        StructField("max_length", LongType(), True),
        StructField("max_bytes", LongType(), True),
        StructField("archive", BooleanType(), False),
    ])  # fmt: skip
    rows = [
        (q.vhost, q.queue, q.max_age_seconds, q.max_length, q.max_bytes, q.archive)
        for key, q in limits.items()
    ]
    return spark.createDataFrame(rows, schema)


def read_messages(spark: SparkSession, backend: Backend, partitions: int, with_body: bool) -> DataFrame:
    """The messages table over JDBC, split on ``offset`` into ``partitions`` range reads."""
    url, options = backend.jdbc()
    low, high, _count = backend.offset_bounds()
    columns = ARCHIVE_COLUMNS if with_body else ["vhost", "queue", "offset", "enqueued_at", "expires_at", "size",
                                                 "state"]  # fmt: skip
    if with_body and backend.kind == "sqlite":
        # The embedded store keeps large bodies in segment files and an empty body plus a reference
        # in the row (persistence/bodystore.py): write_archive reads them from there.
        columns = [*columns, *BODY_REF_COLUMNS]
    reader = (
        spark.read.format("jdbc")
        .option("url", url)
        .option("dbtable", "messages")
        .option("partitionColumn", "offset")
        .option("lowerBound", str(low))
        .option("upperBound", str(high + 1))
        .option("numPartitions", str(max(1, partitions)))
        .option("customSchema", "offset LONG, size LONG, delivery_count LONG"
                + (", body_segment LONG, body_position LONG, body_crc LONG" if backend.kind == "sqlite" else ""))
    )
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load().select(*columns)


def classify(messages: DataFrame, limits: DataFrame, now: float) -> DataFrame:
    """``messages`` with a ``reason`` column (null: kept) and the queue's ``archive`` flag.

    Time limits first (expired, age); max-length and max-bytes then count, newest
    first, only the messages the time limits keep.
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    df = messages.join(F.broadcast(limits), ["vhost", "queue"], "left")
    timed = (
        F.when(F.col("state") == F.lit(MARKED), F.lit("marked"))  # a --mark-only run chose it already
        .when(F.col("expires_at").isNotNull() & (F.col("expires_at") < F.lit(now)), F.lit("expired"))
        .when(F.col("max_age").isNotNull() & (F.col("enqueued_at") < F.lit(now) - F.col("max_age")), F.lit("age"))
    )
    df = df.withColumn("timed", timed)
    newest_first = (
        Window.partitionBy("vhost", "queue")
        .orderBy(F.col("offset").desc())
        .rowsBetween(Window.unboundedPreceding, Window.currentRow)
    )
    alive = F.col("timed").isNull()
    df = df.withColumn("rank", F.sum(F.when(alive, F.lit(1)).otherwise(F.lit(0))).over(newest_first))
    df = df.withColumn("cum_bytes", F.sum(F.when(alive, F.col("size")).otherwise(F.lit(0))).over(newest_first))
    reason = (
        F.when(~alive, F.col("timed"))
        .when(F.col("max_length").isNotNull() & (F.col("rank") > F.col("max_length")), F.lit("max-length"))
        .when(F.col("max_bytes").isNotNull() & (F.col("cum_bytes") > F.col("max_bytes")), F.lit("max-bytes"))
    )
    return (
        df.withColumn("reason", reason)
        .withColumn("archive", F.coalesce(F.col("archive"), F.lit(False)))
        .drop("timed", "rank", "cum_bytes", "max_age", "max_length", "max_bytes")
    )


def _summaries(classified: DataFrame, now: float) -> dict[tuple[str, str], dict[str, Any]]:
    from pyspark.sql import functions as F

    removed = F.col("reason").isNotNull()
    kept = F.col("reason").isNull()
    rows = (
        classified.groupBy("vhost", "queue")
        .agg(
            F.count(F.lit(1)).alias("messages_before"),
            F.sum("size").alias("bytes_before"),
            F.sum(F.when(removed, 1).otherwise(0)).alias("removed_messages"),
            F.sum(F.when(removed, F.col("size")).otherwise(0)).alias("removed_bytes"),
            F.sum(F.when(F.col("reason") == "marked", 1).otherwise(0)).alias("marked"),
            F.sum(F.when(F.col("reason") == "expired", 1).otherwise(0)).alias("expired"),
            F.sum(F.when(F.col("reason") == "age", 1).otherwise(0)).alias("age"),
            F.sum(F.when(F.col("reason") == "max-length", 1).otherwise(0)).alias("max_length"),
            F.sum(F.when(F.col("reason") == "max-bytes", 1).otherwise(0)).alias("max_bytes"),
            F.min("enqueued_at").alias("oldest_before"),
            F.min(F.when(kept, F.col("enqueued_at"))).alias("oldest_kept"),
            F.first("archive").alias("archive"),
        )
        .collect()
    )
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        out[(r["vhost"], r["queue"])] = {
            "vhost": r["vhost"],
            "queue": r["queue"],
            "messages_before": int(r["messages_before"]),
            "bytes_before": int(r["bytes_before"] or 0),
            "removed_messages": int(r["removed_messages"]),
            "removed_bytes": int(r["removed_bytes"] or 0),
            "removed_by": {k: int(r[k.replace("-", "_")]) for k in ("marked", "expired", "age", "max-length",
                                                                     "max-bytes")},  # fmt: skip
            "kept_messages": int(r["messages_before"]) - int(r["removed_messages"]),
            "kept_bytes": int(r["bytes_before"] or 0) - int(r["removed_bytes"] or 0),
            "oldest_age_seconds_before": None if r["oldest_before"] is None else now - float(r["oldest_before"]),
            "oldest_age_seconds": None if r["oldest_kept"] is None else now - float(r["oldest_kept"]),
            "archive": bool(r["archive"]),
            "archived_messages": 0,
            "deleted_messages": 0,
            "marked_messages": 0,
            "fenced": False,
        }
    return out


def with_segment_bodies(removed: DataFrame, bodies_dir: str) -> DataFrame:
    """``removed`` with the bodies that the embedded store keeps in segment files read back whole.

    Only the rows being archived are read (after the filter), one pread each; a body that is
    missing or fails its checksum (e.g. its segment was compacted since the rows were read) fails
    the run before anything is deleted, and the next run reads the rows again.
    """
    from pyspark.sql import functions as F
    from pyspark.sql.types import BinaryType

    def resolve(body: bytes | None, segment: int | None, position: int | None, size: int | None,
                crc: int | None) -> bytes | None:
        if segment is None or position is None or size is None or crc is None:
            return body
        from persistence.bodystore import BodyRef, read_body

        return read_body(bodies_dir, BodyRef(segment, position, size, crc))

    # A plain Python UDF (no Arrow: pandas is not a dependency); the lambda hides resolve's hints,
    # which Spark would otherwise try to read as a pandas UDF's.
    read = F.udf(lambda *cols: resolve(*cols), BinaryType(), useArrow=False)
    return removed.withColumn("body", read(F.col("body"), *(F.col(c) for c in BODY_REF_COLUMNS[:2]),
                                           F.col("size"), F.col(BODY_REF_COLUMNS[2])))


def write_archive(removed: DataFrame, archive_dir: str, run_id: str, now: float) -> int:
    """Write the archived rows of one run; returns the number of files. Idempotent per run id."""
    from pyspark.sql import functions as F

    root = Path(archive_dir)
    staging = root / "_staging" / run_id
    (
        removed.select(*ARCHIVE_COLUMNS, "reason")
        .withColumn("run_id", F.lit(run_id))
        .withColumn("archived_at", F.lit(now))
        .withColumn("day", F.date_format(F.timestamp_seconds(F.col("enqueued_at")), "yyyy-MM-dd"))
        .withColumn("vhost_name", F.col("vhost"))  # the partition directories escape names; keep them whole
        .withColumn("queue_name", F.col("queue"))
        .repartition("vhost", "queue", "day")
        .write.mode("overwrite")
        .partitionBy("vhost", "queue", "day")
        .parquet(str(staging.resolve()))
    )
    files = 0
    for part in sorted(staging.rglob("*.parquet")):
        relative_dir = part.parent.relative_to(staging)
        target_dir = root / relative_dir
        target_dir.mkdir(parents=True, exist_ok=True)
        os.replace(part, target_dir / f"run-{run_id}-{files:05d}.parquet")
        files += 1
    shutil.rmtree(root / "_staging" / run_id, ignore_errors=True)
    return files


def _journal(archive_dir: str | None, run: str, **state: Any) -> None:
    if not archive_dir:
        return
    path = Path(archive_dir) / "_runs" / f"{run}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    current = json.loads(path.read_text()) if path.exists() else {}
    current.update(state)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(current, indent=1))
    os.replace(tmp, path)


def run(options: RunOptions, spark: SparkSession | None = None) -> dict[str, Any]:
    """Run the job; returns the report (also written to ``options.report`` when set)."""
    t0 = time.monotonic()
    say = options.progress
    now = options.now or time.time()
    run_id = options.run_id or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + "-" + uuid.uuid4().hex[:8]
    timings = options.timings
    backend = options.backend
    journal = None if options.dry_run else options.archive_dir  # a dry run writes nothing there
    owned = spark is None

    # 1. plan
    limits = effective_limits(backend.queues(), backend.policies())
    epochs = backend.epochs()
    low, high, total = backend.offset_bounds()
    timings["plan_s"] = time.monotonic() - t0
    archiving = bool(options.archive_dir) and any(q.archive for q in limits.values())
    say(f"run {run_id}: {len(limits)} queue(s), {total} message(s) in the backup, offsets {low}..{high}"
        + (" (dry run)" if options.dry_run else ""))  # fmt: skip

    t = time.monotonic()
    if spark is None:
        say(f"starting Spark ({options.master or 'master from spark-submit, else local[*]'})")
        spark = build_session(options.master)
    timings["spark_start_s"] = time.monotonic() - t
    partitions = options.partitions or max(2, min(64, spark.sparkContext.defaultParallelism * 2, total // 50_000 + 1))

    # 2. compute
    t = time.monotonic()
    from pyspark import StorageLevel

    messages = read_messages(spark, backend, partitions, with_body=archiving and not options.dry_run)
    classified = classify(messages, _limits_frame(spark, limits, epochs), now).persist(StorageLevel.MEMORY_AND_DISK)
    say(f"reading {total} message(s) over JDBC in {partitions} partition(s)")
    summaries = _summaries(classified, now)
    timings["read_compute_s"] = time.monotonic() - t
    to_remove = sum(s["removed_messages"] for s in summaries.values())
    say(f"computed in {timings['read_compute_s']:.1f}s: {to_remove} message(s) to remove in "
        f"{sum(1 for s in summaries.values() if s['removed_messages'])} queue(s)")  # fmt: skip
    _journal(journal, run_id, run_id=run_id, started_at=now, mark_only=options.mark_only, phase="computed")

    removed = classified.where("reason IS NOT NULL")
    # 3. archive
    t = time.monotonic()
    if archiving and not options.dry_run and to_remove:
        assert options.archive_dir is not None
        archived = removed.where("archive")
        if backend.kind == "sqlite":
            archived = with_segment_bodies(archived, str(Path(backend.path).parent / "bodies"))
        files = write_archive(archived, options.archive_dir, run_id, now)
        for s in summaries.values():
            if s["archive"]:
                s["archived_messages"] = s["removed_messages"]
        say(f"archived {sum(s['archived_messages'] for s in summaries.values())} message(s) in {files} file(s)"
            f" under {options.archive_dir}")  # fmt: skip
        _journal(journal, run_id, phase="archived", files=files)
    timings["archive_s"] = time.monotonic() - t

    # 4. delete
    t = time.monotonic()
    live: list[str] = []
    if not options.dry_run and to_remove:
        live = [] if options.mark_only else backend.live_watchers()
        if live:
            say(f"live node(s) {', '.join(sorted(live))}: marking, then asking each queue's owner to drop them")
            _remove_live(backend, classified, summaries, epochs, options, run_id, say)
        else:
            deleted, fenced = _delete(backend, classified, epochs, options.batch_size, say, options.mark_only)
            for key, s in summaries.items():
                s["marked_messages" if options.mark_only else "deleted_messages"] = deleted.get(key, 0)
                s["fenced"] = key in fenced
        _journal(journal, run_id, phase="deleted")
    timings["delete_s"] = time.monotonic() - t
    classified.unpersist()

    # 5. report
    report = _report(run_id, now, options, limits, summaries, epochs)
    report["live_nodes"] = sorted(live)
    timings["total_s"] = time.monotonic() - t0
    report["timings"] = {k: round(v, 3) for k, v in timings.items()}
    report["messages_scanned"] = total
    report["partitions"] = partitions
    if options.report:
        Path(options.report).parent.mkdir(parents=True, exist_ok=True)
        Path(options.report).write_text(json.dumps(report, indent=2))
    chart = options.chart or (str(Path(options.report).with_suffix(".png")) if options.report else None)
    if chart:
        from spark.report_chart import render

        render(chart, report)
        report["chart"] = chart
    _journal(journal, run_id, phase="done", finished_at=time.time())
    if owned:
        spark.stop()
    return report


def delete_spans(classified: DataFrame, batch_size: int) -> DataFrame:
    """The removed rows as offset ranges: (vhost, queue, lo, hi, n), at most ``batch_size`` rows each.

    A range is a run of removed rows with no kept row between them (gaps and
    islands: row number among all rows minus row number among removed rows),
    cut every ``batch_size`` removed rows. Age and length limits remove a
    prefix of each queue, so a queue's removals usually travel as a few ranges
    instead of one key per row.
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    by_offset = Window.partitionBy("vhost", "queue").orderBy("offset")
    numbered = classified.select("vhost", "queue", "offset", "reason")
    numbered = numbered.withColumn("i_all", F.row_number().over(by_offset))
    removed = numbered.where(F.col("reason").isNotNull()).withColumn("i_rm", F.row_number().over(by_offset))
    return (
        removed.withColumn("island", F.col("i_all") - F.col("i_rm"))
        .withColumn("chunk", F.floor((F.col("i_rm") - 1) / F.lit(batch_size)))
        .groupBy("vhost", "queue", "island", "chunk")
        .agg(F.min("offset").alias("lo"), F.max("offset").alias("hi"), F.count(F.lit(1)).alias("n"))
        .select("vhost", "queue", "lo", "hi", "n")
    )


def _delete(backend: Backend, classified: DataFrame, epochs: dict[tuple[str, str], int], batch_size: int,
            say: Progress, mark: bool = False) -> tuple[dict[tuple[str, str], int], set[tuple[str, str]]]:  # fmt: skip
    deleted: dict[tuple[str, str], int] = {}
    fenced: set[tuple[str, str]] = set()
    pending: dict[tuple[str, str], tuple[list[tuple[int, int]], int]] = {}
    done = 0
    last = time.monotonic()

    def flush(key: tuple[str, str]) -> None:
        nonlocal done, last
        spans, _ = pending.pop(key, ([], 0))
        if not spans or key in fenced:
            return
        epoch = epochs.get(key)
        if epoch is None:
            n = None
        elif mark:
            n = backend.mark_batch(key[0], key[1], epoch, spans)
        else:
            n = backend.delete_batch(key[0], key[1], epoch, spans)
        if n is None:
            fenced.add(key)
            say(f"{key[0]}/{key[1]}: fenced (its epoch moved on or it has none): left for the next run")
            return
        deleted[key] = deleted.get(key, 0) + n
        done += n
        if time.monotonic() - last > 2:
            say(f"{'marked' if mark else 'deleted'} {done} message(s) so far")
            last = time.monotonic()

    for row in delete_spans(classified, batch_size).toLocalIterator(prefetchPartitions=True):
        key = (row["vhost"], row["queue"])
        spans, rows = pending.get(key, ([], 0))
        if spans and rows + int(row["n"]) > batch_size:
            flush(key)
            spans, rows = [], 0
        spans.append((int(row["lo"]), int(row["hi"])))
        pending[key] = (spans, rows + int(row["n"]))
    for key in list(pending):
        flush(key)
    say(f"{'marked' if mark else 'deleted'} {done} message(s)")
    return deleted, fenced


def _remove_live(backend: Backend, classified: DataFrame, summaries: dict[tuple[str, str], dict[str, Any]],
                 epochs: dict[tuple[str, str], int], options: RunOptions, run_id: str, say: Progress) -> None:
    """A node is running: mark, ask each owner to drop the marked messages, wait, then delete.

    A queue's messages are reported removed (``deleted_messages``) only after
    its owner said it dropped them from memory and committed that; a queue
    whose owner does not answer within ``apply_timeout`` is reported
    ``pending`` and its rows stay marked (a restart or failover skips them,
    the next run finishes the job).
    """
    marked, fenced = _delete(backend, classified, epochs, options.batch_size, say, mark=True)
    asked = [k for k, s in summaries.items() if s["removed_messages"] and k not in fenced and k in epochs]
    for key in asked:
        backend.request(key[0], key[1], run_id, epochs[key])
    deadline = time.monotonic() + options.apply_timeout
    states: dict[tuple[str, str], str] = {}
    while asked:
        states = backend.request_states(run_id)
        if all(states.get(k) == "applied" for k in asked) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for key, s in summaries.items():
        s["fenced"] = key in fenced
        s["marked_messages"] = marked.get(key, 0)
        if key not in asked:
            continue
        if states.get(key) != "applied":
            s["pending"] = True
            say(f"{key[0]}/{key[1]}: its owner did not apply the removal within {options.apply_timeout:g}s:"
                " pending (rows stay marked; the next run finishes)")  # fmt: skip
            continue
        n = backend.delete_marked(key[0], key[1], epochs[key])
        if n is None:
            s["fenced"] = True
            continue
        # The owner deleted the ready ones itself; what is left were unacked at that moment.
        s["deleted_messages"] = s["removed_messages"]
    backend.forget_applied_requests()


def _report(
    run_id: str,
    now: float,
    options: RunOptions,
    limits: dict[tuple[str, str], QueueLimits],
    summaries: dict[tuple[str, str], dict[str, Any]],
    epochs: dict[tuple[str, str], int],
) -> dict[str, Any]:
    queues = []
    for key in sorted(set(limits) | set(summaries)):
        s = summaries.get(key) or {
            "vhost": key[0], "queue": key[1], "messages_before": 0, "bytes_before": 0, "removed_messages": 0,
            "removed_bytes": 0, "removed_by": {}, "kept_messages": 0, "kept_bytes": 0,
            "oldest_age_seconds_before": None, "oldest_age_seconds": None, "archive": False,
            "archived_messages": 0, "deleted_messages": 0, "marked_messages": 0, "fenced": False,
        }  # fmt: skip
        s.setdefault("pending", False)
        q = limits.get(key)
        s["limits"] = None if q is None else {
            "max_age_seconds": q.max_age_seconds, "max_length": q.max_length, "max_bytes": q.max_bytes,
            "archive": q.archive, "sources": q.sources, "policies": q.policies,
        }  # fmt: skip
        s["epoch"] = epochs.get(key)
        queues.append(s)
    return {
        "run_id": run_id,
        "now": now,
        "dry_run": options.dry_run,
        "mark_only": options.mark_only,
        "store": options.backend.kind,
        "archive_dir": options.archive_dir,
        "queues": queues,
        "totals": {
            k: sum(q[k] for q in queues)
            for k in ("messages_before", "bytes_before", "removed_messages", "removed_bytes", "kept_messages",
                      "kept_bytes", "archived_messages", "deleted_messages", "marked_messages")
        },  # fmt: skip
    }


def format_table(report: dict[str, Any]) -> str:
    head = ("queue", "before", "bytes", "removed", "bytes", "archived", "deleted", "kept", "bytes", "oldest kept")
    rows = [head]
    for q in report["queues"]:
        name = q["queue"] if q["vhost"] == "/" else f"{q['vhost']}/{q['queue']}"
        rows.append((
            name + (" (fenced)" if q["fenced"] else ""), str(q["messages_before"]), format_bytes(q["bytes_before"]),
            str(q["removed_messages"]), format_bytes(q["removed_bytes"]), str(q["archived_messages"]),
            str(q["deleted_messages"]), str(q["kept_messages"]), format_bytes(q["kept_bytes"]),
            format_duration(q["oldest_age_seconds"]),
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    t = report["totals"]
    verb = "would remove" if report["dry_run"] else "removed"
    marked = f", marked {t['marked_messages']}" if report["mark_only"] else ""
    lines.append(f"run {report['run_id']}: {verb} {t['removed_messages']} of {t['messages_before']} message(s)"
                 f" ({format_bytes(t['removed_bytes'])}), archived {t['archived_messages']},"
                 f" deleted {t['deleted_messages']}{marked} in {report['timings'].get('total_s', 0):.1f}s")  # fmt: skip
    return "\n".join(lines)


# -- command line (shared with leveret retention run) ------------------------------------


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML config file, as for serve (env LEVERET_CONFIG)")
    parser.add_argument("--data-dir", default=None, help="directory of the embedded store (sqlite)")
    parser.add_argument("--store", default=None, choices=["sqlite", "postgres"], help="message store")
    parser.add_argument("--postgres-dsn", default=None, help="Postgres connection string for --store postgres")
    parser.add_argument("--master", default=None, help="Spark master (default local[*], or spark-submit's)")
    parser.add_argument("--archive-dir", default=None, help="write removed messages of archiving queues here")
    parser.add_argument("--report", default=None, metavar="FILE", help="JSON report (a PNG chart goes next to it)")
    parser.add_argument("--chart", default=None, metavar="FILE", help="PNG chart of kept vs removed bytes")
    parser.add_argument("--dry-run", action="store_true", help="compute and report; change nothing")
    parser.add_argument("--mark-only", action="store_true",
                        help="mark removed rows state='retained-removed' instead of deleting them")  # fmt: skip
    parser.add_argument("--partitions", type=int, default=0, help="JDBC read partitions (default: from size)")
    parser.add_argument("--batch-size", type=int, default=10_000, help="most rows one DELETE transaction removes")
    parser.add_argument("--run-id", default="", help="reuse a run id (to finish a run that crashed)")
    parser.add_argument("--apply-timeout", type=float, default=30.0,
                        help="seconds a running node has to drop removed messages before the queue is reported"
                        " pending (default 30)")  # fmt: skip


LEASE = "retention"  # leases.name: one retention run at a time per store (so cluster-wide on Postgres)
LEASE_TTL = 60.0


class RunLease:
    """The store-level lease a run holds; a thread renews it (with its own connection) while Spark works."""

    def __init__(self, backend: Backend, ttl: float = LEASE_TTL) -> None:
        self.backend = backend
        self.ttl = ttl
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self) -> bool:
        if not self.backend.take_lease(LEASE, self.holder, self.ttl):
            return False
        self._thread = threading.Thread(target=self._renew, name="retention-lease", daemon=True)
        self._thread.start()
        return True

    def _renew(self) -> None:
        own = self.backend.clone()
        try:
            while not self._stop.wait(self.ttl / 3):
                if not own.take_lease(LEASE, self.holder, self.ttl):
                    _stderr(f"lease {LEASE!r} lost to another holder")
        except Exception as exc:  # noqa: BLE001 - the lease then expires; the run itself goes on
            _stderr(f"lease {LEASE!r} not renewed: {exc}")
        finally:
            own.close()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.backend.release_lease(LEASE, self.holder)


def backend_from_args(args: argparse.Namespace) -> Backend:
    """The store named by the flags alone (spark-submit); ``leveret retention run`` also reads the node's config."""
    if getattr(args, "config", None):
        raise BackendError("--config is read by `leveret retention run`; spark-submit takes --store, --data-dir "
                           "and --postgres-dsn")
    return Backend(args.store or "sqlite", data_dir=args.data_dir or "leveret-data", dsn=args.postgres_dsn)


def run_from_args(args: argparse.Namespace, spark: SparkSession | None = None, backend: Backend | None = None) -> int:
    """Run as the flags say, on ``backend`` (default: the store the flags name)."""
    try:
        if backend is None:
            backend = backend_from_args(args)
        backend.connect()
    except BackendError as exc:
        print(f"leveret retention: {exc}", file=sys.stderr)
        return 2
    lease = None if args.dry_run else RunLease(backend)
    if lease is not None and not lease.take():
        held = backend.lease_holder(LEASE)
        who = f"{held[0]} (until {time.strftime('%H:%M:%S', time.localtime(held[1]))})" if held else "another run"
        print(f"leveret retention: another retention run holds the lease: {who}; not running", file=sys.stderr)
        backend.close()
        return 3
    try:
        report = run(
            RunOptions(
                backend=backend, master=args.master, archive_dir=args.archive_dir, report=args.report,
                chart=args.chart, dry_run=args.dry_run, mark_only=args.mark_only, partitions=args.partitions,
                batch_size=args.batch_size, run_id=args.run_id, apply_timeout=args.apply_timeout,
            ),
            spark,
        )  # fmt: skip
    finally:
        if lease is not None:
            lease.release()
        backend.close()
    print(format_table(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="retention_job", description=__doc__.splitlines()[0] if __doc__ else None)
    add_run_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
