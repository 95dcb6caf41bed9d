"""Who runs a shovel (or a federation link): exactly one node of a cluster, held like a queue's ownership.

In a cluster the holder is an etcd key ``/leveret/<cluster>/shovels/<vhost>/<name>``
put on the node's lease by a transaction that succeeds only while the key does
not exist (create revision 0), as queue owners are elected
(coordination/etcd.py). When the node dies its lease expires, etcd deletes the
key and the next node to ask takes the shovel. A single node holds every shovel.
Federation links are held the same way under ``federation/`` (``kind``), named
``<vhost>/<exchange>/<upstream>``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from coordination.etcd import EtcdCluster

log = logging.getLogger("leveret.shovel")


class Holder(Protocol):
    async def acquire(self, vhost: str, name: str) -> bool:
        """True when this node holds the shovel now (it may run it)."""
        ...

    async def held(self, vhost: str, name: str) -> bool:
        """Still ours? (False once the lease is gone: stop at once.)"""
        ...

    async def release(self, vhost: str, name: str) -> None: ...

    async def holder(self, vhost: str, name: str) -> str | None:
        """The node holding it, if any."""
        ...


class LocalHolder:
    """One node: it holds every shovel."""

    def __init__(self, node: str) -> None:
        self.node = node

    async def acquire(self, vhost: str, name: str) -> bool:
        return True

    async def held(self, vhost: str, name: str) -> bool:
        return True

    async def release(self, vhost: str, name: str) -> None:
        return None

    async def holder(self, vhost: str, name: str) -> str | None:
        return self.node


class EtcdHolder:
    def __init__(self, cluster: EtcdCluster, kind: str = "shovels") -> None:
        self.cluster = cluster
        self.node = cluster.node_id
        self.kind = kind  # the key's folder: "shovels", "federation"

    def _key(self, vhost: str, name: str) -> bytes:
        from coordination.keys import q

        return (self.cluster.keys.prefix + f"{self.kind}/{q(vhost)}/{q(name)}").encode()

    async def acquire(self, vhost: str, name: str) -> bool:
        if self.cluster.lease.lost or not self.cluster.lease_id:
            return False
        t = self.cluster.client.transactions
        key = self._key(vhost, name)
        ok, _ = await self.cluster.client.transaction(
            compare=[t.create(key) == 0], success=[t.put(key, self.node.encode(), lease=self.cluster.lease_id)],
            failure=[])
        if ok:
            log.info(f"{self.kind} assigned", extra={"vhost": vhost, self.kind: name, "node": self.node})
        return bool(ok)

    async def holder(self, vhost: str, name: str) -> str | None:
        kv = await self.cluster.client.get(self._key(vhost, name))
        return kv.value.decode() if kv is not None else None

    async def held(self, vhost: str, name: str) -> bool:
        return not self.cluster.lease.lost and await self.holder(vhost, name) == self.node

    async def release(self, vhost: str, name: str) -> None:
        t = self.cluster.client.transactions
        key = self._key(vhost, name)
        await self.cluster.client.transaction(compare=[t.value(key) == self.node.encode()],
                                              success=[t.delete(key)], failure=[])
