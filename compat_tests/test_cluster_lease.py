"""A queue's owner woken past its lease serves nothing (issue #13, item 4): three nodes, etcd, Postgres.

The owner of a durable queue is stopped (SIGSTOP) while a consumer connected
to it holds unacknowledged messages; the consumer acks them while the owner
is stopped (the acks wait in the owner's socket, the first input it reads on
waking). Another node takes the queue over and a consumer there receives
every confirmed message, redelivered where the old owner had delivered it.
Then SIGCONT: the old owner must give the queue up before it processes those
acks, so its consumer receives nothing more from it (before the fix it was
handed the next messages of its stale ready list, not flagged redelivered),
the late acks remove nothing from the store, and the new owner still holds
every message.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import pika
import pika.exceptions
import pytest
from pamqp import body as pbody
from pamqp import commands, frame, header
from pika.adapters.blocking_connection import BlockingChannel

from compat_tests.raw_amqp import RawAMQP
from harness.cluster import Cluster
from harness.etcd import EtcdServer
from harness.etcd import etcd_server_fixture as etcd_server_fixture  # the module-scoped `etcd_server`
from harness.pg import throwaway_postgres

pytestmark = pytest.mark.timeout(180)

LEASE_TTL = 2
MESSAGES = 60
HELD = 10  # the old owner's consumer's prefetch: what it holds unacked when the owner stops
PERSISTENT = pika.BasicProperties(delivery_mode=2)

Delivery = tuple[bytes, bool, int]  # body, redelivered, delivery tag


@pytest.fixture
def cluster(etcd_server: EtcdServer) -> Iterator[Cluster]:
    with throwaway_postgres() as dsn, Cluster(3, etcd=etcd_server, postgres_dsn=dsn, lease_ttl=LEASE_TTL) as c:
        yield c
        print(c.diagnostics())  # shown for a failed test only


def _consumer(cluster: Cluster, node: str, queue: str, prefetch: int,
              ) -> tuple[pika.BlockingConnection, BlockingChannel, list[Delivery]]:
    # No heartbeats: the client must not give up on a node it knows is stopped.
    params = pika.URLParameters(cluster.url(node) + "?heartbeat=0")
    conn = pika.BlockingConnection(params)
    ch = conn.channel()
    ch.basic_qos(prefetch_count=prefetch)
    got: list[Delivery] = []
    ch.basic_consume(queue, lambda _ch, m, _p, body: got.append((body, bool(m.redelivered), m.delivery_tag)))
    return conn, ch, got


class Busy:
    """Keep the old owner working when it is stopped, so the SIGSTOP finds it running, not waiting.

    A node stopped while it waits in epoll wakes up with EINTR and runs its
    timers (the lease watchdog) before it reads anything. One stopped while
    it runs callbacks finishes the loop's turn and reads the input that is
    ready (the consumer's buffered acks) before any timer: the case the lease
    check exists for. Two loads: unroutable publishes on the old owner's own
    AMQP port (handled as they are read), and transient publishes through
    another node to a second queue the old owner owns (forwarded: handled in
    the owner's gRPC tasks, between reads).
    """

    def __init__(self, cluster: Cluster, old: str, via: str, queue: str) -> None:
        self.stop = threading.Event()
        self.sent = 0
        self.raw = RawAMQP("127.0.0.1", cluster[old].amqp_port)
        self.raw.handshake()
        self.raw.open_channel(1)
        self.raw.sock.settimeout(None)
        body = b"b" * 64
        one = (frame.marshal(commands.Basic.Publish(exchange="amq.direct", routing_key="nowhere"), 1)
               + frame.marshal(header.ContentHeader(0, len(body), commands.Basic.Properties()), 1)
               + frame.marshal(pbody.ContentBody(body), 1))
        self.batch = one * 200
        self.forwarding = pika.BlockingConnection(pika.URLParameters(cluster.url(via) + "?heartbeat=0"))
        self.queue = queue
        self.threads = [threading.Thread(target=self._direct, daemon=True),
                        threading.Thread(target=self._forwarded, daemon=True)]
        for t in self.threads:
            t.start()

    def _direct(self) -> None:
        with contextlib.suppress(OSError):
            while not self.stop.is_set():
                self.raw.sock.sendall(self.batch)
                self.sent += 200

    def _forwarded(self) -> None:
        with contextlib.suppress(pika.exceptions.AMQPError, OSError):
            ch = self.forwarding.channel()
            while not self.stop.is_set():
                for _ in range(50):
                    ch.basic_publish("", self.queue, b"f" * 64)
                self.forwarding.process_data_events(time_limit=0)
                self.sent += 50

    def close(self) -> None:
        self.stop.set()
        with contextlib.suppress(OSError):
            self.raw.sock.shutdown(socket.SHUT_RDWR)
        for t in self.threads:
            t.join(10)
        self.raw.close_socket()
        with contextlib.suppress(pika.exceptions.AMQPError, OSError):
            self.forwarding.close()


def _pump(conn: pika.BlockingConnection, seconds: float, until: int | None = None,
          got: list[Delivery] | None = None) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.1)
        if until is not None and got is not None and len(got) >= until:
            return


def test_an_owner_woken_past_its_lease_delivers_nothing_and_late_acks_change_nothing(cluster: Cluster) -> None:
    queue = f"lease.{uuid.uuid4().hex[:8]}"
    with pika.BlockingConnection(pika.URLParameters(cluster.url("n1"))) as conn:
        conn.channel().queue_declare(queue, durable=True)
    old = cluster.wait_owner(queue)
    assert old is not None
    publisher_node = cluster.others(old)[0]
    # A second queue on the old owner (placement: fewest queues, so one of the next three),
    # kept short: it only gives the old owner forwarded work.
    busy_queue = ""
    with pika.BlockingConnection(pika.URLParameters(cluster.url("n1"))) as conn:
        for i in range(3):
            name = f"{queue}.busy{i}"
            conn.channel().queue_declare(name, durable=True, arguments={"x-max-length": 100})
            if cluster.wait_owner(name) == old:
                busy_queue = name
    assert busy_queue, "no second queue landed on the old owner"
    bodies = [f"m-{i:03d}".encode() for i in range(MESSAGES)]
    with pika.BlockingConnection(pika.URLParameters(cluster.url(publisher_node))) as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        for body in bodies:
            ch.basic_publish("", queue, body, PERSISTENT, mandatory=True)  # raises unless confirmed

    old_conn, old_ch, old_got = _consumer(cluster, old, queue, HELD)
    _pump(old_conn, 10, until=HELD, got=old_got)
    _pump(old_conn, 0.5)  # nothing beyond the prefetch
    assert [b for b, _r, _t in old_got] == bodies[:HELD], old_got
    held = list(old_got)
    old_epoch = cluster.epoch(queue)

    busy = Busy(cluster, old, publisher_node, busy_queue)
    time.sleep(0.5)
    assert busy.sent > 0
    cluster.pause(old)
    try:
        for _body, _r, tag in held:
            old_ch.basic_ack(tag)  # into the stopped owner's socket: the first thing it reads on waking
        new = cluster.wait_owner(queue, lambda o: o not in (None, old), 5 * LEASE_TTL + 10)
        assert new is not None
        new_conn, new_ch, new_got = _consumer(cluster, new, queue, 1000)
        _pump(new_conn, 20, until=MESSAGES, got=new_got)
        _pump(new_conn, 0.5)
        assert sorted(b for b, _r, _t in new_got) == bodies, (
            f"the new owner {new} delivered {len(new_got)} of {MESSAGES}\n{cluster.diagnostics()}")
        redelivered = {b for b, r, _t in new_got if r}
        assert {b for b, _r, _t in held} <= redelivered, "what the old owner had delivered came back not redelivered"
    finally:
        cluster.resume(old)

    # The old owner wakes, reads the acks, finds its lease gone, rejoins. Watch its consumer meanwhile.
    _pump(old_conn, 3 * LEASE_TTL + 2)
    busy.close()
    after = old_got[HELD:]
    not_flagged = [b for b, r, _t in after if not r]
    assert not after, (
        f"the old owner {old} delivered {len(after)} messages after waking ({len(not_flagged)} not flagged "
        f"redelivered): {[b.decode() for b, _r, _t in after][:20]}\n{cluster.diagnostics()}")
    assert old_conn.is_open and old_ch.is_open, "the old owner's consumer was closed"

    # The late acks changed nothing: every message is still stored, under the new owner's epoch,
    # and held unacked by the new owner's consumer; nothing went back to the old one.
    assert sorted(cluster.stored_bodies(queue)) == bodies, "a late ack to the old owner removed stored messages"
    new_epoch = cluster.epoch(queue)
    assert old_epoch is not None and new_epoch is not None and new_epoch > old_epoch
    assert cluster.stored_epoch(queue) == new_epoch
    assert cluster.owner(queue) == new
    assert cluster[old].running(), "the old owner exited after SIGCONT"
    assert len(new_got) == MESSAGES

    # Every confirmed message is delivered (and now acked) through the new owner.
    for _body, _r, tag in list(new_got):
        new_ch.basic_ack(tag)
    _pump(new_conn, 0.5)
    cluster.wait_for(lambda: cluster.stored_bodies(queue) == [], "the new owner's acks stored", 15)
    _pump(old_conn, 1.0)
    assert old_got[HELD:] == [], "the old node delivered after the queue was emptied"
    for conn in (old_conn, new_conn):
        conn.close()
