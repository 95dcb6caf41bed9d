"""The node's federation links: which the policies ask for, which run here, their status; the cluster name.

Upstreams and upstream sets are runtime parameters, which the coordinator
delivers to the shovel manager (leveret/links/shovel/manager.py), which hands
this manager those of its components (``ParameterListener``). Which exchanges
are federated comes from the policies (``federation-upstream``,
``federation-upstream-set``) and the exchanges this node has, which no event
announces; so every ``poll`` seconds (from this node's own tables: no store is
read), at once when a parameter changes, and when a hold may have moved, the
manager works out the links wanted (one per federated exchange and upstream)
and reconciles them with those it runs. Each link runs on one node of the
cluster, held through the coordinator's named hold (kind ``federation``), and
moves when that node dies.

The cluster name (RabbitMQ's ``cluster_name``, which loop prevention compares)
is a global parameter: settable through ``PUT /api/cluster-name``, stored, so
every node of a cluster agrees, and advertised in the AMQP server properties.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from core.model.policy import select
from core.model.tasks import spawn, stop_task
from leveret.links.federation.link import FederationLink, local_connection
from leveret.links.federation.spec import COMPONENTS, UPSTREAM, UPSTREAM_SET, FederationError, LinkSpec, upstreams_of
from leveret.links.federation.spec import validate as validate_parameter
from leveret.links.shovel.spec import redact

if TYPE_CHECKING:
    from core.engine.broker import Broker
    from core.ports.coordinator import Metadata

log = logging.getLogger("leveret.federation")

GLOBAL = "global"  # component of the global parameters (stored under the vhost ""): core.ports.coordinator.GLOBAL
HOLD = "federation"  # the kind of the coordinator's named hold of a link
CLUSTER_NAME = "cluster_name"
LinkKey = tuple[str, str, str]  # (vhost, exchange, upstream)
UNLINK_TIMEOUT = 10.0


def _held_name(exchange: str, upstream: str) -> str:
    return f"{quote(exchange, safe='')}/{quote(upstream, safe='')}"


class FederationManager:
    components = COMPONENTS | {GLOBAL}

    def __init__(self, broker: Broker, coordinator: Metadata, node: str, local_port: int, default_cluster_name: str,
                 on_cluster_name: Callable[[str], None] = lambda name: None, poll: float = 1.0) -> None:
        self.broker = broker
        self.coordinator = coordinator
        self.node = node
        self.local_port = local_port
        self.default_cluster_name = default_cluster_name
        self.on_cluster_name = on_cluster_name
        self.poll = poll
        self.upstreams: dict[str, dict[str, Any]] = {}  # vhost -> name -> stored value
        self.sets: dict[str, dict[str, Any]] = {}
        self.stored_cluster_name: str | None = None
        self.running: dict[LinkKey, FederationLink] = {}
        self.wanted: dict[LinkKey, LinkSpec] = {}
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._unlinking: set[asyncio.Task[None]] = set()
        self._renamed = False
        on_cluster_name(default_cluster_name)

    # -- the cluster name ------------------------------------------------------------
    def cluster_name(self) -> str:
        return self.stored_cluster_name or self.default_cluster_name

    # -- ParameterListener (leveret/links/shovel/manager.py) ----------------------------------
    def validate(self, vhost: str, component: str, name: str, value: Any) -> None:
        if component == GLOBAL:
            if name != CLUSTER_NAME:
                raise FederationError(f"unknown global parameter {name!r}")
            if not isinstance(value, str) or not value or len(value) > 255:
                raise FederationError("cluster_name must be a non-empty string of at most 255 characters")
            return
        validate_parameter(component, name, value)

    def apply(self, vhost: str, component: str, name: str, value: Any) -> None:
        if component == GLOBAL:
            if name == CLUSTER_NAME:
                before = self.cluster_name()
                self.stored_cluster_name = value if isinstance(value, str) and value else None
                self.on_cluster_name(self.cluster_name())
                # The upstream queues are named after it: the links start again under the new name.
                self._renamed = self._renamed or before != self.cluster_name()
            return
        table = (self.upstreams if component == UPSTREAM else self.sets).setdefault(vhost, {})
        if value is None:
            table.pop(name, None)
        else:
            table[name] = value

    async def changed(self) -> None:
        await self.reconcile()

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        self.coordinator.on_holds_changed(HOLD, self._holds_moved)
        await self._reconcile_logged()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="federation manager")

    def _holds_moved(self) -> None:
        if self._task is not None and not self._task.done():
            spawn(self._reconcile_logged(), self._unlinking)

    async def stop(self) -> None:
        await stop_task(self._task)
        async with self._lock:
            for key in list(self.running):
                await self._stop_one(key, release=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.poll)
            await self._reconcile_logged()

    async def _reconcile_logged(self) -> None:
        try:
            await self.reconcile()
        except Exception as exc:  # noqa: BLE001  etcd away: the next poll retries
            log.warning("federation placement failed; the next poll retries",
                        extra={"error": f"{type(exc).__name__}: {exc}"})

    # -- what is wanted, and what runs -------------------------------------------------
    def desired(self) -> dict[LinkKey, LinkSpec]:
        """One link per federated exchange and upstream, from the policies and parameters as they are now."""
        out: dict[LinkKey, LinkSpec] = {}
        for vname, vh in list(self.broker.vhosts.items()):
            ups, sets = self.upstreams.get(vname, {}), self.sets.get(vname, {})
            policies = [p for p in vh.policies.values()
                        if UPSTREAM in p.definition or UPSTREAM_SET in p.definition]
            if not policies or not ups:
                continue
            for x in list(vh.exchanges.values()):
                if x.name == "" or x.name.startswith("amq."):
                    continue  # RabbitMQ federates neither the default exchange nor amq.*
                policy = select(vh.policies.values(), "exchange", x.name)
                if policy is None:
                    continue
                for upstream in upstreams_of(policy.definition, ups, sets):
                    out[(vname, x.name, upstream.name)] = LinkSpec(vname, x.name, x.type, x.durable, policy.name,
                                                                   upstream)
        return out

    async def reconcile(self) -> None:
        """Stop what is no longer wanted, changed or held; start what this node can hold."""
        async with self._lock:
            self.wanted = self.desired()
            renamed, self._renamed = self._renamed, False
            for key, link in list(self.running.items()):
                spec = self.wanted.get(key)
                if spec is None or renamed:
                    await self._stop_one(key, release=True)
                    self._unlink(link)
                elif spec != link.spec:
                    await self._stop_one(key, release=True)
                elif not await self.coordinator.holding(HOLD, key[0], _held_name(key[1], key[2])):
                    log.warning("federation link no longer held by this node; stopped",
                                extra={"vhost": key[0], "exchange": key[1], "upstream": key[2]})
                    await self._stop_one(key, release=False)
            for key, spec in self.wanted.items():
                if key not in self.running and await self.coordinator.hold(HOLD, key[0], _held_name(key[1], key[2])):
                    link = FederationLink(spec, self.broker, self.node, self.local_port, self.cluster_name)
                    self.running[key] = link
                    link.start()

    def _unlink(self, link: FederationLink) -> None:
        """In the background: an unreachable upstream must not hold the other links' reconcile."""
        async def run() -> None:
            try:
                await asyncio.wait_for(link.unlink(), UNLINK_TIMEOUT)
            except Exception as exc:  # noqa: BLE001  the upstream keeps the bindings; expires may clean it
                log.warning("could not remove a federation link's bindings upstream", extra={
                    "vhost": link.spec.vhost, "exchange": link.spec.exchange, "upstream": link.spec.upstream.name,
                    "error": f"{type(exc).__name__}: {exc}"})

        spawn(run(), self._unlinking)

    async def _stop_one(self, key: LinkKey, release: bool) -> None:
        link = self.running.pop(key, None)
        if link is not None:
            await link.stop()
        if release:
            try:
                await self.coordinator.release(HOLD, key[0], _held_name(key[1], key[2]))
            except Exception as exc:  # noqa: BLE001  the key is on our lease: it goes with it anyway
                log.warning("releasing federation link failed", extra={
                    "vhost": key[0], "exchange": key[1], "upstream": key[2], "error": str(exc)})

    # -- status ----------------------------------------------------------------------
    async def status(self, vhosts: set[str] | None = None) -> list[dict[str, Any]]:
        """/api/federation-links: every link wanted; one run elsewhere by its holder (``starting`` if none)."""
        out = []
        for key, spec in sorted(self.wanted.items()):
            if vhosts is not None and key[0] not in vhosts:
                continue
            link = self.running.get(key)
            if link is not None:
                out.append(link.status())
                continue
            try:
                node = await self.coordinator.holder(HOLD, key[0], _held_name(key[1], key[2]))
            except Exception:  # noqa: BLE001
                node = None
            out.append({"node": node or "", "exchange": spec.exchange, "upstream_exchange": spec.upstream_exchange,
                        "type": "exchange", "vhost": spec.vhost, "upstream": spec.upstream.name, "id": spec.id,
                        "status": "running" if node else "starting", "local_connection": local_connection(spec),
                        "uri": redact(spec.upstream.uris[0])})
        return out
