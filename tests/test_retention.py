"""Retention: policies, the Spark job on a real SQLite file and a throwaway Postgres, archive, replay.

One SparkSession for the whole file (a cold start costs 10-25 s here).
"""

from __future__ import annotations

import asyncio
import json
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.model import properties as amqp_properties
from core.ports.store import Batch, QueueRecord, StoredMessage
from harness.ports import free_port
from spark.backend import SQLITE_JAR, Backend
from spark.policies import NamedPolicy, effective_limits, parse_duration, parse_size

ROOT = Path(__file__).resolve().parent.parent
NOW = 1_800_000_000.0
HOUR = 3600.0

needs_java = pytest.mark.skipif(
    not Path("/usr/bin/java").exists() or not Path(SQLITE_JAR).exists(),
    reason="needs Java 17 and Debian's JDBC drivers (scripts/bootstrap.sh installs them)",
)


# -- the data set ------------------------------------------------------------------------

# queue -> arguments; every queue gets offsets 1..10 (age (11 - offset) * 10 min + 1 min) unless said otherwise.
QUEUES: dict[str, dict[str, Any]] = {
    "ttl-q": {"x-message-ttl": 3_600_000},  # 1 h: offsets 1..5 (ages 101..61 min) go
    "age-q": {"x-max-age": "1h"},
    "exp-q": {},  # per-message expiry: odd offsets expired
    "len-q": {"x-max-length": 3},  # keep 8, 9, 10
    "bytes-q": {"x-max-length-bytes": 1000},  # 300 B bodies: keep 8, 9, 10
    "logs.app": {},  # named policy "logs": max-length 4, archive -> keep 7..10
    "keep-q": {"x-max-length": 100},
}
EXPECTED_KEPT = {
    "ttl-q": [6, 7, 8, 9, 10],
    "age-q": [6, 7, 8, 9, 10],
    "exp-q": [2, 4, 6, 8, 10],
    "len-q": [8, 9, 10],
    "bytes-q": [8, 9, 10],
    "logs.app": [7, 8, 9, 10],
    "keep-q": list(range(1, 11)),
}
LOGS_POLICY = NamedPolicy("logs", r"^logs\.", max_length=4, archive=True)


def _message(queue: str, offset: int) -> StoredMessage:
    props = amqp_properties.encode(
        {"content_type": "text/plain", "delivery_mode": 2, "message_id": f"{queue}-{offset}",
         "headers": {"n": offset, "origin": "test"}}
    )  # fmt: skip
    expires_at = None
    if queue == "exp-q":
        expires_at = NOW - 5 if offset % 2 else NOW + HOUR
    body = (f"{queue}:{offset}:".encode() * 100)[:300]
    return StoredMessage("/", queue, offset, f"{queue}-{offset}", "amq.direct", f"rk.{queue}", props, body,
                         NOW - (11 - offset) * 600 - 60, expires_at)  # fmt: skip


async def _populate(store: Any, queues: dict[str, dict[str, Any]] = QUEUES) -> None:
    await store.open()
    try:
        batch = Batch()
        for name, arguments in queues.items():
            await store.save_queue(QueueRecord("/", name, False, arguments))
            batch.epochs[("/", name)] = await store.claim("/", name)
            batch.appends.extend(_message(name, o) for o in range(1, 11))
        await store.commit(batch)
    finally:
        await store.close()


def sqlite_backend(data_dir: Path, queues: dict[str, dict[str, Any]] = QUEUES, body_threshold: int | None = None
                   ) -> Backend:
    from persistence.sqlite import SQLiteStore

    store = SQLiteStore(str(data_dir / "leveret.sqlite3"))
    if body_threshold is not None:
        store = SQLiteStore(str(data_dir / "leveret.sqlite3"), body_threshold=body_threshold)
    asyncio.run(_populate(store, queues))
    backend = Backend("sqlite", data_dir=str(data_dir))
    backend.connect()
    return backend


def offsets_by_queue(backend: Backend, queues: dict[str, Any] = QUEUES) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {name: [] for name in queues}
    for queue, offset in backend._rows('SELECT queue, "offset" FROM messages ORDER BY queue, "offset"'):
        out[queue].append(int(offset))
    return out


def _quiet(line: str) -> None:
    pass


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    if not Path("/usr/bin/java").exists() or not Path(SQLITE_JAR).exists():
        pytest.skip("needs Java 17 and Debian's JDBC drivers (scripts/bootstrap.sh installs them)")
    from spark.retention_job import build_session

    session = build_session("local[2]", "leveret-tests")
    session.conf.set("spark.sql.shuffle.partitions", "2")  # tiny data: fewer tasks per stage
    yield session
    session.stop()


def run_job(backend: Backend, spark: Any, **kwargs: Any) -> dict[str, Any]:
    from spark.retention_job import RunOptions, run

    return run(RunOptions(backend=backend, now=NOW, progress=_quiet, **kwargs), spark)


# -- policies (no Spark) ---------------------------------------------------------------------


def test_limits_parse_and_combine() -> None:
    assert parse_duration("7d") == 7 * 86400
    assert parse_duration("1h") == 3600
    assert parse_duration("30m") == 1800
    assert parse_duration("1M") == 30 * 86400
    assert parse_size("10GB") == 10 * 10**9
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("4096") == 4096
    limits = effective_limits(
        {("/", "logs.a"): {"x-message-ttl": 7_200_000, "x-max-length": 50}, ("/", "other"): {}},
        [NamedPolicy("logs", r"^logs\.", max_age_seconds=3600, max_length=100, archive=True),
         NamedPolicy("zz-all", ".*", max_length=1),  # same priority, later name: "logs" applies, not both
         NamedPolicy("wide", ".*", max_bytes=10**6, operator=True)],
    )  # fmt: skip
    a = limits[("/", "logs.a")]
    assert (a.max_age_seconds, a.max_length, a.max_bytes, a.archive) == (3600, 50, 10**6, True)
    assert a.sources == {"max_age_seconds": "policy logs", "max_length": "queue arguments",
                         "max_bytes": "operator policy wide"}
    other = limits[("/", "other")]
    assert (other.max_age_seconds, other.max_length, other.max_bytes, other.archive) == (None, 1, 10**6, False)


def test_policy_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from leveret.cli.main import main

    sqlite_backend(tmp_path).close()
    store = ["--data-dir", str(tmp_path)]
    assert main(["retention", "policy", "set", "logs", "--pattern", r"^logs\.", "--max-age", "7d",
                 "--max-bytes", "10GB", "--max-length", "5", "--archive", *store]) == 0  # fmt: skip
    assert main(["retention", "policy", "set", "tmp", "--pattern", "tmp", *store]) == 0
    assert main(["retention", "policy", "set", "bad", "--pattern", "x", "--max-age", "soon", *store]) == 2
    capsys.readouterr()
    assert main(["retention", "policy", "list", "--json", *store]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(p["name"], p["max_age_seconds"], p["max_bytes"], p["max_length"], p["archive"]) for p in listed] == [
        ("logs", 7 * 86400, 10**10, 5, True),
        ("tmp", None, None, None, False),
    ]
    assert main(["retention", "policy", "delete", "tmp", *store]) == 0
    assert main(["retention", "policy", "delete", "tmp", *store]) == 1
    assert [p.name for p in Backend("sqlite", data_dir=str(tmp_path)).policies()] == ["logs"]


def test_fenced_delete_removes_nothing(tmp_path: Path) -> None:
    backend = sqlite_backend(tmp_path)
    epoch = backend.epochs()[("/", "len-q")]
    assert backend.delete_batch("/", "len-q", epoch + 1, [(1, 2)]) is None  # a newer owner holds it
    assert offsets_by_queue(backend)["len-q"] == list(range(1, 11))
    assert backend.delete_batch("/", "len-q", epoch, [(1, 2), (5, 5)]) == 3
    assert backend.delete_batch("/", "len-q", epoch, [(1, 2)]) == 0  # idempotent
    assert offsets_by_queue(backend)["len-q"] == [3, 4, 6, 7, 8, 9, 10]


# -- the job on Spark --------------------------------------------------------------------------


@needs_java
def test_sqlite_dry_run_then_run_with_archive(tmp_path: Path, spark: Any) -> None:
    backend = sqlite_backend(tmp_path / "data")
    backend.set_policy(LOGS_POLICY)
    before = offsets_by_queue(backend)

    dry = run_job(backend, spark, dry_run=True, archive_dir=str(tmp_path / "archive"))
    assert offsets_by_queue(backend) == before
    assert not (tmp_path / "archive").exists()  # not even a run journal
    removed = {q["queue"]: q["removed_messages"] for q in dry["queues"]}
    assert removed == {name: 10 - len(kept) for name, kept in EXPECTED_KEPT.items()}
    assert dry["totals"]["deleted_messages"] == 0

    report_path = tmp_path / "report.json"
    report = run_job(backend, spark, archive_dir=str(tmp_path / "archive"), report=str(report_path))
    assert offsets_by_queue(backend) == EXPECTED_KEPT
    by_queue = {q["queue"]: q for q in json.loads(report_path.read_text())["queues"]}
    assert by_queue["exp-q"]["removed_by"]["expired"] == 5
    assert by_queue["len-q"]["removed_by"]["max-length"] == 7
    assert by_queue["bytes-q"]["removed_bytes"] == 7 * 300 and by_queue["bytes-q"]["kept_bytes"] == 900
    assert by_queue["logs.app"]["archived_messages"] == 6
    assert by_queue["ttl-q"]["deleted_messages"] == 5
    assert by_queue["keep-q"]["oldest_age_seconds"] == pytest.approx(10 * 600 + 60)
    assert report["totals"]["deleted_messages"] == sum(10 - len(k) for k in EXPECTED_KEPT.values())
    png = report_path.with_suffix(".png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")

    # The archive holds exactly the removed messages of the archiving queue, byte for byte.
    rows = spark.read.parquet(str(tmp_path / "archive")).collect()
    assert sorted((r["queue_name"], r["offset"]) for r in rows) == [("logs.app", o) for o in range(1, 7)]
    for r in rows:
        original = _message("logs.app", r["offset"])
        assert bytes(r["body"]) == original.body
        assert bytes(r["properties"]) == original.properties
        assert (r["message_id"], r["routing_key"], r["enqueued_at"]) == (
            original.message_id, original.routing_key, original.enqueued_at)  # fmt: skip
        assert r["reason"] == "max-length" and r["vhost"] == "/" and r["vhost_name"] == "/"
    assert not (tmp_path / "archive" / "_staging").exists() or not any((tmp_path / "archive" / "_staging").iterdir())

    # A second run finds nothing more to do.
    again = run_job(backend, spark, archive_dir=str(tmp_path / "archive"))
    assert again["totals"]["removed_messages"] == 0
    assert offsets_by_queue(backend) == EXPECTED_KEPT


@needs_java
def test_the_archive_holds_bodies_the_embedded_store_keeps_in_segment_files(tmp_path: Path, spark: Any) -> None:
    # A threshold under the 300 B bodies: every body is in a segment file, the rows hold references.
    backend = sqlite_backend(tmp_path / "data", body_threshold=256)
    assert list(backend._rows("SELECT count(*) FROM messages WHERE body_segment IS NULL")) == [(0,)]
    backend.set_policy(LOGS_POLICY)
    run_job(backend, spark, archive_dir=str(tmp_path / "archive"))
    rows = spark.read.parquet(str(tmp_path / "archive")).collect()
    assert sorted(r["offset"] for r in rows) == list(range(1, 7))
    for r in rows:
        assert bytes(r["body"]) == _message("logs.app", r["offset"]).body
    assert offsets_by_queue(backend) == EXPECTED_KEPT


@needs_java
def test_rerun_after_a_crash_midway_converges(tmp_path: Path, spark: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = sqlite_backend(tmp_path / "data")
    backend.set_policy(LOGS_POLICY)
    real = Backend.delete_batch
    calls = {"n": 0}

    def crashing(self: Backend, vhost: str, queue: str, epoch: int, offsets: Any) -> int | None:
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("killed midway")
        return real(self, vhost, queue, epoch, offsets)

    monkeypatch.setattr(Backend, "delete_batch", crashing)
    with pytest.raises(RuntimeError, match="killed midway"):
        run_job(backend, spark, archive_dir=str(tmp_path / "archive"), batch_size=2)
    partial = offsets_by_queue(backend)
    assert partial != EXPECTED_KEPT
    assert all(set(EXPECTED_KEPT[q]) <= set(partial[q]) for q in QUEUES)  # nothing kept was deleted
    monkeypatch.setattr(Backend, "delete_batch", real)

    run_job(backend, spark, archive_dir=str(tmp_path / "archive"), batch_size=2)
    assert offsets_by_queue(backend) == EXPECTED_KEPT
    from spark.replay import archived_messages

    archived = list(archived_messages(spark, str(tmp_path / "archive"), "logs.app"))
    assert [m["offset"] for m in archived] == [1, 2, 3, 4, 5, 6]  # once each, whatever the crash left


@needs_java
def test_mark_only_then_delete(tmp_path: Path, spark: Any) -> None:
    """--mark-only flags the rows (a node restarting skips them); the next run deletes them."""
    from persistence.sqlite import SQLiteStore

    backend = sqlite_backend(tmp_path / "data")
    backend.set_policy(LOGS_POLICY)
    report = run_job(backend, spark, mark_only=True)
    assert report["totals"]["marked_messages"] == report["totals"]["removed_messages"] > 0
    assert report["totals"]["deleted_messages"] == 0
    assert offsets_by_queue(backend)["len-q"] == list(range(1, 11))  # still there, marked

    async def ready(queue: str) -> list[int]:
        store = SQLiteStore(str(tmp_path / "data" / "leveret.sqlite3"))
        await store.open()
        try:
            return [m.offset for m in await store.load_messages("/", queue)]
        finally:
            await store.close()

    assert {q: asyncio.run(ready(q)) for q in QUEUES} == EXPECTED_KEPT
    again = run_job(backend, spark)
    assert {q["queue"]: q["removed_by"]["marked"] for q in again["queues"]}["len-q"] == 7
    assert offsets_by_queue(backend) == EXPECTED_KEPT


@needs_java
def test_postgres_run(postgres_db: str, tmp_path: Path, spark: Any) -> None:
    from persistence.postgres import PostgresStore

    asyncio.run(_populate(PostgresStore(postgres_db)))
    backend = Backend("postgres", dsn=postgres_db)
    backend.connect()
    backend.set_policy(LOGS_POLICY)
    try:
        dry = run_job(backend, spark, dry_run=True)
        assert offsets_by_queue(backend)["len-q"] == list(range(1, 11))
        assert dry["totals"]["removed_messages"] == sum(10 - len(k) for k in EXPECTED_KEPT.values())
        report = run_job(backend, spark, archive_dir=str(tmp_path / "archive"), partitions=3)
        assert offsets_by_queue(backend) == EXPECTED_KEPT
        assert report["totals"]["archived_messages"] == 6
        assert report["partitions"] == 3
        epoch = backend.epochs()[("/", "keep-q")]
        assert backend.delete_batch("/", "keep-q", epoch + 1, [(1, 10)]) is None  # fenced: nothing goes
        assert offsets_by_queue(backend)["keep-q"] == list(range(1, 11))
    finally:
        backend.close()


@needs_java
def test_run_command_reads_the_store_options(tmp_path: Path, spark: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """``leveret retention run`` (its argument parsing and config plumbing) on the shared session."""
    from leveret.cli.main import build_parser
    from leveret.cli.retention import run_from_args

    backend = sqlite_backend(tmp_path / "data")
    backend.close()
    config = tmp_path / "leveret.toml"
    config.write_text(f'data_dir = "{tmp_path / "data"}"\n')
    args = build_parser().parse_args(["retention", "run", "--config", str(config), "--dry-run",
                                      "--report", str(tmp_path / "r.json")])  # fmt: skip
    assert run_from_args(args, spark) == 0
    out = capsys.readouterr().out
    assert "len-q" in out and "would remove" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["dry_run"] and report["totals"]["messages_before"] == 10 * len(QUEUES)
    assert offsets_by_queue(Backend("sqlite", data_dir=str(tmp_path / "data")))["len-q"] == list(range(1, 11))


# -- replay through a running node --------------------------------------------------------------



@needs_java
@pytest.mark.timeout(120)
def test_replay_restores_the_archived_messages(tmp_path: Path, spark: Any) -> None:
    import pika

    backend = sqlite_backend(tmp_path / "data")
    backend.set_policy(LOGS_POLICY)
    run_job(backend, spark, archive_dir=str(tmp_path / "archive"))
    backend.close()

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "leveret", "serve", "--amqp-port", str(port), "--grpc-port", str(free_port()),
         "--data-dir", str(tmp_path / "node")],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "node did not start"
                time.sleep(0.05)
        url = f"amqp://guest:guest@127.0.0.1:{port}/"
        conn = pika.BlockingConnection(pika.URLParameters(url))
        ch = conn.channel()
        ch.exchange_declare("restore", "direct", durable=True)
        ch.queue_declare("restored", durable=True)
        ch.queue_bind("restored", "restore", "rk.logs.app")

        from spark.replay import replay

        sent = replay(spark, str(tmp_path / "archive"), "logs.app", "restore", url=url,
                      since=NOW - 9 * 600 - 120, until=NOW)  # fmt: skip  (offsets 2..6)
        assert sent == 5
        got = []
        while True:
            method, props, body = ch.basic_get("restored", auto_ack=True)
            if method is None:
                break
            got.append((props, body))
        conn.close()
        assert [p.message_id for p, _ in got] == [f"logs.app-{o}" for o in range(2, 7)]
        for (props, body), offset in zip(got, range(2, 7), strict=True):
            assert body == _message("logs.app", offset).body
            assert props.content_type == "text/plain" and props.delivery_mode == 2
            assert props.headers["n"] == offset and props.headers["origin"] == "test"
            assert props.headers["x-replayed-from"] == f"//logs.app@{offset}"
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def test_sqlite_connection_is_real(tmp_path: Path) -> None:
    """The SQLite backend reads the file SQLiteStore wrote (guards the path convention with node.py)."""
    sqlite_backend(tmp_path).close()
    with sqlite3.connect(tmp_path / "leveret.sqlite3") as db:
        assert db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 10 * len(QUEUES)


async def _populate_stream(store: Any) -> None:
    await store.open()
    try:
        args = {"x-queue-type": "stream", "x-max-age": "1h", "x-max-length-bytes": 900}
        await store.save_queue(QueueRecord("/", "events", False, args))
        batch = Batch(epochs={("/", "events"): await store.claim("/", "events")})
        batch.appends.extend(_message("events", o) for o in range(1, 11))
        batch.offsets[("/", "events", "billing")] = 4
        await store.commit(batch)
    finally:
        await store.close()


def test_stream_retention_in_the_backup(tmp_path: Path, spark: Any) -> None:
    """A stream's x-max-age and x-max-length-bytes apply to its backup; group offsets stay."""
    from persistence.sqlite import SQLiteStore

    data = tmp_path / "data"
    asyncio.run(_populate_stream(SQLiteStore(str(data / "leveret.sqlite3"))))
    backend = Backend("sqlite", data_dir=str(data))
    backend.connect()
    report = run_job(backend, spark)
    kept = [int(o) for (o,) in backend._rows('SELECT "offset" FROM messages WHERE queue = \'events\' ORDER BY 1')]
    # Age alone keeps 6..10 (younger than 1 h); 900 bytes of 300-byte bodies keeps the newest 3.
    assert kept == [8, 9, 10]
    assert report["totals"]["deleted_messages"] == 7
    assert list(backend._rows("SELECT grp, \"offset\" FROM stream_offsets")) == [("billing", 4)]
# -- a live node (docs/RETENTION.md, "Live brokers") ------------------------------------------


class _Node:
    """``python -m leveret serve`` on a data dir, stderr (JSON logs) to a file."""

    def __init__(self, data_dir: Path, *extra: str) -> None:
        self.port = free_port()
        self.log = data_dir.parent / f"node-{self.port}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "leveret", "serve", "--amqp-port", str(self.port), "--grpc-port",
             str(free_port()), "--data-dir", str(data_dir), "--log-format", "json", *extra],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(self.log, "wb"),
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()[-2000:]
                time.sleep(0.05)
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out


# x-max-age is the job's own limit: a node refuses to declare a queue with it.
LIVE_QUEUES = {k: v for k, v in QUEUES.items() if k != "age-q"}
LIVE_KEPT = {k: v for k, v in EXPECTED_KEPT.items() if k != "age-q"}


@pytest.fixture(params=["sqlite", "postgres"])
def live_store(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Backend, list[str]]:
    """A populated store (LIVE_QUEUES): the job's backend and the node's store flags."""
    if request.param == "sqlite":
        sqlite_backend(tmp_path / "data", LIVE_QUEUES).close()
        return Backend("sqlite", data_dir=str(tmp_path / "data")), []
    from persistence.postgres import PostgresStore

    dsn = request.getfixturevalue("postgres_db")
    asyncio.run(_populate(PostgresStore(dsn), LIVE_QUEUES))
    return Backend("postgres", dsn=dsn), ["--store", "postgres", "--postgres-dsn", dsn]


@needs_java
@pytest.mark.timeout(120)
def test_live_node_never_delivers_what_the_job_removed(
    tmp_path: Path, spark: Any, live_store: tuple[Backend, list[str]]
) -> None:
    import pika

    data = tmp_path / "data"
    backend, flags = live_store
    node = _Node(data, *flags)
    try:
        conn = pika.BlockingConnection(pika.URLParameters(node.url))
        ch = conn.channel()
        ch.basic_qos(prefetch_count=2)
        held = []  # len-q offsets 1 and 2: delivered, unacked while the job runs
        for method, props, _ in ch.consume("len-q", inactivity_timeout=5):
            assert method is not None
            held.append((method.delivery_tag, props.message_id))
            if len(held) == 2:
                break
        assert [m for _, m in held] == ["len-q-1", "len-q-2"]

        backend.connect()
        backend.set_policy(LOGS_POLICY)
        report = run_job(backend, spark, apply_timeout=20)
        assert report["live_nodes"], "the job did not see the running node"
        by_queue = {q["queue"]: q for q in report["queues"]}
        for name, kept in LIVE_KEPT.items():
            assert not by_queue[name]["pending"], name
            assert by_queue[name]["deleted_messages"] == 10 - len(kept), name
        # The node dropped the ready ones and the job the rest: the store holds what is kept.
        assert offsets_by_queue(backend, LIVE_QUEUES) == LIVE_KEPT
        backend.close()

        # The unacked ones come back (nack, requeue): removed, so never redelivered.
        ch.basic_nack(held[-1][0], multiple=True, requeue=True)
        ch.cancel()
        ch.basic_qos(prefetch_count=0)
        for name, kept in LIVE_KEPT.items():
            got = []
            while True:
                method, props, _ = ch.basic_get(name, auto_ack=True)
                if method is None:
                    break
                got.append(props.message_id)
            assert got == [f"{name}-{o}" for o in kept], name
        conn.close()
        applied = [e for e in node.events() if e.get("msg") == "retention applied"]
        assert len(applied) == len(LIVE_KEPT) - 1  # keep-q lost nothing, so no request for it
    finally:
        node.stop()


@needs_java
@pytest.mark.timeout(150)
def test_scheduled_runs_one_at_a_time_under_the_lease(tmp_path: Path) -> None:
    """--retention-interval runs the job in a subprocess; a lease held elsewhere makes it skip."""
    from spark.retention_job import LEASE

    data = tmp_path / "data"
    backend = sqlite_backend(data, LIVE_QUEUES)
    assert backend.take_lease(LEASE, "someone-else", 300)
    node = _Node(data, "--retention-interval", "0.5")
    try:
        deadline = time.monotonic() + 30
        while not any(e.get("msg") == "retention run skipped: another run holds the lease" for e in node.events()):
            assert time.monotonic() < deadline, node.log.read_text()[-3000:]
            time.sleep(0.2)
        report = data / "retention" / "last-report.json"
        assert not report.exists()
        backend.release_lease(LEASE, "someone-else")
        deadline = time.monotonic() + 100
        while not any(e.get("msg") == "retention run finished" for e in node.events()):
            assert time.monotonic() < deadline, (data / "retention" / "run.log").read_text()[-3000:]
            time.sleep(0.5)
        done = json.loads(report.read_text())
        assert done["live_nodes"]  # the node kept serving and applied the requests itself
        assert offsets_by_queue(backend, LIVE_QUEUES)["len-q"] == [8, 9, 10]
        # Never two runs at once: each start is followed by its end before the next start.
        running = False
        for e in node.events():
            if e.get("msg") == "retention run starting":
                assert not running
                running = True
            elif e.get("msg") in ("retention run finished", "retention run failed",
                                      "retention run skipped: another run holds the lease"):
                running = False
    finally:
        node.stop()
        backend.close()


@needs_java
@pytest.mark.timeout(180)
def test_cluster_queue_arguments_apply(spark: Any) -> None:
    """In a cluster the declarations live in etcd; the owner records each queue's arguments in the store
    too, so the job applies them to queues declared through another node, and the live owner drops what
    the job removed."""
    import pika

    from harness.cluster import Cluster

    ttl_30d = {"x-message-ttl": 30 * 86400 * 1000}  # the job runs at NOW, ~50 days from today
    with Cluster(2) as cluster:
        conn = pika.BlockingConnection(pika.URLParameters(cluster.url("n1")))
        ch = conn.channel()
        ch.queue_declare("ret.ttl", durable=True, arguments=ttl_30d)
        ch.queue_declare("ret.keep", durable=True)
        conn.close()
        owners = {q: cluster.wait_owner(q, timeout=10) for q in ("ret.ttl", "ret.keep")}
        other = "n2" if owners["ret.ttl"] == "n1" else "n1"
        conn = pika.BlockingConnection(pika.URLParameters(cluster.url(other)))
        ch = conn.channel()
        ch.confirm_delivery()
        for q in ("ret.ttl", "ret.keep"):
            for i in range(20):
                ch.basic_publish("", q, f"m{i}".encode(), pika.BasicProperties(delivery_mode=2))
        backend = Backend("postgres", dsn=cluster.dsn)
        backend.connect()
        try:
            assert backend.queues()[("/", "ret.ttl")] == ttl_30d
            report = run_job(backend, spark, apply_timeout=20)
        finally:
            backend.close()
        by_queue = {q["queue"]: q for q in report["queues"]}
        assert by_queue["ret.ttl"]["deleted_messages"] == 20 and not by_queue["ret.ttl"]["pending"], by_queue
        assert by_queue["ret.keep"]["deleted_messages"] == 0, by_queue
        counts = {q: ch.queue_declare(q, passive=True).method.message_count for q in ("ret.ttl", "ret.keep")}
        assert counts == {"ret.ttl": 0, "ret.keep": 20}, counts
        assert ch.basic_get("ret.ttl", auto_ack=True)[0] is None
        conn.close()


def test_report_chart_is_a_png_of_the_expected_size(tmp_path: Path) -> None:
    from PIL import Image

    from spark.report_chart import chart_size, render

    def queue(name: str, kept: int, removed: int, archived: int, vhost: str = "/") -> dict[str, Any]:
        return {"vhost": vhost, "queue": name, "kept_messages": kept, "removed_messages": removed,
                "archived_messages": archived, "kept_bytes": kept * 300, "removed_bytes": removed * 300,
                "messages_before": kept + removed, "fenced": name == "fenced-q"}

    queues = [queue("logs.app", 4, 6, 6), queue("len-q", 3, 7, 0), queue("keep-q", 10, 0, 0),
              queue("fenced-q", 5, 0, 0, vhost="other")]
    report = {"run_id": "r-1", "now": 1_763_942_400.0, "dry_run": False, "mark_only": False, "queues": queues,
              "totals": {k: sum(q[k] for q in queues) for k in
                         ("removed_messages", "messages_before", "archived_messages")}}
    path = tmp_path / "chart.png"
    render(str(path), report)
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    with Image.open(path) as img:
        img.load()  # decodes every row: a truncated or corrupt file raises here
        assert img.format == "PNG"
        assert img.size == chart_size(4) == (1200, 288)
        colours = {c for _, c in img.convert("RGB").getcolors(maxcolors=1 << 20) or []}
    assert (0x2E, 0x9F, 0x43) in colours and (0xD6, 0x27, 0x28) in colours  # kept and removed bars are drawn
    assert chart_size(300)[1] > chart_size(4)[1]  # one row per queue
