"""A node whose Postgres accepts TCP but never answers: publishes are nacked in time, and what a nack means.

The node reaches Postgres through bench/chaos_proxy.py; its blackhole holds
every byte and ACKs it, so libpq's TCP timeouts never fire. The store's commit
timeout (--postgres-commit-timeout) must turn the silence into nacks within
about that long, and the node must commit again once the server answers.

It also pins what Leveret decided a nack means (docs/RELIABILITY.md, "What a
nack means"): the broker does not take responsibility for the message, yet
the message stays queued in memory and is delivered (at least once; a classic
queue delivers before its commit, as RabbitMQ's does, and a commit whose
outcome is unknown may be in the store), so a publisher that republishes a
nacked message can make a duplicate and consumers dedupe by message id.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pika
import pika.exceptions
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from bench.chaos import Background
from bench.chaos_proxy import Proxy
from harness.node import NodeProcess
from harness.pg import throwaway_postgres

COMMIT_TIMEOUT = 1.0


@pytest.fixture
def silent_store(tmp_path: Path) -> Iterator[tuple[NodeProcess, Proxy, Background]]:
    bg = Background()
    with throwaway_postgres() as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE DATABASE silent")

        async def make() -> Proxy:
            p = Proxy("pg", int(conninfo_to_dict(dsn).get("port") or 5432))
            await p.start()
            return p

        proxy = bg.run(make())
        proxied = make_conninfo(dsn, dbname="silent", host="127.0.0.1", port=str(proxy.port))
        node = NodeProcess(tmp_path / "data", tmp_path / "logs",
                           ["--store", "postgres", "--postgres-dsn", proxied,
                            "--postgres-commit-timeout", str(COMMIT_TIMEOUT)])
        try:
            node.start()
            yield node, proxy, bg
        finally:
            node.cleanup()
            bg.run(proxy.close())
            bg.close()


def test_silent_postgres_nacks_in_time_and_the_nacked_message_is_still_delivered(
        silent_store: tuple[NodeProcess, Proxy, Background]) -> None:
    node, proxy, bg = silent_store
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    try:
        ch = conn.channel()
        ch.queue_declare("q", durable=True)
        ch.confirm_delivery()
        persistent = pika.BasicProperties(delivery_mode=2, message_id="before")
        ch.basic_publish("", "q", b"before", persistent)  # confirmed: the store answers

        bg.call(lambda: proxy.cut("blackhole"))
        t0 = time.monotonic()
        with pytest.raises(pika.exceptions.NackError):
            ch.basic_publish("", "q", b"during", pika.BasicProperties(delivery_mode=2, message_id="during"))
        took = time.monotonic() - t0
        assert took < COMMIT_TIMEOUT + 3.0, f"the nack came after {took:.1f}s"
        assert "commit did not finish within" in node.stderr_tail()

        bg.call(proxy.heal)
        deadline = time.monotonic() + 30
        while True:  # the store's pool makes its connections again; publishes are confirmed again
            try:
                ch.basic_publish("", "q", b"after", pika.BasicProperties(delivery_mode=2, message_id="after"))
                break
            except pika.exceptions.NackError:
                assert time.monotonic() < deadline, "no confirm within 30 s of the heal"
                conn.sleep(0.2)

        bodies = []
        while (got := ch.basic_get("q", auto_ack=True))[0] is not None:
            bodies.append(got[2])
        # The nacked message was not dropped: it is delivered, once, in publish order.
        assert bodies[:2] == [b"before", b"during"] and set(bodies[2:]) == {b"after"}, bodies
    finally:
        if conn.is_open:
            conn.close()
