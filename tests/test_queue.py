"""The core queue engine with a fake ConsumerSink: dispatch, credit, requeue, lifecycle."""

from __future__ import annotations

import pytest

from core.engine.queue import Consumer, Queue, QueueChannel
from core.engine.vhost import VirtualHost
from core.model import properties
from core.model.errors import AccessRefused
from core.model.message import Message, QueuedMessage


class FakeSink:
    """Records deliveries; ``credit`` per consumer tag (None: unlimited)."""

    def __init__(self, credit: dict[str, int | None] | None = None) -> None:
        self.credit: dict[str, int | None] = dict(credit or {})
        self.delivered: list[tuple[str, QueuedMessage]] = []
        self.redelivered: list[bool] = []  # the flag as it was at delivery time
        self.cancelled: list[str] = []

    def has_credit(self, consumer: Consumer) -> bool:
        left = self.credit.get(consumer.tag)
        return left is None or left > 0

    def deliver(self, consumer: Consumer, qm: QueuedMessage) -> None:
        left = self.credit.get(consumer.tag)
        if left is not None:
            self.credit[consumer.tag] = left - 1
        self.delivered.append((consumer.tag, qm))
        self.redelivered.append(qm.redelivered)

    def consumer_cancelled(self, consumer: Consumer) -> None:
        self.cancelled.append(consumer.tag)

    def bodies(self, tag: str | None = None) -> list[bytes]:
        return [qm.message.body for t, qm in self.delivered if tag is None or t == tag]


def message(body: bytes, routing_key: str = "rk") -> Message:
    return Message("", routing_key, properties.EMPTY, body)


def fill(q: Queue, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        q.enqueue(message(b"m%d" % i))


def consumer(q: Queue, sink: FakeSink, tag: str, no_ack: bool = False, exclusive: bool = False,
             channel: QueueChannel | None = None) -> Consumer:
    c = Consumer(tag, channel or q.default, sink, no_ack=no_ack, exclusive=exclusive)
    (channel or q.default).add_consumer(c)
    return c


def ready_bodies(ch: QueueChannel) -> list[bytes]:
    return [qm.message.body for qm in ch.ready]


@pytest.fixture
def q() -> Queue:
    return Queue("q", "/")


def test_offsets_are_sequential(q: Queue) -> None:
    fill(q, 3)
    assert [qm.offset for qm in q.default.ready] == [0, 1, 2]
    assert q.next_offset == 3
    assert q.message_count == 3
    assert q.default.ready_bytes == 6


def test_round_robin_across_consumers(q: Queue) -> None:
    sink = FakeSink()
    for tag in ("a", "b", "c"):
        consumer(q, sink, tag, no_ack=True)
    fill(q, 7)
    assert [t for t, _ in sink.delivered] == ["a", "b", "c", "a", "b", "c", "a"]
    assert sink.bodies() == [b"m%d" % i for i in range(7)]
    assert q.message_count == 0


def test_round_robin_skips_consumers_without_credit(q: Queue) -> None:
    sink = FakeSink({"a": 1, "b": None, "c": 0})
    for tag in ("a", "b", "c"):
        consumer(q, sink, tag)
    fill(q, 4)
    assert [t for t, _ in sink.delivered] == ["a", "b", "b", "b"]


def test_push_many_is_push_of_each_in_order(q: Queue) -> None:
    sink = FakeSink({"a": 2, "b": 1})
    for tag in ("a", "b"):
        consumer(q, sink, tag)
    q.default.push_many([QueuedMessage(message(b"m%d" % i), i) for i in range(5)])
    assert [t for t, _ in sink.delivered] == ["a", "b", "a"]
    assert sink.bodies() == [b"m0", b"m1", b"m2"]
    assert ready_bodies(q.default) == [b"m3", b"m4"] and q.default.ready_bytes == 4
    q.default.push_many([QueuedMessage(message(b"m5"), 5)])  # behind those waiting
    sink.credit["b"] = 5
    q.default.dispatch()
    assert sink.bodies() == [b"m0", b"m1", b"m2", b"m3", b"m4", b"m5"]


def test_enqueue_many_is_enqueue_of_each() -> None:
    from core.engine.queue_args import parse_queue_args

    for arguments in ({}, {"x-message-ttl": 0}, {"x-message-ttl": 60000}, {"x-max-length": 2}):
        one, many = (Queue("q", "/", arguments=arguments, args=parse_queue_args(arguments, "q", "/"))
                     for _ in range(2))  # fmt: skip
        sinks = []
        for q in (one, many):
            sink = FakeSink({"c": 2})
            consumer(q, sink, "c")
            sinks.append(sink)
        messages = [message(b"m%d" % i) for i in range(5)]
        answers = [one.enqueue(m) for m in messages]
        assert many.enqueue_many(messages) == answers
        # With a TTL of 0 the first two still go out (deliver now or never), as with enqueue.
        assert sinks[0].bodies() == sinks[1].bodies()
        assert ready_bodies(one.default) == ready_bodies(many.default)
        assert [qm.offset for qm in many.default.ready] == [qm.offset for qm in one.default.ready]
        assert [qm.expires_at is None for qm in many.default.ready] == [
            qm.expires_at is None for qm in one.default.ready]  # fmt: skip
        assert many.next_offset == one.next_offset and many.default.ready_bytes == one.default.ready_bytes


def test_backlog_dispatched_when_consumer_arrives(q: Queue) -> None:
    fill(q, 3)
    sink = FakeSink()
    consumer(q, sink, "late", no_ack=True)
    assert sink.bodies() == [b"m0", b"m1", b"m2"]
    assert q.default.ready_bytes == 0


def test_credit_limits_and_resumes(q: Queue) -> None:
    sink = FakeSink({"c": 2})
    c = consumer(q, sink, "c")
    fill(q, 5)
    assert sink.bodies() == [b"m0", b"m1"]
    assert q.message_count == 3
    assert (c.unacked, q.default.unacked) == (2, 2)
    # Credit granted: nothing moves until the channel is dispatched.
    sink.credit["c"] = 2
    q.default.dispatch()
    assert sink.bodies() == [b"m0", b"m1", b"m2", b"m3"]
    # Settling updates the counts.
    for _, qm in sink.delivered:
        q.default.settle(qm, c)
    assert (c.unacked, q.default.unacked) == (0, 0)


def test_no_credit_keeps_messages_ready(q: Queue) -> None:
    sink = FakeSink({"c": 0})
    consumer(q, sink, "c")
    fill(q, 2)
    assert sink.delivered == []
    assert ready_bodies(q.default) == [b"m0", b"m1"]


def test_no_ack_consumer_not_counted_unacked(q: Queue) -> None:
    sink = FakeSink()
    c = consumer(q, sink, "c", no_ack=True)
    fill(q, 3)
    assert (c.unacked, q.default.unacked) == (0, 0)
    assert all(qm.delivery_count == 1 for _, qm in sink.delivered)


def test_requeue_keeps_offset_order(q: Queue) -> None:
    sink = FakeSink({"c": 5})
    c = consumer(q, sink, "c")
    fill(q, 5)
    delivered = [qm for _, qm in sink.delivered]
    sink.credit["c"] = 0
    # Requeue out of order: they come back sorted by offset, marked redelivered.
    q.default.requeue([(delivered[3], c), (delivered[0], c), (delivered[2], c)])
    assert ready_bodies(q.default) == [b"m0", b"m2", b"m3"]
    assert all(qm.redelivered for qm in q.default.ready)
    assert not delivered[1].redelivered
    assert (c.unacked, q.default.unacked) == (2, 2)
    assert q.default.ready_bytes == 6


def test_requeue_merges_into_non_empty_ready_list(q: Queue) -> None:
    sink = FakeSink({"c": 0})
    c = consumer(q, sink, "c")
    fill(q, 6)
    ch = q.default
    taken = {qm.message.body: qm for qm in (ch.get(no_ack=False) for _ in range(6)) if qm is not None}
    assert ready_bodies(ch) == []
    # m2 and m5 are ready again (requeued earlier), then m4, m0, m3 come back.
    ch.requeue([(taken[b"m2"], None), (taken[b"m5"], None)])
    assert ready_bodies(ch) == [b"m2", b"m5"]
    ch.requeue([(taken[b"m4"], None), (taken[b"m0"], None), (taken[b"m3"], None)])
    assert ready_bodies(ch) == [b"m0", b"m2", b"m3", b"m4", b"m5"]
    assert [qm.offset for qm in ch.ready] == [0, 2, 3, 4, 5]
    assert ch.unacked == 1  # m1 still out
    # Newer arrivals go after the requeued ones.
    fill(q, 1, start=6)
    assert ready_bodies(ch)[-1] == b"m6"
    del c


def test_requeue_all_before_ready(q: Queue) -> None:
    ch = q.default
    fill(q, 4)
    first = [ch.get(no_ack=False) for _ in range(2)]
    ch.requeue([(qm, None) for qm in reversed(first) if qm is not None])
    assert ready_bodies(ch) == [b"m0", b"m1", b"m2", b"m3"]


def test_requeue_redelivers_to_consumer(q: Queue) -> None:
    sink = FakeSink()
    c = consumer(q, sink, "c")
    fill(q, 2)
    first = [qm for _, qm in sink.delivered]
    q.default.requeue([(qm, c) for qm in first])
    assert sink.bodies() == [b"m0", b"m1", b"m0", b"m1"]
    assert sink.redelivered == [False, False, True, True]
    assert [qm.delivery_count for _, qm in sink.delivered[2:]] == [2, 2]


def test_get(q: Queue) -> None:
    ch = q.default
    assert ch.get(no_ack=False) is None
    fill(q, 2)
    qm = ch.get(no_ack=False)
    assert qm is not None and qm.message.body == b"m0"
    assert ch.unacked == 1
    qm2 = ch.get(no_ack=True)
    assert qm2 is not None and qm2.message.body == b"m1"
    assert ch.unacked == 1
    assert ch.ready_bytes == 0


def test_purge(q: Queue) -> None:
    sink = FakeSink({"c": 1})
    c = consumer(q, sink, "c")
    fill(q, 4)
    assert q.purge() == 3
    assert q.message_count == 0
    assert q.default.ready_bytes == 0
    # Unacked deliveries are not purged.
    assert q.default.unacked == 1
    q.default.requeue([(sink.delivered[0][1], c)])
    assert ready_bodies(q.default) == [b"m0"]  # no credit left: back in the ready list
    assert q.default.unacked == 0


def test_purge_empty_queue(q: Queue) -> None:
    assert q.purge() == 0


def test_exclusive_consumer(q: Queue) -> None:
    sink = FakeSink()
    consumer(q, sink, "only", exclusive=True)
    with pytest.raises(AccessRefused):
        consumer(q, sink, "second")
    q2 = Queue("q2", "/")
    consumer(q2, sink, "first")
    with pytest.raises(AccessRefused):
        consumer(q2, sink, "exclusive", exclusive=True)


def test_remove_consumer_keeps_round_robin_valid(q: Queue) -> None:
    sink = FakeSink()
    a = consumer(q, sink, "a", no_ack=True)
    b = consumer(q, sink, "b", no_ack=True)
    fill(q, 1)  # to a; next is b
    q.default.remove_consumer(b)
    fill(q, 2, start=1)
    assert [t for t, _ in sink.delivered] == ["a", "a", "a"]
    q.default.remove_consumer(a)
    q.default.remove_consumer(a)  # twice is harmless
    fill(q, 1, start=3)
    assert q.message_count == 1


def test_auto_delete_when_last_consumer_leaves() -> None:
    gone: list[Queue] = []
    q = Queue("ad", "/", auto_delete=True, on_unused=gone.append)
    sink = FakeSink()
    a = consumer(q, sink, "a")
    b = consumer(q, sink, "b")
    q.default.remove_consumer(a)
    assert gone == []
    q.default.remove_consumer(b)
    assert gone == [q]


def test_auto_delete_queue_never_consumed_stays() -> None:
    vh = VirtualHost("/")
    q = vh.declare_queue("ad", object(), auto_delete=True)
    fill(q, 2)
    assert "ad" in vh.queues


def test_auto_delete_through_vhost() -> None:
    vh = VirtualHost("/")
    q = vh.declare_queue("ad", object(), auto_delete=True)
    vh.bind("amq.fanout", q, "", None)
    sink = FakeSink()
    c = consumer(q, sink, "c")
    q.default.remove_consumer(c)
    assert "ad" not in vh.queues
    assert q.deleted
    assert vh.get_exchange("amq.fanout").bindings == {}


def test_non_auto_delete_queue_stays_without_consumers() -> None:
    gone: list[Queue] = []
    q = Queue("q", "/", on_unused=gone.append)
    sink = FakeSink()
    c = consumer(q, sink, "c")
    q.default.remove_consumer(c)
    assert gone == []


def test_delete_cancels_consumers() -> None:
    q = Queue("q", "/")
    s1, s2 = FakeSink({"a": 0}), FakeSink()
    a = consumer(q, s1, "a")
    consumer(q, s2, "b", no_ack=True)
    consumer(q, s2, "c", no_ack=True)
    s2.credit = {"b": 0, "c": 0}
    fill(q, 3)
    assert q.delete() == 3
    assert q.deleted
    assert s1.cancelled == ["a"] and sorted(s2.cancelled) == ["b", "c"]
    assert q.default.consumers == []
    assert q.message_count == 0
    # Unacked messages coming back to a deleted queue are dropped.
    qm = QueuedMessage(message(b"late"), 99)
    q.default.unacked += 1
    a.unacked += 1
    q.default.requeue([(qm, a)])
    assert q.message_count == 0
    assert q.default.unacked == 0


def test_vhost_delete_queue_notifies_observers() -> None:
    vh = VirtualHost("/")
    seen: list[str] = []
    vh.on_queue_deleted.append(lambda queue: seen.append(queue.name))
    vh.declare_queue("q", object())
    assert vh.delete_queue("q", None) == 0
    assert seen == ["q"]


def test_topic_filtered_channels_each_see_their_messages(q: Queue) -> None:
    orders = QueueChannel(q, "orders", topic_filter=lambda rk: rk.startswith("order."))
    q.channels.append(orders)
    sink = FakeSink()
    consumer(q, sink, "all", no_ack=True)
    consumer(q, sink, "orders", no_ack=True, channel=orders)
    q.enqueue(message(b"o1", "order.created"))
    q.enqueue(message(b"p1", "payment.done"))
    assert sink.bodies("all") == [b"o1", b"p1"]
    assert sink.bodies("orders") == [b"o1"]
    # Each channel has its own copy at the same offset.
    offsets = [qm.offset for t, qm in sink.delivered if qm.message.body == b"o1"]
    assert offsets == [0, 0]


def test_purge_with_several_channels(q: Queue) -> None:
    other = QueueChannel(q, "other")
    q.channels.append(other)
    fill(q, 3)
    assert q.purge() == 6
    assert other.ready_bytes == 0 and not other.ready


def test_dispatch_is_not_reentrant(q: Queue) -> None:
    class Echo(FakeSink):
        def deliver(self, consumer: Consumer, qm: QueuedMessage) -> None:
            super().deliver(consumer, qm)
            if len(self.delivered) < 3:
                q.enqueue(message(b"echo%d" % len(self.delivered)))

    sink = Echo()
    consumer(q, sink, "c", no_ack=True)
    fill(q, 1)
    assert sink.bodies() == [b"m0", b"echo1", b"echo2"]


def test_drop_offsets_removes_ready_and_never_redelivers_unacked(q: Queue) -> None:
    fill(q, 6)
    sink = FakeSink({"c": 2})
    c = consumer(q, sink, "c")
    assert sink.bodies() == [b"m0", b"m1"]  # offsets 0 and 1 are out, unacked
    assert q.drop_offsets([1, 2, 4]) == 2  # 2 and 4 were ready
    assert ready_bodies(q.default) == [b"m3", b"m5"]
    assert q.default.ready_bytes == 4
    # Offset 1 comes back (nack/requeue, channel closed): dropped, not requeued.
    q.default.requeue([(qm, c) for _, qm in sink.delivered])
    assert ready_bodies(q.default) == [b"m0", b"m3", b"m5"]
    assert q.retained == set()
    sink.credit["c"] = None
    q.default.dispatch()
    assert sink.bodies()[2:] == [b"m0", b"m3", b"m5"]


def test_drop_offsets_on_a_priority_queue() -> None:
    q = Queue("p", "/", arguments={"x-max-priority": 5})
    fill(q, 4)
    assert q.drop_offsets({0, 3, 99}) == 2
    assert ready_bodies(q.default) == [b"m1", b"m2"]
    assert len(q.default.ready) == 2
    assert q.retained == {99}
