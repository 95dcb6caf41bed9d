"""Durability end to end: a real node process, killed (-9) or stopped, restarted on the same store.

Every scenario runs against both stores: SQLite (the default, a file in the
data dir) and PostgreSQL (a fresh database on a throwaway server per test).

What "durable" means here (DESIGN.md, core/group_commit.py):
- a persistent message (delivery_mode 2) routed to a durable queue is
  confirmed only after the group commit that stores it; a confirmed message
  survives kill -9 exactly once and in order; unconfirmed ones may or may
  not be there, never twice;
- acks (removals), requeues (delivery counts), purges and deletes go
  through the same group committer: they are durable once the commit that
  carries them lands, which the client cannot observe directly. The tests
  therefore publish a confirmed "barrier" message on the same connection
  after acking: commits are FIFO, so its confirm proves the acks before it
  are stored;
- everything is marked redelivered after a restart;
- transient queues and transient messages do not survive a restart.

The tests start their own nodes (harness/node.py), not the
session node of conftest.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import decimal
import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pika
import pika.exceptions
import pytest
from pamqp import commands, frame, header
from pika.adapters.blocking_connection import BlockingChannel

from compat_tests.raw_amqp import RawAMQP
from harness.node import (
    REPO_ROOT,
    ConfirmingPublisher,
    ConnectionLost,
    NodeProcess,
    RestartablePostgres,
    free_ports,
    node_env,
    serve_command,
)
from harness.pg import throwaway_postgres

pytestmark = pytest.mark.timeout(90)

PERSISTENT = pika.BasicProperties(delivery_mode=2)
TRANSIENT = pika.BasicProperties(delivery_mode=1)


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def durability_postgres() -> Iterator[str]:
    """One throwaway PostgreSQL server for this module's tests (skips when none can run here)."""
    with throwaway_postgres() as dsn:
        yield dsn


@pytest.fixture
def fresh_database(durability_postgres: str) -> Iterator[str]:
    """The DSN of a database created for one test and dropped after it."""
    import psycopg
    from psycopg import sql
    from psycopg.conninfo import make_conninfo

    name = f"leveret_durability_{uuid.uuid4().hex}"
    with psycopg.connect(durability_postgres, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield make_conninfo(durability_postgres, dbname=name)
    finally:
        with psycopg.connect(durability_postgres, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture(params=["sqlite", "postgres"])
def store_args(request: pytest.FixtureRequest) -> list[str]:
    if request.param == "sqlite":
        return []  # the default store: a file in the data dir
    dsn = request.getfixturevalue("fresh_database")
    return ["--store", "postgres", "--postgres-dsn", dsn]


@pytest.fixture
def node(tmp_path: Path, store_args: list[str]) -> Iterator[NodeProcess]:
    """A node on a fresh data dir / database; not started yet."""
    n = NodeProcess(tmp_path / "data", tmp_path / "logs", store_args)
    try:
        yield n
    finally:
        n.cleanup()


# -- helpers ----------------------------------------------------------------------------------


@contextlib.contextmanager
def blocking(node: NodeProcess) -> Iterator[BlockingChannel]:
    params = pika.URLParameters(node.url)
    params.socket_timeout = 15
    params.blocked_connection_timeout = 60
    conn = pika.BlockingConnection(params)
    try:
        yield conn.channel()
    finally:
        if conn.is_open:
            with contextlib.suppress(pika.exceptions.AMQPError):
                conn.close()


def name(prefix: str) -> str:
    return f"durability.{prefix}.{uuid.uuid4().hex[:12]}"


def seq_body(seq: int, transient: bool = False) -> bytes:
    return b"%s-%010d" % (b"T" if transient else b"P", seq)


def parse_body(body: bytes) -> tuple[str, int]:
    kind, _, number = body.partition(b"-")
    return kind.decode(), int(number)


@dataclass
class Got:
    body: bytes
    redelivered: bool
    properties: pika.BasicProperties


def drain_queue(ch: BlockingChannel, queue: str, expected: int, timeout: float = 60.0) -> list[Got]:
    """Consume (auto-ack) until ``expected`` messages arrived, then until 0.3 s passes without another."""
    got: list[Got] = []
    deadline = time.monotonic() + timeout
    for method, props, body in ch.consume(queue, auto_ack=True, inactivity_timeout=0.3):
        if method is None:
            if len(got) >= expected or time.monotonic() > deadline:
                break
            continue
        got.append(Got(body, bool(method.redelivered), props))
    ch.cancel()
    return got


def barrier(conn: pika.BlockingConnection) -> None:
    """Publish a confirmed persistent message on ``conn``: its confirm proves that every
    ack/nack/purge the connection sent before it is committed (commits are FIFO)."""
    ch = conn.channel()
    ch.confirm_delivery()
    q = ch.queue_declare("durability.barrier", durable=True).method.queue
    ch.basic_publish("", q, b"barrier", PERSISTENT)
    ch.queue_purge(q)
    ch.close()


async def _publish_confirmed(port: int, messages: list[tuple[str, str, bytes, int]]) -> ConfirmingPublisher:
    pub = ConfirmingPublisher()
    await pub.open("127.0.0.1", port)
    try:
        for exchange, routing_key, body, mode in messages:
            pub.publish(exchange, routing_key, body, mode)
        await pub.flush()
        await pub.wait_settled(pub.published, 60)
    finally:
        await pub.close()
    return pub


def publish_confirmed(node: NodeProcess, messages: list[tuple[str, str, bytes, int]]) -> None:
    """Publish all at once on one confirm channel; every one must be acked."""
    pub = asyncio.run(_publish_confirmed(node.amqp_port, messages))
    assert not pub.anomalies, pub.anomalies
    assert pub.lowest_waiting > pub.published, f"not all confirmed: {pub.close_reason}"
    assert not pub.nacked(), f"nacked: {sorted(pub.nacked())[:20]}"


def assert_not_found(ch: BlockingChannel, queue: str) -> None:
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as info:
        ch.queue_declare(queue, passive=True)
    assert info.value.reply_code == 404, info.value


# -- 1. kill -9 in the middle of a confirmed publish stream --------------------------------------


@dataclass
class StreamResult:
    publisher: ConfirmingPublisher
    published_at_kill: int
    settled_at_kill: int


async def _publish_until_killed(
    node: NodeProcess, exchange: str, routing_key: str, *, min_seconds: float = 1.5, min_settled: int = 500,
    window: int = 5000, chunk: int = 250,
) -> StreamResult:  # fmt: skip
    """Publish as fast as the window allows; every 10th message is transient.

    The node is SIGKILLed once ``min_seconds`` have passed and at least
    ``min_settled`` confirms have arrived (so the test is never vacuous on a
    slow machine), and publishing goes on until the connection drops.
    """
    loop = asyncio.get_running_loop()
    pub = ConfirmingPublisher()
    await pub.open("127.0.0.1", node.amqp_port)
    started = loop.time()
    published_at_kill = settled_at_kill = -1
    try:
        while not pub.closed.is_set():
            elapsed = loop.time() - started
            if published_at_kill < 0 and ((elapsed >= min_seconds and pub.settled >= min_settled) or elapsed > 30):
                node.send_kill()
                published_at_kill, settled_at_kill = pub.published, pub.settled
            room = window - pub.outstanding
            if room <= 0:
                await pub.wait_progress(0.2)
                continue
            for _ in range(min(chunk, room)):
                seq = pub.published + 1
                transient = seq % 10 == 0
                pub.publish(exchange, routing_key, seq_body(seq, transient), 1 if transient else 2)
            try:
                await pub.flush()
            except ConnectionLost:
                break
            await asyncio.sleep(0)
        await pub.wait_closed(30)
    finally:
        await pub.close()
    return StreamResult(pub, published_at_kill, settled_at_kill)


def test_kill9_mid_stream_keeps_every_confirmed_message_once_and_in_order(node: NodeProcess) -> None:
    queue, exchange, transient_queue = name("stream"), name("x"), name("transient")
    node.start()
    with blocking(node) as ch:
        ch.exchange_declare(exchange, "direct", durable=True)
        ch.queue_declare(queue, durable=True)
        ch.queue_bind(queue, exchange, "k")
        ch.queue_declare(transient_queue, durable=False)
        ch.basic_publish("", transient_queue, b"in a transient queue", PERSISTENT)

    result = asyncio.run(_publish_until_killed(node, exchange, "k"))
    node.kill()
    pub = result.publisher
    assert result.published_at_kill > 0, "the publisher never reached the kill point"
    assert not pub.anomalies, pub.anomalies
    acked = pub.acked()
    confirmed_persistent = sorted(s for s in acked if s % 10 != 0)
    assert len(confirmed_persistent) >= 400, f"only {len(confirmed_persistent)} confirms before the kill"

    node.start()
    with blocking(node) as ch:
        count = ch.queue_declare(queue, durable=True, passive=True).method.message_count
        print(  # shown when the test fails
            f"published {pub.published} (at kill {result.published_at_kill}), settled at kill "
            f"{result.settled_at_kill}, acked {len(acked)}, nacked {len(pub.nacked())}, "
            f"confirmed persistent {len(confirmed_persistent)}, restored {count}"
        )
        got = drain_queue(ch, queue, count)
        kinds_seqs = [parse_body(g.body) for g in got]
        seqs = [s for _, s in kinds_seqs]
        assert len(got) == count, f"message_count said {count}, consumed {len(got)}"
        assert len(set(seqs)) == len(seqs), "duplicated messages after restart"
        assert seqs == sorted(seqs), "order not kept after restart"
        transient_back = [s for k, s in kinds_seqs if k == "T"]
        assert not transient_back, f"transient messages survived: {transient_back[:10]}"
        missing = sorted(set(confirmed_persistent) - set(seqs))
        assert not missing, (
            f"{len(missing)} confirmed messages lost, first {missing[:10]} "
            f"(published {pub.published}, confirmed {len(confirmed_persistent)} persistent, restored {count})"
        )
        assert all(g.redelivered for g in got), "restored messages must be marked redelivered"
        assert max(seqs, default=0) <= pub.published

        # the durable exchange and its binding still route
        ch.confirm_delivery()
        ch.basic_publish(exchange, "k", b"after restart", PERSISTENT, mandatory=True)
        method, _props, body = ch.basic_get(queue, auto_ack=True)
        assert method is not None and body == b"after restart"
        assert not method.redelivered

    with blocking(node) as ch:
        assert_not_found(ch, transient_queue)


# -- 2. acked messages stay acked -------------------------------------------------------------------


def test_acked_messages_do_not_come_back_after_kill9(node: NodeProcess) -> None:
    queue = name("acks")
    node.start()
    with blocking(node) as ch:
        ch.queue_declare(queue, durable=True)
    publish_confirmed(node, [("", queue, seq_body(i), 2) for i in range(200)])

    params = pika.URLParameters(node.url)
    conn = pika.BlockingConnection(params)
    try:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=0)
        deliveries: list[tuple[int, int]] = []  # (delivery tag, seq)
        for method, _props, body in ch.consume(queue, inactivity_timeout=10):
            assert method is not None, "deliveries stopped"
            deliveries.append((method.delivery_tag, parse_body(body)[1]))
            if len(deliveries) == 200:
                break
        assert [s for _, s in deliveries] == list(range(200))
        # ack the first half: 0..49 one by one, 50..99 with one multiple ack
        for tag, _seq in deliveries[:50]:
            ch.basic_ack(tag)
        ch.basic_ack(deliveries[99][0], multiple=True)
        barrier(conn)  # the acks are committed once this confirm arrives
        node.kill()  # 100..199 still unacked on the open connection
    finally:
        with contextlib.suppress(Exception):
            conn.close()

    node.start()
    with blocking(node) as ch:
        count = ch.queue_declare(queue, durable=True, passive=True).method.message_count
        got = drain_queue(ch, queue, count)
    seqs = [parse_body(g.body)[1] for g in got]
    assert seqs == list(range(100, 200)), f"expected the 100 unacked messages, got {len(seqs)}: {seqs[:10]}..."
    assert all(g.redelivered for g in got)


# -- 3. graceful restart ------------------------------------------------------------------------------


def test_graceful_restart_keeps_messages_deletes_and_purges(node: NodeProcess) -> None:
    keep, gone, purged, exchange = name("keep"), name("gone"), name("purged"), name("x")
    node.start()
    with blocking(node) as ch:
        ch.exchange_declare(exchange, "topic", durable=True)
        for q in (keep, gone, purged):
            ch.queue_declare(q, durable=True)
        ch.queue_bind(keep, exchange, "keep.#")
    publish_confirmed(
        node,
        [(exchange, "keep.a", seq_body(i), 2) for i in range(50)]
        + [("", gone, seq_body(i), 2) for i in range(20)]
        + [("", purged, seq_body(i), 2) for i in range(10)],
    )
    with blocking(node) as ch:
        assert ch.queue_purge(purged).method.message_count == 10
        ch.queue_delete(gone)
    # published after the purge: must survive it
    publish_confirmed(node, [("", purged, seq_body(i), 2) for i in range(100, 103)])

    assert node.terminate() == 0, node.stderr_tail()
    node.start()
    with blocking(node) as ch:
        got = drain_queue(ch, keep, ch.queue_declare(keep, durable=True, passive=True).method.message_count)
        assert [parse_body(g.body)[1] for g in got] == list(range(50))
        got = drain_queue(ch, purged, ch.queue_declare(purged, durable=True, passive=True).method.message_count)
        assert [parse_body(g.body)[1] for g in got] == [100, 101, 102], "the purge did not stay purged"
        ch.confirm_delivery()
        ch.basic_publish(exchange, "keep.b", b"routed", PERSISTENT, mandatory=True)
        method, _props, body = ch.basic_get(keep, auto_ack=True)
        assert method is not None and body == b"routed"
    with blocking(node) as ch:
        assert_not_found(ch, gone)


# -- 4. properties byte for byte -----------------------------------------------------------------------


def _rich_properties() -> commands.Basic.Properties:
    return commands.Basic.Properties(
        content_type="application/json",
        content_encoding="utf-8",
        headers={
            "str": "välue",
            "int": 42,
            "neg": -5,
            "big": 2**40,
            "bool": True,
            "none": None,
            "float": 1.5,
            "decimal": decimal.Decimal("1.25"),
            "time": datetime.datetime(2024, 1, 2, 3, 4, 5, tzinfo=datetime.UTC),
            "bytes": bytearray(b"\x00\x01\xff"),
            "list": [1, "two", {"x": True}],
            "nested": {"a": {"b": "c"}},
        },
        delivery_mode=2,
        priority=7,
        correlation_id="corr-1",
        reply_to="replies",
        message_id="msg-1",
        timestamp=datetime.datetime(2024, 5, 6, 7, 8, 9, tzinfo=datetime.UTC),
        message_type="example.type",
        user_id="guest",
        app_id="durability-tests",
    )


@contextlib.contextmanager
def raw_client(node: NodeProcess) -> Iterator[RawAMQP]:
    # not ``with RawAMQP(...)``: RawAMQP.close() builds connection.close without
    # class_id/method_id, which pamqp 4 refuses to marshal (TypeError)
    raw = RawAMQP("127.0.0.1", node.amqp_port, timeout=15)
    try:
        yield raw
    finally:
        raw.close_socket()


def _header_payload(props: commands.Basic.Properties, body_size: int) -> bytes:
    raw = frame.marshal(header.ContentHeader(0, body_size, props), 1)
    return raw[7:-1]


def test_message_properties_survive_restart_byte_for_byte(node: NodeProcess) -> None:
    queue, prio_queue = name("props"), name("prio")
    props = _rich_properties()
    body = b'{"hello": "world"}'
    pika_props = pika.BasicProperties(
        content_type="text/plain", headers={"k": "v", "n": 1, "deep": {"list": [1, 2]}}, delivery_mode=2,
        priority=3, correlation_id="corr-2", message_id="msg-2", reply_to="r", app_id="pika", type="t",
    )  # fmt: skip
    node.start()
    with blocking(node) as ch:
        ch.queue_declare(queue, durable=True)
        ch.queue_declare(prio_queue, durable=True, arguments={"x-max-priority": 10})
    with raw_client(node) as raw:
        raw.handshake()
        raw.open_channel(1)
        assert isinstance(raw.rpc(commands.Confirm.Select()), commands.Confirm.SelectOk)
        raw.publish(1, body, routing_key=queue, properties=props)
        raw.expect(commands.Basic.Ack, timeout=30)
    with blocking(node) as ch:
        ch.confirm_delivery()
        ch.basic_publish("", queue, b"second", pika_props)
        for priority in (1, 9, 5):
            ch.basic_publish("", prio_queue, b"p%d" % priority, pika.BasicProperties(delivery_mode=2,
                                                                                     priority=priority))

    node.kill()
    node.start()

    expected_header = _header_payload(props, len(body))
    with raw_client(node) as raw:
        raw.handshake()
        raw.open_channel(1)
        raw.send(commands.Basic.Get(queue=queue, no_ack=True), 1)
        get_ok = raw.expect(commands.Basic.GetOk, timeout=15)
        assert get_ok.redelivered and (get_ok.exchange, get_ok.routing_key) == ("", queue)
        frame_type, _channel, payload = raw.read_frame_bytes(timeout=15)
        assert frame_type == 2
        assert payload == expected_header, "content header (properties) changed across the restart"
        frame_type, _channel, got_body = raw.read_frame_bytes(timeout=15)
        assert (frame_type, got_body) == (3, body)

    with blocking(node) as ch:
        method, got_props, got_body = ch.basic_get(queue, auto_ack=True)
        assert method is not None and got_body == b"second" and method.redelivered
        for attr in ("content_type", "headers", "delivery_mode", "priority", "correlation_id", "message_id",
                     "reply_to", "app_id", "type"):
            assert getattr(got_props, attr) == getattr(pika_props, attr), attr
        assert got_props.expiration is None and got_props.timestamp is None
        # the priority queue came back as one (its arguments persisted), highest priority first
        ch.queue_declare(prio_queue, durable=True, arguments={"x-max-priority": 10})
        order = []
        for _ in range(3):
            method, got_props, got_body = ch.basic_get(prio_queue, auto_ack=True)
            assert method is not None
            order.append((got_body, got_props.priority))
        assert order == [(b"p9", 9), (b"p5", 5), (b"p1", 1)]


# -- 5. store problems (PostgreSQL) -------------------------------------------------------------------


@pytest.mark.parametrize("form", ["url", "keyword"])
def test_unreachable_postgres_at_start_exits_nonzero_naming_host_not_password(tmp_path: Path, form: str) -> None:
    closed_port, amqp_port, grpc_port = free_ports(3)  # nothing listens on closed_port
    password = "Sup3rSecretPw"
    dsn = (
        f"postgresql://leveret:{password}@127.0.0.1:{closed_port}/leveret"
        if form == "url"
        else f"host=127.0.0.1 port={closed_port} user=leveret password={password} dbname=leveret"
    )
    cmd = serve_command(amqp_port, grpc_port, tmp_path / "data", ["--store", "postgres", "--postgres-dsn", dsn])
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=node_env(), capture_output=True, timeout=60)
    output = (proc.stdout + proc.stderr).decode(errors="replace")
    assert proc.returncode != 0, output
    assert "127.0.0.1" in output and str(closed_port) in output, output
    assert password not in output, output


async def _publish_and_settle(port: int, messages: list[tuple[str, str, bytes, int]],
                              timeout: float) -> ConfirmingPublisher:  # fmt: skip
    pub = ConfirmingPublisher()
    await pub.open("127.0.0.1", port)
    try:
        for exchange, routing_key, body, mode in messages:
            pub.publish(exchange, routing_key, body, mode)
        await pub.flush()
        await pub.wait_settled(pub.published, timeout)
    finally:
        await pub.close()
    return pub


Outage = tuple[RestartablePostgres, NodeProcess]


@pytest.fixture(scope="module")
def restartable_postgres() -> Iterator[RestartablePostgres]:
    """A PostgreSQL server the outage tests stop and start again on the same port."""
    server = RestartablePostgres()
    try:
        server.create()
        yield server
    finally:
        server.close()


@pytest.fixture
def outage(restartable_postgres: RestartablePostgres, tmp_path: Path) -> Iterator[Outage]:
    """A node on a fresh database of the restartable server (running again after the test)."""
    import psycopg
    from psycopg import sql
    from psycopg.conninfo import make_conninfo

    server = restartable_postgres
    if server.proc is None or server.proc.poll() is not None:
        server.start()
    db = f"leveret_outage_{uuid.uuid4().hex}"
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db)))
    node = NodeProcess(tmp_path / "data", tmp_path / "logs",
                       ["--store", "postgres", "--postgres-dsn", make_conninfo(server.dsn, dbname=db)])
    try:
        yield server, node
    finally:
        node.cleanup()
        if server.proc is None or server.proc.poll() is not None:
            server.start()
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db)))


def publish_until_confirmed(node: NodeProcess, queue: str, body: bytes, timeout: float = 45) -> bytes | None:
    """After an outage: publish ``body``-N until one is confirmed; return the confirmed body (None: never)."""
    deadline = time.monotonic() + timeout
    attempt = 0
    while time.monotonic() < deadline:
        attempt += 1
        this = b"%s-%d" % (body, attempt)
        pub = asyncio.run(_publish_and_settle(node.amqp_port, [("", queue, this, 2)], timeout=30))
        assert not pub.anomalies, pub.anomalies
        if pub.acked() == {1}:
            return this
        time.sleep(0.5)
    return None


def test_postgres_outage_nacks_persistent_publishes_then_recovers(outage: Outage) -> None:
    server, node = outage
    node.start()
    queue, transient_queue = name("outage"), name("outage-transient")
    with blocking(node) as ch:
        ch.queue_declare(queue, durable=True)
        ch.queue_declare(transient_queue, durable=False)
    publish_confirmed(node, [("", queue, seq_body(0), 2)])  # healthy store: confirmed

    server.stop()
    pub = asyncio.run(_publish_and_settle(node.amqp_port, [("", queue, seq_body(i), 2) for i in range(1, 21)],
                                          timeout=60))
    assert not pub.anomalies, pub.anomalies
    assert pub.lowest_waiting > pub.published, f"publishes never settled: {pub.close_reason}"
    assert not pub.acked(), f"confirmed while the store is down: {sorted(pub.acked())}"
    assert len(pub.nacked()) == 20
    assert node.running(), node.stderr_tail()
    # what does not need the store is still confirmed
    pub = asyncio.run(_publish_and_settle(node.amqp_port, [("", transient_queue, b"t", 1)], timeout=30))
    assert pub.acked() == {1}, (pub.status, pub.close_reason)

    server.start()
    confirmed = publish_until_confirmed(node, queue, b"after-outage")
    assert confirmed is not None, f"publishes still not confirmed after Postgres came back:\n{node.stderr_tail()}"

    # and what was confirmed after the outage is really stored
    node.kill()
    node.start()
    with blocking(node) as ch:
        got = drain_queue(ch, queue, ch.queue_declare(queue, durable=True, passive=True).method.message_count)
    bodies = [g.body for g in got]
    assert bodies[0] == seq_body(0)
    assert confirmed in bodies
    assert len(set(bodies)) == len(bodies)


def test_durable_queue_declared_during_postgres_outage_is_not_silently_dropped(outage: Outage) -> None:
    """declare-ok for a durable queue is a promise: if the node cannot store the queue it
    must refuse the declare, or store it once the store is back. It must not drop it later."""
    server, node = outage
    node.start()
    queue = name("declared-in-outage")
    server.stop()
    with blocking(node) as ch:
        try:
            ch.queue_declare(queue, durable=True)
        except pika.exceptions.AMQPError:
            return  # refused while the store is down: nothing was promised
    server.start()
    confirmed = publish_until_confirmed(node, queue, b"after-outage")
    with blocking(node) as ch:
        try:
            count = ch.queue_declare(queue, durable=True, passive=True).method.message_count
        except pika.exceptions.ChannelClosedByBroker as exc:
            pytest.fail(f"the queue declared (declare-ok) during the outage vanished after Postgres came back: "
                        f"{exc}; node log:\n{node.stderr_tail(1500)}")
    assert confirmed is not None and count >= 1, "publishes to the queue never confirmed after the outage"
    node.kill()
    node.start()
    with blocking(node) as ch:
        got = drain_queue(ch, queue, ch.queue_declare(queue, durable=True, passive=True).method.message_count)
    assert confirmed in [g.body for g in got]


def test_durable_queue_deleted_during_postgres_outage_stays_deleted(outage: Outage) -> None:
    """delete-ok is a promise too: the queue and its messages must not come back after a restart."""
    server, node = outage
    node.start()
    queue = name("deleted-in-outage")
    with blocking(node) as ch:
        ch.queue_declare(queue, durable=True)
    publish_confirmed(node, [("", queue, b"doomed", 2)])
    server.stop()
    with blocking(node) as ch:
        try:
            ch.queue_delete(queue)
        except pika.exceptions.AMQPError:
            return  # refused while the store is down: nothing was promised
    server.start()
    # the store works again (a confirmed publish to another durable queue), then a crash
    other = name("other")
    with blocking(node) as ch:
        ch.queue_declare(other, durable=True)
    assert publish_until_confirmed(node, other, b"after-outage") is not None
    node.kill()
    node.start()
    with blocking(node) as ch:
        try:
            count = ch.queue_declare(queue, durable=True, passive=True).method.message_count
        except pika.exceptions.ChannelClosedByBroker as exc:
            assert exc.reply_code == 404
            return
    pytest.fail(f"the queue deleted (delete-ok) during the outage is back after a restart, with {count} message(s)")


# -- 6. requeued (nacked) messages -------------------------------------------------------------------


def test_message_nacked_with_requeue_twice_survives_kill9_redelivered(node: NodeProcess) -> None:
    queue = name("requeue")
    node.start()
    with blocking(node) as ch:
        ch.queue_declare(queue, durable=True)
    publish_confirmed(node, [("", queue, seq_body(i), 2) for i in range(3)])

    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    try:
        ch = conn.channel()
        for attempt in range(2):
            method, _props, body = ch.basic_get(queue, auto_ack=False)
            assert method is not None and body == seq_body(0)
            assert method.redelivered == (attempt > 0)
            ch.basic_nack(method.delivery_tag, requeue=True)
        barrier(conn)
        node.kill()
    finally:
        with contextlib.suppress(Exception):
            conn.close()

    node.start()
    with blocking(node) as ch:
        got = drain_queue(ch, queue, ch.queue_declare(queue, durable=True, passive=True).method.message_count)
    assert [g.body for g in got] == [seq_body(i) for i in range(3)]
    assert all(g.redelivered for g in got)



# -- users and vhosts ------------------------------------------------------------------------


def _login(node: NodeProcess, user: str, password: str, vhost: str) -> pika.BlockingConnection:
    params = pika.ConnectionParameters("127.0.0.1", node.amqp_port, vhost, pika.PlainCredentials(user, password),
                                       connection_attempts=1)  # fmt: skip
    return pika.BlockingConnection(params)


def test_users_and_vhosts_survive_restarts(node: NodeProcess, store_args: list[str],
                                           capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """``leveret users|vhosts`` write through the store; a node loads them at every start."""
    from leveret.cli.main import main as cli

    flags = [*store_args, "--data-dir", str(node.data_dir)]
    assert cli(["vhosts", "add", "app", *flags]) == 0
    assert cli(["users", "add", "alice", "--password", "s3cret", "--vhost", "app", "--tag", "monitoring",
                *flags]) == 0  # fmt: skip
    assert cli(["users", "list", *flags]) == 0
    assert "alice\ttags=monitoring\tvhosts=app" in capsys.readouterr().out

    for _ in range(2):  # the first start loads them, and a restart still has them
        node.start()
        conn = _login(node, "alice", "s3cret", "app")
        conn.channel().queue_declare("in-app", durable=True)
        conn.close()
        with pytest.raises(pika.exceptions.ProbableAuthenticationError):
            _login(node, "alice", "wrong", "app")
        with pytest.raises(pika.exceptions.ProbableAccessDeniedError):
            _login(node, "alice", "s3cret", "/")  # no permission there
        assert node.terminate() == 0

    assert cli(["users", "delete", "alice", *flags]) == 0
    assert cli(["users", "delete", "alice", *flags]) == 1  # gone already: says so
    assert cli(["vhosts", "delete", "app", *flags]) == 0
    capsys.readouterr()
    assert cli(["vhosts", "list", "--json", *flags]) == 0
    assert "app" not in json.loads(capsys.readouterr().out)
    node.start()
    with pytest.raises(pika.exceptions.ProbableAuthenticationError):
        _login(node, "alice", "s3cret", "app")
    with pytest.raises(pika.exceptions.ProbableAccessDeniedError):
        _login(node, "guest", "guest", "app")  # the vhost is gone, with its durable queue
    _login(node, "guest", "guest", "/").close()  # the default user still works
