"""kill -9 in the middle of a run of 1 MiB persistent messages with confirms (the body store).

A real node process on the embedded store (1 MiB bodies go to segment files,
persistence/bodystore.py). A consumer takes the first messages and acks some
(a confirmed barrier proves the acks are committed), keeps the rest unacked;
the publisher goes on with 1 MiB messages until the node is SIGKILLed. After
the restart every confirmed message not acked is back, in order, exactly once,
with its whole body, redelivered; and the body files hold nothing no row needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest

from compat_tests.test_durability import barrier, blocking, drain_queue
from harness.node import ConfirmingPublisher, ConnectionLost, NodeProcess

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20
PERSISTENT = pika.BasicProperties(delivery_mode=2)


def big_body(seq: int) -> bytes:
    """1 MiB that says which message it is throughout (a body read back from the wrong place fails)."""
    head = b"P-%010d-" % seq
    block = hashlib.sha256(head).digest() * 64  # 2 KiB
    return (head + block * (MIB // len(block) + 1))[:MIB]


def seq_of(body: bytes) -> int:
    return int(body[2:12])


@pytest.fixture
def node(tmp_path: Path) -> Iterator[NodeProcess]:
    n = NodeProcess(tmp_path / "data", tmp_path / "logs")
    try:
        yield n
    finally:
        n.cleanup()


async def _publish_until_killed(node: NodeProcess, queue: str, first: int, min_settled: int) -> ConfirmingPublisher:
    """1 MiB persistent publishes, 16 unconfirmed at most (the bench's window), until the node dies;
    SIGKILL once ``min_settled`` confirms came back (or after 20 s)."""
    loop = asyncio.get_running_loop()
    pub = ConfirmingPublisher()
    await pub.open("127.0.0.1", node.amqp_port)
    started = loop.time()
    killed = False
    try:
        while not pub.closed.is_set():
            if not killed and (pub.settled >= min_settled or loop.time() - started > 20):
                node.send_kill()
                killed = True
            if pub.outstanding >= 16:
                await pub.wait_progress(0.2)
                continue
            pub.publish("", queue, big_body(first + pub.published + 1))
            try:
                await pub.flush()
            except ConnectionLost:
                break
        await pub.wait_closed(30)
    finally:
        await pub.close()
    return pub


def test_kill9_mid_1mib_run_keeps_every_confirmed_message_once_in_order(node: NodeProcess) -> None:
    queue = f"bodystore.crash.{uuid.uuid4().hex[:12]}"
    node.start()
    with blocking(node) as ch:
        ch.queue_declare(queue, durable=True)
        ch.confirm_delivery()
        for seq in range(20):
            ch.basic_publish("", queue, big_body(seq), PERSISTENT)

    # A consumer takes 0..19: acks 0..9 (committed: the barrier's confirm), keeps 10..19 unacked.
    consumer = pika.BlockingConnection(pika.URLParameters(node.url))
    try:
        cch = consumer.channel()
        cch.basic_qos(prefetch_count=10)
        tags: list[int] = []
        for method, _props, body in cch.consume(queue, inactivity_timeout=10):
            assert method is not None, "deliveries stopped"
            assert body == big_body(len(tags))
            tags.append(method.delivery_tag)
            if len(tags) == 10:
                cch.basic_ack(tags[-1], multiple=True)
                barrier(consumer)
            if len(tags) == 20:
                break
        pub = asyncio.run(_publish_until_killed(node, queue, 19, min_settled=30))
    finally:
        with contextlib.suppress(Exception):
            consumer.close()
    node.kill()
    assert not pub.anomalies, pub.anomalies
    confirmed = sorted(19 + s for s in pub.acked())
    assert len(confirmed) >= 30, f"only {len(confirmed)} confirms before the kill"

    node.start()
    with blocking(node) as ch:
        count = ch.queue_declare(queue, durable=True, passive=True).method.message_count
        got = drain_queue(ch, queue, count)
        seqs = [seq_of(g.body) for g in got]
        print(f"published {pub.published}, confirmed {len(confirmed)}, restored {count}")  # shown on failure
        assert len(got) == count
        assert len(set(seqs)) == len(seqs), "duplicated messages after restart"
        assert seqs == sorted(seqs), "order not kept after restart"
        assert seqs[:10] == list(range(10, 20)), "the unacked messages must come back, the acked ones not"
        missing = sorted(set(confirmed) - set(seqs))
        assert not missing, f"{len(missing)} confirmed messages lost, first {missing[:10]}"
        assert max(seqs) <= 19 + pub.published
        bad = [s for g, s in zip(got, seqs, strict=True) if g.body != big_body(s)]
        assert not bad, f"bodies read back wrong: {bad[:10]}"
        assert all(g.redelivered for g in got), "restored messages must be marked redelivered"
        # Everything consumed (auto-ack) and the acks committed: no segment is left holding bodies.
        conn = ch.connection
        barrier(conn)
    bodies = node.data_dir / "bodies"
    leftover = sorted(p.name for p in bodies.glob("*.seg"))
    assert leftover == [], f"segments left after every message was consumed: {leftover}"
    assert len(list(bodies.glob("*.free"))) <= 2
    node.terminate()
