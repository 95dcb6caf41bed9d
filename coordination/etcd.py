"""Cluster coordination on etcd: the coordinator of one node of a cluster, a facade over one class per job.

How it follows DESIGN.md ("A cluster"), and which module does what:

- ``etcd_session.py``: the endpoints, the clients, the lease and its
  keep-alive, the node's key. A node that cannot refresh its lease in time
  stops serving its queues on its own.
- ``etcd_mirror.py``: the one watch on the cluster prefix and what this node
  knows of every key; a failed watch resyncs from a snapshot, so an etcd
  restart or a missed event heals. Each key kind is applied there.
- ``etcd_topology.py``: declarations are etcd transactions (create-if-absent,
  then an equivalence check against what won); counts, purge and get of a
  queue another node owns go to its owner.
- ``takeover.py``: the owner key sits on the owner's lease and its create
  revision is the queue's epoch; the driver of core/engine/ownership.py's
  machine runs the take-over both coordinators share (core/durable/takeover.py:
  fence the store with the epoch, attach storage, load the backlog, serve).
- ``election.py``: placement (coordination/placement.py's one rule: the
  queue's region first, then the fewest owned queues, ties by node id) picks
  the successor when an owner's lease goes; etcd's transaction settles races.
  Transient and exclusive queues stay on the node whose client declared them
  (as RabbitMQ's client-local) and go when it goes.
- ``drain.py``: a graceful hand-over of every queue (SIGTERM, `leveret cluster drain`).
- ``etcd_peers.py``: peers' addresses, a crashed peer noticed, direct replies.
- ``metadata.py`` + ``etcd_records.py``: users, vhosts, policies, parameters
  (the store, then etcd; other nodes apply them from the watch), and here the
  named holds and the members.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

from coordination.drain import Drain
from coordination.election import Election
from coordination.etcd_mirror import Mirror, NodeInfo, RemoteOwner
from coordination.etcd_peers import PeerWatch
from coordination.etcd_records import EtcdRecords
from coordination.etcd_session import OP_TIMEOUT, ClusterSettings, ClusterUnavailable, EtcdSession, endpoint
from coordination.etcd_topology import EtcdTopology
from coordination.keys import Layout, dumps, user_value
from coordination.metadata import StoredMetadata
from coordination.takeover import TakeOver
from core.cluster.link import Peers
from core.cluster.service import NodeService
from core.durable.durability import Durability
from core.durable.group_commit import GroupCommitter
from core.engine import direct_reply
from core.engine.broker import Broker
from core.engine.ownership import Lease, Ownership
from core.engine.queue import Queue
from core.engine.vhost import VirtualHost
from core.model.message import QueuedMessage
from core.model.policy import Policy
from core.model.tasks import spawn
from core.ports.coordinator import ClusterStartError, Member
from core.ports.store import MessageStore

__all__ = ["ClusterSettings", "ClusterUnavailable", "EtcdCoordinator", "NodeInfo", "RemoteOwner", "endpoint"]

log = logging.getLogger("leveret.cluster")


class EtcdCoordinator(StoredMetadata):
    """The etcd coordinator of one node (core.ports.coordinator.Coordinator)."""

    def __init__(
        self,
        broker: Broker,
        store: MessageStore,
        committer: GroupCommitter,
        settings: ClusterSettings,
        on_event: Callable[[str, str, str, str], None] | None = None,
    ) -> None:
        if settings.auth is None:
            raise ClusterStartError("a cluster needs --cluster-secret-file or --cluster-tls-cert/-key/-ca")
        self.settings = settings
        self.keys = Layout(settings.cluster)
        self.session = EtcdSession(settings, self.keys, self.node_value, self._rejoined)
        # Users, vhosts, policies, parameters: the store and etcd (coordination/metadata.py).
        self.records = EtcdRecords(lambda: self.session.client, self.keys)
        super().__init__(broker, store, self.records)
        self.messages: MessageStore = store  # the store this node's queues live in (shared by the cluster)
        self.committer = committer
        self.durability = Durability(store, committer)
        self.node_id = settings.node_id
        self.on_event = on_event
        self.session.lease.on_lost = self._lease_lost
        self.ownership = Ownership(self.session.lease)
        self.background: set[asyncio.Task[Any]] = set()  # fire-and-forget work, held until it ends
        self._tasks: list[asyncio.Task[Any]] = []
        self._hold_listeners: dict[str, list[Callable[[], None]]] = {}
        self._taken_listeners: dict[str, list[Callable[[str, str, str, int], None]]] = {}
        self.stopping = False
        # Set by `leveret cluster drain` and at shutdown: take no queues, give them away.
        self.draining = False
        self.mirror = Mirror(self)
        self.takeover = TakeOver(self)
        self.election = Election(self)
        self.drainer = Drain(self)
        self.topology = EtcdTopology(self)
        self.peer_watch = PeerWatch(self)
        self.peers = Peers(self.peer_watch.cluster_address, self.peer_watch.broken, settings.auth)
        self.service = NodeService(broker, self.takeover.owned, settings.auth)
        self.on_vhost.append(self._watch_vhost)

    @property
    def lease(self) -> Lease:
        return self.session.lease

    @property
    def lease_id(self) -> int:
        return self.session.lease_id

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.session.open()
        self.peers.on_congestion = self.broker.set_forward_congestion
        self.broker.reply_to.tag = direct_reply.node_tag(self.node_id)
        self.broker.reply_to.remote = self.peer_watch.forward_reply
        for vh in self.broker.vhosts.values():
            self._watch_vhost(vh)
        await self._seed()
        await self.mirror.resync()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self.session.keepalive_loop()),
            loop.create_task(self.mirror.watch_loop()),
            loop.create_task(self.election.reconcile_loop()),
        ]
        log.info("joined cluster", extra={"cluster": self.settings.cluster, "node": self.node_id,
                                           "nodes": sorted(self.mirror.nodes), "lease_ttl": self.settings.lease_ttl})

    def node_value(self) -> bytes:
        """This node's key: its addresses, region, lease, load and whether it drains."""
        s = self.settings
        return dumps({"id": self.node_id, "amqp": s.amqp_address, "grpc": s.grpc_address, "cluster": s.cluster_address,
                      "cluster_remote": s.cluster_remote_address, "region": s.region,
                      "lease": self.session.lease_id, "queues": len(self.ownership), "draining": self.draining,
                      "started": self.session.started})

    async def _seed(self) -> None:
        """The node's configured vhosts and users, and its stored runtime parameters, exist cluster-wide
        unless already defined there."""
        t = self.session.client.transactions
        txn = self.session.txn
        for name in list(self.broker.vhosts):
            key = self.keys.vhost(name)
            await txn([t.create(key) == 0], [t.put(key, dumps({}))])
        for user in list(self.broker.users.values()):
            key = self.keys.user(user.name)
            await txn([t.create(key) == 0], [t.put(key, user_value(user))])
        for (vhost, component, name), value in (await self.parameters()).items():
            key = self.keys.parameter(vhost, component, name)
            await txn([t.create(key) == 0], [t.put(key, json.dumps({"value": value}, sort_keys=True).encode())])

    async def _rejoined(self) -> None:
        """A new lease after the old one ran out: the mirror again, then what our owner keys still say."""
        await self.mirror.resync()

    def _lease_lost(self, reason: str) -> None:
        """The lease ran out (Lease.on_lost): every owned queue is lost, now, before anything else runs."""
        self.takeover.lose_all(reason)
        self.holds_changed(None)  # our holds went with the lease: their shovels and links stop

    async def stop(self, handover: bool = True) -> None:
        self.stopping = True
        if handover and not self.session.lease.lost:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.drain(), 20)
        for task in self._tasks:
            task.cancel()
        self.takeover.cancel_all()
        await self.peers.close()
        await self.session.close(revoke=True)

    def policy_stored(self, key: tuple[str, bool, str], policy: Policy | None) -> None:
        """A policy written straight to the store (``leveret policies``; leveret/node/policy_watch.py saw it):
        etcd's copy follows, so a node that restarts applies what the store says."""
        vhost, operator, name = key

        async def follow() -> None:
            try:
                if policy is None:
                    await self.records.delete_policy(vhost, name, operator)
                else:
                    await self.records.put_policy(policy)
            except Exception as exc:  # noqa: BLE001  every node does the same: one of them gets through
                log.warning("could not copy a stored policy change to etcd", extra={
                    "vhost": vhost, "policy": name, "error": f"{type(exc).__name__}: {exc}"})

        spawn(follow(), self.background)

    def emit(self, kind: str, node: str, vhost: str = "", queue: str = "") -> None:
        if self.on_event is not None:
            self.on_event(kind, node, vhost, queue)

    def _watch_vhost(self, vh: VirtualHost) -> None:
        """Whatever the engine drops by itself in ``vh`` (auto-delete, x-expires) goes from etcd too."""
        vh.on_queue_deleted.append(self.topology.local_queue_deleted)
        vh.on_exchange_auto_deleted.append(self.topology.local_exchange_auto_deleted)

    # -- the coordinator: topology and queue operations (etcd_topology.py) ------------------------
    async def declare_exchange(
        self, vhost: VirtualHost, name: str, type_: str, durable: bool, auto_delete: bool, internal: bool,
        arguments: dict[str, Any],
    ) -> None:
        await self.topology.declare_exchange(vhost, name, type_, durable, auto_delete, internal, arguments)

    async def delete_exchange(self, vhost: VirtualHost, name: str, if_unused: bool) -> None:
        await self.topology.delete_exchange(vhost, name, if_unused)

    async def declare_queue(
        self, vhost: VirtualHost, name: str, owner: object, durable: bool, exclusive: bool, auto_delete: bool,
        arguments: dict[str, Any],
    ) -> Queue:
        return await self.topology.declare_queue(vhost, name, owner, durable, exclusive, auto_delete, arguments)

    async def delete_queue(self, vhost: VirtualHost, name: str, owner: object, if_unused: bool, if_empty: bool) -> int:
        return await self.topology.delete_queue(vhost, name, owner, if_unused, if_empty)

    async def bind(
        self, vhost: VirtualHost, source: str, kind: str, destination: str, routing_key: str,
        arguments: dict[str, Any], add: bool,
    ) -> None:
        await self.topology.bind(vhost, source, kind, destination, routing_key, arguments, add)

    async def counts(self, queue: Queue) -> tuple[int, int]:
        return await self.topology.counts(queue)

    async def purge(self, queue: Queue) -> int:
        return await self.topology.purge(queue)

    async def get(self, queue: Queue, no_ack: bool) -> tuple[QueuedMessage | None, int]:
        return await self.topology.get(queue, no_ack)

    # -- ownership, seen from outside -----------------------------------------------------------------
    async def drain(self) -> int:
        """Hand every durable queue this node owns to the others (SIGTERM, `leveret cluster drain`)."""
        return await self.drainer.drain()

    def fenced(self, queues: list[tuple[str, str]]) -> None:
        """The store refused a batch: a newer owner holds these queues."""
        self.takeover.fenced(queues)

    # -- members ------------------------------------------------------------------------------------
    def members(self) -> list[Member]:
        """The live nodes as etcd has them, in id order (queues: the owner keys each holds now)."""
        counts = self.election.owned_counts()
        return [Member(n.id, n.region, n.amqp, n.grpc, counts.get(n.id, 0), n.draining, n.started)
                for _, n in sorted(self.mirror.nodes.items())]

    def owner_counts(self) -> dict[str, int]:
        return self.election.owned_counts()

    # -- named holds ----------------------------------------------------------------------------------
    # A shovel or a federation link runs on exactly one node: the holder of the key
    # /leveret/<cluster>/<kind>/<vhost>/<name>, put on its lease by a transaction that
    # succeeds only while the key does not exist, as queue owners are elected. When the
    # node dies its lease expires, etcd deletes the key, the watch tells every node
    # (on_holds_changed) and the first to ask takes it.
    async def hold(self, kind: str, vhost: str, name: str) -> bool:
        if self.session.lease.lost or not self.session.lease_id:
            return False
        t = self.session.client.transactions
        key = self.keys.hold(kind, vhost, name)
        ok, _ = await self.session.txn([t.create(key) == 0],
                                       [t.put(key, self.node_id.encode(), lease=self.session.lease_id)])
        if ok:
            log.info(f"{kind} assigned", extra={"vhost": vhost, kind: name, "node": self.node_id})
        return bool(ok)

    async def holder(self, kind: str, vhost: str, name: str) -> str | None:
        kv = await asyncio.wait_for(self.session.client.get(self.keys.hold(kind, vhost, name)), OP_TIMEOUT)
        return kv.value.decode() if kv is not None else None

    async def holding(self, kind: str, vhost: str, name: str) -> bool:
        return not self.session.lease.lost and await self.holder(kind, vhost, name) == self.node_id

    async def release(self, kind: str, vhost: str, name: str) -> None:
        t = self.session.client.transactions
        key = self.keys.hold(kind, vhost, name)
        await self.session.txn([t.value(key) == self.node_id.encode()], [t.delete(key)])

    def on_holds_changed(self, kind: str, listener: Callable[[], None]) -> None:
        self._hold_listeners.setdefault(kind, []).append(listener)

    async def take_hold(self, kind: str, vhost: str, name: str) -> int:
        """Put the hold's key on our lease unconditionally; every node's watch sees the put (hold_taken)."""
        if self.session.lease.lost or not self.session.lease_id:
            raise ClusterUnavailable("no lease to hold on")
        t = self.session.client.transactions
        key = self.keys.hold(kind, vhost, name)
        _, responses = await self.session.txn([], [t.put(key, self.node_id.encode(), lease=self.session.lease_id)])
        return int(responses[0].response_put.header.revision)

    def on_hold_taken(self, kind: str, listener: Callable[[str, str, str, int], None]) -> None:
        self._taken_listeners.setdefault(kind, []).append(listener)

    def hold_taken(self, kind: str, vhost: str, name: str, holder: str, revision: int) -> None:
        for listener in list(self._taken_listeners.get(kind, ())):
            listener(vhost, name, holder, revision)

    def holds_changed(self, kind: str | None) -> None:
        """Holds of ``kind`` (None: every kind) may have moved: their managers look again."""
        for k, listeners in self._hold_listeners.items():
            if kind is None or k == kind:
                for listener in list(listeners):
                    listener()
