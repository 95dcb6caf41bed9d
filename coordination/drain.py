"""Graceful moves: this node hands every durable queue it owns to the others (SIGTERM, `leveret cluster drain`).

For each queue: hold new publishes at a ``LoadingGate``, let what the group
committer has pending reach the store, then delete our owner key and create
the target's (a new key: a new, higher epoch), so the target fences and loads
as after a failover. A give-up etcd refuses (the key is not ours any
more) serves on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from coordination.etcd_mirror import NodeInfo
from coordination.etcd_session import OP_TIMEOUT
from coordination.placement import queue_region
from core.cluster.remote import LoadingGate
from core.engine.ownership import OwnershipState
from core.engine.queue import Queue

if TYPE_CHECKING:
    from coordination.etcd import EtcdCoordinator

log = logging.getLogger("leveret.cluster")

VQ = tuple[str, str]


class Drain:
    def __init__(self, cluster: EtcdCoordinator) -> None:
        self.c = cluster

    async def requested(self, raw_key: bytes) -> None:
        """``leveret cluster drain`` put our drain key: take it away, then drain."""
        with contextlib.suppress(Exception):
            await self.c.session.client.delete(raw_key)
        await self.drain()

    async def drain(self) -> int:
        """Hand every durable queue this node owns to the others; how many moved."""
        c = self.c
        c.draining = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(c.session.put_node_info(), OP_TIMEOUT)
        moved = 0
        for vq in c.ownership.owned(OwnershipState.SERVING):
            vh = c.broker.vhosts.get(vq[0])
            q = vh.queues.get(vq[1]) if vh is not None else None
            if q is None or not q.durable or q.exclusive:
                continue
            target = c.election.placement(queue_region(c.mirror.queues.get(vq)), exclude=c.node_id)
            if target is None:
                log.warning("no other node to hand queues to", extra={"queues": len(c.ownership)})
                break
            if await self._hand_over(vq, q, target):
                moved += 1
        if moved:
            log.info("queues handed over", extra={"node": c.node_id, "moved": moved})
        return moved

    async def _hand_over(self, vq: VQ, q: Queue, target: NodeInfo) -> bool:
        # Hold new publishes, let what is committed-pending reach the store,
        # then give the key to the target (a new key: a new, higher epoch).
        c = self.c
        if c.ownership.state(vq) is not OwnershipState.SERVING:
            return False  # lost (or deleted) while the queues before it moved
        gate = LoadingGate(q, c.peers)
        q.set_remote(gate)
        c.ownership.release(vq)
        try:
            await asyncio.wait_for(c.committer.drain(), 10)
        except TimeoutError:
            pass
        if not await self.give_up(vq):
            if c.ownership.state(vq) is OwnershipState.RELEASING and q.remote is gate:
                q.set_remote(None)
                c.ownership.serve(vq)  # refused: serve on
                c.takeover.flush_held(q, gate.detach())
                q.touch()
            return False
        # While we waited for etcd, the delete's watch event may already have
        # released the queue here, and the next owner's key may have arrived
        # too: keep what the mirror knows instead of forgetting it (a node
        # that forgot the new owner held forwards for it until OWNED_WAIT).
        current = c.mirror.owners.get(vq)
        if current is not None and current[0] == c.node_id:
            c.mirror.owners.pop(vq, None)
        if c.ownership.state(vq) is OwnershipState.RELEASING:
            c.takeover.hand_back(vq, None)  # the gate's held publishes follow to the next owner
        if vq not in c.mirror.owners:  # a lost race to another node is fine: someone owns it
            await c.election.acquire(vq, target.id, target.lease)
        return True

    async def give_up(self, vq: VQ) -> bool:
        """Delete our owner key of ``vq``; False when it is not ours (any more) or etcd did not answer."""
        c = self.c
        t = c.session.client.transactions
        key = c.keys.owner(*vq)
        try:
            ok, _ = await c.session.txn([t.value(key) == c.node_id.encode()], [t.delete(key)])
        except Exception:  # noqa: BLE001 - the caller goes on either way
            return False
        return bool(ok)
