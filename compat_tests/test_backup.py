"""``leveret ctl backup`` of a running node under a confirmed publisher, ``leveret ctl restore`` into an
empty data dir, and another node serving the copy: every message confirmed before the backup began is
there (small bodies in SQLite and large ones in body segments alike)."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest

from harness.node import REPO_ROOT, NodeProcess, _python, node_env

QUEUE = "backed-up"
LARGE = 40 * 1024  # above the 32 KiB body-store threshold: a body segment


def ctl(node: NodeProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_python(), "-m", "leveret", "ctl", "--node", f"127.0.0.1:{node.management_port}", *args],
                          cwd=REPO_ROOT, env=node_env(), capture_output=True, text=True, timeout=120)


def body(i: int) -> bytes:
    head = b"%08d" % i
    return head + b"x" * (LARGE if i % 5 == 0 else 100)


@pytest.fixture
def source(tmp_path: Path) -> Iterator[NodeProcess]:
    n = NodeProcess(tmp_path / "a-data", tmp_path / "a-logs")
    n.start()
    try:
        yield n
    finally:
        n.cleanup()


def test_backup_under_a_confirmed_publisher_restores_on_another_node(source: NodeProcess, tmp_path: Path) -> None:
    confirmed: list[int] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def publish() -> None:
        try:
            conn = pika.BlockingConnection(pika.URLParameters(source.url))
            ch = conn.channel()
            ch.queue_declare(QUEUE, durable=True)
            ch.confirm_delivery()
            i = 0
            while not stop.is_set():
                ch.basic_publish("", QUEUE, body(i), pika.BasicProperties(delivery_mode=2))  # returns once acked
                confirmed.append(i)
                i += 1
            conn.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    thread = threading.Thread(target=publish)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while len(confirmed) < 300 and time.monotonic() < deadline and not errors:
            time.sleep(0.05)
        before = len(confirmed)  # everything confirmed before the backup began
        backup_dir = tmp_path / "backup"
        made = ctl(source, "backup", str(backup_dir))
        during = len(confirmed) - before
    finally:
        stop.set()
        thread.join(30)
    assert not errors, errors
    assert made.returncode == 0, made.stdout + made.stderr
    assert before >= 300 and during > 0, (before, during)  # the publisher kept going while the copy was made
    assert (backup_dir / "leveret.sqlite3").is_file() and list((backup_dir / "bodies").glob("*.seg"))

    # No temporary file left in the source's data dir.
    assert not list(source.data_dir.glob(".backup-*"))

    # Restore refuses a data dir that holds something, then fills an empty one.
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    refused = ctl(source, "restore", str(backup_dir), str(busy))
    assert refused.returncode == 65 and "not empty" in refused.stderr
    restored_dir = tmp_path / "b-data"
    restored = ctl(source, "restore", str(backup_dir), str(restored_dir))
    assert restored.returncode == 0, restored.stdout + restored.stderr

    other = NodeProcess(restored_dir, tmp_path / "b-logs")
    other.start()
    try:
        conn = pika.BlockingConnection(pika.URLParameters(other.url))
        ch = conn.channel()
        got: set[int] = set()
        while True:
            method, _props, content = ch.basic_get(QUEUE, auto_ack=True)
            if method is None:
                break
            i = int(content[:8])
            assert content == body(i), f"message {i} came back altered"
            got.add(i)
        conn.close()
    finally:
        other.cleanup()
    missing = set(range(before)) - got
    assert not missing, f"{len(missing)} messages confirmed before the backup are missing, e.g. {sorted(missing)[:5]}"
    assert got <= set(range(len(confirmed) + 1))


def test_backup_refuses_a_non_empty_directory_and_bad_credentials(source: NodeProcess, tmp_path: Path) -> None:
    target = tmp_path / "full"
    target.mkdir()
    (target / "x").write_text("x")
    out = ctl(source, "backup", str(target))
    assert out.returncode == 65 and "not empty" in out.stderr  # rabbitmqctl's EX_DATAERR
    out = ctl(source, "--username", "nobody", "backup", str(tmp_path / "empty"))
    assert out.returncode == 77 and "401" in out.stderr  # EX_NOPERM
    out = ctl(source, "restore", str(tmp_path))
    assert out.returncode == 65 and "BACKUP.json" in out.stderr
