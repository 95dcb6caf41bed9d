"""Cluster semantics a RabbitMQ user relies on across nodes, with pika against three node processes.

The failover and fencing scenarios are in test_cluster.py; this file covers
what must behave as on a single node when the client's node is not the
queue's owner: direct reply-to, auto-delete, x-expires, basic.get order,
exclusive queues, stream consumers and consumer groups.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pika
import pytest
from pika.adapters.blocking_connection import BlockingChannel

from harness.cluster import Cluster
from harness.node import REPO_ROOT, _python, node_env

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(3) as c:
        yield c


@pytest.fixture
def make_three() -> Iterator[Cluster]:
    """A cluster of its own, for a test that kills a node the others still need."""
    with Cluster(3) as c:
        yield c


def _channel(cluster: Cluster, node: str) -> tuple[pika.BlockingConnection, BlockingChannel]:
    conn = pika.BlockingConnection(pika.URLParameters(cluster.url(node)))
    return conn, conn.channel()


def test_direct_reply_to_across_nodes(cluster: Cluster) -> None:
    req_conn, req = _channel(cluster, "n1")
    srv_conn, srv = _channel(cluster, "n2")
    try:
        srv.queue_declare("rpc.requests", durable=True)
        replies: list[bytes] = []
        req.basic_consume("amq.rabbitmq.reply-to", lambda ch, m, p, body: replies.append(body), auto_ack=True)
        req.basic_publish("", "rpc.requests", b"ping", pika.BasicProperties(reply_to="amq.rabbitmq.reply-to"))
        deadline = time.monotonic() + 10
        request = None
        while request is None and time.monotonic() < deadline:
            request = srv.basic_get("rpc.requests", auto_ack=True)
            if request[0] is None:
                request = None
                time.sleep(0.05)
        assert request is not None, "the request never reached the server's node"
        _, props, body = request
        assert body == b"ping" and props.reply_to.startswith("amq.rabbitmq.reply-to.")
        srv.basic_publish("", props.reply_to, b"pong")
        while not replies and time.monotonic() < deadline:
            req_conn.process_data_events(time_limit=0.1)
        assert replies == [b"pong"]
    finally:
        req_conn.close()
        srv_conn.close()


def test_publish_then_get_through_a_non_owner_sees_the_message(cluster: Cluster) -> None:
    conn, ch = _channel(cluster, "n1")
    try:
        ch.queue_declare("sem.order", durable=True)
        owner = cluster.wait_owner("sem.order", timeout=10)
        other = next(n for n in ("n1", "n2", "n3") if n != owner)
        oconn, och = _channel(cluster, other)
        try:
            for i in range(20):
                och.basic_publish("", "sem.order", f"m{i}".encode())
                got = och.basic_get("sem.order", auto_ack=True)
                assert got[2] == f"m{i}".encode(), f"publish {i} through {other} not seen by the next basic.get"
            assert och.queue_declare("sem.order", passive=True).method.message_count == 0
        finally:
            oconn.close()
    finally:
        conn.close()


def test_tx_commit_through_a_non_owner_waits_for_the_owner(cluster: Cluster) -> None:
    conn, ch = _channel(cluster, "n1")
    try:
        ch.queue_declare("sem.tx", durable=True)
        owner = cluster.wait_owner("sem.tx", timeout=10)
        other = next(n for n in ("n1", "n2", "n3") if n != owner)
        oconn, och = _channel(cluster, other)
        wconn, wch = _channel(cluster, str(owner))
        try:
            och.tx_select()
            for i in range(5):
                och.basic_publish("", "sem.tx", f"t{i}".encode(), pika.BasicProperties(delivery_mode=2))
            assert wch.queue_declare("sem.tx", passive=True).method.message_count == 0  # not before commit
            och.tx_commit()
            # commit-ok came after the owner took them: they are there on the owner right away.
            assert wch.queue_declare("sem.tx", passive=True).method.message_count == 5
            stored = cluster.sql("SELECT count(*) FROM messages WHERE queue = 'sem.tx'")
            assert stored == [(5,)]
        finally:
            oconn.close()
            wconn.close()
    finally:
        conn.close()


def test_auto_delete_queue_stays_while_the_owner_has_consumers(cluster: Cluster) -> None:
    conn1, ch1 = _channel(cluster, "n1")
    conn2, ch2 = _channel(cluster, "n2")
    try:
        # A non-durable queue lives on the node that declared it (n1).
        ch1.queue_declare("sem.autodel", auto_delete=True)
        ch1.basic_consume("sem.autodel", lambda *a: None, auto_ack=True)
        tag = ch2.basic_consume("sem.autodel", lambda *a: None, auto_ack=True)
        ch2.basic_cancel(tag)  # n2's last local consumer leaves: n1 still has one
        time.sleep(1.0)
        assert ch2.queue_declare("sem.autodel", passive=True).method.consumer_count == 1
        ch1.close()  # the last consumer anywhere: the queue goes, on every node
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                ch2.queue_declare("sem.autodel", passive=True)
            except pika.exceptions.ChannelClosedByBroker as exc:
                assert exc.reply_code == 404
                break
            time.sleep(0.2)
        else:
            raise AssertionError("auto-delete queue still there after its last consumer left")
    finally:
        conn1.close()
        conn2.close()


def test_auto_delete_exchange_goes_cluster_wide_with_its_last_binding(cluster: Cluster) -> None:
    conn1, ch1 = _channel(cluster, "n1")
    conn2, ch2 = _channel(cluster, "n2")
    try:
        ch1.exchange_declare("sem.autox", "direct", durable=True, auto_delete=True)
        ch1.queue_declare("sem.autox.q", durable=True)
        ch1.queue_bind("sem.autox.q", "sem.autox", "k")
        assert [kv.key for kv in cluster.etcd_keys("meta/exchanges/%2F/sem.autox")]
        ch2.queue_unbind("sem.autox.q", "sem.autox", "k")  # the last binding, through another node
        deadline = time.monotonic() + 10
        while cluster.etcd_keys("meta/exchanges/%2F/sem.autox") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not cluster.etcd_keys("meta/exchanges/%2F/sem.autox"), "auto-delete exchange still in etcd"
        for ch in (ch1, ch2):
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as info:
                ch.exchange_declare("sem.autox", "direct", passive=True)
            assert info.value.reply_code == 404
        ch3 = conn1.channel()
        ch3.queue_delete("sem.autox.q")
    finally:
        for c in (conn1, conn2):
            if c.is_open:
                c.close()


def test_exclusive_queue_is_locked_to_its_connection_on_every_node(cluster: Cluster) -> None:
    conn1, ch1 = _channel(cluster, "n1")
    conn2, ch2 = _channel(cluster, "n2")
    try:
        name = ch1.queue_declare("", exclusive=True).method.queue
        ch2.basic_publish("", name, b"to an exclusive queue of another node")
        deadline = time.monotonic() + 5
        got = None
        while got is None and time.monotonic() < deadline:
            m = ch1.basic_get(name, auto_ack=True)
            got = m[2]
            time.sleep(0.02)
        assert got == b"to an exclusive queue of another node"
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as info:
            ch2.basic_consume(name, lambda *a: None)
        assert info.value.reply_code == 405
        conn1.close()  # the owning connection goes: the queue goes cluster-wide
        _, ch3 = _channel(cluster, "n3")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                ch3.queue_declare(name, passive=True)
            except pika.exceptions.ChannelClosedByBroker as exc:
                assert exc.reply_code == 404
                break
            time.sleep(0.2)
        else:
            raise AssertionError("exclusive queue outlived its connection")
    finally:
        if conn1.is_open:
            conn1.close()
        conn2.close()


def _pump(conn: pika.BlockingConnection, done: Any, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)


def test_stream_read_through_a_non_owner_keeps_offsets_and_credit(cluster: Cluster) -> None:
    conn, ch = _channel(cluster, "n1")
    try:
        ch.queue_declare("sem.stream", durable=True, arguments={"x-queue-type": "stream"})
        owner = cluster.wait_owner("sem.stream", timeout=10)
        assert owner is not None
        other = next(n for n in ("n1", "n2", "n3") if n != owner)
        oconn, och = _channel(cluster, other)
        try:
            och.confirm_delivery()
            for i in range(30):
                och.basic_publish("", "sem.stream", f"s{i}".encode())
            och.basic_qos(prefetch_count=10)
            got: list[tuple[int, bytes, int]] = []

            def hold(chan: BlockingChannel, method: Any, props: Any, body: bytes) -> None:
                got.append((int(props.headers["x-stream-offset"]), body, method.delivery_tag))

            tag = och.basic_consume("sem.stream", hold, arguments={"x-stream-offset": "first"})
            _pump(oconn, lambda: len(got) >= 10, 10)
            _pump(oconn, lambda: False, 0.5)  # no more than the prefetch while nothing is acked
            assert [(o, b) for o, b, _ in got] == [(i, f"s{i}".encode()) for i in range(10)]
            for upto in (20, 30):  # each ack of the window lets the next ten through
                och.basic_ack(got[-1][2], multiple=True)
                _pump(oconn, lambda n=upto: len(got) >= n, 10)
                _pump(oconn, lambda: False, 0.2)
                assert [(o, b) for o, b, _ in got] == [(i, f"s{i}".encode()) for i in range(upto)]
            och.basic_ack(got[-1][2], multiple=True)
            och.basic_cancel(tag)

            # A numeric offset, read through the non-owner too.
            tail: list[int] = []

            def ack(chan: BlockingChannel, method: Any, props: Any, body: bytes) -> None:
                tail.append(int(props.headers["x-stream-offset"]))
                chan.basic_ack(method.delivery_tag)

            och.basic_consume("sem.stream", ack, arguments={"x-stream-offset": 25})
            _pump(oconn, lambda: len(tail) >= 5, 10)
            assert tail == [25, 26, 27, 28, 29]
            # The owner serves the same log to its own consumers.
            wconn, wch = _channel(cluster, owner)
            try:
                wch.basic_qos(prefetch_count=10)
                mine: list[bytes] = []
                wch.basic_consume("sem.stream", lambda c, m, p, b: (mine.append(b), c.basic_ack(m.delivery_tag)),
                                  arguments={"x-stream-offset": "first"})
                _pump(wconn, lambda: len(mine) >= 30, 10)
                assert mine == [f"s{i}".encode() for i in range(30)]
            finally:
                wconn.close()
            # Bad consumer arguments are refused by the non-owner itself, as on the owner.
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as info:
                och.basic_consume("sem.stream", lambda *a: None, arguments={"x-stream-offset": "sideways"})
            assert info.value.reply_code == 406, info.value
        finally:
            if oconn.is_open:
                oconn.close()
    finally:
        conn.close()


def test_stream_group_read_through_non_owners_resumes_on_any_node(cluster: Cluster) -> None:
    conn, ch = _channel(cluster, "n1")
    try:
        ch.queue_declare("sem.gstream", durable=True, arguments={"x-queue-type": "stream"})
        owner = cluster.wait_owner("sem.gstream", timeout=10)
        assert owner is not None
        ch.confirm_delivery()
        for i in range(40):
            ch.basic_publish("", "sem.gstream", f"m{i}".encode())
    finally:
        conn.close()
    first, second = (n for n in ("n1", "n2", "n3") if n != owner)
    group = {"x-stream-offset": "first", "x-stream-consumer-group": "sem-g"}
    aconn, ach = _channel(cluster, first)
    seen: list[int] = []

    def first_fifteen(chan: BlockingChannel, method: Any, props: Any, body: bytes) -> None:
        if len(seen) < 15:
            seen.append(int(props.headers["x-stream-offset"]))
            chan.basic_ack(method.delivery_tag)

    ach.basic_qos(prefetch_count=5)
    ach.basic_consume("sem.gstream", first_fifteen, arguments=group)
    _pump(aconn, lambda: len(seen) >= 15, 10)
    assert seen == list(range(15))
    committed = "SELECT \"offset\" FROM stream_offsets WHERE queue = 'sem.gstream' AND grp = 'sem-g'"
    _pump(aconn, lambda: cluster.sql(committed) == [(14,)], 5)
    assert cluster.sql(committed) == [(14,)]
    aconn.close()  # the unacked deliveries (15..19) were never acked: the group resumes at 15

    bconn, bch = _channel(cluster, second)
    try:
        bch.basic_qos(prefetch_count=50)
        resumed: list[tuple[int, bytes]] = []

        def on_message(chan: BlockingChannel, method: Any, props: Any, body: bytes) -> None:
            resumed.append((int(props.headers["x-stream-offset"]), body))
            chan.basic_ack(method.delivery_tag)

        bch.basic_consume("sem.gstream", on_message, arguments=group)
        _pump(bconn, lambda: len(resumed) >= 25, 10)
        assert resumed == [(i, f"m{i}".encode()) for i in range(15, 40)]
    finally:
        bconn.close()


def test_stream_consumer_group_resumes_on_the_new_owner_after_a_failover(make_three: Any) -> None:
    cluster = make_three
    conn, ch = _channel(cluster, "n1")
    ch.queue_declare("gs", durable=True, arguments={"x-queue-type": "stream"})
    conn.close()
    owner = cluster.wait_owner("gs", timeout=10)
    assert owner is not None
    oconn, och = _channel(cluster, owner)
    och.confirm_delivery()
    for i in range(20):
        och.basic_publish("", "gs", f"g{i}".encode(), pika.BasicProperties(delivery_mode=2))
    och.basic_qos(prefetch_count=5)
    seen: list[int] = []

    def first_ten(chan: BlockingChannel, method: Any, props: Any, body: bytes) -> None:
        if len(seen) < 10:
            seen.append(int(props.headers["x-stream-offset"]))
            chan.basic_ack(method.delivery_tag)

    och.basic_consume("gs", first_ten, arguments={"x-stream-offset": "first", "x-stream-consumer-group": "g"})
    deadline = time.monotonic() + 10
    while len(seen) < 10 and time.monotonic() < deadline:
        oconn.process_data_events(time_limit=0.1)
    assert seen == list(range(10))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # the group's committed offset reaches the store
        oconn.process_data_events(time_limit=0.1)
        if cluster.sql("SELECT \"offset\" FROM stream_offsets WHERE queue = 'gs' AND grp = 'g'") == [(9,)]:
            break
    else:
        raise AssertionError(f"group offset in the store: {cluster.sql('SELECT * FROM stream_offsets')}")
    oconn.close()
    # A reader on each other node, through the owner: the owner's death cancels them (basic.cancel).
    watchers = []
    cancelled: list[str] = []
    for node in (n for n in ("n1", "n2", "n3") if n != owner):
        wconn, wch = _channel(cluster, node)
        wch.basic_qos(prefetch_count=5)
        wch.add_on_cancel_callback(lambda frame, node=node: cancelled.append(node))
        wch.basic_consume("gs", lambda c, m, p, b: c.basic_ack(m.delivery_tag), arguments={"x-stream-offset": "last"})
        watchers.append(wconn)
    cluster.kill(owner)
    deadline = time.monotonic() + 15
    while len(cancelled) < 2 and time.monotonic() < deadline:
        for wconn in watchers:
            wconn.process_data_events(time_limit=0.05)
    for wconn in watchers:
        wconn.close()
    assert sorted(cancelled) == sorted(n for n in ("n1", "n2", "n3") if n != owner), cancelled
    new = cluster.wait_owner("gs", lambda o: o not in (None, owner), timeout=15)
    assert new is not None and new != owner
    # Resume through the survivor that is not the new owner: it reads through the new owner.
    third = next(n for n in ("n1", "n2", "n3") if n not in (owner, new))
    nconn, nch = _channel(cluster, third)
    try:
        nch.basic_qos(prefetch_count=50)
        resumed: list[tuple[int, bytes]] = []

        def on_message(chan: BlockingChannel, method: Any, props: Any, body: bytes) -> None:
            resumed.append((int(props.headers["x-stream-offset"]), body))
            chan.basic_ack(method.delivery_tag)

        nch.basic_consume("gs", on_message, arguments={"x-stream-offset": "first", "x-stream-consumer-group": "g"})
        deadline = time.monotonic() + 10
        while len(resumed) < 10 and time.monotonic() < deadline:
            nconn.process_data_events(time_limit=0.1)
        assert resumed == [(i, f"g{i}".encode()) for i in range(10, 20)]
    finally:
        nconn.close()


def test_grpc_streams_through_any_node(cluster: Cluster) -> None:
    """The geo seed's shape on a cluster: a partitioned stream written through a node that does not own it,
    read as one subscription through another, a group committed through one node and resumed on another."""
    from leveret.streams_client import FIRST, StreamsClient

    topic = "sem.geo"
    clients = {n: StreamsClient(f"127.0.0.1:{cluster[n].grpc_port}") for n in ("n1", "n2", "n3")}
    try:
        clients["n1"].create_stream(topic, partitions=3)
        owners = {p: cluster.wait_owner(f"{topic}-{p}", timeout=10) for p in range(3)}
        assert None not in owners.values(), owners
        # Placement (fewest queues) may put every partition on one node; the nodes that do not own
        # partition 0 publish and read, so at least that partition goes through forwarding and a proxy.
        writer, reader = (n for n in ("n1", "n2", "n3") if n != owners[0])
        sent: dict[str, tuple[bytes, str]] = {}
        for i in range(60):
            id_, stream, _ = clients[writer].publish(topic, f"e{i}".encode(), key=f"k{i % 12}")
            sent[id_] = (f"e{i}".encode(), stream)
        with clients[reader].subscribe({topic: FIRST}) as sub:
            got = sub.take(60, timeout=10)
        assert {m.id: (m.body, m.stream) for m in got} == sent
        per_stream: dict[str, list[int]] = {}
        for m in got:
            per_stream.setdefault(m.stream, []).append(m.offset)
        assert all(offsets == list(range(len(offsets))) for offsets in per_stream.values()), per_stream

        # A group: read and commit through one non-owner, resume through the other; the store holds the commits.
        with clients[writer].subscribe({topic: FIRST}, group="geo-g") as sub:
            first = sub.take(60, timeout=10)
            last: dict[str, int] = {}
            for m in first:
                last[m.stream] = m.offset
            for stream, offset in last.items():
                clients[writer].commit("geo-g", stream, offset - 2)  # all but the last two of each partition
        rows = cluster.sql(
            f"SELECT queue, \"offset\" FROM stream_offsets WHERE grp = 'geo-g' AND queue LIKE '{topic}-%%'"
        )
        assert dict(rows) == {s: o - 2 for s, o in last.items()}, rows
        # Any node reports the owners' figures (offsets, sizes, commits), not its own empty copies.
        info = clients[reader].get_stream(topic)
        assert {p.stream: (p.first_offset, p.next_offset, p.messages, dict(p.committed)) for p in info.partitions} == {
            s: (0, per_stream[s][-1] + 1, len(per_stream[s]), {"geo-g": last[s] - 2}) for s in per_stream
        }
        assert all(p.bytes > 0 for p in info.partitions)
        with clients[reader].subscribe({topic: FIRST}, group="geo-g") as sub:
            again = sub.take(3 * 2, timeout=10)
        assert sorted((m.stream, m.offset) for m in again) == sorted(
            (s, o) for s, end in last.items() for o in (end - 1, end)
        )
    finally:
        for c in clients.values():
            c.close()


def test_users_changed_through_the_cli_apply_on_every_running_node(cluster: Cluster) -> None:
    def leveret(*args: str) -> None:
        done = subprocess.run(
            [_python(), "-m", "leveret", *args, "--store", "postgres", "--postgres-dsn", cluster.dsn,
             "--etcd", cluster.etcd.url, "--cluster", cluster.name],
            cwd=REPO_ROOT, env=node_env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr

    def login(node: str, password: str) -> int:
        params = pika.ConnectionParameters("127.0.0.1", cluster[node].amqp_port, "/",
                                           pika.PlainCredentials("sem-alice", password))
        try:
            pika.BlockingConnection(params).close()
            return 200
        except pika.exceptions.ProbableAuthenticationError:
            return 403

    def eventually(node: str, password: str, code: int) -> None:
        deadline = time.monotonic() + 10
        while login(node, password) != code:
            assert time.monotonic() < deadline, f"{node}: login with {password!r} never gave {code}"
            time.sleep(0.2)

    leveret("users", "add", "sem-alice", "--password", "one", "--vhost", "/")
    for node in ("n1", "n2", "n3"):
        eventually(node, "one", 200)
    leveret("users", "add", "sem-alice", "--password", "two", "--vhost", "/")  # a new password, live
    for node in ("n1", "n2", "n3"):
        eventually(node, "two", 200)
        assert login(node, "one") == 403
    leveret("users", "delete", "sem-alice")
    for node in ("n1", "n2", "n3"):
        eventually(node, "two", 403)


def test_native_api_default_channel_on_any_node_extra_channels_on_the_owner(cluster: Cluster) -> None:
    """The native gRPC API on a cluster: push and subscribe to a queue's default channel through any node
    (the ids are the ones the push returned); an extra (topic) channel is refused on a non-owner with a
    text naming the owner, and works on the owner."""
    from leveret.client import Client, LeveretError

    clients = {n: Client(f"127.0.0.1:{cluster[n].grpc_port}") for n in ("n1", "n2", "n3")}
    try:
        clients["n1"].create_queue("sem.native", durable=True)
        owner = cluster.wait_owner("sem.native", timeout=10)
        assert owner is not None
        pusher, reader = (n for n in ("n1", "n2", "n3") if n != owner)
        ids = [clients[pusher].push("sem.native", f"p{i}".encode(), topic="t.a") for i in range(5)]
        with clients[reader].subscribe("sem.native/") as sub:
            got = [sub.get(5.0) for _ in range(5)]
            assert all(m is not None for m in got)
            assert [m.id for m in got] == ids and [m.content for m in got] == [f"p{i}".encode() for i in range(5)]
            clients[reader].ack(got)
        with pytest.raises(LeveretError) as info:
            clients[reader].create_channel("sem.native", topic="t.*", kind="pattern")
        assert "FAILED_PRECONDITION" in str(info.value) and owner in str(info.value), info.value
        channel = clients[owner].create_channel("sem.native", topic="t.*", kind="pattern")
        with clients[owner].subscribe(channel) as sub:
            clients[pusher].push("sem.native", b"filtered", topic="t.b")
            m = sub.get(5.0)
            assert m is not None and m.content == b"filtered"
            clients[owner].ack(m)
    finally:
        for c in clients.values():
            c.close()


def test_status_events_report_a_lost_node_and_its_moved_queues(cluster: Cluster) -> None:
    """Runs last in this module: it kills a node."""
    from leveret.client import Client

    conn, ch = _channel(cluster, "n1")
    try:
        for i in range(3):
            ch.queue_declare(f"sem.moving.{i}", durable=True)
        victim = next(n for n in ("n2", "n3") if any(
            cluster.owner(f"sem.moving.{i}") == n for i in range(3)))
        ours = {f"sem.moving.{i}" for i in range(3) if cluster.owner(f"sem.moving.{i}") == victim}
        client = Client(f"127.0.0.1:{cluster['n1'].grpc_port}")
        try:
            events = client.status_subscriber()
            first = events.get(timeout=10)
            assert first is not None and first.kind == "NODE_UP" and first.node == "n1"
            cluster.kill(victim)
            seen: list[tuple[str, str, str]] = []
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and not (
                ("NODE_LOST", victim, "") in seen and ours <= {q for k, _, q in seen if k == "QUEUE_MOVED"}
            ):
                ev = events.get(timeout=1)
                if ev is not None:
                    seen.append((ev.kind, ev.node, ev.queue))
            assert ("NODE_LOST", victim, "") in seen, seen
            moved = {q: node for kind, node, q in seen if kind == "QUEUE_MOVED"}
            # Every queue the victim owned moved, to a live node (others may have moved too).
            assert ours and all(moved.get(q) not in (None, victim) for q in ours), seen
        finally:
            client.close()
    finally:
        conn.close()


def test_sigterm_hands_the_queues_over_before_exit(cluster: Cluster) -> None:
    """After the status test killed a node: SIGTERM the other non-n1 node, which owns a queue with messages."""
    leaving = next(n for n in cluster.others("n1"))
    conn, ch = _channel(cluster, "n1")
    try:
        name = ""
        for i in range(10):  # placement: the next queues go to the node with the fewest
            ch.queue_declare(f"sem.leaving.{i}", durable=True)
            if cluster.wait_owner(f"sem.leaving.{i}", timeout=10) == leaving:
                name = f"sem.leaving.{i}"
                break
        assert name, f"no queue placed on {leaving}"
        ch.confirm_delivery()
        for i in range(20):
            ch.basic_publish("", name, f"h{i}".encode(), pika.BasicProperties(delivery_mode=2))
        assert cluster.terminate(leaving) == 0
        assert cluster.owner(name) == "n1"
        got = []
        while True:
            m = ch.basic_get(name, auto_ack=True)
            if m[0] is None:
                break
            got.append(m[2])
        assert got == [f"h{i}".encode() for i in range(20)]
        assert not [q for q in cluster.status()["queues"] if q["owner"] == leaving]
    finally:
        conn.close()

