"""What the HTTP layer reads of a node (leveret/node/wiring.py's Node satisfies it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from amqp_frontend.server import AMQPServer
    from core.cluster.link import Peers
    from core.engine.broker import Broker
    from core.engine.ownership import Lease
    from core.ports.store import MessageStore
    from leveret.links.federation.manager import FederationManager
    from leveret.links.shovel.manager import ShovelManager
    from leveret.node.config import NodeConfig
    from mqtt_frontend.server import MQTTServer


class NodeView(Protocol):
    broker: Broker
    amqp: AMQPServer
    mqtt: MQTTServer
    store: MessageStore | None
    config: NodeConfig
    # The links to the other nodes of a cluster (forwarding metrics); None on a single node.
    # Everything else of the cluster the HTTP layer reads through broker.coordinator.
    @property
    def peers(self) -> Peers | None: ...

    @property
    def lease(self) -> Lease | None:
        """This node's etcd lease, once granted; None on a single node."""
        ...
    shovels: ShovelManager | None
    federation: FederationManager | None
