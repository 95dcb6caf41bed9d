"""The coordinator's topology and queue operations in a cluster: agreed in etcd first, then applied here.

A declaration is an etcd transaction: create the key if it is absent; if
another node won the race, the stored declaration is mirrored and the usual
equivalence check runs against it, so a redeclare with different arguments
gets 406 on any node. The change is mirrored here before the call returns
(without waiting for the watch event), so the client's next method already
finds it. A durable queue is placed by coordination/placement.py's rule
(``balanced``) or on this node (``client-local``, transient and exclusive
queues) with its owner key in the same transaction. Counts, purge and
``basic.get`` of a queue another node owns go to that owner over its link.
What the engine drops by itself (auto-delete, x-expires, an exclusive
queue's connection gone) is removed from etcd by the hooks below.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

import grpc

from coordination.etcd_session import OP_TIMEOUT, ClusterUnavailable
from coordination.keys import dumps, encode_args, loads
from core.engine.exchange import Exchange
from core.engine.queue import Queue
from core.engine.vhost import VirtualHost, server_generated_name
from core.model.errors import AccessRefused, BrokerError, NotFound, NotOwner, PreconditionFailed
from core.model.message import QueuedMessage
from core.model.tasks import spawn
from core.ports.store import StoreError

if TYPE_CHECKING:
    from coordination.etcd import EtcdCoordinator


class EtcdTopology:
    def __init__(self, cluster: EtcdCoordinator) -> None:
        self.c = cluster

    async def declare_exchange(
        self, vhost: VirtualHost, name: str, type_: str, durable: bool, auto_delete: bool, internal: bool,
        arguments: dict[str, Any],
    ) -> None:
        if name not in vhost.exchanges:  # else the local mirror decides equivalence, below
            vhost.check_new_exchange(name, type_, arguments)
            key = self.c.keys.exchange(vhost.name, name)
            value = dumps({"type": type_, "durable": durable, "auto_delete": auto_delete, "internal": internal,
                           "arguments": encode_args(arguments)})
            t = self.c.session.client.transactions
            ok, responses = await self.c.session.txn([t.create(key) == 0], [t.put(key, value)], [t.get(key)])
            stored = loads(value) if ok else _first_value(responses)
            if stored is not None:
                self.c.mirror.exchange_event(vhost.name, name, stored)
        vhost.declare_exchange(name, type_, durable=durable, auto_delete=auto_delete, internal=internal,
                               arguments=arguments)

    async def delete_exchange(self, vhost: VirtualHost, name: str, if_unused: bool) -> None:
        vhost.check_exchange_deletable(name)
        x = vhost.exchanges.get(name)
        if x is None:
            return
        if if_unused and x.bindings:
            raise PreconditionFailed(f"exchange '{name}' in vhost '{vhost.name}' in use")
        t = self.c.session.client.transactions
        await self.c.session.txn([], [t.delete(self.c.keys.exchange(vhost.name, name))])
        await self.delete_bindings_from(vhost.name, name)
        await self.delete_bindings_to(vhost.name, "exchange", name)
        self.c.mirror.exchange_event(vhost.name, name, None)

    async def declare_queue(
        self, vhost: VirtualHost, name: str, owner: object, durable: bool, exclusive: bool, auto_delete: bool,
        arguments: dict[str, Any],
    ) -> Queue:
        if not name:
            name = server_generated_name()
        if name not in vhost.queues:  # else the local declare checks equivalence and exclusivity, below
            await self._agree_queue(vhost, name, owner, durable, exclusive, auto_delete, arguments)
        return vhost.declare_queue(name, owner, durable=durable, exclusive=exclusive, auto_delete=auto_delete,
                                   arguments=arguments)

    async def _agree_queue(
        self, vhost: VirtualHost, name: str, owner: object, durable: bool, exclusive: bool, auto_delete: bool,
        arguments: dict[str, Any],
    ) -> None:
        vhost.check_new_queue(name, arguments, durable, exclusive, auto_delete)
        key = self.c.keys.queue(vhost.name, name)
        okey = self.c.keys.owner(vhost.name, name)
        moving = durable and not exclusive
        here = self.c.mirror.nodes.get(self.c.node_id)
        if moving and not (_client_local(arguments) and here is not None and here.lease and not self.c.draining):
            # RabbitMQ's x-queue-leader-locator "balanced" (the default): the
            # least loaded node of this (the declaring) node's region, else of any.
            target = self.c.election.placement(self.c.settings.region)
        else:
            # Not moving, or x-queue-leader-locator "client-local": the node the client declared on.
            target = here
        if target is None or not target.lease:
            raise ClusterUnavailable("no live node in the cluster to own the queue")
        # "region": where a failover or a drain looks first for its next owner.
        value = dumps({"durable": durable, "exclusive": exclusive, "auto_delete": auto_delete,
                       "arguments": encode_args(arguments), "node": self.c.node_id,
                       "region": self.c.settings.region})
        t = self.c.session.client.transactions
        if exclusive:
            self.c.mirror.pending_exclusive[(vhost.name, name)] = owner
        for _ in range(3):
            ok, responses = await self.c.session.txn(
                [t.create(key) == 0, t.create(okey) == 0],
                [t.put(key, value), t.put(okey, target.id.encode(), lease=target.lease)],
                [t.get(key)],
            )
            if ok:
                # Mirror it now rather than at the watch event, so the next
                # method of this client already finds the queue and its owner.
                epoch = 0
                with contextlib.suppress(Exception):
                    kv = await asyncio.wait_for(self.c.session.client.get(okey), OP_TIMEOUT)
                    if kv is not None and kv.value == target.id.encode():
                        epoch = kv.create_revision
                if epoch:
                    self.c.mirror.owners.setdefault((vhost.name, name), (target.id, epoch))
                self.c.mirror.queue_event(vhost.name, name, loads(value))
                if epoch:
                    self.c.mirror.owner_event((vhost.name, name), target.id, epoch)
                return
            stored = _first_value(responses)
            if stored is not None:
                self.c.mirror.pending_exclusive.pop((vhost.name, name), None)
                self.c.mirror.queue_event(vhost.name, name, stored)
                return
            # The owner key exists without the queue key (a leftover): clear it and retry.
            await self.c.session.txn([t.version(key) == 0], [t.delete(okey)])
        raise ClusterUnavailable(f"cannot declare queue '{name}': the cluster metadata keeps changing")

    async def delete_queue(self, vhost: VirtualHost, name: str, owner: object, if_unused: bool, if_empty: bool) -> int:
        q = vhost.queues.get(name)
        if q is None:
            return 0
        vhost.get_queue(name, owner)  # 405 for an exclusive queue of another connection
        messages, consumers = await self.counts(q)
        if if_unused and consumers:
            raise PreconditionFailed(f"queue '{name}' in vhost '{vhost.name}' in use")
        if if_empty and messages:
            raise PreconditionFailed(f"queue '{name}' in vhost '{vhost.name}' not empty")
        vq = (vhost.name, name)
        owner_entry = self.c.mirror.owners.get(vq)
        t = self.c.session.client.transactions
        await self.c.session.txn([], [t.delete(self.c.keys.queue(*vq)), t.delete(self.c.keys.owner(*vq))])
        await self.delete_bindings_to(vhost.name, "queue", name)
        if owner_entry is None and q.durable:
            # Nobody serves it: remove its stored messages here.
            with contextlib.suppress(StoreError):
                await self.c.messages.delete_queue(*vq)
        self.c.mirror.queue_event(vhost.name, name, None)
        return messages

    def local_queue_deleted(self, q: Queue) -> None:
        """The core dropped a queue itself (auto-delete, x-expires, exclusive owner gone): tell the cluster."""
        if self.c.mirror.applying or self.c.stopping:
            return
        vq = (q.vhost, q.name)
        if vq not in self.c.mirror.queues:
            return
        self.c.mirror.queues.pop(vq, None)
        self.c.ownership.forget(vq)

        async def remove() -> None:
            t = self.c.session.client.transactions
            with contextlib.suppress(Exception):
                await self.c.session.txn([], [t.delete(self.c.keys.queue(*vq)), t.delete(self.c.keys.owner(*vq))])
                await self.delete_bindings_to(vq[0], "queue", vq[1])

        spawn(remove(), self.c.background)

    def local_exchange_auto_deleted(self, vh: VirtualHost, x: Exchange) -> None:
        """An auto-delete exchange lost its last binding here: remove it from etcd too.

        Every node drops it from its own tables when it applies the unbind
        (or the deletion of the bound queue), and every node then removes the
        key, so a restarted or joining node does not bring the exchange back.
        The removal only applies to the exchange as this node knew it: one
        declared again since (a higher create revision than anything this
        node has seen) is left alone. A bind racing the removal on another
        node may get a 404, as in RabbitMQ.
        """
        if self.c.stopping:
            return
        vhost, name, seen = vh.name, x.name, self.c.mirror.revision

        async def remove() -> None:
            t = self.c.session.client.transactions
            key = self.c.keys.exchange(vhost, name)
            with contextlib.suppress(Exception):
                ok, _ = await self.c.session.txn([t.create(key) < seen + 1] if seen else [], [t.delete(key)])
                if ok:
                    await self.delete_bindings_to(vhost, "exchange", name)

        spawn(remove(), self.c.background)

    async def delete_bindings_from(self, vhost: str, source: str) -> None:
        with contextlib.suppress(Exception):
            prefix = self.c.keys.bindings_from(vhost, source)
            await asyncio.wait_for(self.c.session.client.delete_prefix(prefix), OP_TIMEOUT)

    async def delete_bindings_to(self, vhost: str, kind: str, dest: str) -> None:
        doomed = self.c.mirror.bindings_to(vhost, kind, dest)
        if not doomed:
            return
        t = self.c.session.client.transactions
        with contextlib.suppress(Exception):
            await self.c.session.txn([], [t.delete(k) for k in doomed])

    async def bind(
        self, vhost: VirtualHost, source: str, kind: str, destination: str, routing_key: str,
        arguments: dict[str, Any], add: bool,
    ) -> None:
        if not add and (vhost.queues if kind == "queue" else vhost.exchanges).get(destination) is None:
            return  # unbinding what is gone succeeds, as in RabbitMQ
        if source == "":
            raise AccessRefused("operation not permitted on the default exchange")
        if add:
            vhost.get_exchange(source)  # 404 before asking the cluster
        key = self.c.keys.binding(vhost.name, source, kind, destination, routing_key, arguments)
        t = self.c.session.client.transactions
        if add:
            value = dumps({"routing_key": routing_key, "arguments": encode_args(arguments)})
            skey = self.c.keys.exchange(vhost.name, source)
            dkey = self.c.keys.queue(vhost.name, destination) if kind == "queue" else self.c.keys.exchange(
                vhost.name, destination)
            compare = []
            # Standard exchanges (amq.*) are not in etcd; every node has them.
            if not source.startswith("amq."):
                compare.append(t.version(skey) > 0)
            if kind == "queue" or not destination.startswith("amq."):
                compare.append(t.version(dkey) > 0)
            ok, _ = await self.c.session.txn(compare, [t.put(key, value)])
            if not ok:
                raise NotFound(f"no exchange '{source}' or {kind} '{destination}' in vhost '{vhost.name}'")
            self.c.mirror.binding_event(key, (vhost.name, source, kind, destination, "x"), loads(value))
        else:
            await self.c.session.txn([], [t.delete(key)])
            self.c.mirror.binding_event(key, (vhost.name, source, kind, destination, "x"), None)

    # -- queue operations: at the owner ----------------------------------------------------
    def _link_for(self, q: Queue) -> Any:
        remote = q.remote
        if remote is None or remote.link is None or remote.link.closed:
            raise NotOwner(f"queue '{q.name}' in vhost '{q.vhost}' has no reachable owner right now; retry")
        return remote.link

    async def counts(self, queue: Queue) -> tuple[int, int]:
        if queue.remote is None:
            return queue.message_count, queue.consumer_count
        try:
            link = self._link_for(queue)
            await link.barrier()
            messages, consumers = await link.stats(queue.vhost, queue.name)
        except (BrokerError, grpc.aio.AioRpcError, TimeoutError):
            return queue.message_count, queue.consumer_count
        return messages, consumers

    async def purge(self, queue: Queue) -> int:
        if queue.remote is None:
            return queue.purge()
        try:
            link = self._link_for(queue)
            await link.barrier()
            return await link.purge(queue.vhost, queue.name)
        except grpc.aio.AioRpcError as exc:
            raise NotOwner(f"purge of '{queue.name}' failed at its owner: {exc.details()}") from exc

    async def get(self, queue: Queue, no_ack: bool) -> tuple[QueuedMessage | None, int]:
        if queue.remote is None:
            queue.touch()  # basic.get counts as use for x-expires
            qm = await queue.default.get_loaded(no_ack)  # waits if the head is being read from the store
            return qm, queue.message_count
        link = self._link_for(queue)
        await link.barrier()
        result: tuple[QueuedMessage | None, int] = await link.get(queue.vhost, queue.name, no_ack)
        return result


def _first_value(responses: Any) -> dict[str, Any] | None:
    for r in responses or ():
        if isinstance(r, list) and r:
            value, _meta = r[0]
            return loads(value)
    return None


def _client_local(arguments: dict[str, Any]) -> bool:
    """A quorum queue's ``x-queue-leader-locator: client-local``: placed on the declaring node."""
    value = arguments.get("x-queue-leader-locator")
    return value in ("client-local", b"client-local")
