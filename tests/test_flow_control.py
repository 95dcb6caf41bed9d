"""Flow control and input fairness in the sans-IO connection (core/engine/flow.py, READ_BUDGET).

A queue with consumers and FLOW_HIGH ready messages holds the connection
that publishes into it: no more input is handled until the queue catches up
(FLOW_LOW, its consumers leave, it is purged or deleted), or until its
consumers turn out to be stalled. Nothing is dropped or reordered.
"""

from __future__ import annotations

from pamqp import commands

from amqp_frontend.connection import READ_BUDGET
from core.engine.broker import Broker
from core.engine.flow import CHECK_S, FLOW_HIGH, FLOW_LOW, MIN_DRAIN
from core.model.clock import ManualScheduler
from harness.brokers import local_broker
from tests.amqp_client import Client, assemble, connected, publish_bytes

BODY = b"x" * 32


def _many(n: int, queue: str = "q", start: int = 0) -> bytes:
    return b"".join(publish_bytes(1, b"%08d" % i + BODY, routing_key=queue) for i in range(start, start + n))


def _setup(broker: Broker, prefetch: int = 10) -> tuple[Client, Client]:
    """A publisher (confirm mode) and a consumer at ``prefetch`` that has not acked anything."""
    pub = connected(broker)
    sub = connected(broker)
    sub.declare_queue(1, "q")
    sub.expect(1, commands.Basic.Qos(prefetch_count=prefetch), commands.Basic.QosOk)
    sub.consume(1, "q", tag="c")
    pub.expect(1, commands.Confirm.Select(), commands.Confirm.SelectOk)
    return pub, sub


def _drain_input(client: Client) -> None:
    """What the I/O layer does: handle buffered input, READ_BUDGET units per turn."""
    for _ in range(1000):
        if not client.conn.input_pending:
            return
        client.conn.receive_data(b"")
    raise AssertionError("input never drained")


def test_queue_behind_its_consumer_holds_the_publisher_then_releases_it_in_order() -> None:
    broker = local_broker()
    pub, sub = _setup(broker)
    released: list[bool] = []
    pub.conn.on_input_ready = lambda: released.append(True)
    total = FLOW_HIGH + 2000
    q = broker.vhosts["/"].queues["q"]
    pub.send_raw(_many(total))
    _drain_input(pub)
    # The consumer took its prefetch (10); the queue held FLOW_HIGH ready, then the publisher stopped.
    assert pub.conn.in_flow and pub.conn.flow_state == "flow"
    assert len(q.default.ready) == FLOW_HIGH
    assert not pub.conn.wants_read
    pub.conn.receive_data(b"")  # a stray turn while held handles nothing
    assert len(q.default.ready) == FLOW_HIGH and pub.conn.flow_count == 1

    # The consumer acks its way down to FLOW_LOW: the publisher is released, once.
    deliveries, _ = assemble(sub.read())
    tag = len(deliveries)
    while len(q.default.ready) > FLOW_LOW:
        sub.send(1, commands.Basic.Ack(delivery_tag=tag, multiple=True))
        tag += len(assemble(sub.read())[0])
    assert released == [True] and not pub.conn.in_flow and pub.conn.flow_state == "running"
    pub.conn.receive_data(b"")
    _drain_input(pub)

    # Everything arrived, in order; the confirms cover every publish, in order.
    rest: list[bytes] = []
    while True:
        sub.send(1, commands.Basic.Ack(delivery_tag=tag, multiple=True))
        got = assemble(sub.read())[0]
        if not got:
            break
        tag += len(got)
        rest.extend(d.body for d in got)
    assert tag == total
    assert [int(b[:8]) for b in rest] == list(range(total - len(rest), total))
    acks = [v for _, v in pub.read() if isinstance(v, commands.Basic.Ack)]
    tags = [a.delivery_tag for a in acks]
    assert tags == sorted(tags) and tags[-1] == total


def test_queue_without_consumers_never_holds() -> None:
    broker = local_broker()
    pub = connected(broker)
    pub.declare_queue(1, "q")
    pub.send_raw(_many(2 * FLOW_HIGH))
    _drain_input(pub)
    assert not pub.conn.in_flow
    assert broker.vhosts["/"].queues["q"].message_count == 2 * FLOW_HIGH


def test_consumer_leaving_releases_the_publisher() -> None:
    broker = local_broker()
    pub, sub = _setup(broker)
    pub.send_raw(_many(FLOW_HIGH + 100))
    _drain_input(pub)
    assert pub.conn.in_flow
    sub.send(1, commands.Basic.Cancel(consumer_tag="c"))
    assert not pub.conn.in_flow


def test_stalled_consumer_releases_the_publisher_and_the_queue_takes_the_rest() -> None:
    scheduler = ManualScheduler()
    broker = local_broker(scheduler=scheduler)
    pub, _sub = _setup(broker)
    q = broker.vhosts["/"].queues["q"]
    total = FLOW_HIGH + 3 * MIN_DRAIN
    pub.send_raw(_many(total))
    _drain_input(pub)
    assert pub.conn.in_flow
    scheduler.advance(CHECK_S)  # the consumer never acked: it is stalled, not starved
    assert not pub.conn.in_flow and q.default.flow.stalled
    pub.conn.receive_data(b"")
    _drain_input(pub)
    assert not pub.conn.in_flow and len(q.default.ready) == total - 10


def test_draining_consumer_keeps_the_publisher_held() -> None:
    scheduler = ManualScheduler()
    broker = local_broker(scheduler=scheduler)
    pub, sub = _setup(broker, prefetch=MIN_DRAIN)
    pub.send_raw(_many(FLOW_HIGH + 3 * MIN_DRAIN))
    _drain_input(pub)
    assert pub.conn.in_flow
    tag = len(assemble(sub.read())[0])
    sub.send(1, commands.Basic.Ack(delivery_tag=tag, multiple=True))  # MIN_DRAIN more leave the queue
    scheduler.advance(CHECK_S)
    assert pub.conn.in_flow


def test_flow_seconds_and_heartbeats_while_held() -> None:
    broker = local_broker()
    pub = Client(broker, now=100.0)
    pub.handshake(heartbeat=10)
    pub.open_channel(1)
    sub = connected(broker)
    sub.declare_queue(1, "q")
    sub.expect(1, commands.Basic.Qos(prefetch_count=10), commands.Basic.QosOk)
    sub.consume(1, "q", tag="c")
    pub.send_raw(_many(FLOW_HIGH + 10))
    _drain_input(pub)
    assert pub.conn.in_flow
    pub.tick(160.0)  # 60 s without reading a byte from it: not a missed heartbeat, we stopped reading
    assert not pub.conn.should_close
    assert pub.conn.flow_seconds == 60.0
    sub.send(1, commands.Basic.Cancel(consumer_tag="c"))  # released at 160 (its clock's last reading)
    pub.tick(170.0)
    assert not pub.conn.in_flow and pub.conn.flow_seconds == 60.0


def test_one_read_is_handled_in_budget_sized_turns() -> None:
    broker = local_broker()
    pub = connected(broker)
    pub.declare_queue(1, "q")
    data = _many(4000)
    pub.send_raw(data)
    q = broker.vhosts["/"].queues["q"]
    first = q.message_count
    assert pub.conn.input_pending and not pub.conn.wants_read
    assert first == READ_BUDGET
    turns = 1
    while pub.conn.input_pending:
        pub.conn.receive_data(b"")
        turns += 1
    assert turns == -(-4000 // READ_BUDGET)
    assert q.message_count == 4000
    assert [int(qm.message.body[:8]) for qm in q.default.ready] == list(range(4000))


def test_forwarded_batch_waits_while_the_owners_queue_is_behind() -> None:
    """The owner's side of forwarding: slices of a batch wait for the queue to catch up, in order."""
    import asyncio

    from core.cluster.service import FORWARD_SLICE, _enqueue_fairly
    from core.engine import publish
    from core.model.message import Message
    from core.model.properties import EMPTY, scan

    broker = local_broker(scheduler=ManualScheduler())
    _pub, sub = _setup(broker)
    q = broker.vhosts["/"].queues["q"]
    summary = scan(EMPTY)
    messages = [Message("", "q", EMPTY, b"%08d" % i, summary, "n1") for i in range(FLOW_HIGH + 3 * FORWARD_SLICE)]

    async def run() -> None:
        task = asyncio.ensure_future(_enqueue_fairly(q, messages, publish.Outcome()))
        for _ in range(100):
            await asyncio.sleep(0)
        assert not task.done()
        assert FLOW_HIGH <= len(q.default.ready) < FLOW_HIGH + FORWARD_SLICE
        sub.send(1, commands.Basic.Cancel(consumer_tag="c"))  # caught up: no consumers left
        oks = await asyncio.wait_for(task, 5)
        assert oks == [True] * len(messages)

    asyncio.run(run())
    got = [int(qm.message.body) for qm in q.default.ready]
    assert got == list(range(10, len(messages)))
