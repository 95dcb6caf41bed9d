"""Who owns a queue whose owner went: coordination/placement.py's rule over the mirror, then an etcd race.

When an owner key goes (its node's lease expired or was revoked), every node
computes the same successor from the same mirror (``placement``: the queue's
region first, then the fewest owned queues, ties by node id) and only the
chosen one tries to acquire the key; etcd's transaction settles any race. The
reconcile loop heals what events alone may miss: a durable queue ownerless
for 3 TTLs is taken by whoever tries first, a transient queue whose node is
gone is deleted, an owner key naming this node that nothing acted on is taken
over, and this node's key is refreshed when its load changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from coordination.etcd_mirror import NodeInfo
from coordination.etcd_session import OP_TIMEOUT
from coordination.placement import Candidate, place, queue_region
from core.model.tasks import spawn

if TYPE_CHECKING:
    from coordination.etcd import EtcdCoordinator

log = logging.getLogger("leveret.cluster")

VQ = tuple[str, str]


class Election:
    def __init__(self, cluster: EtcdCoordinator) -> None:
        self.c = cluster

    def owned_counts(self) -> dict[str, int]:
        counts = {node: 0 for node in self.c.mirror.nodes}
        for node, _ in self.c.mirror.owners.values():
            if node in counts:
                counts[node] += 1
        return counts

    def placement(self, region: str | None = None, exclude: str | None = None) -> NodeInfo | None:
        """coordination.placement.place over the mirrored nodes (our own draining flag counts at once)."""
        c = self.c
        nodes = [Candidate(n.id, n.region, bool(n.lease), n.draining or (n.id == c.node_id and c.draining))
                 for n in c.mirror.nodes.values()]
        chosen = place(nodes, self.owned_counts(), region, exclude)
        return c.mirror.nodes.get(chosen.id) if chosen is not None else None

    def elect(self, vq: VQ, anyone: bool = False) -> None:
        c = self.c
        if c.session.lease.lost or c.stopping or vq in c.mirror.owners:
            return
        chosen = self.placement(queue_region(c.mirror.queues.get(vq)))
        if chosen is None:
            return
        if anyone or chosen.id == c.node_id:
            spawn(self.acquire(vq, c.node_id, c.session.lease_id), c.background)

    async def acquire(self, vq: VQ, node: str, lease: int) -> bool:
        c = self.c
        t = c.session.client.transactions
        okey = c.keys.owner(*vq)
        qkey = c.keys.queue(*vq)
        try:
            ok, _ = await c.session.txn([t.create(okey) == 0, t.version(qkey) > 0],
                                        [t.put(okey, node.encode(), lease=lease)])
        except Exception as exc:  # noqa: BLE001
            log.warning("acquiring queue failed", extra={"vhost": vq[0], "queue": vq[1], "error": str(exc)})
            return False
        if ok:
            log.info("queue assigned", extra={"vhost": vq[0], "queue": vq[1], "owner": node})
        return bool(ok)

    async def delete_dead_queue(self, vq: VQ) -> None:
        c = self.c
        t = c.session.client.transactions
        qkey = c.keys.queue(*vq)
        okey = c.keys.owner(*vq)
        with contextlib.suppress(Exception):
            await c.session.txn([t.create(okey) == 0], [t.delete(qkey)])
            await c.topology.delete_bindings_to(vq[0], "queue", vq[1])

    async def reconcile_loop(self) -> None:
        """Heal what events alone may miss: ownerless durable queues, owner keys not acted on."""
        c = self.c
        last_info = b""
        while True:
            await asyncio.sleep(1.0)
            if c.session.lease.lost or c.stopping:
                continue
            now = time.monotonic()
            for vq, meta in list(c.mirror.queues.items()):
                owner = c.mirror.owners.get(vq)
                if owner is None:
                    if meta.get("durable") and not meta.get("exclusive"):
                        since = c.mirror.orphaned_since.setdefault(vq, now)
                        self.elect(vq, anyone=now - since > 3 * c.settings.lease_ttl)
                    elif meta.get("node") not in c.mirror.nodes:
                        await self.delete_dead_queue(vq)
                elif owner[0] == c.node_id and not c.ownership.owning(vq):
                    c.takeover.start(vq, owner[1])
                elif owner[0] != c.node_id and owner[0] not in c.mirror.nodes:
                    pass  # its lease is about to expire; the delete event follows
            c.peer_watch.keep_streams()
            value = c.node_value()
            if value != last_info:  # the load (queue count) changed
                last_info = value
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(c.session.put_node_info(), OP_TIMEOUT)
