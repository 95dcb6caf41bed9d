"""Declarations, deletions and bindings the API makes, through the path AMQP uses.

Every declaration goes through the node's coordinator (``broker.coordinator``:
coordination/local.py on a single node, etcd in a cluster), as
amqp_frontend/channel.py's do, so it is stored before it is answered.
The owner passed for queues is this module's ``API_OWNER``: the management
API never declares exclusive queues.
"""

from __future__ import annotations

from typing import Any

from core.engine.broker import Broker
from core.engine.exchange import Exchange
from core.engine.queue import Queue
from core.engine.vhost import VirtualHost

API_OWNER = object()


async def declare_queue(broker: Broker, vh: VirtualHost, name: str, durable: bool, auto_delete: bool,
                        arguments: dict[str, Any]) -> Queue:
    return await broker.coordinator.declare_queue(vh, name, API_OWNER, durable, False, auto_delete, arguments)


async def delete_queue(broker: Broker, vh: VirtualHost, name: str, if_unused: bool, if_empty: bool) -> int:
    q = vh.queues.get(name)
    owner = q.exclusive_owner if q is not None else API_OWNER  # an operator may delete anyone's queue
    return await broker.coordinator.delete_queue(vh, name, owner, if_unused, if_empty)


async def purge_queue(broker: Broker, q: Queue) -> int:
    return await broker.coordinator.purge(q)


async def declare_exchange(broker: Broker, vh: VirtualHost, name: str, type_: str, durable: bool,
                           auto_delete: bool, internal: bool, arguments: dict[str, Any]) -> Exchange:
    await broker.coordinator.declare_exchange(vh, name, type_, durable, auto_delete, internal, arguments)
    return vh.get_exchange(name)


async def delete_exchange(broker: Broker, vh: VirtualHost, name: str, if_unused: bool) -> None:
    await broker.coordinator.delete_exchange(vh, name, if_unused)


async def bind(broker: Broker, vh: VirtualHost, source: str, kind: str, destination: str, routing_key: str,
               arguments: dict[str, Any], add: bool) -> None:
    """``kind`` is "queue" or "exchange"; the destination must exist (404 otherwise)."""
    await broker.coordinator.bind(vh, source, kind, destination, routing_key, arguments, add)
