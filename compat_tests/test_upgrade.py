"""A data dir written by the previous release opens with this code and serves its messages.

tests/fixtures/datadir-0.1.0.tar.gz was written by release 0.1.0 (main at 52f8564, SQLite schema
versions 1-5, 20, 30, 40, 50): a node on an empty data dir, then with pika a durable topic exchange
``fixture.topic`` bound to the durable queue ``fixture`` with ``orders.#``, and 20 persistent
messages published to it with routing key ``orders.eu``: body ``%04d`` of i followed by 40 KiB of
``L`` when i % 10 == 0 (two bodies in a body segment) and ``small`` otherwise, ``message_id``
``m-<i>``, header ``n`` = i; then a graceful stop (SIGTERM), and the data dir packed without
``bodies/LOCK``. A release that changes the store's schema keeps this fixture and adds its own.
"""

from __future__ import annotations

import sqlite3
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest

from harness.node import REPO_ROOT, NodeProcess
from persistence.schema import SQLITE_MIGRATIONS, migration_files

FIXTURE = REPO_ROOT / "tests" / "fixtures" / "datadir-0.1.0.tar.gz"


def expected_body(i: int) -> bytes:
    return (b"%04d" % i) + (b"L" * (40 * 1024) if i % 10 == 0 else b"small")


@pytest.fixture
def old_node(tmp_path: Path) -> Iterator[NodeProcess]:
    data = tmp_path / "data"
    data.mkdir()
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(data, filter="data")
    node = NodeProcess(data, tmp_path / "logs")
    node.start()
    try:
        yield node
    finally:
        node.cleanup()


def test_previous_release_data_dir_is_served(old_node: NodeProcess) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(old_node.url))
    ch = conn.channel()
    # Topology came back: the exchange and its binding route a new publish into the old queue.
    ch.confirm_delivery()
    ch.basic_publish("fixture.topic", "orders.us", b"new", pika.BasicProperties(delivery_mode=2))
    got = []
    while True:
        method, props, body = ch.basic_get("fixture", auto_ack=False)
        if method is None:
            break
        got.append((body, props.message_id, (props.headers or {}).get("n"), method.redelivered))
        ch.basic_ack(method.delivery_tag)
    conn.close()
    assert [g[0] for g in got] == [expected_body(i) for i in range(20)] + [b"new"]
    assert [g[1] for g in got[:20]] == [f"m-{i}" for i in range(20)]
    assert [g[2] for g in got[:20]] == list(range(20))
    # The schema was brought up to this release's migrations.
    db = sqlite3.connect(old_node.data_dir / "leveret.sqlite3")
    try:
        versions = [v for (v,) in db.execute("SELECT version FROM schema_migrations ORDER BY version")]
    finally:
        db.close()
    assert versions == [v for v, _ in migration_files(SQLITE_MIGRATIONS)]
