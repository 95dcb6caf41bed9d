"""Backlogs far larger than a queue's memory budget (core/engine/paging.py), against a real node.

A node with 4 MiB per queue takes N 1 KiB messages with confirms and no consumer: the publisher
is never held up (no memory alarm, no stall), the node's RSS stays bounded, and a consumer then
gets every message in order. Once for persistent messages on a durable queue, once for transient
ones on a non-durable queue (the persistent ones page back from the store: nothing of them is
written to the paging dir); and a kill -9 in the middle of the persistent run. The full count
(2 million, 256 MiB) is bench/backlog.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pika
import pika.exceptions
import pytest

from compat_tests.backlog import drain, publish_backlog, rss_bytes
from harness.node import NodeProcess

pytestmark = pytest.mark.timeout(120)

N = int(os.environ.get("LEVERET_BACKLOG_TEST_MESSAGES", "100000"))  # 100 MiB of bodies: 25x the budget
SIZE = 1024
BUDGET = 4 * 1024 * 1024
# RSS may grow by this much over the idle node's while N messages wait: without paging the same
# backlog takes ~160 MiB (about 1.6 KB a message, issue #17).
RSS_GROWTH = 64 * 1024 * 1024


@pytest.fixture
def node(tmp_path: Path) -> Iterator[NodeProcess]:
    n = NodeProcess(tmp_path / "data", tmp_path / "logs",
                    ["--queue-memory-bytes", str(BUDGET), "--memory-high-watermark", str(256 * 1024 * 1024)])
    try:
        yield n
    finally:
        n.cleanup()


def declare(node: NodeProcess, queue: str, durable: bool) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    try:
        conn.channel().queue_declare(queue, durable=durable)
    finally:
        conn.close()


def spill_files(node: NodeProcess) -> list[str]:
    return os.listdir(node.data_dir / "paging")


def spill_bytes(node: NodeProcess) -> int:
    d = node.data_dir / "paging"
    return sum(os.path.getsize(d / f) for f in os.listdir(d))


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent-durable", "transient-non-durable"])
def test_a_backlog_past_the_budget_never_blocks_the_publisher_and_drains_in_order(
        node: NodeProcess, persistent: bool) -> None:
    node.start()
    idle_rss = rss_bytes(node.pid)
    declare(node, "backlog", durable=persistent)
    run = asyncio.run(publish_backlog(node.amqp_port, "backlog", N, SIZE, 2 if persistent else 1, pid=node.pid))
    assert run.confirmed == N, run.close_reason
    assert not run.blocked and run.longest_wait < 10, run
    peak = max(r for _, r in run.rss)
    assert peak - idle_rss < RSS_GROWTH, f"RSS grew {(peak - idle_rss) >> 20} MiB"
    if persistent:
        assert spill_bytes(node) == 0  # in the store already: pages back from there, not written again
    else:
        assert spill_bytes(node) > N * SIZE // 2  # the backlog is in segment files
    assert "memory high watermark" not in node.stderr_tail(1 << 20)
    got = drain(node.url, "backlog", N, pid=node.pid)
    assert len(got.seqs) == N
    assert got.seqs == list(range(1, N + 1))
    assert not any(got.redelivered)
    assert max(r for _, r in got.rss) - idle_rss < RSS_GROWTH
    assert spill_files(node) == []  # removed as they were read back


def test_persistent_messages_of_a_paged_durable_queue_are_not_written_to_the_paging_dir(
        node: NodeProcess) -> None:
    node.start()
    declare(node, "mixed", durable=True)
    n = N // 4
    persistent = asyncio.run(publish_backlog(node.amqp_port, "mixed", n, SIZE, 2))
    assert persistent.confirmed == n
    assert spill_bytes(node) == 0  # paged past the budget, yet nothing in the paging dir
    # Transient ones behind them on the same durable queue: those go to segment files.
    transient = asyncio.run(publish_backlog(node.amqp_port, "mixed", n, SIZE, 1, first=n + 1))
    assert transient.confirmed == n
    written = spill_bytes(node)
    assert n * SIZE // 2 < written < n * (SIZE + 256), written  # the transient ones, only they
    got = drain(node.url, "mixed", 2 * n)
    assert got.seqs == list(range(1, 2 * n + 1))  # the store's pages and the segment files merged in order
    assert spill_files(node) == []


def test_kill_9_mid_backlog_loses_no_confirmed_message_and_duplicates_none(node: NodeProcess) -> None:
    node.start()
    declare(node, "backlog", durable=True)
    half = N // 2
    # First a part that a consumer takes without acking (delivered before the kill), then more.
    first = asyncio.run(publish_backlog(node.amqp_port, "backlog", half, SIZE, 2))
    assert first.confirmed == half
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    ch = conn.channel()
    ch.basic_qos(prefetch_count=100)
    delivered: list[int] = []
    for method, _props, body in ch.consume("backlog", inactivity_timeout=5):
        assert method is not None
        delivered.append(int.from_bytes(body[:8], "big"))
        if len(delivered) == 100:
            break
    run = asyncio.run(publish_backlog(node.amqp_port, "backlog", N, SIZE, 2, kill_after=half // 2,
                                      kill=node.send_kill, first=half + 1))
    assert node.proc is not None and node.proc.wait(30) is not None
    with contextlib.suppress(Exception):
        conn.close()  # the node is gone
    confirmed = first.confirmed_seqs | run.confirmed_seqs
    assert len(confirmed) >= half + half // 2
    node.start()
    got = drain(node.url, "backlog", N + half, idle=5)
    assert len(got.seqs) == len(set(got.seqs)), "a message came back twice"
    assert got.seqs == sorted(got.seqs), "out of order"
    missing = confirmed - set(got.seqs)
    assert not missing, f"{len(missing)} confirmed messages lost, e.g. {sorted(missing)[:5]}"
    assert delivered == list(range(1, 101))
    assert all(got.redelivered[: 100])  # delivered before the kill: redelivered now


def test_kill_9_mid_transient_backlog_restarts_with_no_spill_left(node: NodeProcess) -> None:
    node.start()
    declare(node, "backlog", durable=False)
    run = asyncio.run(publish_backlog(node.amqp_port, "backlog", N, SIZE, 1, kill_after=N // 2, kill=node.send_kill))
    assert node.proc is not None and node.proc.wait(30) is not None
    assert run.confirmed >= N // 2
    node.start()
    assert spill_files(node) == []  # never reloaded: transient messages do not survive a restart
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    try:
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as info:
            conn.channel().queue_declare("backlog", passive=True)
        assert info.value.reply_code == 404
    finally:
        with contextlib.suppress(Exception):
            conn.close()
