"""RabbitMQ's vhost and user limits over HTTP: /api/vhost-limits/..., /api/user-limits/... (core/engine/limits.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from core.engine import limits
from leveret.http.errors import bad_request, not_found
from leveret.http.responses import no_content

if TYPE_CHECKING:
    from core.engine.broker import User
    from leveret.http.routing import Router
    from leveret.http.server import Call


def register(r: Router) -> None:
    r.add("vhost-limits", GET=(vhost_limits, "management"))
    r.add("vhost-limits/{vhost}", GET=(vhost_limits, "management"))
    r.add("vhost-limits/{vhost}/{name}", PUT=(vhost_limit_put, "administrator"),
          DELETE=(vhost_limit_delete, "administrator"))
    r.add("user-limits", GET=(user_limits, "administrator"))
    r.add("user-limits/{user}", GET=(user_limits, "administrator"))
    r.add("user-limits/{user}/{name}", PUT=(user_limit_put, "administrator"),
          DELETE=(user_limit_delete, "administrator"))


async def _value(call: Call, name: str, known: tuple[str, ...], kind: str) -> int:
    """The ``{"value": N}`` body, checked as RabbitMQ does (400 with its words)."""
    body = await call.body(frozenset({"value", "vhost", "user", "name"}))
    if "value" not in body:
        raise bad_request("value is required")
    try:
        return limits.parse(kind, {name: body["value"]}, known)[name]
    except ValueError as exc:
        raise bad_request(str(exc)) from None


async def vhost_limits(call: Call) -> Any:
    vhosts = [call.vhost()] if "vhost" in call.params else call.visible_vhosts()
    table = call.broker.vhost_limits
    return [{"vhost": vh.name, "value": dict(table[vh.name])} for vh in vhosts if table.get(vh.name)]


async def vhost_limit_put(call: Call) -> web.Response:
    vh = call.vhost(write=True)
    name = call.params["name"]
    value = await _value(call, name, limits.VHOST_LIMITS, "limits")
    current = dict(call.broker.vhost_limits.get(vh.name, {}))
    current[name] = value
    await call.broker.coordinator.set_vhost_limits(vh.name, current)
    return no_content()


async def vhost_limit_delete(call: Call) -> web.Response:
    vh = call.vhost(write=True)
    current = dict(call.broker.vhost_limits.get(vh.name, {}))
    if current.pop(call.params["name"], None) is not None:
        await call.broker.coordinator.set_vhost_limits(vh.name, current)
    return no_content()


def _user(call: Call, status_404: bool) -> User:
    user = call.broker.users.get(call.params["user"])
    if user is None:
        raise not_found() if status_404 else bad_request(f"no_such_user: {call.params['user']}")
    return user


async def user_limits(call: Call) -> Any:
    users = [_user(call, True)] if "user" in call.params else list(call.broker.users.values())
    return [{"user": u.name, "value": dict(u.limits)} for u in users if u.limits]


async def user_limit_put(call: Call) -> web.Response:
    user = _user(call, False)
    name = call.params["name"]
    user.limits[name] = await _value(call, name, limits.USER_LIMITS, "user-limits")
    await call.broker.coordinator.save_user(user)
    return no_content()


async def user_limit_delete(call: Call) -> web.Response:
    user = _user(call, False)
    if user.limits.pop(call.params["name"], None) is not None:
        await call.broker.coordinator.save_user(user)
    return no_content()
