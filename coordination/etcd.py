"""Cluster coordination on etcd: membership, shared metadata, queue ownership.

How it follows DESIGN.md ("A cluster"):
- Membership: the node's key lives on its lease, refreshed every TTL/4; a
  node that cannot refresh in time stops serving its queues on its own.
- Metadata: declarations are etcd transactions (create-if-absent, then an
  equivalence check against what won), mirrored into every node's routing
  table through one watch on the cluster prefix; a failed watch resyncs from
  a snapshot, so an etcd restart or a missed event heals.
- Ownership: the owner key sits on the owner's lease and its create revision
  is the queue's epoch. The owner fences the store with it, loads the
  backlog, and only then serves; every durable write is conditional on it.
  The states and their moves are core/engine/ownership.py's machine; this
  module drives it (watch events, the lease, the store's fence, drain) and
  does the queue-side work through the engine's public methods.
- Placement: coordination/placement.py's one rule (declare, failover, drain):
  the live node of the queue's region (the declaring node's, recorded in the
  queue's metadata) with the fewest owned queues, else the least loaded of
  any region (ties by node id), computed from the mirrored owner keys; the
  same rule picks the successor when an owner's lease goes. Fewest-queues over
  rendezvous hashing because it keeps nodes balanced as they join, which is
  what an operator watches; etcd's transaction settles any race. Transient
  and exclusive queues stay on the node whose client declared them (as
  RabbitMQ's client-local) and go when it goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aetcd
import grpc

from coordination.etcd_client import EtcdTLS, etcd_client
from coordination.etcd_records import EtcdRecords
from coordination.keys import Layout, decode_args, dumps, encode_args, loads, user_value
from coordination.metadata import StoredMetadata
from coordination.placement import Candidate, place, queue_region
from core.cluster.auth import PeerAuth
from core.cluster.forwarding import LoadingGate, NodeService, NotOwner, Peers, QueueRemote
from core.durable.durability import Durability, QueueStorage
from core.durable.group_commit import GroupCommitter
from core.engine import direct_reply, publish
from core.engine.broker import Broker, User
from core.engine.exchange import Exchange
from core.engine.ownership import Lease, Ownership, OwnershipState
from core.engine.queue import Queue
from core.engine.stream import StreamQueue
from core.engine.vhost import VirtualHost, server_generated_name
from core.model.errors import AccessRefused, BrokerError, NotFound, PreconditionFailed
from core.model.message import Message, QueuedMessage
from core.model.policy import Policy, PolicyError
from core.model.tasks import spawn
from core.ports.coordinator import ClusterStartError, Member
from core.ports.store import Fenced, MessageStore, QueueRecord, StoreError

log = logging.getLogger("leveret.cluster")

OP_TIMEOUT = 5.0
# How long a forwarded publish or a proxied subscription waits for this node
# to finish taking over a queue it was just given.
OWNED_WAIT = 10.0
OWNED_GRACE = 0.5


class RemoteOwner:
    """The exclusive owner of a queue declared on another node: nobody here may use it."""


@dataclass
class ClusterSettings:
    endpoints: list[str]
    cluster: str = "leveret"
    region: str = ""
    lease_ttl: int = 2
    node_id: str = "leveret"
    amqp_address: str = ""
    grpc_address: str = ""
    # The internal listener (--cluster-port) peers dial, and how they prove membership.
    cluster_address: str = ""
    # What nodes of other regions dial instead (--advertise-cluster-remote): "" = cluster_address.
    cluster_remote_address: str = ""
    auth: PeerAuth | None = None
    # etcd's own transport and login (--etcd-cacert/--etcd-cert/--etcd-key, --etcd-user).
    etcd_tls: EtcdTLS | None = None
    etcd_user: str = ""
    etcd_password: str = ""


@dataclass
class NodeInfo:
    id: str
    amqp: str = ""
    grpc: str = ""
    region: str = ""
    lease: int = 0
    queues: int = 0
    started: float = 0.0
    draining: bool = False
    cluster: str = ""  # the internal listener (--cluster-port) peers dial
    cluster_remote: str = ""  # what peers of another region dial instead, when set

    @classmethod
    def of(cls, value: dict[str, Any]) -> NodeInfo:
        return cls(str(value.get("id", "")), str(value.get("amqp", "")), str(value.get("grpc", "")),
                   str(value.get("region", "")), int(value.get("lease", 0)), int(value.get("queues", 0)),
                   float(value.get("started", 0.0)), bool(value.get("draining", False)),
                   str(value.get("cluster", "")), str(value.get("cluster_remote", "")))


@dataclass
class Mirror:
    """What this node knows of the cluster's keys."""

    nodes: dict[str, NodeInfo] = field(default_factory=dict)
    queues: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    owners: dict[tuple[str, str], tuple[str, int]] = field(default_factory=dict)  # -> (node, epoch)
    orphaned_since: dict[tuple[str, str], float] = field(default_factory=dict)
    last_owner: dict[tuple[str, str], str] = field(default_factory=dict)  # survives the owner key's delete


def _endpoint(url: str) -> tuple[str, int]:
    text = url.strip()
    for scheme in ("http://", "https://"):
        if text.startswith(scheme):
            text = text[len(scheme):]
    text = text.rstrip("/")
    host, _, port = text.rpartition(":")
    if not host:
        return text, 2379
    return host.strip("[]"), int(port)


class EtcdCluster(StoredMetadata):
    """The etcd coordinator of one node (core.ports.coordinator.Coordinator)."""

    def __init__(
        self,
        broker: Broker,
        store: MessageStore,
        committer: GroupCommitter,
        settings: ClusterSettings,
        on_event: Callable[[str, str, str, str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.keys = Layout(settings.cluster)
        # Users, vhosts, policies, parameters: the store and etcd (coordination/metadata.py).
        super().__init__(broker, store, EtcdRecords(lambda: self.client, self.keys))
        self.messages: MessageStore = store  # the store this node's queues live in (shared by the cluster)
        self.committer = committer
        self.node_id = settings.node_id
        self.on_vhost.append(self._watch_vhost)
        # Policies and parameters as etcd has them (a resync clears what went meanwhile).
        self._policies: set[tuple[str, bool, str]] = set()
        self._hold_listeners: dict[str, list[Callable[[], None]]] = {}
        self._background: set[asyncio.Task[Any]] = set()  # fire-and-forget work, held until it ends
        self.on_event = on_event
        self.mirror = Mirror()
        if settings.auth is None:
            raise ClusterStartError("a cluster needs --cluster-secret-file or --cluster-tls-cert/-key/-ca")
        self.peers = Peers(self._cluster_address, self._peer_broken, settings.auth)
        self.service = NodeService(broker, self.owned, settings.auth)
        self.durability = Durability(store, committer)
        ttl = settings.lease_ttl
        # Served until the last refresh asked + TTL - margin (core/engine/ownership.py).
        self.lease = Lease(ttl, margin=min(0.5, ttl / 4))
        self.lease.on_lost = self._fence_self
        self.ownership = Ownership(self.lease)
        # The take-over in progress of each queue (TAKING_OVER .. LOADING).
        self._taking: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._client: aetcd.Client | None = None
        self._watch_client: aetcd.Client | None = None
        self._endpoint_index = 0
        self.lease_id = 0
        self._tasks: list[asyncio.Task[Any]] = []
        self._applying = 0
        self._stopping = False
        self.revision = 0
        self._started = time.time()
        self._synced = asyncio.Event()
        self._bindings: dict[bytes, tuple[str, str, str, str, str, dict[str, Any]]] = {}
        # Exclusive queues being declared here: the connection that owns each.
        self._pending_exclusive: dict[tuple[str, str], object] = {}
        # Queues deleted lately (insertion-ordered, bounded): forwards to them fail at once.
        self._tombstones: dict[tuple[str, str], None] = {}
        # Set by `leveret cluster drain` and at shutdown: take no queues, give them away.
        self.draining = False

    # ================================================================ lifecycle
    def _new_client(self, timeout: float | None) -> aetcd.Client:
        host, port = _endpoint(self.settings.endpoints[self._endpoint_index % len(self.settings.endpoints)])
        s = self.settings
        return etcd_client(host, port, timeout, s.etcd_tls, s.etcd_user, s.etcd_password)

    async def _connect(self, deadline: float) -> None:
        errors: list[str] = []
        for _ in range(len(self.settings.endpoints)):
            client = self._new_client(OP_TIMEOUT)
            try:
                await asyncio.wait_for(client.connect(), OP_TIMEOUT)
                await asyncio.wait_for(client.status(), max(0.5, min(OP_TIMEOUT, deadline - time.monotonic())))
                self._client = client
                self._watch_client = self._new_client(None)
                return
            except Exception as exc:  # noqa: BLE001 - every failure means "try the next endpoint"
                errors.append(f"{self.settings.endpoints[self._endpoint_index % len(self.settings.endpoints)]}: "
                              f"{type(exc).__name__} {exc}")
                with contextlib.suppress(Exception):
                    await client.close()
                self._endpoint_index += 1
        raise StoreError("cannot reach etcd at " + "; ".join(errors))

    @property
    def client(self) -> aetcd.Client:
        assert self._client is not None
        return self._client

    async def start(self) -> None:
        deadline = time.monotonic() + 15
        while True:
            try:
                await self._connect(deadline)
                break
            except StoreError as exc:
                if time.monotonic() > deadline:
                    raise ClusterStartError(f"{exc} (--etcd {','.join(self.settings.endpoints)})") from None
                await asyncio.sleep(0.5)
        self.peers.on_congestion = self._congestion
        self.broker.reply_to.tag = direct_reply.node_tag(self.node_id)
        self.broker.reply_to.remote = self._forward_reply
        for vh in self.broker.vhosts.values():
            self._watch_vhost(vh)
        await self._register()
        await self._seed_defaults()
        await self._resync()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._keepalive_loop()),
            loop.create_task(self._watch_loop()),
            loop.create_task(self._reconcile_loop()),
        ]
        log.info("joined cluster", extra={"cluster": self.settings.cluster, "node": self.node_id,
                                           "nodes": sorted(self.mirror.nodes), "lease_ttl": self.settings.lease_ttl})

    async def _register(self) -> None:
        asked = time.monotonic()
        lease = await asyncio.wait_for(self.client.lease(self.settings.lease_ttl), OP_TIMEOUT)
        self.lease_id = lease.id
        self.lease.granted(asked)
        await self._put_node_info()

    def _node_value(self) -> bytes:
        s = self.settings
        return dumps({"id": self.node_id, "amqp": s.amqp_address, "grpc": s.grpc_address, "cluster": s.cluster_address,
                      "cluster_remote": s.cluster_remote_address, "region": s.region,
                      "lease": self.lease_id, "queues": len(self.ownership), "draining": self.draining,
                      "started": self._started})

    async def _put_node_info(self) -> None:
        await asyncio.wait_for(self.client.put(self.keys.node(self.node_id), self._node_value(), lease=self.lease_id),
                               OP_TIMEOUT)

    async def _seed_defaults(self) -> None:
        """The node's configured vhosts and users exist cluster-wide unless already defined there."""
        t = self.client.transactions
        for name in list(self.broker.vhosts):
            key = self.keys.vhost(name)
            await self._txn([t.create(key) == 0], [t.put(key, dumps({}))])
        for user in list(self.broker.users.values()):
            key = self.keys.user(user.name)
            await self._txn([t.create(key) == 0], [t.put(key, user_value(user))])
        # Runtime parameters stored before the cluster had them (the store keeps them across restarts).
        for (vhost, component, name), value in (await self.parameters()).items():
            key = self.keys.parameter(vhost, component, name)
            await self._txn([t.create(key) == 0], [t.put(key, json.dumps({"value": value}, sort_keys=True).encode())])

    async def stop(self, handover: bool = True) -> None:
        self._stopping = True
        if handover and not self.lease.lost:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.drain(), 20)
        for task in self._tasks:
            task.cancel()
        for task in list(self._taking.values()):
            task.cancel()
        await self.peers.close()
        if self._client is not None and self.lease_id:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.client.revoke_lease(self.lease_id), 2)
        for client in (self._client, self._watch_client):
            if client is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(client.close(), 2)

    # ================================================================= leases
    async def _keepalive_loop(self) -> None:
        ttl = self.settings.lease_ttl
        interval = ttl / 4
        watchdog = asyncio.get_running_loop().create_task(self._lease_watchdog())
        try:
            while True:
                await asyncio.sleep(interval)
                await self._refresh_once(ttl)
        finally:
            watchdog.cancel()

    async def _lease_watchdog(self) -> None:
        # Cut off from etcd while idle: nothing else would look at the
        # deadline, and a new owner may be loading our queues. (A node woken
        # from a pause meets the deadline earlier, at the first thing it does
        # for an owned queue: Queue.guard.) The store's epoch check makes
        # anything still in flight fail.
        while True:
            await asyncio.sleep(0.1)
            self.lease.valid()

    async def _refresh_once(self, ttl: int) -> None:
        sent = time.monotonic()
        try:
            # A slow answer still counts (from when it was asked): cutting it
            # short made loaded nodes fence themselves with a live lease.
            reply = await asyncio.wait_for(self.client.refresh_lease(self.lease_id), ttl)
            alive = reply is not None and reply.TTL > 0
        except Exception as exc:  # noqa: BLE001 - etcd unreachable: keep trying
            log.debug("lease refresh failed", extra={"error": f"{type(exc).__name__}: {exc}"})
            await self._reconnect_if_needed()
            return
        if alive and not self.lease.lost:
            if self.lease.granted(sent):
                return
            # Answered past the deadline (we were paused, or etcd was slow):
            # it proves nothing about now. Stop serving, then rejoin below.
            self.lease.expire("lease refresh answered after the deadline")
        if not alive and not self.lease.lost:
            self.lease.expire("lease expired")
        # A new lease, a new registration; the reconcile loop takes back
        # what our owner keys still say is ours, each with a new fence.
        try:
            if not alive:
                asked = time.monotonic()
                lease = await asyncio.wait_for(self.client.lease(ttl), OP_TIMEOUT)
                self.lease_id = lease.id
                sent = asked
            if not self.lease.granted(sent):
                return  # too slow again: the next refresh tries
            await self._put_node_info()
            log.warning("rejoined the cluster", extra={"node": self.node_id, "lease": self.lease_id,
                                                        "new_lease": not alive})
            await self._resync()
        except Exception as exc:  # noqa: BLE001
            log.warning("rejoin failed; retrying", extra={"error": f"{type(exc).__name__}: {exc}"})

    async def _reconnect_if_needed(self) -> None:
        try:
            await asyncio.wait_for(self.client.status(), 1.0)
        except Exception:  # noqa: BLE001
            old = self._client
            try:
                await self._connect(time.monotonic() + 2)
            except StoreError:
                return
            if old is not None:
                with contextlib.suppress(Exception):
                    await old.close()

    def _fence_self(self, reason: str) -> None:
        """The lease ran out (Lease.on_lost): every owned queue is lost, now, before anything else runs."""
        owned = self.ownership.owned()
        log.error("stopping serving owned queues: " + reason, extra={"node": self.node_id, "queues": len(owned)})
        for vq in owned:
            self._lose(vq, None)
        self._holds_changed(None)  # our holds went with the lease: their shovels and links stop

    # ================================================================ watching
    async def _watch_loop(self) -> None:
        while True:
            try:
                assert self._watch_client is not None
                watch = await self._watch_client.watch_prefix(self.keys.prefix.encode(),
                                                              start_revision=self.revision + 1)
                async for event in watch:
                    self.revision = max(self.revision, event.kv.mod_revision)
                    self._apply_event(event.kind, event.kv.key, event.kv.value, event.kv.create_revision)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - compaction, etcd restart: resync below
                log.warning("etcd watch ended; resyncing", extra={"error": f"{type(exc).__name__}: {exc}"})
            await asyncio.sleep(0.2)
            with contextlib.suppress(Exception):
                if self._watch_client is not None:
                    await self._watch_client.close()
            self._watch_client = self._new_client(None)
            try:
                await self._resync()
            except Exception as exc:  # noqa: BLE001
                log.warning("resync failed; retrying", extra={"error": f"{type(exc).__name__}: {exc}"})
                await asyncio.sleep(0.5)

    async def _resync(self) -> None:
        """Rebuild the mirror from a snapshot and make the local state match it."""
        snap = await asyncio.wait_for(self.client.get_prefix(self.keys.prefix.encode()), OP_TIMEOUT)
        self.revision = snap.header.revision
        seen_queues: set[tuple[str, str]] = set()
        seen_owners: set[tuple[str, str]] = set()
        seen_nodes: set[str] = set()
        seen_exchanges: set[tuple[str, str]] = set()
        seen_bindings: set[bytes] = set()
        seen_policies: set[tuple[str, bool, str]] = set()
        seen_parameters: set[tuple[str, str, str]] = set()
        items = sorted(snap, key=lambda kv: _order(self.keys.parse(kv.key)))
        for kv in items:
            key = self.keys.parse(kv.key)
            if key is None:
                continue
            if key.section == "queues":
                seen_queues.add((key.parts[0], key.parts[1]))
            elif key.section == "owners":
                seen_owners.add((key.parts[0], key.parts[1]))
            elif key.section == "nodes":
                seen_nodes.add(key.parts[0])
            elif key.section == "exchanges":
                seen_exchanges.add((key.parts[0], key.parts[1]))
            elif key.section == "bindings":
                seen_bindings.add(kv.key)
            elif key.section == "policies" and len(key.parts) == 3:
                seen_policies.add((key.parts[0], key.parts[1] == "operator", key.parts[2]))
            elif key.section == "parameters" and len(key.parts) == 3:
                seen_parameters.add((key.parts[0], key.parts[1], key.parts[2]))
            self._apply_event("PUT", kv.key, kv.value, kv.create_revision)
        for node in list(self.mirror.nodes):
            if node not in seen_nodes:
                self._apply_event("DELETE", self.keys.node(node), b"", 0)
        for vq in list(self.mirror.owners):
            if vq not in seen_owners:
                self._apply_event("DELETE", self.keys.owner(*vq), b"", 0)
        for vq in list(self.mirror.queues):
            if vq not in seen_queues:
                self._apply_event("DELETE", self.keys.queue(*vq), b"", 0)
        for key_raw in list(self._bindings):
            if key_raw not in seen_bindings:
                self._apply_event("DELETE", key_raw, b"", 0)
        for vname, vh in list(self.broker.vhosts.items()):
            for xname, x in list(vh.exchanges.items()):
                if not xname.startswith("amq.") and xname and (vname, xname) not in seen_exchanges:
                    self._apply(functools.partial(vh.drop_exchange, x))
        for vhost, operator, name in self._policies - seen_policies:
            self._policy_event(vhost, operator, name, None)
        self.forget_parameters(seen_parameters)
        self._holds_changed(None)  # holds may have gone while the watch was down
        self._synced.set()

    def _apply(self, fn: Callable[[], Any]) -> Any:
        self._applying += 1
        try:
            return fn()
        finally:
            self._applying -= 1

    def _apply_event(self, kind: str, raw_key: bytes, value: bytes, create_revision: int) -> None:
        key = self.keys.parse(raw_key)
        if key is None:
            return
        try:
            put = kind == "PUT"
            s = key.section
            if s == "nodes":
                self._node_event(key.parts[0], loads(value) if put else None)
            elif s == "vhosts":
                if put:
                    self.add_vhost(key.parts[0])
                    self._vhost_limits(key.parts[0], loads(value).get("limits"))
            elif s == "users":
                if put:
                    self._user_put(key.parts[0], loads(value))
                else:
                    self.broker.delete_user(key.parts[0])  # its connections here close too
            elif s == "exchanges":
                self._exchange_event(key.parts[0], key.parts[1], loads(value) if put else None)
            elif s == "queues":
                self._queue_event(key.parts[0], key.parts[1], loads(value) if put else None)
            elif s == "bindings":
                self._binding_event(raw_key, key.parts, loads(value) if put else None)
            elif s == "owners":
                self._owner_event((key.parts[0], key.parts[1]), value.decode() if put else None, create_revision)
            elif s == "policies" and len(key.parts) == 3:
                operator = key.parts[1] == "operator"
                self._policy_event(key.parts[0], operator, key.parts[2], loads(value) if put else None)
            elif s == "parameters" and len(key.parts) == 3:
                self.deliver((key.parts[0], key.parts[1], key.parts[2]), loads(value).get("value") if put else None)
            elif s in self._hold_listeners:
                self._holds_changed(s)
            elif s == "drain":
                if put and key.parts[0] == self.node_id:
                    spawn(self._drain_requested(raw_key), self._background)
        except Exception:  # a bad key must not stop the watch
            log.exception("cannot apply etcd event", extra={"key": raw_key.decode(errors="replace"), "kind": kind})

    # -- mirrored sections -------------------------------------------------------
    def _watch_vhost(self, vh: VirtualHost) -> None:
        """Whatever the engine drops by itself in ``vh`` (auto-delete, x-expires) goes from etcd too."""
        vh.on_queue_deleted.append(self._local_queue_deleted)
        vh.on_exchange_auto_deleted.append(self._local_exchange_auto_deleted)

    def _vhost(self, name: str) -> VirtualHost:
        return self.add_vhost(name)

    def _policy_event(self, vhost: str, operator: bool, name: str, value: dict[str, Any] | None) -> None:
        """A policy set or cleared through some node: applied here as that node applied it."""
        vh = self.broker.vhosts.get(vhost)
        if value is None:
            self._policies.discard((vhost, operator, name))
            if vh is not None:
                vh.clear_policy(name, operator=operator, restoring=True)
            return
        self._policies.add((vhost, operator, name))
        if vh is None:
            return  # applied when the vhost comes (its policies are restored from the store)
        try:
            policy = Policy.create(vhost, name, str(value.get("pattern", "")), value.get("definition") or {},
                                   str(value.get("apply_to", "all")), int(value.get("priority", 0)), operator)
        except (PolicyError, TypeError, ValueError) as exc:
            log.warning("ignoring malformed policy record in etcd", extra={"vhost": vhost, "policy": name,
                                                                           "error": str(exc)})
            return
        current = (vh.operator_policies if operator else vh.policies).get(name)
        if current != policy:
            vh.set_policy(policy, restoring=True)

    def _holds_changed(self, kind: str | None) -> None:
        """Holds of ``kind`` (None: every kind) may have moved: their managers look again."""
        for k, listeners in self._hold_listeners.items():
            if kind is None or k == kind:
                for listener in list(listeners):
                    listener()

    def _vhost_limits(self, name: str, limits: Any) -> None:
        """RabbitMQ's vhost limits, carried by the vhost's record (leveret/http/metadata.py)."""
        if isinstance(limits, dict) and limits:
            self.broker.vhost_limits[name] = {str(k): int(v) for k, v in limits.items()}
        else:
            self.broker.vhost_limits.pop(name, None)

    def _user_put(self, name: str, value: dict[str, Any]) -> None:
        try:
            user = User(name, bytes.fromhex(value["salt"]), bytes.fromhex(value["hash"]),
                        tags=tuple(value.get("tags", ())), vhosts=set(value.get("vhosts", ())),
                        loopback_only=bool(value.get("loopback_only", False)))
            permissions = value.get("permissions")
            user.load_grants(permissions if isinstance(permissions, dict) else {})
        except (KeyError, ValueError, TypeError, AttributeError):
            log.warning("ignoring malformed user record in etcd", extra={"user": name})
            return
        self.broker.put_user(user)

    def _node_event(self, node: str, value: dict[str, Any] | None) -> None:
        known = node in self.mirror.nodes
        if value is None:
            if known:
                del self.mirror.nodes[node]
                self.peers.forget(node)
                log.warning("node left the cluster", extra={"peer": node})
                self._emit("node-lost", node)
            return
        info = NodeInfo.of(value)
        self.mirror.nodes[node] = info
        if node != self.node_id and not self._stopping:
            # A standing stream to every peer: a crashed peer is noticed when
            # it breaks, not only when its lease expires (see _probe_peer).
            link = self.peers.link(node)
            if link is not None:
                link.watch()
        if not known:
            if node != self.node_id:
                log.info("node joined the cluster", extra={"peer": node, "region": info.region})
            self._emit("node-added", node)

    def _exchange_event(self, vhost: str, name: str, value: dict[str, Any] | None) -> None:
        vh = self._vhost(vhost)
        if value is None:
            x = vh.exchanges.get(name)
            if x is not None:
                self._apply(lambda: vh.drop_exchange(x))
            return
        if name in vh.exchanges:
            return
        self._apply(lambda: vh.declare_exchange(
            name, str(value["type"]), durable=bool(value.get("durable")), auto_delete=bool(value.get("auto_delete")),
            internal=bool(value.get("internal")), arguments=decode_args(value.get("arguments", "")),
            restoring=True))

    def _queue_event(self, vhost: str, name: str, value: dict[str, Any] | None) -> None:
        vq = (vhost, name)
        vh = self._vhost(vhost)
        if value is None:
            self.mirror.queues.pop(vq, None)
            self.mirror.orphaned_since.pop(vq, None)
            self.mirror.last_owner.pop(vq, None)
            self._tombstones[vq] = None
            if len(self._tombstones) > 10_000:
                self._tombstones.pop(next(iter(self._tombstones)))
            q = vh.queues.get(name)
            if q is not None:
                self.ownership.forget(vq)
                task = self._taking.pop(vq, None)
                if task is not None:
                    task.cancel()
                q.guard(None)
                if q.detach_storage() is not None:
                    # The owner removes the stored messages, in order with its other writes.
                    self.committer.run(lambda: self.messages.delete_queue(vhost, name))
                self._apply(functools.partial(vh.drop_queue, q))
                self._emit("queue-deleted", self.node_id, vhost, name)
            return
        self.mirror.queues[vq] = value
        self._tombstones.pop(vq, None)
        if name in vh.queues:
            return
        exclusive = bool(value.get("exclusive"))
        local = value.get("node") == self.node_id
        owner_obj = self._pending_exclusive.pop(vq, None) if exclusive and local else None
        q = self._apply(lambda: vh.declare_queue(
            name, owner_obj if owner_obj is not None else RemoteOwner(), durable=bool(value.get("durable")),
            exclusive=exclusive, auto_delete=bool(value.get("auto_delete")),
            arguments=decode_args(value.get("arguments", "")), restoring=True))
        owner = self.mirror.owners.get(vq)
        if owner is not None and owner[0] == self.node_id and not self.lease.lost and not self._stopping:
            self._start_takeover(vq, owner[1])
        else:
            self._become_remote(q, owner[0] if owner and owner[0] != self.node_id else None)
            if owner is None and value.get("durable"):
                self.mirror.orphaned_since.setdefault(vq, time.monotonic())
        self._emit("queue-created", self.node_id, vhost, name)

    def _binding_event(self, raw_key: bytes, parts: tuple[str, ...], value: dict[str, Any] | None) -> None:
        if len(parts) < 5:
            return
        vhost, source, kind, dest = parts[0], parts[1], parts[2], parts[3]
        vh = self._vhost(vhost)
        if value is None:
            entry = self._bindings.pop(raw_key, None)
            if entry is None:
                return
            _, _, _, _, rk, args = entry
            d = vh.queues.get(dest) if kind == "queue" else vh.exchanges.get(dest)
            if d is not None:
                self._apply(lambda: vh.unbind(source, d, rk, args))  # type: ignore[arg-type]
            return
        rk = str(value.get("routing_key", ""))
        args = decode_args(value.get("arguments", ""))
        self._bindings[raw_key] = (vhost, source, kind, dest, rk, args)
        d2: Queue | Exchange | None = vh.queues.get(dest) if kind == "queue" else vh.exchanges.get(dest)
        if d2 is not None and source in vh.exchanges:
            self._apply(lambda: vh.bind(source, d2, rk, args, restoring=True))

    def _owner_event(self, vq: tuple[str, str], node: str | None, epoch: int) -> None:
        previous = self.mirror.owners.get(vq)
        vh = self.broker.vhosts.get(vq[0])
        q = vh.queues.get(vq[1]) if vh is not None else None
        own = self.ownership
        if node is None:
            self.mirror.owners.pop(vq, None)
            if previous is not None and previous[0] == self.node_id:
                if own.state(vq) is OwnershipState.RELEASING:
                    self._hand_back(vq, None)  # our own give-up's event, ahead of its answer
                elif own.owning(vq):
                    self._lose(vq, None)
            elif q is not None and q.remote is not None:
                q.remote.set_owner(None)
            meta = self.mirror.queues.get(vq)
            if meta is None:
                return
            if meta.get("durable") and not meta.get("exclusive"):
                self.mirror.orphaned_since[vq] = time.monotonic()
                self._elect(vq)
            else:
                # Transient and exclusive queues die with their node (as in RabbitMQ).
                spawn(self._delete_dead_queue(vq), self._background)
            return
        self.mirror.owners[vq] = (node, epoch)
        self.mirror.orphaned_since.pop(vq, None)
        last = self.mirror.last_owner.get(vq)
        self.mirror.last_owner[vq] = node
        if last is not None and last != node:
            self._emit("queue-moved", node, vq[0], vq[1])
        if q is None:
            return
        if node == self.node_id:
            if not own.owning(vq) or own.epoch(vq) != epoch:
                self._start_takeover(vq, epoch)
        elif own.owning(vq):
            self._lose(vq, node)
        else:
            if own.state(vq) is OwnershipState.LOST:
                own.disown(vq)  # someone else's now
            if q.remote is not None:
                q.remote.set_owner(node)

    # ================================================================ ownership
    # The moves are core/engine/ownership.py's; each method below makes one
    # (or a few) and does its queue-side work through the engine's methods.
    def _start_takeover(self, vq: tuple[str, str], epoch: int) -> None:
        if self.lease.lost or self._stopping:
            return
        old = self._taking.pop(vq, None)
        if old is not None:
            old.cancel()
        if self.ownership.owning(vq):
            # Ours again under a newer epoch: that incarnation is over, the
            # take-over below resets what it served and fences anew.
            self.ownership.lose(vq)
        self.ownership.take_over(vq, epoch)
        self._taking[vq] = asyncio.get_running_loop().create_task(self._take_over(vq, epoch))

    async def _take_over(self, vq: tuple[str, str], epoch: int) -> None:
        own = self.ownership
        vh = self.broker.vhosts.get(vq[0])
        q = vh.queues.get(vq[1]) if vh is not None else None
        me = asyncio.current_task()
        if q is None:
            if self._taking.get(vq) is me:
                self._taking.pop(vq, None)
                own.forget(vq)
            return
        # Publishes wait at the gate (with what an earlier stand-in held)
        # until the backlog is loaded; the lease guards everything from now.
        gate = LoadingGate(q, self.peers, q.remote.detach() if q.remote is not None else None)
        q.set_remote(gate)
        q.guard(self.lease)
        started = time.monotonic()
        try:
            loaded = 0
            if q.durable and not q.exclusive:
                # Fence first, then load: a write from a previous owner can no longer land.
                await self.messages.claim(vq[0], vq[1], epoch)
                own.fence(vq)
                # The store describes what it holds (the retention job reads each queue's
                # arguments there); the declarations themselves live in etcd.
                await self.messages.save_queue(QueueRecord(vq[0], vq[1], q.auto_delete, q.arguments))
                q.reset_ready()
                q.attach_storage(QueueStorage(vq[0], vq[1], self.committer, epoch))
                own.load(vq)
                loaded = await self.durability.load(q, self.broker.node_id)  # marked redelivered
            else:
                own.fence(vq)  # nothing stored: nothing to fence or load
                own.load(vq)
        except (StoreError, asyncio.CancelledError) as exc:
            if self._taking.get(vq) is me:  # still this take-over's to undo (not lost or restarted meanwhile)
                self._taking.pop(vq, None)
                own.lose(vq)
                q.stop_serving()
                self._become_remote(q, None)
            if isinstance(exc, asyncio.CancelledError):
                raise
            if isinstance(exc, Fenced):
                log.warning("queue taken over by a newer owner while loading", extra={"vhost": vq[0], "queue": vq[1]})
                return
            log.error("cannot take the queue over (store failed); giving it up",
                      extra={"vhost": vq[0], "queue": vq[1], "error": str(exc)})
            await self._give_up(vq)
            return
        if self._taking.get(vq) is not me or not q.lease_valid():
            return  # lost meanwhile (the lease check gave it up already), or restarted
        held = gate.detach()
        q.set_remote(None)
        self._taking.pop(vq, None)
        own.serve(vq)
        self._flush_held(q, held)
        q.default.dispatch()
        q.touch()  # the x-expires clock runs on the owner
        log.info("serving queue", extra={"vhost": vq[0], "queue": vq[1], "epoch": epoch, "messages_loaded": loaded,
                                         "ms": round((time.monotonic() - started) * 1000, 1)})

    def _flush_held(self, q: Queue, held: list[Any]) -> None:
        # Publishes held while the queue loaded: enqueued now, answered by the one confirm rule.
        committer = self.committer
        for message, cbs in held:
            outcome = publish.publish_to(q, message, committer, track=bool(cbs))
            for cb in cbs:
                outcome.on_settled(cb)

    def _lose(self, vq: tuple[str, str], new_owner: str | None) -> None:
        """Stop serving a queue involuntarily (lease lost, fenced, moved): LOST; NOT_OWNED once the owner is known."""
        own = self.ownership
        if own.owning(vq):
            own.lose(vq)
        if new_owner is not None and own.state(vq) is OwnershipState.LOST:
            own.disown(vq)
        self._stop_serving(vq, new_owner)

    def _hand_back(self, vq: tuple[str, str], new_owner: str | None) -> None:
        """The hand-over is done (our owner key is gone): RELEASING -> NOT_OWNED."""
        self.ownership.disown(vq)
        self._stop_serving(vq, new_owner)

    def _stop_serving(self, vq: tuple[str, str], new_owner: str | None) -> None:
        """The queue side of losing or handing back: its stored data stays for the next owner."""
        task = self._taking.pop(vq, None)
        if task is not None:
            task.cancel()
        vh = self.broker.vhosts.get(vq[0])
        q = vh.queues.get(vq[1]) if vh is not None else None
        if vh is None or q is None:
            return
        q.stop_serving()
        if not q.durable or q.exclusive:
            # Nothing of it is stored: it cannot move, it goes (its consumers get basic.cancel).
            self._apply(functools.partial(vh.drop_queue, q))
            return
        if isinstance(q, StreamQueue):
            # A stream's in-memory log and readers belong to its owner: start
            # over with a fresh remote copy (its bindings come back with it).
            self._recreate(vq, new_owner)
            log.warning("stopped serving stream", extra={"vhost": vq[0], "queue": vq[1],
                                                          "new_owner": new_owner or "-"})
            return
        self._become_remote(q, new_owner)
        log.warning("stopped serving queue", extra={"vhost": vq[0], "queue": vq[1], "new_owner": new_owner or "-"})

    def _recreate(self, vq: tuple[str, str], owner: str | None) -> None:
        vh = self.broker.vhosts.get(vq[0])
        meta = self.mirror.queues.get(vq)
        q = vh.queues.get(vq[1]) if vh is not None else None
        if vh is None or meta is None or q is None:
            return
        held = q.remote.detach() if q.remote is not None else []
        self._apply(functools.partial(vh.drop_queue, q))
        self._queue_event(vq[0], vq[1], meta)
        fresh = vh.queues.get(vq[1])
        if fresh is None:
            return
        if fresh.remote is not None:
            fresh.remote.set_owner(owner)
            fresh.remote.adopt(held)
        for v, source, kind, dest, rk, args in list(self._bindings.values()):
            if v == vq[0] and kind == "queue" and dest == vq[1] and source in vh.exchanges:
                self._apply(functools.partial(vh.bind, source, fresh, rk, args, restoring=True))

    def _become_remote(self, q: Queue, owner: str | None) -> None:
        """Serve ``q`` through its owner from now on; publishes held so far follow."""
        held = q.remote.detach() if q.remote is not None else []
        remote = QueueRemote(q, self.peers, owner)
        q.set_remote(remote)
        remote.adopt(held)

    def fenced(self, queues: list[tuple[str, str]]) -> None:
        """The store refused a batch: a newer owner holds these queues."""
        for vq in queues:
            if self.ownership.owning(vq):
                owner = self.mirror.owners.get(vq)
                self._lose(vq, owner[0] if owner and owner[0] != self.node_id else None)

    async def _give_up(self, vq: tuple[str, str]) -> bool:
        """Delete our owner key of ``vq``; False when it is not ours (any more) or etcd did not answer."""
        t = self.client.transactions
        key = self.keys.owner(*vq)
        try:
            ok, _ = await self._txn([t.value(key) == self.node_id.encode()], [t.delete(key)])
        except Exception:  # noqa: BLE001 - the caller goes on either way
            return False
        return bool(ok)

    def _owned_counts(self) -> dict[str, int]:
        counts = {node: 0 for node in self.mirror.nodes}
        for node, _ in self.mirror.owners.values():
            if node in counts:
                counts[node] += 1
        return counts

    def _placement(self, region: str | None = None, exclude: str | None = None) -> NodeInfo | None:
        """coordination.placement.place over the mirrored nodes (our own draining flag counts at once)."""
        nodes = [Candidate(n.id, n.region, bool(n.lease), n.draining or (n.id == self.node_id and self.draining))
                 for n in self.mirror.nodes.values()]
        chosen = place(nodes, self._owned_counts(), region, exclude)
        return self.mirror.nodes.get(chosen.id) if chosen is not None else None

    def _elect(self, vq: tuple[str, str], anyone: bool = False) -> None:
        if self.lease.lost or self._stopping or vq in self.mirror.owners:
            return
        chosen = self._placement(queue_region(self.mirror.queues.get(vq)))
        if chosen is None:
            return
        if anyone or chosen.id == self.node_id:
            spawn(self._acquire(vq, self.node_id, self.lease_id), self._background)

    async def _acquire(self, vq: tuple[str, str], node: str, lease: int) -> bool:
        t = self.client.transactions
        okey = self.keys.owner(*vq)
        qkey = self.keys.queue(*vq)
        try:
            ok, _ = await self._txn([t.create(okey) == 0, t.version(qkey) > 0],
                                    [t.put(okey, node.encode(), lease=lease)])
        except Exception as exc:  # noqa: BLE001
            log.warning("acquiring queue failed", extra={"vhost": vq[0], "queue": vq[1], "error": str(exc)})
            return False
        if ok:
            log.info("queue assigned", extra={"vhost": vq[0], "queue": vq[1], "owner": node})
        return bool(ok)

    async def _delete_dead_queue(self, vq: tuple[str, str]) -> None:
        t = self.client.transactions
        qkey = self.keys.queue(*vq)
        okey = self.keys.owner(*vq)
        with contextlib.suppress(Exception):
            await self._txn([t.create(okey) == 0], [t.delete(qkey)])
            await self._delete_bindings_to(vq[0], "queue", vq[1])

    async def _reconcile_loop(self) -> None:
        """Heal what events alone may miss: ownerless durable queues, owner keys not acted on."""
        last_info = b""
        while True:
            await asyncio.sleep(1.0)
            if self.lease.lost or self._stopping:
                continue
            now = time.monotonic()
            for vq, meta in list(self.mirror.queues.items()):
                owner = self.mirror.owners.get(vq)
                if owner is None:
                    if meta.get("durable") and not meta.get("exclusive"):
                        since = self.mirror.orphaned_since.setdefault(vq, now)
                        self._elect(vq, anyone=now - since > 3 * self.settings.lease_ttl)
                    elif meta.get("node") not in self.mirror.nodes:
                        await self._delete_dead_queue(vq)
                elif owner[0] == self.node_id and not self.ownership.owning(vq):
                    self._start_takeover(vq, owner[1])
                elif owner[0] != self.node_id and owner[0] not in self.mirror.nodes:
                    pass  # its lease is about to expire; the delete event follows
            for node in list(self.mirror.nodes):
                if node != self.node_id:
                    link = self.peers.link(node)
                    if link is not None:
                        link.watch()
            value = self._node_value()
            if value != last_info:  # the load (queue count) changed
                last_info = value
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._put_node_info(), OP_TIMEOUT)

    async def owned(self, vhost: str, queue: str) -> Queue | None:
        """The local queue when this node owns it, once loaded (waits while it is being taken over)."""
        started = time.monotonic()
        vq = (vhost, queue)
        while True:
            vh = self.broker.vhosts.get(vhost)
            q = vh.queues.get(queue) if vh is not None else None
            if q is not None and q.remote is None and not q.deleted and self.ownership.serving(vq):
                return q
            owner = self.mirror.owners.get(vq)
            mine = self.ownership.owning(vq) or (owner is not None and owner[0] == self.node_id)
            if not mine and (owner is not None or vq in self._tombstones):
                # Another node's, or deleted: answer now. (Waiting here would
                # hold up every batch behind this one on the peer's stream.)
                return None
            # Ours: wait for the take-over. Ownerless or unknown: only a short
            # grace, for an owner key or declaration still on its way here;
            # batches on a peer's stream are answered in order, so a long
            # wait here would hold up every queue that peer forwards to us.
            waited = time.monotonic() - started
            if waited > (OWNED_WAIT if mine else OWNED_GRACE):
                return None
            task = self._taking.get(vq)
            if task is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(task), OWNED_WAIT)
            else:
                await asyncio.sleep(0.01)

    def members(self) -> list[Member]:
        """The live nodes as etcd has them, in id order (queues: the owner keys each holds now)."""
        counts = self._owned_counts()
        return [Member(n.id, n.region, n.amqp, n.grpc, counts.get(n.id, 0), n.draining, n.started)
                for _, n in sorted(self.mirror.nodes.items())]

    def owner_counts(self) -> dict[str, int]:
        return self._owned_counts()

    # ============================================================ named holds
    # A shovel or a federation link runs on exactly one node: the holder of the key
    # /leveret/<cluster>/<kind>/<vhost>/<name>, put on its lease by a transaction that
    # succeeds only while the key does not exist, as queue owners are elected. When the
    # node dies its lease expires, etcd deletes the key, the watch tells every node
    # (on_holds_changed) and the first to ask takes it.
    async def hold(self, kind: str, vhost: str, name: str) -> bool:
        if self.lease.lost or not self.lease_id:
            return False
        t = self.client.transactions
        key = self.keys.hold(kind, vhost, name)
        ok, _ = await self._txn([t.create(key) == 0], [t.put(key, self.node_id.encode(), lease=self.lease_id)])
        if ok:
            log.info(f"{kind} assigned", extra={"vhost": vhost, kind: name, "node": self.node_id})
        return bool(ok)

    async def holder(self, kind: str, vhost: str, name: str) -> str | None:
        kv = await asyncio.wait_for(self.client.get(self.keys.hold(kind, vhost, name)), OP_TIMEOUT)
        return kv.value.decode() if kv is not None else None

    async def holding(self, kind: str, vhost: str, name: str) -> bool:
        return not self.lease.lost and await self.holder(kind, vhost, name) == self.node_id

    async def release(self, kind: str, vhost: str, name: str) -> None:
        t = self.client.transactions
        key = self.keys.hold(kind, vhost, name)
        await self._txn([t.value(key) == self.node_id.encode()], [t.delete(key)])

    def on_holds_changed(self, kind: str, listener: Callable[[], None]) -> None:
        self._hold_listeners.setdefault(kind, []).append(listener)

    # ================================================================= peers
    def _cluster_address(self, node: str) -> str | None:
        info = self.mirror.nodes.get(node)
        return self._dial_address(info) if info is not None else None

    def _dial_address(self, info: NodeInfo) -> str | None:
        """A peer's cluster port as this node reaches it: its remote address from another region, if it has one."""
        if info.cluster_remote and info.region != self.settings.region:
            return info.cluster_remote
        return info.cluster or None

    def _peer_broken(self, node: str) -> None:
        """A stream to a peer broke: if its port refuses connections, it is dead; end its lease now."""
        info = self.mirror.nodes.get(node)
        if info is None or self._stopping:
            return
        spawn(self._probe_peer(info), self._background)

    async def _probe_peer(self, info: NodeInfo) -> None:
        host, _, port = (self._dial_address(info) or info.grpc).rpartition(":")
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), 1.0)
            writer.close()
            return  # it listens: alive (or restarted); its lease decides
        except (OSError, TimeoutError, ValueError):
            pass
        current = self.mirror.nodes.get(info.id)
        if current is None or current.lease != info.lease:
            return
        # Its process is gone (the port refuses connections): revoking its
        # lease starts the failover now instead of at the lease's expiry. If
        # it was only restarting, the epoch fencing keeps its writes out.
        log.warning("peer unreachable and not listening: revoking its lease", extra={"peer": info.id})
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.client.revoke_lease(info.lease), OP_TIMEOUT)

    def _forward_reply(self, tag: str, routing_key: str, message: Message) -> bool:
        """A direct reply-to address of a requester on another node: send the reply there."""
        for node in self.mirror.nodes:
            if direct_reply.node_tag(node) == tag:
                link = self.peers.link(node)
                if link is None:
                    return False
                link.forward(b"/", routing_key.encode(), message)
                return True
        return False

    def _congestion(self, congested: bool) -> None:
        self.broker.set_forward_congestion(congested)

    # ============================================================ graceful moves
    async def _drain_requested(self, raw_key: bytes) -> None:
        with contextlib.suppress(Exception):
            await self.client.delete(raw_key)
        await self.drain()

    async def drain(self) -> int:
        """Hand every durable queue this node owns to the others (SIGTERM, `leveret cluster drain`)."""
        self.draining = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._put_node_info(), OP_TIMEOUT)
        moved = 0
        for vq in self.ownership.owned(OwnershipState.SERVING):
            vh = self.broker.vhosts.get(vq[0])
            q = vh.queues.get(vq[1]) if vh is not None else None
            if q is None or not q.durable or q.exclusive:
                continue
            target = self._placement(queue_region(self.mirror.queues.get(vq)), exclude=self.node_id)
            if target is None:
                log.warning("no other node to hand queues to", extra={"queues": len(self.ownership)})
                break
            if await self._hand_over(vq, q, target):
                moved += 1
        if moved:
            log.info("queues handed over", extra={"node": self.node_id, "moved": moved})
        return moved

    async def _hand_over(self, vq: tuple[str, str], q: Queue, target: NodeInfo) -> bool:
        # Hold new publishes, let what is committed-pending reach the store,
        # then give the key to the target (a new key: a new, higher epoch).
        if self.ownership.state(vq) is not OwnershipState.SERVING:
            return False  # lost (or deleted) while the queues before it moved
        gate = LoadingGate(q, self.peers)
        q.set_remote(gate)
        self.ownership.release(vq)
        try:
            await asyncio.wait_for(self.committer.drain(), 10)
        except TimeoutError:
            pass
        if not await self._give_up(vq):
            if self.ownership.state(vq) is OwnershipState.RELEASING and q.remote is gate:
                q.set_remote(None)
                self.ownership.serve(vq)  # refused: serve on
                self._flush_held(q, gate.detach())
                q.touch()
            return False
        # While we waited for etcd, the delete's watch event may already have
        # released the queue here, and the next owner's key may have arrived
        # too: keep what the mirror knows instead of forgetting it (a node
        # that forgot the new owner held forwards for it until OWNED_WAIT).
        current = self.mirror.owners.get(vq)
        if current is not None and current[0] == self.node_id:
            self.mirror.owners.pop(vq, None)
        if self.ownership.state(vq) is OwnershipState.RELEASING:
            self._hand_back(vq, None)  # the gate's held publishes follow to the next owner
        if vq not in self.mirror.owners:  # a lost race to another node is fine: someone owns it
            await self._acquire(vq, target.id, target.lease)
        return True

    # ============================================================== metadata API
    def _emit(self, kind: str, node: str, vhost: str = "", queue: str = "") -> None:
        if self.on_event is not None:
            self.on_event(kind, node, vhost, queue)

    async def _txn(self, compare: list[Any], success: list[Any], failure: list[Any] | None = None) -> tuple[bool, Any]:
        try:
            return await asyncio.wait_for(self.client.transaction(compare=compare, success=success,
                                                                  failure=failure or []), OP_TIMEOUT)
        except (aetcd.exceptions.ClientError, grpc.aio.AioRpcError, TimeoutError, ConnectionError) as exc:
            raise ClusterUnavailable(f"cluster metadata store (etcd) unavailable: {exc}") from exc

    async def declare_exchange(
        self, vhost: VirtualHost, name: str, type_: str, durable: bool, auto_delete: bool, internal: bool,
        arguments: dict[str, Any],
    ) -> None:
        if name not in vhost.exchanges:  # else the local mirror decides equivalence, below
            vhost.check_new_exchange(name, type_, arguments)
            key = self.keys.exchange(vhost.name, name)
            value = dumps({"type": type_, "durable": durable, "auto_delete": auto_delete, "internal": internal,
                           "arguments": encode_args(arguments)})
            t = self.client.transactions
            ok, responses = await self._txn([t.create(key) == 0], [t.put(key, value)], [t.get(key)])
            stored = loads(value) if ok else _first_value(responses)
            if stored is not None:
                self._exchange_event(vhost.name, name, stored)
        vhost.declare_exchange(name, type_, durable=durable, auto_delete=auto_delete, internal=internal,
                               arguments=arguments)

    async def delete_exchange(self, vhost: VirtualHost, name: str, if_unused: bool) -> None:
        vhost.check_exchange_deletable(name)
        x = vhost.exchanges.get(name)
        if x is None:
            return
        if if_unused and x.bindings:
            raise PreconditionFailed(f"exchange '{name}' in vhost '{vhost.name}' in use")
        t = self.client.transactions
        await self._txn([], [t.delete(self.keys.exchange(vhost.name, name))])
        await self._delete_bindings_from(vhost.name, name)
        await self._delete_bindings_to(vhost.name, "exchange", name)
        self._exchange_event(vhost.name, name, None)

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
        key = self.keys.queue(vhost.name, name)
        okey = self.keys.owner(vhost.name, name)
        moving = durable and not exclusive
        here = self.mirror.nodes.get(self.node_id)
        if moving and not (_client_local(arguments) and here is not None and here.lease and not self.draining):
            # RabbitMQ's x-queue-leader-locator "balanced" (the default): the
            # least loaded node of this (the declaring) node's region, else of any.
            target = self._placement(self.settings.region)
        else:
            # Not moving, or x-queue-leader-locator "client-local": the node the client declared on.
            target = here
        if target is None or not target.lease:
            raise ClusterUnavailable("no live node in the cluster to own the queue")
        # "region": where a failover or a drain looks first for its next owner.
        value = dumps({"durable": durable, "exclusive": exclusive, "auto_delete": auto_delete,
                       "arguments": encode_args(arguments), "node": self.node_id,
                       "region": self.settings.region})
        t = self.client.transactions
        if exclusive:
            self._pending_exclusive[(vhost.name, name)] = owner
        for _ in range(3):
            ok, responses = await self._txn(
                [t.create(key) == 0, t.create(okey) == 0],
                [t.put(key, value), t.put(okey, target.id.encode(), lease=target.lease)],
                [t.get(key)],
            )
            if ok:
                # Mirror it now rather than at the watch event, so the next
                # method of this client already finds the queue and its owner.
                epoch = 0
                with contextlib.suppress(Exception):
                    kv = await asyncio.wait_for(self.client.get(okey), OP_TIMEOUT)
                    if kv is not None and kv.value == target.id.encode():
                        epoch = kv.create_revision
                if epoch:
                    self.mirror.owners.setdefault((vhost.name, name), (target.id, epoch))
                self._queue_event(vhost.name, name, loads(value))
                if epoch:
                    self._owner_event((vhost.name, name), target.id, epoch)
                return
            stored = _first_value(responses)
            if stored is not None:
                self._pending_exclusive.pop((vhost.name, name), None)
                self._queue_event(vhost.name, name, stored)
                return
            # The owner key exists without the queue key (a leftover): clear it and retry.
            await self._txn([t.version(key) == 0], [t.delete(okey)])
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
        owner_entry = self.mirror.owners.get(vq)
        t = self.client.transactions
        await self._txn([], [t.delete(self.keys.queue(*vq)), t.delete(self.keys.owner(*vq))])
        await self._delete_bindings_to(vhost.name, "queue", name)
        if owner_entry is None and q.durable:
            # Nobody serves it: remove its stored messages here.
            with contextlib.suppress(StoreError):
                await self.messages.delete_queue(*vq)
        self._queue_event(vhost.name, name, None)
        return messages

    def _local_queue_deleted(self, q: Queue) -> None:
        """The core dropped a queue itself (auto-delete, x-expires, exclusive owner gone): tell the cluster."""
        if self._applying or self._stopping:
            return
        vq = (q.vhost, q.name)
        if vq not in self.mirror.queues:
            return
        self.mirror.queues.pop(vq, None)
        self.ownership.forget(vq)

        async def remove() -> None:
            t = self.client.transactions
            with contextlib.suppress(Exception):
                await self._txn([], [t.delete(self.keys.queue(*vq)), t.delete(self.keys.owner(*vq))])
                await self._delete_bindings_to(vq[0], "queue", vq[1])

        spawn(remove(), self._background)

    def _local_exchange_auto_deleted(self, vh: VirtualHost, x: Exchange) -> None:
        """An auto-delete exchange lost its last binding here: remove it from etcd too.

        Every node drops it from its own tables when it applies the unbind
        (or the deletion of the bound queue), and every node then removes the
        key, so a restarted or joining node does not bring the exchange back.
        The removal only applies to the exchange as this node knew it: one
        declared again since (a higher create revision than anything this
        node has seen) is left alone. A bind racing the removal on another
        node may get a 404, as in RabbitMQ.
        """
        if self._stopping:
            return
        vhost, name, seen = vh.name, x.name, self.revision

        async def remove() -> None:
            t = self.client.transactions
            key = self.keys.exchange(vhost, name)
            with contextlib.suppress(Exception):
                ok, _ = await self._txn([t.create(key) < seen + 1] if seen else [], [t.delete(key)])
                if ok:
                    await self._delete_bindings_to(vhost, "exchange", name)

        spawn(remove(), self._background)

    async def _delete_bindings_from(self, vhost: str, source: str) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.client.delete_prefix(self.keys.bindings_from(vhost, source)), OP_TIMEOUT)

    async def _delete_bindings_to(self, vhost: str, kind: str, dest: str) -> None:
        doomed = [k for k, (v, _, bkind, d, _, _) in self._bindings.items()
                  if v == vhost and bkind == kind and d == dest]
        if not doomed:
            return
        t = self.client.transactions
        with contextlib.suppress(Exception):
            await self._txn([], [t.delete(k) for k in doomed])

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
        key = self.keys.binding(vhost.name, source, kind, destination, routing_key, arguments)
        t = self.client.transactions
        if add:
            value = dumps({"routing_key": routing_key, "arguments": encode_args(arguments)})
            skey = self.keys.exchange(vhost.name, source)
            dkey = self.keys.queue(vhost.name, destination) if kind == "queue" else self.keys.exchange(
                vhost.name, destination)
            compare = []
            # Standard exchanges (amq.*) are not in etcd; every node has them.
            if not source.startswith("amq."):
                compare.append(t.version(skey) > 0)
            if kind == "queue" or not destination.startswith("amq."):
                compare.append(t.version(dkey) > 0)
            ok, _ = await self._txn(compare, [t.put(key, value)])
            if not ok:
                raise NotFound(f"no exchange '{source}' or {kind} '{destination}' in vhost '{vhost.name}'")
            self._binding_event(key, (vhost.name, source, kind, destination, "x"), loads(value))
        else:
            await self._txn([], [t.delete(key)])
            self._binding_event(key, (vhost.name, source, kind, destination, "x"), None)

    # ========================================================== owner operations
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


class ClusterUnavailable(BrokerError):
    code = 541  # internal error class: the client sees a clear text and may retry


def _first_value(responses: Any) -> dict[str, Any] | None:
    for r in responses or ():
        if isinstance(r, list) and r:
            value, _meta = r[0]
            return loads(value)
    return None


_SECTION_ORDER = {"nodes": 0, "vhosts": 1, "users": 2, "exchanges": 3, "queues": 4, "owners": 5, "bindings": 6,
                  "policies": 7, "parameters": 8, "drain": 9}


def _order(key: Any) -> int:
    return _SECTION_ORDER.get(key.section, 10) if key is not None else 11


def _client_local(arguments: dict[str, Any]) -> bool:
    """A quorum queue's ``x-queue-leader-locator: client-local``: placed on the declaring node."""
    value = arguments.get("x-queue-leader-locator")
    return value in ("client-local", b"client-local")
