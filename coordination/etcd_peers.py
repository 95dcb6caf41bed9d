"""The other nodes as this one reaches them: their cluster addresses, a crashed peer noticed, direct replies.

Peers (core/cluster/link.py) dial the address a node put in its key:
its ``cluster_remote`` address from another region when it has one. Every
node keeps a standing stream to every peer, so a crashed peer is noticed when
the stream breaks rather than when its lease expires: if its port then
refuses connections its process is gone, and this node revokes its lease so
the failover starts at once (epoch fencing keeps a peer that was only
restarting from writing).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from coordination.etcd_mirror import NodeInfo
from coordination.etcd_session import OP_TIMEOUT
from core.engine import direct_reply
from core.model.message import Message
from core.model.tasks import spawn

if TYPE_CHECKING:
    from coordination.etcd import EtcdCoordinator

log = logging.getLogger("leveret.cluster")


class PeerWatch:
    def __init__(self, cluster: EtcdCoordinator) -> None:
        self.c = cluster

    def cluster_address(self, node: str) -> str | None:
        info = self.c.mirror.nodes.get(node)
        return self.dial_address(info) if info is not None else None

    def dial_address(self, info: NodeInfo) -> str | None:
        """A peer's cluster port as this node reaches it: its remote address from another region, if it has one."""
        if info.cluster_remote and info.region != self.c.settings.region:
            return info.cluster_remote
        return info.cluster or None

    def keep_streams(self) -> None:
        """A standing stream to every peer (re-opened if it broke)."""
        c = self.c
        for node in list(c.mirror.nodes):
            if node != c.node_id:
                link = c.peers.link(node)
                if link is not None:
                    link.watch()

    def broken(self, node: str) -> None:
        """A stream to a peer broke: if its port refuses connections, it is dead; end its lease now."""
        info = self.c.mirror.nodes.get(node)
        if info is None or self.c.stopping:
            return
        spawn(self._probe(info), self.c.background)

    async def _probe(self, info: NodeInfo) -> None:
        c = self.c
        host, _, port = (self.dial_address(info) or info.grpc).rpartition(":")
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), 1.0)
            writer.close()
            return  # it listens: alive (or restarted); its lease decides
        except (OSError, TimeoutError, ValueError):
            pass
        current = c.mirror.nodes.get(info.id)
        if current is None or current.lease != info.lease:
            return
        # Its process is gone (the port refuses connections): revoking its
        # lease starts the failover now instead of at the lease's expiry. If
        # it was only restarting, the epoch fencing keeps its writes out.
        log.warning("peer unreachable and not listening: revoking its lease", extra={"peer": info.id})
        with contextlib.suppress(Exception):
            await asyncio.wait_for(c.session.client.revoke_lease(info.lease), OP_TIMEOUT)

    def forward_reply(self, tag: str, routing_key: str, message: Message) -> bool:
        """A direct reply-to address of a requester on another node: send the reply there."""
        c = self.c
        for node in c.mirror.nodes:
            if direct_reply.node_tag(node) == tag:
                link = c.peers.link(node)
                if link is None:
                    return False
                link.forward(b"/", routing_key.encode(), message)
                return True
        return False
