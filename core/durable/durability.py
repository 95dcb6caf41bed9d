"""Durability: what of the core goes to the store, and how it comes back.

``QueueStorage`` is a durable queue's link to the group committer (appends,
removals, delivery counts, all fenced by the queue's epoch). ``Durability``
persists durable topology as it changes and rebuilds it, with each queue's
backlog, at start-up.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from core.durable.group_commit import GroupCommitter
from core.engine.exchange import Binding, Exchange
from core.engine.stream import StreamQueue
from core.model.errors import BrokerError
from core.model.message import Message, QueuedMessage
from core.model.policy import Policy
from core.ports.store import (
    Batch,
    BindingRecord,
    ExchangeRecord,
    MessageStore,
    QueueRecord,
    StoredMessage,
    TopologyWrite,
)

if TYPE_CHECKING:
    from core.engine.broker import Broker
    from core.engine.queue import Queue
    from core.engine.vhost import VirtualHost

log = logging.getLogger("leveret.store")

# A stream is restored in pages of at most this many messages, and about this many bytes.
RESTORE_PAGE = 10_000
RESTORE_PAGE_BYTES = 8 * 1024 * 1024


class QueueStorage:
    """One durable queue's writes, handed to the group committer."""

    __slots__ = ("vhost", "name", "key", "epoch", "committer")

    def __init__(self, vhost: str, name: str, committer: GroupCommitter, epoch: int = 0) -> None:
        self.vhost = vhost
        self.name = name
        self.key = (vhost, name)
        self.epoch = epoch
        self.committer = committer

    def append(self, qm: QueuedMessage) -> None:
        m = qm.message
        self.committer.append(
            self,
            StoredMessage(
                self.vhost, self.name, qm.offset, m.id, m.exchange, m.routing_key, m.props, m.body,
                m.timestamp, qm.expires_at, qm.delivery_count,
            ),
            len(m.body),
        )

    def remove(self, qm: QueuedMessage) -> None:
        self.committer.remove(self, qm.offset)

    def remove_offset(self, offset: int) -> None:
        """Remove a message known by its offset only (one paged out to disk: core/engine/paging.py)."""
        self.committer.remove(self, offset)

    def delivery_count(self, qm: QueuedMessage) -> None:
        self.committer.update_delivery_count(self, qm.offset, qm.delivery_count)

    def truncate(self, first_kept: int) -> None:
        self.committer.truncate(self, first_kept)

    def commit_offset(self, group: str, offset: int) -> None:
        self.committer.set_offset(self, group, offset)


def _is_durable_queue(q: Queue) -> bool:
    return q.durable and not q.exclusive


def is_stored(item: Queue | Exchange) -> bool:
    """Whether a declaration of ``item`` is written to the store (exclusive queues never are)."""
    return item.durable if isinstance(item, Exchange) else _is_durable_queue(item)


def binding_is_stored(source: Exchange, destination: Queue | Exchange) -> bool:
    return source.durable and is_stored(destination)


class Durability:
    """Keeps the store in step with durable topology; restores it at start."""

    def __init__(self, store: MessageStore, committer: GroupCommitter) -> None:
        self.store = store
        self.committer = committer

    # -- start-up ----------------------------------------------------------------
    async def restore(self, broker: Broker) -> tuple[int, int]:
        """Recreate durable exchanges, queues (with their messages) and bindings."""
        from core.durable.takeover import fence_and_load  # it builds on this module

        queues = await self.restore_topology(broker)
        stored = [q for q in queues if q.storage is not None]
        return len(queues), await fence_and_load(stored, self.fence, self, broker.node_id)

    async def restore_topology(self, broker: Broker) -> list[Queue]:
        """Recreate durable exchanges, queues and bindings (not claimed, nothing loaded): the queues."""
        topo = await self.store.load_topology()
        broker.durability = self
        for vh in broker.vhosts.values():
            vh.durability = self
        await self.restore_users(broker)
        await self.restore_policies(broker)  # before the queues, which declare with them applied
        for xr in topo.exchanges:
            vh = broker.add_vhost(xr.vhost)
            if xr.name not in vh.exchanges:
                try:
                    vh.declare_exchange(xr.name, xr.type, durable=True, auto_delete=xr.auto_delete,
                                        internal=xr.internal, arguments=xr.arguments, restoring=True)
                except BrokerError as exc:
                    # Declared by a version that allowed it: keep it stored, serve the rest.
                    log.error("stored exchange not restored; it stays in the store",
                              extra={"vhost": xr.vhost, "exchange": xr.name, "error": str(exc)})
        restored: list[Queue] = []
        for qr in topo.queues:
            vh = broker.add_vhost(qr.vhost)
            try:
                q = vh.declare_queue(qr.name, None, durable=True, auto_delete=qr.auto_delete,
                                     arguments=qr.arguments, restoring=True)
            except BrokerError as exc:
                log.error("stored queue not restored (its arguments are refused now); its messages stay in the "
                          "store", extra={"vhost": qr.vhost, "queue": qr.name, "error": str(exc)})
                continue
            restored.append(q)
        for br in topo.bindings:
            bvh = broker.vhosts.get(br.vhost)
            if bvh is None or br.source not in bvh.exchanges:
                continue
            dest: Queue | Exchange | None = (
                bvh.queues.get(br.destination) if br.destination_kind == "queue" else bvh.exchanges.get(br.destination)
            )
            if dest is not None:
                bvh.bind(br.source, dest, br.routing_key, br.arguments, restoring=True)
        return restored

    async def fence(self, queues: Sequence[Queue]) -> dict[tuple[str, str], int]:
        """The take-over's fence for a single node (core/durable/takeover.py): every queue's epoch moves
        on in one transaction (one fsync for 50,000 queues, not one each); the new epochs."""
        batch = Batch(claims=[(q.vhost, q.name) for q in queues])
        await self.store.commit(batch)
        return dict(batch.claimed)

    async def load(self, q: Queue, node: str) -> int:
        """A queue's stored backlog, for an owner that has just claimed its epoch: at start-up,
        and (in a cluster) when it takes the queue over. Loaded messages are redelivered."""
        if isinstance(q, StreamQueue):
            return await self.restore_stream(q, node)
        assert q.storage is not None
        # In pages, as a stream: a backlog larger than memory pages out (core/engine/paging.py)
        # as it is restored, instead of being held whole in one list first.
        loaded = 0
        start = 0
        limit = 256
        while True:
            page = await self.store.load_range(q.storage.vhost, q.storage.name, start, None, limit)
            if not q.lease_valid() or q.storage is None:
                return loaded  # the lease ran out while the store answered: the queue was given up meanwhile
            size = 0
            for sm in page:
                q.restore(_restored(sm, node), sm.offset, sm.expires_at, sm.delivery_count)
                size += len(sm.body)
            loaded += len(page)
            if len(page) < limit:
                return loaded
            start = page[-1].offset + 1
            limit = min(limit * 2, RESTORE_PAGE) if size < RESTORE_PAGE_BYTES else max(1, limit // 2)

    async def restore_stream(self, q: StreamQueue, node: str) -> int:
        """A stream's log in pages (only its newest part stays in memory), then its groups' offsets.

        For an owner that has just claimed the stream's epoch: at start-up, and (in a
        cluster) when it takes the stream over from a failed node.
        """
        assert q.storage is not None
        loaded = 0
        start = 0
        limit = 256  # grows while pages stay small, shrinks for large bodies
        while True:
            page = await self.store.load_range(q.storage.vhost, q.storage.name, start, None, limit)
            if not q.lease_valid() or q.storage is None:
                return loaded  # given up meanwhile (see load)
            size = 0
            for sm in page:
                q.restore(_restored(sm, node), sm.offset, None, 0)
                size += len(sm.body)
            loaded += len(page)
            if len(page) < limit:
                break
            start = page[-1].offset + 1
            limit = min(limit * 2, RESTORE_PAGE) if size < RESTORE_PAGE_BYTES else max(1, limit // 2)
        committed = await self.store.load_offsets(q.storage.vhost, q.storage.name)
        if not q.lease_valid():
            return loaded
        q.committed = committed
        q.enforce_age()  # for the time the node was down
        return loaded
    async def restore_users(self, broker: Broker) -> None:
        """Vhosts and users written by ``leveret vhosts|users``; a stored user replaces a default one."""
        from core.engine.broker import User

        for name in await self.store.load_vhosts():
            broker.add_vhost(name)
        broker.vhost_limits.update(await self.store.load_vhost_limits())
        for r in await self.store.load_users():
            user = User(r.name, r.salt, r.password_hash, tuple(r.tags), set(r.vhosts), r.loopback_only)
            user.load_grants(r.permissions)
            broker.put_user(user)

    async def restore_policies(self, broker: Broker) -> None:
        """Stored policies onto their vhosts (a policy of a vhost that is gone stays stored, unused)."""
        for policy in await self.store.load_policies():
            vh = broker.vhosts.get(policy.vhost)
            if vh is not None:
                vh.set_policy(policy, restoring=True)

    def policy_changed(self, policy: Policy, cleared: bool) -> None:
        """Policies are durable whatever they match; written in the topology FIFO of the group committer."""
        if cleared:
            self.committer.run(lambda: self._delete_policy(policy))
        else:
            self.committer.run(lambda: self.store.save_policy(policy))

    async def _delete_policy(self, policy: Policy) -> None:
        await self.store.delete_policy(policy.vhost, policy.name, policy.operator)

    # -- topology changes (called by the vhost) -------------------------------------
    def exchange_declared(self, vhost: VirtualHost, x: Exchange) -> None:
        if x.durable:
            record = ExchangeRecord(vhost.name, x.name, x.type, x.auto_delete, x.internal, x.arguments)
            self.committer.topology(TopologyWrite(record))

    def exchange_deleted(self, vhost: VirtualHost, x: Exchange) -> None:
        if x.durable:
            self.committer.topology(TopologyWrite(ExchangeRecord(vhost.name, x.name, x.type), delete=True))

    def queue_declared(self, vhost: VirtualHost, q: Queue, restoring: bool = False) -> None:
        if not _is_durable_queue(q):
            return
        storage = QueueStorage(vhost.name, q.name, self.committer)
        q.storage = storage
        if restoring:
            return  # restore() claims the epoch itself
        record = QueueRecord(vhost.name, q.name, q.auto_delete, q.arguments)
        self.committer.topology(TopologyWrite(record), claim=storage)

    def queue_deleted(self, vhost: VirtualHost, q: Queue) -> None:
        if q.storage is not None:
            self.committer.topology(TopologyWrite(QueueRecord(vhost.name, q.name), delete=True))

    def binding_changed(self, vhost: VirtualHost, b: Binding, added: bool) -> None:
        dest = b.destination
        if not binding_is_stored(b.source, dest):
            return
        kind = "exchange" if isinstance(dest, Exchange) else "queue"
        record = BindingRecord(vhost.name, b.source.name, kind, dest.name, b.routing_key, b.arguments)
        self.committer.topology(TopologyWrite(record, delete=not added))


def _restored(sm: StoredMessage, node: str) -> Message:
    m = Message(sm.exchange, sm.routing_key, sm.properties, sm.body, node=node)
    m.timestamp = sm.enqueued_at
    m.id = sm.message_id
    return m
