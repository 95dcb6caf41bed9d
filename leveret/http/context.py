"""What the HTTP layer reads of a node (leveret/node/wiring.py's Node satisfies it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from amqp_frontend.server import AMQPServer
    from coordination.etcd import EtcdCluster
    from core.engine.broker import Broker
    from core.ports.store import MessageStore
    from leveret.links.federation.manager import FederationManager
    from leveret.links.shovel.manager import ShovelManager
    from leveret.node.config import NodeConfig


class NodeView(Protocol):
    broker: Broker
    amqp: AMQPServer
    store: MessageStore | None
    config: NodeConfig
    cluster: EtcdCluster | None
    shovels: ShovelManager | None
    federation: FederationManager | None
