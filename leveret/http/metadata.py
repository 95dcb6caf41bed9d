"""Users and vhosts changed over HTTP, written where the node keeps them.

The broker's in-memory tables change at once (so the change applies to the
running node); the store keeps them across restarts, as ``leveret users``
writes them; in a cluster the record also goes to etcd, where every node's
watch applies it (coordination/etcd.py), as ``leveret users --etcd`` does.
etcd records hold what ``coordination.keys.user_value`` holds, the
permission regexes included, so every node enforces them.
"""

from __future__ import annotations

import asyncio

from core.engine.broker import User
from core.engine.vhost import VirtualHost
from core.ports.store import UserRecord
from leveret.http.context import NodeView

ETCD_TIMEOUT = 10.0


async def save_user(node: NodeView, user: User) -> None:
    node.broker.put_user(user)  # open connections see the change at once (core/engine/access.py)
    if node.store is not None:
        await node.store.save_user(UserRecord(user.name, user.salt, user.password_hash, list(user.tags),
                                              sorted(user.vhosts), user.loopback_only, user.grants_record()))
    cluster = node.cluster
    if cluster is not None:
        from coordination.keys import user_value

        await asyncio.wait_for(cluster.client.put(cluster.keys.user(user.name), user_value(user)), ETCD_TIMEOUT)


async def delete_user(node: NodeView, name: str) -> None:
    node.broker.delete_user(name)  # its open connections close (320)
    if node.store is not None:
        await node.store.delete_user(name)
    cluster = node.cluster
    if cluster is not None:
        await asyncio.wait_for(cluster.client.delete(cluster.keys.user(name)), ETCD_TIMEOUT)


def add_vhost(node: NodeView, name: str) -> VirtualHost:
    """The vhost, made here if new; in a cluster the cluster makes it, so it watches its queues."""
    cluster = node.cluster
    if cluster is not None:
        return cluster._vhost(name)  # what the etcd watch calls for a vhost it learns of
    return node.broker.add_vhost(name)


async def save_vhost(node: NodeView, name: str) -> None:
    if node.store is not None:
        await node.store.save_vhost(name)
    cluster = node.cluster
    if cluster is not None:
        from coordination.keys import dumps

        limits = node.broker.vhost_limits.get(name, {})
        await asyncio.wait_for(cluster.client.put(cluster.keys.vhost(name), dumps({"limits": limits})), ETCD_TIMEOUT)


async def save_vhost_limits(node: NodeView, name: str, limits: dict[str, int]) -> None:
    """Applied here at once; stored; in a cluster, etcd's vhost record carries them to every node."""
    if limits:
        node.broker.vhost_limits[name] = dict(limits)
    else:
        node.broker.vhost_limits.pop(name, None)
    if node.store is not None:
        await node.store.save_vhost_limits(name, limits)
    cluster = node.cluster
    if cluster is not None:
        from coordination.keys import dumps

        await asyncio.wait_for(cluster.client.put(cluster.keys.vhost(name), dumps({"limits": limits})), ETCD_TIMEOUT)


async def delete_vhost(node: NodeView, name: str) -> None:
    """The vhost's record goes from the store; in a cluster other nodes keep theirs until restarted."""
    node.broker.vhost_limits.pop(name, None)  # its limits go with it, as in RabbitMQ
    if node.store is not None:
        await node.store.save_vhost_limits(name, {})
        await node.store.delete_vhost(name)
