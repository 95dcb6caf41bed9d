"""What this node knows of the cluster's etcd keys, kept by one watch, and how each key kind is applied.

Every node mirrors the cluster prefix through one watch; when the watch breaks
(etcd restarted, compaction) the node rebuilds its mirror from a snapshot and
makes its local state match it (``resync``), so a missed event heals. Each key
kind (coordination/keys.py) has its applier below: topology goes into the
local routing tables (the engine's methods, under ``applying`` so the
coordinator's own deletion hooks do not echo it back to etcd), owner keys
drive the take-over (coordination/takeover.py) and the election
(coordination/election.py), users, vhosts, policies and parameters go where
the coordinator's metadata side keeps them, and holds wake the shovel and
federation managers.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from coordination.etcd_session import OP_TIMEOUT
from coordination.keys import decode_args, loads
from core.engine.broker import User
from core.engine.exchange import Exchange
from core.engine.ownership import OwnershipState
from core.engine.queue import Queue
from core.model.policy import Policy, PolicyError
from core.model.tasks import spawn

if TYPE_CHECKING:
    from coordination.etcd import EtcdCoordinator

log = logging.getLogger("leveret.cluster")

VQ = tuple[str, str]  # (vhost, queue)
Binding = tuple[str, str, str, str, str, dict[str, Any]]  # (vhost, source, kind, destination, routing key, args)

_SECTION_ORDER = {"nodes": 0, "vhosts": 1, "users": 2, "exchanges": 3, "queues": 4, "owners": 5, "bindings": 6,
                  "policies": 7, "parameters": 8, "drain": 9}


class RemoteOwner:
    """The exclusive owner of a queue declared on another node: nobody here may use it."""


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


class Mirror:
    """The cluster's keys as this node last saw them, and the watch that keeps them."""

    def __init__(self, cluster: EtcdCoordinator) -> None:
        self.c = cluster
        self.nodes: dict[str, NodeInfo] = {}
        self.queues: dict[VQ, dict[str, Any]] = {}
        self.owners: dict[VQ, tuple[str, int]] = {}  # -> (node, epoch)
        self.orphaned_since: dict[VQ, float] = {}
        self.last_owner: dict[VQ, str] = {}  # survives the owner key's delete
        self.bindings: dict[bytes, Binding] = {}
        self.policies: set[tuple[str, bool, str]] = set()  # (vhost, operator, name) as etcd has them
        # Queues deleted lately (insertion-ordered, bounded): forwards to them fail at once.
        self.tombstones: dict[VQ, None] = {}
        # Exclusive queues being declared here: the connection that owns each.
        self.pending_exclusive: dict[VQ, object] = {}
        self.revision = 0
        self.applying = 0  # > 0 while a change from etcd is applied: the local deletion hooks stay quiet
        self.synced = asyncio.Event()

    # -- the watch and the resync --------------------------------------------------------------
    async def watch_loop(self) -> None:
        c = self.c
        while True:
            try:
                client = c.session.watch_client
                assert client is not None
                watch = await client.watch_prefix(c.keys.prefix.encode(), start_revision=self.revision + 1)
                async for event in watch:
                    self.revision = max(self.revision, event.kv.mod_revision)
                    self.apply_event(event.kind, event.kv.key, event.kv.value, event.kv.create_revision,
                                     event.kv.mod_revision)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - compaction, etcd restart: resync below
                log.warning("etcd watch ended; resyncing", extra={"error": f"{type(exc).__name__}: {exc}"})
            await asyncio.sleep(0.2)
            await c.session.renew_watch_client()
            try:
                await self.resync()
            except Exception as exc:  # noqa: BLE001
                log.warning("resync failed; retrying", extra={"error": f"{type(exc).__name__}: {exc}"})
                await asyncio.sleep(0.5)

    async def resync(self) -> None:
        """Rebuild the mirror from a snapshot and make the local state match it."""
        c = self.c
        snap = await asyncio.wait_for(c.session.client.get_prefix(c.keys.prefix.encode()), OP_TIMEOUT)
        self.revision = snap.header.revision
        seen_queues: set[VQ] = set()
        seen_owners: set[VQ] = set()
        seen_nodes: set[str] = set()
        seen_exchanges: set[VQ] = set()
        seen_bindings: set[bytes] = set()
        seen_policies: set[tuple[str, bool, str]] = set()
        seen_parameters: set[tuple[str, str, str]] = set()
        items = sorted(snap, key=lambda kv: _order(c.keys.parse(kv.key)))
        for kv in items:
            key = c.keys.parse(kv.key)
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
            self.apply_event("PUT", kv.key, kv.value, kv.create_revision, kv.mod_revision)
        for node in list(self.nodes):
            if node not in seen_nodes:
                self.apply_event("DELETE", c.keys.node(node), b"", 0)
        for vq in list(self.owners):
            if vq not in seen_owners:
                self.apply_event("DELETE", c.keys.owner(*vq), b"", 0)
        for vq in list(self.queues):
            if vq not in seen_queues:
                self.apply_event("DELETE", c.keys.queue(*vq), b"", 0)
        for key_raw in list(self.bindings):
            if key_raw not in seen_bindings:
                self.apply_event("DELETE", key_raw, b"", 0)
        for vname, vh in list(c.broker.vhosts.items()):
            for xname, x in list(vh.exchanges.items()):
                if not xname.startswith("amq.") and xname and (vname, xname) not in seen_exchanges:
                    self.apply(functools.partial(vh.drop_exchange, x))
        for vhost, operator, name in self.policies - seen_policies:
            self._policy_event(vhost, operator, name, None)
        c.forget_parameters(seen_parameters)
        c.holds_changed(None)  # holds may have gone while the watch was down
        self.synced.set()

    def apply(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (an engine change) as a change that came from etcd."""
        self.applying += 1
        try:
            return fn()
        finally:
            self.applying -= 1

    def apply_event(self, kind: str, raw_key: bytes, value: bytes, create_revision: int,
                    mod_revision: int = 0) -> None:
        c = self.c
        key = c.keys.parse(raw_key)
        if key is None:
            return
        try:
            put = kind == "PUT"
            s = key.section
            if s == "nodes":
                self._node_event(key.parts[0], loads(value) if put else None)
            elif s == "vhosts":
                if put:
                    c.add_vhost(key.parts[0])
                    self._vhost_limits(key.parts[0], loads(value).get("limits"))
            elif s == "users":
                if put:
                    self._user_put(key.parts[0], loads(value))
                else:
                    c.broker.delete_user(key.parts[0])  # its connections here close too
            elif s == "exchanges":
                self.exchange_event(key.parts[0], key.parts[1], loads(value) if put else None)
            elif s == "queues":
                self.queue_event(key.parts[0], key.parts[1], loads(value) if put else None)
            elif s == "bindings":
                self.binding_event(raw_key, key.parts, loads(value) if put else None)
            elif s == "owners":
                self.owner_event((key.parts[0], key.parts[1]), value.decode() if put else None, create_revision)
            elif s == "policies" and len(key.parts) == 3:
                operator = key.parts[1] == "operator"
                self._policy_event(key.parts[0], operator, key.parts[2], loads(value) if put else None)
            elif s == "parameters" and len(key.parts) == 3:
                c.deliver((key.parts[0], key.parts[1], key.parts[2]), loads(value).get("value") if put else None)
            elif s == "drain":
                if put and key.parts[0] == c.node_id:
                    spawn(c.drainer.requested(raw_key), c.background)
            else:
                if put and len(key.parts) == 2:  # mqtt/: which node took it, and when (take_hold)
                    c.hold_taken(s, key.parts[0], key.parts[1], value.decode(), mod_revision)
                c.holds_changed(s)  # shovels/, federation/: a hold was taken or went
        except Exception:  # a bad key must not stop the watch
            log.exception("cannot apply etcd event", extra={"key": raw_key.decode(errors="replace"), "kind": kind})

    # -- users, vhosts, policies -------------------------------------------------------------------
    def _vhost_limits(self, name: str, limits: Any) -> None:
        """RabbitMQ's vhost limits, carried by the vhost's record (coordination/metadata.py)."""
        if isinstance(limits, dict) and limits:
            self.c.broker.vhost_limits[name] = {str(k): int(v) for k, v in limits.items()}
        else:
            self.c.broker.vhost_limits.pop(name, None)

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
        self.c.broker.put_user(user)

    def _policy_event(self, vhost: str, operator: bool, name: str, value: dict[str, Any] | None) -> None:
        """A policy set or cleared through some node: applied here as that node applied it."""
        vh = self.c.broker.vhosts.get(vhost)
        if value is None:
            self.policies.discard((vhost, operator, name))
            if vh is not None:
                vh.clear_policy(name, operator=operator, restoring=True)
            return
        self.policies.add((vhost, operator, name))
        if vh is None:
            return  # applied when the vhost comes (its policies are restored from the store)
        try:
            policy = Policy.create(vhost, name, str(value.get("pattern", "")), value.get("definition") or {},
                                   str(value.get("apply_to", "all")), int(value.get("priority", 0)), operator)
        except (PolicyError, TypeError, ValueError) as exc:
            log.warning("ignoring malformed policy record in etcd", extra={"vhost": vhost, "policy": name,
                                                                           "error": str(exc)})
            return
        if (vh.operator_policies if operator else vh.policies).get(name) != policy:
            vh.set_policy(policy, restoring=True)

    # -- members -------------------------------------------------------------------------------------
    def _node_event(self, node: str, value: dict[str, Any] | None) -> None:
        c = self.c
        known = node in self.nodes
        if value is None:
            if known:
                del self.nodes[node]
                c.peers.forget(node)
                log.warning("node left the cluster", extra={"peer": node})
                c.emit("node-lost", node)
            return
        info = NodeInfo.of(value)
        self.nodes[node] = info
        if node != c.node_id and not c.stopping:
            # A standing stream to every peer: a crashed peer is noticed when
            # it breaks, not only when its lease expires (coordination/etcd_peers.py).
            link = c.peers.link(node)
            if link is not None:
                link.watch()
        if not known:
            if node != c.node_id:
                log.info("node joined the cluster", extra={"peer": node, "region": info.region})
            c.emit("node-added", node)

    # -- topology ------------------------------------------------------------------------------------
    def exchange_event(self, vhost: str, name: str, value: dict[str, Any] | None) -> None:
        vh = self.c.add_vhost(vhost)
        if value is None:
            x = vh.exchanges.get(name)
            if x is not None:
                self.apply(lambda: vh.drop_exchange(x))
            return
        if name in vh.exchanges:
            return
        self.apply(lambda: vh.declare_exchange(
            name, str(value["type"]), durable=bool(value.get("durable")), auto_delete=bool(value.get("auto_delete")),
            internal=bool(value.get("internal")), arguments=decode_args(value.get("arguments", "")),
            restoring=True))

    def queue_event(self, vhost: str, name: str, value: dict[str, Any] | None) -> None:
        c = self.c
        vq = (vhost, name)
        vh = c.add_vhost(vhost)
        if value is None:
            self.queues.pop(vq, None)
            self.orphaned_since.pop(vq, None)
            self.last_owner.pop(vq, None)
            self.tombstones[vq] = None
            if len(self.tombstones) > 10_000:
                self.tombstones.pop(next(iter(self.tombstones)))
            q = vh.queues.get(name)
            if q is not None:
                c.takeover.deleted(vq, q)
                if q.detach_storage() is not None:
                    # The owner removes the stored messages, in order with its other writes.
                    c.committer.run(lambda: c.messages.delete_queue(vhost, name))
                self.apply(functools.partial(vh.drop_queue, q))
                c.emit("queue-deleted", c.node_id, vhost, name)
            return
        self.queues[vq] = value
        self.tombstones.pop(vq, None)
        if name in vh.queues:
            return
        exclusive = bool(value.get("exclusive"))
        local = value.get("node") == c.node_id
        owner_obj = self.pending_exclusive.pop(vq, None) if exclusive and local else None
        q = self.apply(lambda: vh.declare_queue(
            name, owner_obj if owner_obj is not None else RemoteOwner(), durable=bool(value.get("durable")),
            exclusive=exclusive, auto_delete=bool(value.get("auto_delete")),
            arguments=decode_args(value.get("arguments", "")), restoring=True))
        owner = self.owners.get(vq)
        if owner is not None and owner[0] == c.node_id and not c.session.lease.lost and not c.stopping:
            c.takeover.start(vq, owner[1])
        else:
            c.takeover.become_remote(q, owner[0] if owner and owner[0] != c.node_id else None)
            if owner is None and value.get("durable"):
                self.orphaned_since.setdefault(vq, time.monotonic())
        c.emit("queue-created", c.node_id, vhost, name)

    def binding_event(self, raw_key: bytes, parts: tuple[str, ...], value: dict[str, Any] | None) -> None:
        if len(parts) < 5:
            return
        vhost, source, kind, dest = parts[0], parts[1], parts[2], parts[3]
        vh = self.c.add_vhost(vhost)
        if value is None:
            entry = self.bindings.pop(raw_key, None)
            if entry is None:
                return
            _, _, _, _, rk, args = entry
            d = vh.queues.get(dest) if kind == "queue" else vh.exchanges.get(dest)
            if d is not None:
                self.apply(lambda: vh.unbind(source, d, rk, args))  # type: ignore[arg-type]
            return
        rk = str(value.get("routing_key", ""))
        args = decode_args(value.get("arguments", ""))
        self.bindings[raw_key] = (vhost, source, kind, dest, rk, args)
        d2: Queue | Exchange | None = vh.queues.get(dest) if kind == "queue" else vh.exchanges.get(dest)
        if d2 is not None and source in vh.exchanges:
            self.apply(lambda: vh.bind(source, d2, rk, args, restoring=True))

    def bindings_to(self, vhost: str, kind: str, dest: str) -> list[bytes]:
        return [k for k, (v, _, bkind, d, _, _) in self.bindings.items() if v == vhost and bkind == kind and d == dest]

    # -- owners --------------------------------------------------------------------------------------
    def owner_event(self, vq: VQ, node: str | None, epoch: int) -> None:
        c = self.c
        previous = self.owners.get(vq)
        vh = c.broker.vhosts.get(vq[0])
        q = vh.queues.get(vq[1]) if vh is not None else None
        own = c.ownership
        if node is None:
            self.owners.pop(vq, None)
            if previous is not None and previous[0] == c.node_id:
                if own.state(vq) is OwnershipState.RELEASING:
                    c.takeover.hand_back(vq, None)  # our own give-up's event, ahead of its answer
                elif own.owning(vq):
                    c.takeover.lose(vq, None)
            elif q is not None and q.remote is not None:
                q.remote.set_owner(None)
            meta = self.queues.get(vq)
            if meta is None:
                return
            if meta.get("durable") and not meta.get("exclusive"):
                self.orphaned_since[vq] = time.monotonic()
                c.election.elect(vq)
            else:
                # Transient and exclusive queues die with their node (as in RabbitMQ).
                spawn(c.election.delete_dead_queue(vq), c.background)
            return
        self.owners[vq] = (node, epoch)
        self.orphaned_since.pop(vq, None)
        last = self.last_owner.get(vq)
        self.last_owner[vq] = node
        if last is not None and last != node:
            c.emit("queue-moved", node, vq[0], vq[1])
        if q is None:
            return
        if node == c.node_id:
            if not own.owning(vq) or own.epoch(vq) != epoch:
                c.takeover.start(vq, epoch)
        elif own.owning(vq):
            c.takeover.lose(vq, node)
        else:
            if own.state(vq) is OwnershipState.LOST:
                own.disown(vq)  # someone else's now
            if q.remote is not None:
                q.remote.set_owner(node)

    def recreate(self, vq: VQ, owner: str | None) -> None:
        """A stream that stopped being served here: a fresh remote copy, its bindings back on it."""
        c = self.c
        vh = c.broker.vhosts.get(vq[0])
        meta = self.queues.get(vq)
        q = vh.queues.get(vq[1]) if vh is not None else None
        if vh is None or meta is None or q is None:
            return
        held = q.remote.detach() if q.remote is not None else []
        self.apply(functools.partial(vh.drop_queue, q))
        self.queue_event(vq[0], vq[1], meta)
        fresh = vh.queues.get(vq[1])
        if fresh is None:
            return
        if fresh.remote is not None:
            fresh.remote.set_owner(owner)
            fresh.remote.adopt(held)
        for v, source, kind, dest, rk, args in list(self.bindings.values()):
            if v == vq[0] and kind == "queue" and dest == vq[1] and source in vh.exchanges:
                self.apply(functools.partial(vh.bind, source, fresh, rk, args, restoring=True))


def _order(key: Any) -> int:
    return _SECTION_ORDER.get(key.section, 10) if key is not None else 11

