"""The node's shovels: which exist (runtime parameters), which run here, their status.

Parameters go through the coordinator (core/ports/coordinator.py): stored, and in
a cluster carried to every node by etcd, whose watch delivers each change
(``on_parameter``), this node's own included; nothing polls. A shovel defined
anywhere is tried here when it appears and whenever a hold may have moved
(``on_holds_changed``: its holder's lease went, our lease went, the watch
resynced): the node that wins the named hold runs it, the others only list
it. A shovel set or cleared through this node's API starts or stops before
the call returns.

The manager is the node's one writer of runtime parameters: other components
that live in them (federation upstreams and upstream sets,
leveret/links/federation/) register a ``ParameterListener`` and are validated,
applied and told of changes through it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Protocol

from core.model.tasks import spawn
from core.ports.store import StoreError
from leveret.links.shovel.spec import COMPONENT, ShovelError, ShovelSpec, parse, redact
from leveret.links.shovel.worker import ShovelRunner

if TYPE_CHECKING:
    from core.engine.broker import Broker
    from core.ports.coordinator import Metadata

log = logging.getLogger("leveret.shovel")

Key = tuple[str, str, str]  # (vhost, component, name)
HOLD = "shovels"  # the kind of the coordinator's named hold of a shovel
# A change another node made is acted on this much later: the node it was made through starts
# the shovel (or link) at once and so normally holds it, as an operator who defined it there expects.
OTHERS_DELAY = 0.5


class ParameterListener(Protocol):
    """A component other than ``shovel`` whose parameters the manager stores and applies for it."""

    components: frozenset[str]

    def validate(self, vhost: str, component: str, name: str, value: Any) -> None:
        """ParameterError (400) when ``value`` is not acceptable; nothing is stored then."""
        ...

    def apply(self, vhost: str, component: str, name: str, value: Any) -> None:
        """The parameter as stored now (None: cleared); also for a vhost this node does not have."""
        ...

    async def changed(self) -> None:
        """A parameter of the listener's was set or cleared through this node: act on it now."""
        ...


class ShovelManager:
    def __init__(self, broker: Broker, coordinator: Metadata, node: str, local_port: int) -> None:
        self.broker = broker
        self.coordinator = coordinator
        self._background: set[asyncio.Task[Any]] = set()  # finished shovels deleting their parameter, reconciles
        self.node = node
        self.local_port = local_port
        self.specs: dict[tuple[str, str], ShovelSpec] = {}  # every shovel defined, wherever it runs
        self.running: dict[tuple[str, str], ShovelRunner] = {}  # those this node runs
        self._lock = asyncio.Lock()  # one reconcile at a time (changes delivered and API calls)
        self._stopped = False
        self._mine: set[Key] = set()  # parameters being set or cleared through this node right now
        self.listeners: list[ParameterListener] = []

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Restore every stored parameter into its vhost and start the shovels this node holds."""
        for key, value in (await self.coordinator.parameters()).items():
            self._apply(key, value)
        self.coordinator.on_parameter(self._delivered)
        self.coordinator.on_holds_changed(HOLD, self._holds_moved)
        await self.reconcile()

    async def stop(self) -> None:
        self._stopped = True
        async with self._lock:
            pass  # a reconcile under way ends first
        for vn in list(self.running):
            await self._stop_one(vn, release=True)

    # -- parameters, as the management API sets and clears them ----------------------
    def validate(self, vhost: str, component: str, name: str, value: Any) -> None:
        """ParameterError (400) when a shovel's or a listener's parameter is not valid; other components pass."""
        if component == COMPONENT:
            parse(vhost, name, value)
        for listener in self.listeners:
            if component in listener.components:
                listener.validate(vhost, component, name, value)

    async def _changed(self, component: str) -> None:
        for listener in self.listeners:
            if component in listener.components:
                try:
                    await listener.changed()
                except Exception as exc:  # noqa: BLE001  stored already: the next change or resync retries
                    log.warning("applying a runtime parameter failed; retried at the next change",
                                extra={"component": component, "error": f"{type(exc).__name__}: {exc}"})

    async def set_parameter(self, vhost: str, component: str, name: str, value: Any) -> None:
        """Validated, stored (StoreError: not stored, not applied), applied here before it returns."""
        self.validate(vhost, component, name, value)
        key = (vhost, component, name)
        self._mine.add(key)
        try:
            await self.coordinator.set_parameter(vhost, component, name, value)  # delivered here: _delivered
        finally:
            self._mine.discard(key)
        await self._settle(component)

    async def clear_parameter(self, vhost: str, component: str, name: str) -> bool:
        vh = self.broker.vhosts.get(vhost)
        existed = vh is not None and (component, name) in vh.parameters
        key = (vhost, component, name)
        self._mine.add(key)
        try:
            await self.coordinator.clear_parameter(vhost, component, name)
        finally:
            self._mine.discard(key)
        await self._settle(component)
        return existed

    def _delivered(self, vhost: str, component: str, name: str, value: Any) -> None:
        """The coordinator's delivery of a parameter change (another node's, or this node's own)."""
        key = (vhost, component, name)
        self._apply(key, value)
        if key not in self._mine and not self._stopped:  # this node's own: set_parameter settles it
            spawn(self._settle(component, OTHERS_DELAY), self._background)

    def _holds_moved(self) -> None:
        if not self._stopped:
            spawn(self._reconcile_now(), self._background)

    async def _settle(self, component: str, delay: float = 0.0) -> None:
        """After a change of ``component``: shovels started or stopped, listeners told."""
        if delay:
            await asyncio.sleep(delay)
            if self._stopped:
                return  # the node stops: nothing starts any more (federation has stopped already)
        if component == COMPONENT:
            await self._reconcile_now()
        await self._changed(component)

    async def _reconcile_now(self) -> None:
        """The parameter is stored: a failure to place it now (etcd away) is retried when holds move
        again (the coordinator's watch resyncs once etcd is back)."""
        try:
            await self.reconcile()
        except Exception as exc:  # noqa: BLE001
            log.warning("shovel placement failed; retried when etcd is back",
                        extra={"error": f"{type(exc).__name__}: {exc}"})

    def _apply(self, key: Key, value: Any) -> None:
        vhost, component, name = key
        vh = self.broker.vhosts.get(vhost)
        if vh is not None:
            if value is None:
                vh.parameters.pop((component, name), None)
            else:
                vh.parameters[(component, name)] = value
        for listener in self.listeners:
            if component in listener.components:
                listener.apply(vhost, component, name, value)
        if component != COMPONENT:
            return
        if value is None or vh is None:
            self.specs.pop((vhost, name), None)
            return
        try:
            self.specs[(vhost, name)] = parse(vhost, name, value)
        except ShovelError as exc:
            log.warning("stored shovel parameter is invalid; not run", extra={
                "vhost": vhost, "shovel": name, "error": str(exc)})
            self.specs.pop((vhost, name), None)

    async def reconcile(self) -> None:
        """Stop what is gone, changed or no longer held; start what this node can hold."""
        async with self._lock:
            if self._stopped:
                return
            for vn, runner in list(self.running.items()):
                spec = self.specs.get(vn)
                if spec != runner.spec:
                    await self._stop_one(vn, release=True)
                elif not await self.coordinator.holding(HOLD, *vn):
                    log.warning("shovel no longer held by this node; stopped", extra={"vhost": vn[0], "shovel": vn[1]})
                    await self._stop_one(vn, release=False)
            for vn, spec in list(self.specs.items()):
                if vn not in self.running and await self.coordinator.hold(HOLD, *vn):
                    runner = ShovelRunner(spec, self.node, self.local_port, self._finished, self.broker)
                    self.running[vn] = runner
                    runner.start()

    async def _stop_one(self, vn: tuple[str, str], release: bool) -> None:
        runner = self.running.pop(vn, None)
        if runner is not None:
            await runner.stop()
        if release:
            try:
                await self.coordinator.release(HOLD, *vn)
            except Exception as exc:  # noqa: BLE001  the key is on our lease: it goes with it anyway
                log.warning("releasing shovel failed", extra={"vhost": vn[0], "shovel": vn[1], "error": str(exc)})

    def _finished(self, spec: ShovelSpec) -> None:
        """src-delete-after reached: the shovel deletes its own parameter (as RabbitMQ's does)."""
        async def delete() -> None:
            try:
                await self.clear_parameter(spec.vhost, COMPONENT, spec.name)
            except StoreError as exc:
                log.warning("could not delete the finished shovel's parameter",
                            extra={"vhost": spec.vhost, "shovel": spec.name, "error": str(exc)})

        spawn(delete(), self._background)

    async def restart(self, vhost: str, name: str) -> bool:
        """Stop and start the shovel if this node runs it (False: it runs elsewhere, or nowhere yet)."""
        runner = self.running.get((vhost, name))
        if runner is None:
            return False
        await runner.stop()
        runner.start()
        return True

    # -- status ----------------------------------------------------------------------
    async def status(self, vhosts: set[str] | None = None) -> list[dict[str, Any]]:
        """/api/shovels: every shovel defined; those run elsewhere by their holder (or 'starting' when none)."""
        out = []
        for vn, spec in sorted(self.specs.items()):
            if vhosts is not None and vn[0] not in vhosts:
                continue
            runner = self.running.get(vn)
            if runner is not None:
                out.append(runner.status())
                continue
            try:
                node = await self.coordinator.holder(HOLD, *vn)
            except Exception:  # noqa: BLE001
                node = None
            out.append({"node": node or "", "name": spec.name, "vhost": spec.vhost, "type": "dynamic",
                        "state": "running" if node else "starting", "src_uri": redact(spec.src_uris[0]),
                        "dest_uri": redact(spec.dest_uris[0])})
        return out
