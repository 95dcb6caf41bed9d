"""Declarations, deletions, bindings and publishes the API makes, through the path AMQP uses.

One adapter, so the change to a local coordinator that is never None is made
here only: with ``broker.cluster`` set, declarations are agreed through it
(as amqp_frontend/channel.py does); without, the vhost applies them directly.
The owner passed for queues is this module's ``API_OWNER``: the management
API never declares exclusive queues.
"""

from __future__ import annotations

from typing import Any

from core.engine.broker import Broker
from core.engine.exchange import Exchange
from core.engine.queue import Queue
from core.engine.vhost import VirtualHost
from core.model.message import Message

API_OWNER = object()


async def declare_queue(broker: Broker, vh: VirtualHost, name: str, durable: bool, auto_delete: bool,
                        arguments: dict[str, Any]) -> Queue:
    cluster = broker.cluster
    if cluster is not None:
        await cluster.declare_queue(vh, name, API_OWNER, durable, False, auto_delete, arguments)
        return vh.get_queue(name)
    return vh.declare_queue(name, API_OWNER, durable=durable, auto_delete=auto_delete, arguments=arguments)


async def delete_queue(broker: Broker, vh: VirtualHost, name: str, if_unused: bool, if_empty: bool) -> int:
    q = vh.queues.get(name)
    owner = q.exclusive_owner if q is not None else API_OWNER  # an operator may delete anyone's queue
    cluster = broker.cluster
    if cluster is not None:
        return await cluster.delete_queue(vh, name, owner, if_unused, if_empty)
    return vh.delete_queue(name, owner, if_unused=if_unused, if_empty=if_empty)


async def purge_queue(broker: Broker, q: Queue) -> int:
    cluster = broker.cluster
    if cluster is not None and q.remote is not None:
        return await cluster.purge(q)
    return q.purge()


async def declare_exchange(broker: Broker, vh: VirtualHost, name: str, type_: str, durable: bool,
                           auto_delete: bool, internal: bool, arguments: dict[str, Any]) -> Exchange:
    cluster = broker.cluster
    if cluster is not None:
        await cluster.declare_exchange(vh, name, type_, durable, auto_delete, internal, arguments)
        return vh.get_exchange(name)
    return vh.declare_exchange(name, type_, durable=durable, auto_delete=auto_delete, internal=internal,
                               arguments=arguments)


async def delete_exchange(broker: Broker, vh: VirtualHost, name: str, if_unused: bool) -> None:
    cluster = broker.cluster
    if cluster is not None and name in vh.exchanges and not name.startswith("amq."):
        await cluster.delete_exchange(vh, name, if_unused)
        return
    vh.delete_exchange(name, if_unused=if_unused)


async def bind(broker: Broker, vh: VirtualHost, source: str, kind: str, destination: str, routing_key: str,
               arguments: dict[str, Any], add: bool) -> None:
    """``kind`` is "queue" or "exchange"; the destination must exist (404 otherwise)."""
    cluster = broker.cluster
    if cluster is not None:
        await cluster.bind(vh, source, kind, destination, routing_key, arguments, add)
        return
    dest: Queue | Exchange = vh.get_queue(destination, API_OWNER) if kind == "queue" else \
        vh.get_exchange(destination)
    if add:
        vh.bind(source, dest, routing_key, arguments)
    else:
        vh.unbind(source, dest, routing_key, arguments)


def publish(vh: VirtualHost, exchange: Exchange | None, message: Message) -> bool:
    """Route and enqueue as a publish without confirms would; True when some queue took it."""
    queues = vh.route(exchange, message)
    routed = False
    for q in queues:
        if q.enqueue(message):
            routed = True
    return routed
