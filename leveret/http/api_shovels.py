"""Runtime parameters stored and applied through the node's shovel manager, and /api/shovels (leveret/links/shovel/)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from core.ports.store import StoreError
from leveret.http import listing
from leveret.http.errors import HttpError, bad_request, not_found
from leveret.http.responses import no_content
from leveret.links import identity
from leveret.links.federation.spec import UPSTREAM, UPSTREAM_SET
from leveret.links.shovel.manager import HOLD
from leveret.links.shovel.spec import COMPONENT, ParameterError, ShovelError

if TYPE_CHECKING:
    from leveret.http.routing import Router
    from leveret.http.server import Call


def register(r: Router) -> None:
    r.add("shovels", GET=(shovels, "monitoring"))
    r.add("shovels/{vhost}", GET=(shovels, "monitoring"))
    r.add("shovels/vhost/{vhost}/{name}", GET=(shovel_one, "monitoring"))
    r.add("shovels/vhost/{vhost}/{name}/restart", DELETE=(shovel_restart, "policymaker"))


def _unavailable(exc: StoreError) -> HttpError:
    return HttpError(503, "service_unavailable", f"the store did not take the parameter: {exc}")


def _owned(call: Call, component: str, value: Any) -> Any:
    """A shovel's or federation upstream's value stamped with its owner, the setter (403 when the setter may
    not reach what its URIs name: leveret/links/identity.py)."""
    if component == UPSTREAM_SET and isinstance(value, list):
        # A set's entry may override an upstream's uri: the setter must be allowed that URI itself.
        _check(call, call.user.name, [e for e in value if isinstance(e, dict)], ("uri",))
        return value
    if component not in (COMPONENT, UPSTREAM) or not isinstance(value, dict):
        return value
    value = identity.stamped(call.broker, value, call.user)
    keys = ("src-uri", "dest-uri") if component == COMPONENT else ("uri",)
    _check(call, value[identity.OWNER_KEY], [value], keys)
    return value


def _check(call: Call, owner: str, values: list[dict[str, Any]], keys: tuple[str, ...]) -> None:
    uris = [u for value in values for k in keys
            for u in ([value[k]] if isinstance(value.get(k), str) else value.get(k) or []) if isinstance(u, str)]
    try:
        identity.check_set(call.broker, owner, uris, call.node.config.default_user)
    except identity.LinkForbidden as exc:
        raise HttpError(403, "access_refused", str(exc)) from None


async def set_parameter(call: Call, vhost: str, component: str, name: str, value: Any) -> None:
    """Owned (403), validated (400), stored (503 when the store is down: nothing applied), applied here now."""
    value = _owned(call, component, value)
    manager = call.node.shovels
    if manager is None:  # a node without a store (tests of the HTTP layer alone): memory only
        call.broker.vhosts[vhost].parameters[(component, name)] = value
        return
    try:
        await manager.set_parameter(vhost, component, name, value)
    except ShovelError as exc:
        raise bad_request(f"invalid shovel {name!r}: {exc}") from None
    except ParameterError as exc:
        raise bad_request(f"invalid {component} {name!r}: {exc}") from None
    except StoreError as exc:
        raise _unavailable(exc) from None


async def clear_parameter(call: Call, vhost: str, component: str, name: str) -> bool:
    manager = call.node.shovels
    if manager is None:
        return call.broker.vhosts[vhost].parameters.pop((component, name), None) is not None
    try:
        return await manager.clear_parameter(vhost, component, name)
    except StoreError as exc:
        raise _unavailable(exc) from None


async def _status(call: Call, vhost: str | None) -> list[dict[str, Any]]:
    manager = call.node.shovels
    if manager is None:
        return []
    names = {vhost} if vhost is not None else {vh.name for vh in call.visible_vhosts()}
    return await manager.status(names)


async def shovels(call: Call) -> Any:
    vhost = call.vhost().name if "vhost" in call.params else None
    return listing.apply(await _status(call, vhost), call.query)


async def shovel_one(call: Call) -> Any:
    vh = call.vhost()
    found = [s for s in await _status(call, vh.name) if s["name"] == call.params["name"]]
    if not found:
        raise not_found(f"shovel '{call.params['name']}' not found")
    return found[0]


async def shovel_restart(call: Call) -> Any:
    """RabbitMQ's restart: the shovel's connections closed and opened again (on the node that runs it)."""
    vh = call.vhost(write=True)
    manager, name = call.node.shovels, call.params["name"]
    if manager is None or (vh.name, name) not in manager.specs:
        raise not_found(f"shovel '{name}' not found")
    if not await manager.restart(vh.name, name):
        node = await call.broker.coordinator.holder(HOLD, vh.name, name)
        raise bad_request(f"shovel '{name}' runs on node {node or '(none yet)'}: restart it there")
    return no_content()
