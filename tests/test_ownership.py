"""Queue ownership as a state machine, the lease deadline, and the engine's check of it (no etcd).

core/engine/ownership.py: every move of the table is allowed and every other
one raises; the lease counts from when a refresh was asked, an answer that
comes after the deadline does not revive it, and its loss is reported once.
core/engine/queue.py: an owned queue checks the lease before it enqueues,
delivers, settles or gets, so a node that wakes past the deadline gives the
queue up before the input that woke it is processed (issue #13, item 4).
The coordinator end to end (SIGSTOP of a real node) is in
compat_tests/test_cluster_lease.py.
"""

from __future__ import annotations

import itertools

import pytest

from core.cluster.link import Peers
from core.cluster.remote import QueueRemote
from core.engine.ownership import (
    TRANSITIONS,
    IllegalTransition,
    Lease,
    Ownership,
    OwnershipState,
    QueueOwnership,
    Transition,
)
from core.engine.queue import Consumer, Queue
from core.engine.vhost import VirtualHost
from core.model import properties
from core.model.message import Message, QueuedMessage

S = OwnershipState
T = Transition
VQ = ("/", "q")

ALLOWED = sorted(TRANSITIONS.items(), key=lambda kv: (kv[0][0].value, kv[0][1].value))
REFUSED = sorted(
    ((state, move) for state, move in itertools.product(S, T) if (state, move) not in TRANSITIONS),
    key=lambda sm: (sm[0].value, sm[1].value),
)


# -- the table ---------------------------------------------------------------------------------


def test_the_table_is_the_one_the_design_names() -> None:
    assert {(s.name, t.name, n.name) for (s, t), n in TRANSITIONS.items()} == {
        ("NOT_OWNED", "TAKE_OVER", "TAKING_OVER"),
        ("LOST", "TAKE_OVER", "TAKING_OVER"),
        ("TAKING_OVER", "FENCE", "FENCED"),
        ("FENCED", "LOAD", "LOADING"),
        ("LOADING", "SERVE", "SERVING"),
        ("RELEASING", "SERVE", "SERVING"),
        ("SERVING", "RELEASE", "RELEASING"),
        ("TAKING_OVER", "LOSE", "LOST"),
        ("FENCED", "LOSE", "LOST"),
        ("LOADING", "LOSE", "LOST"),
        ("SERVING", "LOSE", "LOST"),
        ("RELEASING", "LOSE", "LOST"),
        ("RELEASING", "DISOWN", "NOT_OWNED"),
        ("LOST", "DISOWN", "NOT_OWNED"),
    }
    assert len(REFUSED) == len(S) * len(T) - len(TRANSITIONS)


@pytest.mark.parametrize(("start", "move", "end"), [(s, t, n) for (s, t), n in ALLOWED],
                         ids=[f"{s.name}-{t.name}" for (s, t), _n in ALLOWED])
def test_every_allowed_move(start: OwnershipState, move: Transition, end: OwnershipState) -> None:
    record = QueueOwnership(VQ)
    record.state = start
    assert record.step(move, epoch=7) is end
    assert record.state is end
    if move is T.TAKE_OVER:
        assert record.epoch == 7


@pytest.mark.parametrize(("start", "move"), REFUSED, ids=[f"{s.name}-{t.name}" for s, t in REFUSED])
def test_every_other_move_is_refused(start: OwnershipState, move: Transition) -> None:
    record = QueueOwnership(VQ)
    record.state = start
    record.epoch = 3
    with pytest.raises(IllegalTransition, match=move.value):
        record.step(move, epoch=9)
    assert record.state is start and record.epoch == 3  # a refused move changes nothing


def test_take_over_needs_an_epoch() -> None:
    with pytest.raises(IllegalTransition):
        QueueOwnership(VQ).step(T.TAKE_OVER)


# -- the registry ------------------------------------------------------------------------------


def test_a_take_over_to_serving_and_a_hand_over_back_to_not_owned() -> None:
    own = Ownership()
    assert own.state(VQ) is S.NOT_OWNED and not own.owning(VQ) and len(own) == 0
    assert own.take_over(VQ, 12) is S.TAKING_OVER
    assert own.owning(VQ) and own.epoch(VQ) == 12 and len(own) == 1
    assert own.fence(VQ) is S.FENCED
    assert own.load(VQ) is S.LOADING
    assert not own.serving(VQ)
    assert own.serve(VQ) is S.SERVING
    assert own.serving(VQ) and own.owned() == [VQ] and own.owned(S.LOADING) == []
    assert own.release(VQ) is S.RELEASING
    assert own.disown(VQ) is S.NOT_OWNED
    assert own.owned() == [] and len(own) == 0 and own.epoch(VQ) == 0  # no record is kept for it


def test_a_lost_queue_is_taken_again_only_through_a_new_fence() -> None:
    own = Ownership()
    own.claim(VQ, 5)
    assert own.lose(VQ) is S.LOST
    assert not own.owning(VQ) and len(own) == 0 and own.owned(S.LOST) == [VQ]
    with pytest.raises(IllegalTransition):
        own.serve(VQ)  # no way back to serving but take over, fence, load
    own.take_over(VQ, 6)
    with pytest.raises(IllegalTransition):
        own.load(VQ)  # not before the fence
    assert own.fence(VQ) is S.FENCED and own.epoch(VQ) == 6


def test_claim_and_forget() -> None:
    """A single node's coordinator claims each queue in one call; a deleted queue's record goes."""
    own = Ownership()
    assert own.claim(VQ, 1) is S.SERVING and own.serving(VQ)
    with pytest.raises(IllegalTransition):
        own.claim(VQ, 2)  # a claim is a take-over: not of a queue already served
    own.forget(VQ)
    assert own.state(VQ) is S.NOT_OWNED


# -- the lease ---------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_deadline_counts_from_when_the_refresh_was_asked() -> None:
    clock = Clock()
    lease = Lease(2, margin=0.5, clock=clock)
    losses: list[str] = []
    lease.on_lost = losses.append
    assert not lease.lost and lease.deadline < clock.now  # not held before the first grant
    asked = clock.now
    clock.now += 0.3  # the answer took 0.3 s
    assert lease.granted(asked)
    assert lease.deadline == asked + 1.5
    clock.now = asked + 1.49
    assert lease.enforce() and not losses
    clock.now = asked + 1.5
    assert not lease.held() and not lease.lost and not losses  # the query changes nothing
    assert not lease.enforce()
    assert lease.lost and len(losses) == 1 and "deadline" in losses[0]
    assert not lease.enforce() and len(losses) == 1  # lost once, reported once


def test_an_answer_that_comes_after_the_deadline_proves_nothing() -> None:
    """A refresh asked before a pause and answered after it must not extend the lease."""
    clock = Clock()
    lease = Lease(2, margin=0.5, clock=clock)
    assert lease.granted(clock.now)
    asked = clock.now + 0.5
    clock.now += 5.0  # SIGSTOP between the request and its answer
    assert not lease.granted(asked)
    assert not lease.enforce() and lease.lost
    # A new lease asked now counts again, and never extends from the old deadline.
    assert lease.granted(clock.now)
    assert not lease.lost and lease.deadline == clock.now + 1.5


def test_a_lease_that_never_ends() -> None:
    lease = Lease.forever()
    assert lease.held() and lease.enforce() and lease.deadline == float("inf")


# -- the engine checks the lease before it serves ------------------------------------------------


class Sink:
    def __init__(self, prefetch: int) -> None:
        self.prefetch = prefetch
        self.got: list[QueuedMessage] = []
        self.cancelled = 0

    def has_credit(self, consumer: Consumer) -> bool:
        return consumer.unacked < self.prefetch

    def deliver(self, consumer: Consumer, qm: QueuedMessage) -> None:
        self.got.append(qm)

    def consumer_cancelled(self, consumer: Consumer) -> None:
        self.cancelled += 1


def _msg(body: bytes) -> Message:
    return Message("", "q", properties.encode({"delivery_mode": 2}), body)


class Node:
    """What a coordinator does on a lost lease, through the engine's public methods only."""

    def __init__(self, vhost: VirtualHost, clock: Clock) -> None:
        self.vhost = vhost
        self.lease = Lease(2, margin=0.5, clock=clock)
        self.lease.on_lost = self.lost
        self.ownership = Ownership(self.lease)
        self.peers = Peers(lambda node: None, lambda node: None)
        self.losses = 0

    def serve(self, q: Queue) -> None:
        q.guard(self.lease)
        self.ownership.claim((q.vhost, q.name), 1)

    def lost(self, reason: str) -> None:
        self.losses += 1
        for vq in self.ownership.owned():
            self.ownership.lose(vq)
            q = self.vhost.queues[vq[1]]
            q.stop_serving()
            if q.durable:
                q.set_remote(QueueRemote(q, self.peers, None))  # held for the next owner
            else:
                self.vhost.drop_queue(q)


async def _owned_queue(durable: bool = True) -> tuple[Node, Queue, Sink, Consumer, Clock]:
    clock = Clock()
    vhost = VirtualHost("/")
    node = Node(vhost, clock)
    assert node.lease.granted(clock.now)
    q = vhost.declare_queue("q", None, durable=durable)
    node.serve(q)
    sink = Sink(prefetch=2)
    c = Consumer("c", q.default, sink, no_ack=False)
    q.default.add_consumer(c)
    for i in range(5):
        assert q.enqueue(_msg(b"m%d" % i))
    assert [qm.message.body for qm in sink.got] == [b"m0", b"m1"]
    return node, q, sink, c, clock


async def test_a_late_ack_after_the_deadline_gives_the_queue_up_and_delivers_nothing() -> None:
    node, q, sink, c, clock = await _owned_queue()
    held = list(sink.got)
    clock.now += 10  # SIGSTOP past the lease; the consumer's acks wait in the socket
    q.default.settle(held[0], c)  # the first input after waking
    q.default.dispatch()
    q.default.settle(held[1], c)
    q.default.dispatch()
    assert node.losses == 1
    assert node.ownership.state(("/", "q")) is S.LOST
    assert len(sink.got) == 2, "delivered after the lease ran out"
    assert q.message_count == 0 and q.storage is None and q.lease is None
    # A publish after the loss is held for the next owner, not queued here.
    assert q.enqueue(_msg(b"late"))
    assert q.message_count == 0 and len(sink.got) == 2


async def test_a_publish_is_the_first_input_after_the_deadline() -> None:
    node, q, sink, c, clock = await _owned_queue()
    clock.now += 10
    assert q.enqueue(_msg(b"after"))  # held by the stand-in, for the next owner
    assert node.losses == 1 and q.message_count == 0 and len(sink.got) == 2
    assert q.default.get(no_ack=True) is None


async def test_a_transient_queue_goes_with_the_lease_and_its_consumers_are_cancelled() -> None:
    node, q, sink, c, clock = await _owned_queue(durable=False)
    clock.now += 10
    assert not q.enqueue(_msg(b"after"))  # refused: the queue went with the lease, before this publish
    assert node.losses == 1 and sink.cancelled == 1 and q.deleted and "q" not in node.vhost.queues
    assert len(sink.got) == 2


async def test_within_the_lease_the_guard_changes_nothing() -> None:
    node, q, sink, c, clock = await _owned_queue()
    clock.now += 1.0
    for qm in list(sink.got):
        q.default.settle(qm, c)
    q.default.dispatch()
    assert [qm.message.body for qm in sink.got] == [b"m0", b"m1", b"m2", b"m3"]
    assert node.losses == 0 and node.ownership.serving(("/", "q"))


async def test_asking_whether_a_queue_is_served_past_the_deadline_changes_nothing() -> None:
    """``Ownership.serving`` and ``Lease.held`` are queries: the engine's check (``Queue.lease_valid``) acts."""
    node, q, sink, c, clock = await _owned_queue()
    clock.now += 10
    assert not node.ownership.serving(("/", "q")) and not node.lease.held()
    assert node.losses == 0 and node.ownership.state(("/", "q")) is S.SERVING and q.lease is node.lease
    assert not q.lease_valid()  # the check gives everything up, once
    assert node.losses == 1 and node.ownership.state(("/", "q")) is S.LOST and q.lease is None
