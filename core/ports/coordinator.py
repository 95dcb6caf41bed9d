"""What the front ends ask of the cluster: shared metadata and remote queues.

In cluster mode (``Broker.cluster`` set, implemented by coordination/etcd.py)
declarations, deletions and bindings are first agreed in etcd, so they race
safely across nodes, and then applied to the local routing table; the front
end waits for that before it answers. Operations on a queue another node
owns (``basic.get``, ``queue.purge``, counts) go to its owner. Single node
(``Broker.cluster`` None), the front ends use the vhost directly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from core.engine.queue import Queue
    from core.engine.vhost import VirtualHost
    from core.model.message import QueuedMessage


class ClusterStartError(Exception):
    """The node cannot join its cluster (etcd unreachable at start-up)."""


class ClusterEvents(Protocol):
    def __call__(self, kind: str, node: str, vhost: str = "", queue: str = "") -> None: ...


class Cluster(Protocol):
    node_id: str

    async def declare_exchange(
        self, vhost: VirtualHost, name: str, type_: str, durable: bool, auto_delete: bool, internal: bool,
        arguments: dict[str, Any],
    ) -> None: ...

    async def delete_exchange(self, vhost: VirtualHost, name: str, if_unused: bool) -> None: ...

    async def declare_queue(
        self, vhost: VirtualHost, name: str, owner: object, durable: bool, exclusive: bool, auto_delete: bool,
        arguments: dict[str, Any],
    ) -> None:
        """Agree the queue cluster-wide and create it locally (a 406/405 is raised as for a local declare)."""
        ...

    async def delete_queue(self, vhost: VirtualHost, name: str, owner: object, if_unused: bool, if_empty: bool) -> int:
        ...

    async def bind(
        self, vhost: VirtualHost, source: str, kind: str, destination: str, routing_key: str, arguments: dict[str, Any],
        add: bool,
    ) -> None: ...

    async def counts(self, queue: Queue) -> tuple[int, int]:
        """(messages ready, consumers) as the owner sees them."""
        ...

    async def purge(self, queue: Queue) -> int: ...

    async def get(self, queue: Queue, no_ack: bool) -> tuple[QueuedMessage | None, int]: ...
