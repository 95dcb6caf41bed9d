"""The take-over driver of a cluster: core/engine/ownership.py's moves, made from what etcd says.

The owner key of a queue sits on its owner's lease and its create revision is
the queue's epoch. When the mirror (coordination/etcd_mirror.py) sees a key
naming this node, ``start`` runs the take-over: publishes wait at the queue's
``LoadingGate``, then the take-over both coordinators share
(core/durable/takeover.py) fences the store with the epoch, attaches
storage, loads the backlog (marked redelivered) and serves, flushing what the
gate held. A key that moves away, a lease that runs out, a
batch the store fenced (``fenced``) stop serving the queue here
(``lose``; ``hand_back`` after a drain's give-up); its stored data stays for
the next owner, and the queue is served through its owner from then on
(``become_remote``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import TYPE_CHECKING, Any

from core.cluster.remote import LoadingGate, QueueRemote
from core.durable.takeover import fence_and_load, flush_held, serve
from core.engine.ownership import OwnershipState
from core.engine.queue import Queue
from core.engine.stream import StreamQueue
from core.ports.store import Fenced, QueueRecord, StoreError

if TYPE_CHECKING:
    from coordination.etcd import EtcdCoordinator

log = logging.getLogger("leveret.cluster")

VQ = tuple[str, str]
# How long a forwarded publish or a proxied subscription waits for this node
# to finish taking over a queue it was just given.
OWNED_WAIT = 10.0
OWNED_GRACE = 0.5


class TakeOver:
    def __init__(self, cluster: EtcdCoordinator) -> None:
        self.c = cluster
        # The take-over in progress of each queue (TAKING_OVER .. LOADING).
        self.taking: dict[VQ, asyncio.Task[None]] = {}

    def start(self, vq: VQ, epoch: int) -> None:
        c = self.c
        if c.session.lease.lost or c.stopping:
            return
        old = self.taking.pop(vq, None)
        if old is not None:
            old.cancel()
        if c.ownership.owning(vq):
            # Ours again under a newer epoch: that incarnation is over, the
            # take-over below resets what it served and fences anew.
            c.ownership.lose(vq)
        c.ownership.take_over(vq, epoch)
        self.taking[vq] = asyncio.get_running_loop().create_task(self._run(vq, epoch))

    async def _run(self, vq: VQ, epoch: int) -> None:
        c = self.c
        own = c.ownership
        vh = c.broker.vhosts.get(vq[0])
        q = vh.queues.get(vq[1]) if vh is not None else None
        me = asyncio.current_task()
        if q is None:
            if self.taking.get(vq) is me:
                self.taking.pop(vq, None)
                own.forget(vq)
            return
        # Publishes wait at the gate (with what an earlier stand-in held)
        # until the backlog is loaded; the lease guards everything from now.
        gate = LoadingGate(q, c.peers, q.remote.detach() if q.remote is not None else None)
        q.set_remote(gate)
        q.guard(c.session.lease)
        started = time.monotonic()
        try:
            if q.durable and not q.exclusive:
                async def fence(_: object) -> dict[VQ, int]:
                    await c.messages.claim(vq[0], vq[1], epoch)
                    # The store describes what it holds (the retention job reads each queue's
                    # arguments there); the declarations themselves live in etcd.
                    await c.messages.save_queue(QueueRecord(vq[0], vq[1], q.auto_delete, q.arguments))
                    return {vq: epoch}

                loaded = await fence_and_load([q], fence, c.durability, c.node_id, c.ownership)
            else:
                own.fence(vq)  # nothing stored: nothing to fence or load
                own.load(vq)
                loaded = 0
        except (StoreError, asyncio.CancelledError) as exc:
            if self.taking.get(vq) is me:  # still this take-over's to undo (not lost or restarted meanwhile)
                self.taking.pop(vq, None)
                own.lose(vq)
                q.stop_serving()
                self.become_remote(q, None)
            if isinstance(exc, asyncio.CancelledError):
                raise
            if isinstance(exc, Fenced):
                log.warning("queue taken over by a newer owner while loading", extra={"vhost": vq[0], "queue": vq[1]})
                return
            log.error("cannot take the queue over (store failed); giving it up",
                      extra={"vhost": vq[0], "queue": vq[1], "error": str(exc)})
            await c.drainer.give_up(vq)
            return
        if self.taking.get(vq) is not me or not q.lease_valid():
            return  # lost meanwhile (the lease check gave it up already), or restarted
        held = gate.detach()
        q.set_remote(None)
        self.taking.pop(vq, None)
        serve(q, own, c.committer, held)
        log.info("serving queue", extra={"vhost": vq[0], "queue": vq[1], "epoch": epoch, "messages_loaded": loaded,
                                         "ms": round((time.monotonic() - started) * 1000, 1)})

    def flush_held(self, q: Queue, held: list[Any]) -> None:
        flush_held(q, held, self.c.committer)

    def lose(self, vq: VQ, new_owner: str | None) -> None:
        """Stop serving a queue involuntarily (lease lost, fenced, moved): LOST; NOT_OWNED once the owner is known."""
        own = self.c.ownership
        if own.owning(vq):
            own.lose(vq)
        if new_owner is not None and own.state(vq) is OwnershipState.LOST:
            own.disown(vq)
        self._stop_serving(vq, new_owner)

    def hand_back(self, vq: VQ, new_owner: str | None) -> None:
        """The hand-over is done (our owner key is gone): RELEASING -> NOT_OWNED."""
        self.c.ownership.disown(vq)
        self._stop_serving(vq, new_owner)

    def lose_all(self, reason: str) -> None:
        """The lease ran out (Lease.on_lost): every owned queue is lost, now, before anything else runs."""
        c = self.c
        owned = c.ownership.owned()
        log.error("stopping serving owned queues: " + reason, extra={"node": c.node_id, "queues": len(owned)})
        for vq in owned:
            self.lose(vq, None)

    def deleted(self, vq: VQ, q: Queue) -> None:
        """The queue's key went: nothing of it is ours any more."""
        self.c.ownership.forget(vq)
        task = self.taking.pop(vq, None)
        if task is not None:
            task.cancel()
        q.guard(None)

    def cancel_all(self) -> None:
        for task in list(self.taking.values()):
            task.cancel()

    def _stop_serving(self, vq: VQ, new_owner: str | None) -> None:
        """The queue side of losing or handing back: its stored data stays for the next owner."""
        c = self.c
        task = self.taking.pop(vq, None)
        if task is not None:
            task.cancel()
        vh = c.broker.vhosts.get(vq[0])
        q = vh.queues.get(vq[1]) if vh is not None else None
        if vh is None or q is None:
            return
        q.stop_serving()
        if not q.durable or q.exclusive:
            # Nothing of it is stored: it cannot move, it goes (its consumers get basic.cancel).
            c.mirror.apply(functools.partial(vh.drop_queue, q))
            return
        if isinstance(q, StreamQueue):
            # A stream's in-memory log and readers belong to its owner: start
            # over with a fresh remote copy (its bindings come back with it).
            c.mirror.recreate(vq, new_owner)
            log.warning("stopped serving stream", extra={"vhost": vq[0], "queue": vq[1],
                                                          "new_owner": new_owner or "-"})
            return
        self.become_remote(q, new_owner)
        log.warning("stopped serving queue", extra={"vhost": vq[0], "queue": vq[1], "new_owner": new_owner or "-"})

    def become_remote(self, q: Queue, owner: str | None) -> None:
        """Serve ``q`` through its owner from now on; publishes held so far follow."""
        held = q.remote.detach() if q.remote is not None else []
        remote = QueueRemote(q, self.c.peers, owner)
        q.set_remote(remote)
        remote.adopt(held)

    def fenced(self, queues: list[VQ]) -> None:
        """The store refused a batch: a newer owner holds these queues."""
        c = self.c
        for vq in queues:
            if c.ownership.owning(vq):
                owner = c.mirror.owners.get(vq)
                self.lose(vq, owner[0] if owner and owner[0] != c.node_id else None)

    async def owned(self, vhost: str, queue: str) -> Queue | None:
        """The local queue when this node owns it, once loaded (waits while it is being taken over)."""
        c = self.c
        started = time.monotonic()
        vq = (vhost, queue)
        while True:
            vh = c.broker.vhosts.get(vhost)
            q = vh.queues.get(queue) if vh is not None else None
            if q is not None and q.remote is None and not q.deleted and c.ownership.serving(vq):
                return q
            owner = c.mirror.owners.get(vq)
            mine = c.ownership.owning(vq) or (owner is not None and owner[0] == c.node_id)
            if not mine and (owner is not None or vq in c.mirror.tombstones):
                # Another node's, or deleted: answer now. (Waiting here would
                # hold up every batch behind this one on the peer's stream.)
                return None
            # Ours: wait for the take-over. Ownerless or unknown: only a short
            # grace, for an owner key or declaration still on its way here;
            # batches on a peer's stream are answered in order, so a long
            # wait here would hold up every queue that peer forwards to us.
            waited = time.monotonic() - started
            if waited > (OWNED_WAIT if mine else OWNED_GRACE):
                return None
            task = self.taking.get(vq)
            if task is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(task), OWNED_WAIT)
            else:
                await asyncio.sleep(0.01)
