"""Queue ownership as a state machine, and the lease a node serves its queues under.

Every queue this node owns (or is taking, or has just lost) has one
``QueueOwnership``; the others are ``NOT_OWNED`` and have no record. The
states and the only moves between them (``TRANSITIONS``):

    NOT_OWNED --take_over--> TAKING_OVER --fence--> FENCED --load--> LOADING --serve--> SERVING
    SERVING --release--> RELEASING --disown--> NOT_OWNED     (drain, SIGTERM: handed to another node)
    RELEASING --serve--> SERVING                             (the hand-over was refused: serve on)
    TAKING_OVER | FENCED | LOADING | SERVING | RELEASING --lose--> LOST
    LOST --take_over--> TAKING_OVER                          (ours again: a new claim, a new fence)
    LOST --disown--> NOT_OWNED                               (another node owns it now)

Any other move is a bug in the coordinator and raises ``IllegalTransition``.
A coordinator drives the machine (coordination/etcd.py from its watch, its
lease and the store's fence; a single node's coordinator claims everything at
start with ``Ownership.claim``) and does the queue-side work of each move
through the engine's public methods (``Queue.guard``, ``Queue.set_remote``,
``Queue.attach_storage``, ``Queue.stop_serving``, ``VirtualHost.drop_queue``).

The lease: a node may deliver, settle and confirm for its queues only while
its lease is surely held: until ``Lease.deadline``, the monotonic time of the
last successful refresh *request* plus the TTL minus a margin. A node that
wakes past it (SIGSTOP, a long GC, a VM pause) finds out at the first thing
it does for an owned queue: every owned queue carries the lease
(``Queue.guard``), and the engine checks it before it enqueues, delivers,
settles or gets (``Queue.lease_valid``, the one check). ``Lease.held`` is the
query; ``Lease.enforce`` acts on it: past the deadline it loses every owned
queue at once (``Lease.on_lost``) before the input that found it is processed, so
nothing is served under a lease that may belong to a new owner by now.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable

VQ = tuple[str, str]  # (vhost, queue)


class OwnershipState(enum.Enum):
    NOT_OWNED = "not owned"
    TAKING_OVER = "taking over"  # the owner key is ours; publishes are held, nothing is served
    FENCED = "fenced"  # the store's epoch is ours: an older owner can no longer write
    LOADING = "loading"  # storage attached with the epoch; the backlog comes back, redelivered
    SERVING = "serving"
    RELEASING = "releasing"  # handing it to another node: publishes held, pending writes drain
    LOST = "lost"  # stopped serving without handing it over (lease ran out, store fenced us)


class Transition(enum.Enum):
    TAKE_OVER = "take over"
    FENCE = "fence"
    LOAD = "load"
    SERVE = "serve"
    RELEASE = "release"
    LOSE = "lose"
    DISOWN = "disown"


S = OwnershipState
T = Transition
_OWNING = (S.TAKING_OVER, S.FENCED, S.LOADING, S.SERVING, S.RELEASING)

# (state, transition) -> next state. Everything not here is refused.
TRANSITIONS: dict[tuple[OwnershipState, Transition], OwnershipState] = {
    (S.NOT_OWNED, T.TAKE_OVER): S.TAKING_OVER,
    (S.LOST, T.TAKE_OVER): S.TAKING_OVER,
    (S.TAKING_OVER, T.FENCE): S.FENCED,
    (S.FENCED, T.LOAD): S.LOADING,
    (S.LOADING, T.SERVE): S.SERVING,
    (S.RELEASING, T.SERVE): S.SERVING,
    (S.SERVING, T.RELEASE): S.RELEASING,
    **{(state, T.LOSE): S.LOST for state in _OWNING},
    (S.RELEASING, T.DISOWN): S.NOT_OWNED,
    (S.LOST, T.DISOWN): S.NOT_OWNED,
}


class IllegalTransition(RuntimeError):
    """A coordinator asked for a move the machine does not have: a bug, never a runtime condition."""


class QueueOwnership:
    """One queue's ownership on this node: its state and the epoch it was claimed with."""

    __slots__ = ("vq", "state", "epoch")

    def __init__(self, vq: VQ) -> None:
        self.vq = vq
        self.state = S.NOT_OWNED
        self.epoch = 0

    def step(self, transition: Transition, epoch: int | None = None) -> OwnershipState:
        nxt = TRANSITIONS.get((self.state, transition))
        if nxt is None:
            raise IllegalTransition(
                f"queue '{self.vq[1]}' in vhost '{self.vq[0]}': cannot {transition.value} when {self.state.value}")
        if transition is T.TAKE_OVER:
            if epoch is None:
                raise IllegalTransition("take over needs the epoch of the claim")
            self.epoch = epoch
        self.state = nxt
        return nxt

    @property
    def owning(self) -> bool:
        """Taken, being taken or being handed over: this node answers for the queue."""
        return self.state in _OWNING


class Lease:
    """The node's lease as the engine sees it: queues are served until ``deadline`` (monotonic).

    ``deadline`` is the time the last successful refresh was *asked* plus the
    TTL minus ``margin``: etcd counts the TTL from when it received the
    request, which is after we asked, so the deadline is never later than the
    lease's real end; the margin covers the clocks and the time to stop. A
    lease that never ends (a single node) has an infinite deadline.
    """

    __slots__ = ("ttl", "margin", "deadline", "lost", "on_lost", "clock", "granted_at")

    def __init__(self, ttl: float = math.inf, margin: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self.margin = margin
        self.clock = clock
        self.deadline = math.inf if ttl == math.inf else -math.inf
        self.lost = False
        self.granted_at = -math.inf  # when the last refresh that counted was asked (lease age)
        # Called once when the lease is found past its deadline (or given up): stop serving everything.
        self.on_lost: Callable[[str], None] | None = None

    @classmethod
    def forever(cls) -> Lease:
        return cls()

    def granted(self, asked_at: float) -> bool:
        """A refresh (or a new lease) asked at ``asked_at`` succeeded. False when its answer came too late to count."""
        deadline = asked_at + self.ttl - self.margin
        if deadline <= self.clock():
            return False  # asked before a pause: it says nothing about now
        self.deadline = max(self.deadline, deadline) if not self.lost else deadline
        self.granted_at = max(self.granted_at, asked_at)
        self.lost = False
        return True

    def held(self) -> bool:
        """Still held now? A query: it changes nothing (``enforce`` acts on the answer)."""
        return self.clock() < self.deadline

    def enforce(self) -> bool:
        """Whether the lease is still held; when not, it is given up first (``expire``: every owned
        queue is lost before this returns). The engine calls it before it serves (``Queue.lease_valid``),
        the coordinator's watchdog while idle."""
        if self.clock() < self.deadline:
            return True
        self.expire(f"lease deadline passed {self.clock() - self.deadline:.2f}s ago")
        return False

    def expire(self, reason: str) -> None:
        """The lease is gone (or cannot be trusted): stop serving, once."""
        self.deadline = -math.inf
        if self.lost:
            return
        self.lost = True
        if self.on_lost is not None:
            self.on_lost(reason)


class Ownership:
    """Every queue this node owns, by (vhost, queue), and the lease they are served under."""

    def __init__(self, lease: Lease | None = None) -> None:
        self.lease = lease if lease is not None else Lease.forever()
        self._queues: dict[VQ, QueueOwnership] = {}

    # -- reading -----------------------------------------------------------------
    def state(self, vq: VQ) -> OwnershipState:
        record = self._queues.get(vq)
        return record.state if record is not None else S.NOT_OWNED

    def epoch(self, vq: VQ) -> int:
        record = self._queues.get(vq)
        return record.epoch if record is not None else 0

    def owning(self, vq: VQ) -> bool:
        record = self._queues.get(vq)
        return record is not None and record.owning

    def owned(self, *states: OwnershipState) -> list[VQ]:
        """The queues in ``states`` (default: every owning state), sorted."""
        wanted = states or _OWNING
        return sorted(vq for vq, r in self._queues.items() if r.state in wanted)

    def serving(self, vq: VQ) -> bool:
        return self.state(vq) is S.SERVING and self.lease.held()

    def __len__(self) -> int:
        """How many queues this node answers for (its load, as placement counts it)."""
        return sum(1 for r in self._queues.values() if r.owning)

    # -- moving ------------------------------------------------------------------
    def step(self, vq: VQ, transition: Transition, epoch: int | None = None) -> OwnershipState:
        record = self._queues.get(vq)
        if record is None:
            record = QueueOwnership(vq)
        state = record.step(transition, epoch)
        if state is S.NOT_OWNED:
            self._queues.pop(vq, None)
        else:
            self._queues[vq] = record
        return state

    def take_over(self, vq: VQ, epoch: int) -> OwnershipState:
        return self.step(vq, T.TAKE_OVER, epoch)

    def fence(self, vq: VQ) -> OwnershipState:
        return self.step(vq, T.FENCE)

    def load(self, vq: VQ) -> OwnershipState:
        return self.step(vq, T.LOAD)

    def serve(self, vq: VQ) -> OwnershipState:
        return self.step(vq, T.SERVE)

    def release(self, vq: VQ) -> OwnershipState:
        return self.step(vq, T.RELEASE)

    def lose(self, vq: VQ) -> OwnershipState:
        return self.step(vq, T.LOSE)

    def disown(self, vq: VQ) -> OwnershipState:
        return self.step(vq, T.DISOWN)

    def claim(self, vq: VQ, epoch: int) -> OwnershipState:
        """Take, fence, load and serve in one go: for a coordinator that fenced and loaded the
        queue itself and cannot race another node (a single node at start, coordination/local.py)."""
        for transition in (T.TAKE_OVER, T.FENCE, T.LOAD, T.SERVE):
            self.step(vq, transition, epoch if transition is T.TAKE_OVER else None)
        return S.SERVING

    def forget(self, vq: VQ) -> None:
        """The queue was deleted: its record goes, whatever its state (deletion is not a move)."""
        self._queues.pop(vq, None)
