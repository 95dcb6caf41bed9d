"""``/api/definitions``: export and import in RabbitMQ's definitions format.

An import is checked in full before anything changes (every user, regex,
policy, queue argument and exchange type), so a bad file is refused with a 400
and nothing of it applied. The objects then go through the same declaration
path as AMQP (leveret/http/declare.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from core.engine import limits
from core.engine.broker import Permission, User
from core.engine.vhost import VirtualHost
from core.model.errors import BrokerError
from core.model.policy import Policy
from leveret import __version__
from leveret.http import api_shovels, declare
from leveret.http.api_admin import (
    PRODUCT,
    RABBIT_COMPAT_VERSION,
    _tags,
    check_regex,
    cluster_name_of,
    permission_from_json,
    policy_from_json,
    save_user,
    user_from_json,
)
from leveret.http.errors import bad_request
from leveret.http.responses import no_content
from leveret.http.views import jsonable, user_json
from leveret.links import identity
from leveret.links.federation import spec as federation_spec
from leveret.links.shovel import spec as shovel_spec

if TYPE_CHECKING:
    from leveret.http.routing import Router
    from leveret.http.server import Call



def register(r: Router) -> None:
    r.add("definitions", GET=(export, "administrator"), POST=(import_, "administrator"))
    r.add("definitions/{vhost}", GET=(export, "administrator"), POST=(import_, "administrator"))


def _exported_vhosts(call: Call) -> list[VirtualHost]:
    return [call.vhost()] if "vhost" in call.params else list(call.broker.vhosts.values())


async def export(call: Call) -> Any:
    vhosts = _exported_vhosts(call)
    names = {vh.name for vh in vhosts}
    whole = "vhost" not in call.params
    out: dict[str, Any] = {
        "rabbit_version": RABBIT_COMPAT_VERSION, "rabbitmq_version": RABBIT_COMPAT_VERSION,
        "product_name": PRODUCT, "product_version": __version__,
    }
    if whole:
        # Users whose hash RabbitMQ cannot check (made by ``leveret users add`` or the default
        # user) go under leveret_* keys, which RabbitMQ ignores: imported there they would
        # replace its own users (guest) with ones nobody can log in as.
        portable = {u.name for u in call.broker.users.values() if u.rabbit_hash() is not None}
        out["users"] = [user_json(u) for u in call.broker.users.values() if u.name in portable]
        out["leveret_users"] = [user_json(u) for u in call.broker.users.values() if u.name not in portable]
        out["vhosts"] = [{"name": vh.name, "description": vh.description, "tags": list(vh.tags),
                          "metadata": {"description": vh.description, "tags": list(vh.tags)}, "limits": []}
                         for vh in vhosts]
        permissions = [
            {"user": u.name, "vhost": v, "configure": p.configure, "write": p.write, "read": p.read}
            for u in call.broker.users.values() for v in sorted(u.vhosts) if v in names
            for p in (u.permission(v) or Permission(),)]
        topic_permissions = [
            {"user": u.name, "vhost": v, "exchange": x, "write": w, "read": r}
            for u in call.broker.users.values() for v, per in u.topic_permissions.items() if v in names
            for x, (w, r) in per.items()]
        out["permissions"] = [p for p in permissions if p["user"] in portable]
        out["topic_permissions"] = [p for p in topic_permissions if p["user"] in portable]
        out["leveret_permissions"] = [p for p in permissions if p["user"] not in portable]
        out["leveret_topic_permissions"] = [p for p in topic_permissions if p["user"] not in portable]
        out["global_parameters"] = [{"name": "cluster_name", "value": cluster_name_of(call)}]
    out["parameters"] = [{"vhost": vh.name, "component": c, "name": n, "value": identity.without_owner(c, v)}
                         for vh in vhosts for (c, n), v in vh.parameters.items()]
    # RabbitMQ exports vhost limits as this parameter (checked with 3.10.8).
    out["parameters"] += [{"vhost": vh.name, "component": "vhost-limits", "name": "limits", "value": dict(lim)}
                          for vh in vhosts for lim in (call.broker.vhost_limits.get(vh.name),) if lim]
    out["policies"] = [p.as_rabbitmq() for vh in vhosts for p in vh.policies.values()]
    out["queues"] = [{"name": q.name, "vhost": vh.name, "durable": q.durable, "auto_delete": q.auto_delete,
                      "arguments": jsonable(q.arguments)}
                     for vh in vhosts for q in vh.queues.values() if not q.exclusive]
    out["exchanges"] = [{"name": x.name, "vhost": vh.name, "type": x.type, "durable": x.durable,
                         "auto_delete": x.auto_delete, "internal": x.internal, "arguments": jsonable(x.arguments)}
                        for vh in vhosts for x in vh.exchanges.values() if not x.name.startswith("amq.")]
    out["bindings"] = [{"source": b.source.name, "vhost": vh.name, "destination": b.destination.name,
                        "destination_type": "queue" if b.key[0] == "queue" else "exchange",
                        "routing_key": b.routing_key, "arguments": jsonable(b.arguments)}
                       for vh in vhosts for x in vh.exchanges.values() for b in x.bindings.values()
                       if not (b.destination.name in vh.queues and vh.queues[b.destination.name].exclusive)]
    if not whole:
        for items in out.values():
            if isinstance(items, list):
                for item in items:
                    item.pop("vhost", None)
    return out


def _vhost_limits(value: Any) -> dict[str, int]:
    try:
        return limits.parse("limits", value, limits.VHOST_LIMITS)
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def _list(data: dict[str, Any], key: str) -> list[dict[str, Any]]:
    items = data.get(key) or []
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise bad_request(f"'{key}' must be a list of objects")
    return items


def _str(item: dict[str, Any], key: str, what: str, default: str | None = None) -> str:
    value = item.get(key, default)
    if not isinstance(value, str):
        raise bad_request(f"{what}: '{key}' must be a string")
    return value


def _bool(item: dict[str, Any], key: str, what: str, default: bool) -> bool:
    value = item.get(key, default)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise bad_request(f"{what}: '{key}' must be true or false")
    return value


def _args(item: dict[str, Any], what: str) -> dict[str, Any]:
    value = item.get("arguments") or {}
    if not isinstance(value, dict):
        raise bad_request(f"{what}: 'arguments' must be an object")
    return value


class Plan:
    """Everything an import will do, checked before any of it is done."""

    def __init__(self) -> None:
        self.vhosts: list[tuple[str, str, tuple[str, ...]]] = []
        self.users: list[User] = []
        self.permissions: list[tuple[str, str, Permission]] = []
        self.topic_permissions: list[tuple[str, str, str, str, str]] = []
        self.policies: list[Policy] = []
        self.parameters: list[tuple[str, str, str, Any]] = []
        self.queues: list[tuple[str, str, bool, bool, dict[str, Any]]] = []
        self.exchanges: list[tuple[str, str, str, bool, bool, bool, dict[str, Any]]] = []
        self.bindings: list[tuple[str, str, str, str, str, dict[str, Any]]] = []


def plan_import(call: Call, data: dict[str, Any], only_vhost: str | None) -> Plan:
    plan = Plan()
    broker = call.broker
    vhost_names = set(broker.vhosts)
    if only_vhost is None:
        for item in _list(data, "vhosts"):
            name = _str(item, "name", "vhost")
            if not name:
                raise bad_request("vhost: the name cannot be empty")
            raw_meta = item.get("metadata")
            meta: dict[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
            description = item.get("description", meta.get("description", ""))
            plan.vhosts.append((name, description if isinstance(description, str) else "",
                                _tags(item.get("tags", meta.get("tags")), f"vhost '{name}' tags")))
            vhost_names.add(name)
        users: dict[str, User] = {}
        for item in _list(data, "users") + _list(data, "leveret_users"):
            name = _str(item, "name", "user")
            body = {k: v for k, v in item.items()
                    if k in ("password", "password_hash", "hashing_algorithm", "tags", "limits")}
            if "password_hash" not in body and "password" not in body:
                raise bad_request(f"user '{name}': password_hash is required")
            users[name] = user_from_json(name, body, broker.users.get(name))
        plan.users = list(users.values())
        for item in _list(data, "permissions") + _list(data, "leveret_permissions"):
            user, vhost = _str(item, "user", "permission"), _str(item, "vhost", "permission")
            if user not in users and user not in broker.users:
                raise bad_request(f"permission: no user '{user}'")
            if vhost not in vhost_names:
                raise bad_request(f"permission: no vhost '{vhost}'")
            plan.permissions.append((user, vhost, permission_from_json(item)))
        for item in _list(data, "topic_permissions") + _list(data, "leveret_topic_permissions"):
            user, vhost = _str(item, "user", "topic permission"), _str(item, "vhost", "topic permission")
            if user not in users and user not in broker.users:
                raise bad_request(f"topic permission: no user '{user}'")
            plan.topic_permissions.append((user, vhost, _str(item, "exchange", "topic permission"),
                                           check_regex(item.get("write", ".*"), "write"),
                                           check_regex(item.get("read", ".*"), "read")))

    def vhost_of(item: dict[str, Any], what: str) -> str:
        if only_vhost is not None:
            return only_vhost
        name = _str(item, "vhost", what)
        if name not in vhost_names:
            raise bad_request(f"{what}: no vhost '{name}'")
        return name

    # Checks of a new exchange or queue need no state of the vhost: a scratch one answers them.
    scratch = VirtualHost("import-check")
    for item in _list(data, "policies"):
        vhost = vhost_of(item, "policy")
        plan.policies.append(policy_from_json(vhost, _str(item, "name", "policy"), item))
    for item in _list(data, "parameters"):
        vhost = vhost_of(item, "parameter")
        component, name = _str(item, "component", "parameter"), _str(item, "name", "parameter")
        value = _vhost_limits(item.get("value")) if component == "vhost-limits" else item.get("value")
        if component == "shovel":  # refused before anything is applied, as the API's PUT refuses it
            try:
                shovel_spec.parse(vhost, name, value)
            except shovel_spec.ShovelError as exc:
                raise bad_request(f"invalid shovel {name!r}: {exc}") from None
        elif component in federation_spec.COMPONENTS:
            try:
                federation_spec.validate(component, name, value)
            except federation_spec.FederationError as exc:
                raise bad_request(f"invalid {component} {name!r}: {exc}") from None
        plan.parameters.append((vhost, component, name, value))
    for item in _list(data, "exchanges"):
        name = _str(item, "name", "exchange")
        what = f"exchange '{name}'"
        vhost = vhost_of(item, what)
        type_ = _str(item, "type", what)
        args = _args(item, what)
        if name.startswith("amq.") or not name:
            continue  # the standard exchanges exist in every vhost
        durable, auto_delete = _bool(item, "durable", what, True), _bool(item, "auto_delete", what, False)
        internal = _bool(item, "internal", what, False)
        vh = broker.vhosts.get(vhost)
        existing = vh.exchanges.get(name) if vh is not None else None
        try:
            if existing is None:
                scratch.check_new_exchange(name, type_, args)
            else:  # as a redeclaration: 406 for a different one, before anything is applied
                assert vh is not None
                vh._check_equivalent("exchange", name, (
                    ("type", type_, existing.type), ("durable", durable, existing.durable),
                    ("auto_delete", auto_delete, existing.auto_delete), ("internal", internal, existing.internal)),
                    args, existing.arguments)
        except BrokerError as exc:
            raise bad_request(f"{what}: {exc.text}") from None
        plan.exchanges.append((vhost, name, type_, durable, auto_delete, internal, args))
    for item in _list(data, "queues"):
        name = _str(item, "name", "queue")
        what = f"queue '{name}'"
        vhost = vhost_of(item, what)
        args = _args(item, what)
        if item.get("type") in ("quorum", "stream") and "x-queue-type" not in args:
            args = {**args, "x-queue-type": item["type"]}
        durable, auto_delete = _bool(item, "durable", what, True), _bool(item, "auto_delete", what, False)
        vh = broker.vhosts.get(vhost)
        existing_q = vh.queues.get(name) if vh is not None else None
        try:
            if existing_q is None:
                scratch.check_new_queue(name, args, durable=durable, auto_delete=auto_delete)
            else:
                assert vh is not None
                vh._check_equivalent("queue", name, (("durable", durable, existing_q.durable),
                                                     ("auto_delete", auto_delete, existing_q.auto_delete)),
                                     args, existing_q.arguments)
        except BrokerError as exc:
            raise bad_request(f"{what}: {exc.text}") from None
        plan.queues.append((vhost, name, durable, auto_delete, args))
    exchange_names = {(v, n) for v, n, *_ in plan.exchanges}
    queue_names = {(v, n) for v, n, *_ in plan.queues}
    for item in _list(data, "bindings"):
        what = "binding"
        vhost = vhost_of(item, what)
        source, dest = _str(item, "source", what), _str(item, "destination", what)
        kind = _str(item, "destination_type", what, "queue")
        if kind not in ("queue", "exchange"):
            raise bad_request(f"binding: destination_type must be queue or exchange, got {kind!r}")
        if source == "":
            continue  # the default exchange's bindings are implicit
        vh = broker.vhosts.get(vhost)
        if (vhost, source) not in exchange_names and not source.startswith("amq.") and \
                (vh is None or source not in vh.exchanges):
            raise bad_request(f"binding: no exchange '{source}' in vhost '{vhost}'")
        known = queue_names if kind == "queue" else exchange_names
        present = vh is not None and dest in (vh.queues if kind == "queue" else vh.exchanges)
        if (vhost, dest) not in known and not present and not dest.startswith("amq."):
            raise bad_request(f"binding: no {kind} '{dest}' in vhost '{vhost}'")
        plan.bindings.append((vhost, source, kind, dest, _str(item, "routing_key", what, ""), _args(item, what)))
    return plan


async def apply_plan(call: Call, plan: Plan) -> None:
    broker = call.broker
    for name, description, tags in plan.vhosts:
        existed = name in broker.vhosts
        vh = call.broker.coordinator.add_vhost(name)
        vh.description, vh.tags = description, tags
        if not existed:
            await call.broker.coordinator.save_vhost(name)
    changed: dict[str, User] = {u.name: u for u in plan.users}
    for user in plan.users:
        broker.put_user(user)
    for user_name, vhost, perm in plan.permissions:
        user = broker.users[user_name]
        user.vhosts.add(vhost)
        user.permissions[vhost] = perm
        changed[user.name] = user
    for user_name, vhost, exchange, write, read in plan.topic_permissions:
        broker.users[user_name].topic_permissions.setdefault(vhost, {})[exchange] = (write, read)
        changed[user_name] = broker.users[user_name]
    for user in changed.values():
        await save_user(call, user)
    for policy in plan.policies:
        await broker.coordinator.set_policy(policy)
    for vhost, component, _name, value in plan.parameters:
        if component == "vhost-limits":  # RabbitMQ's form of vhost limits (core/engine/limits.py)
            await call.broker.coordinator.set_vhost_limits(vhost, value)
    for vhost, name, type_, durable, auto_delete, internal, args in plan.exchanges:
        await declare.declare_exchange(broker, broker.vhosts[vhost], name, type_, durable, auto_delete, internal,
                                       args)
    for vhost, name, durable, auto_delete, args in plan.queues:
        await declare.declare_queue(broker, broker.vhosts[vhost], name, durable, auto_delete, args)
    for vhost, source, kind, dest, routing_key, args in plan.bindings:
        await declare.bind(broker, broker.vhosts[vhost], source, kind, dest, routing_key, args, add=True)
    # Last: a shovel starts at once, with its queues declared above.
    for vhost, component, name, value in plan.parameters:
        if component != "vhost-limits":
            await api_shovels.set_parameter(call, vhost, component, name, value)


async def import_(call: Call) -> web.Response:
    data = await call.body()
    only_vhost = call.vhost(write=True).name if "vhost" in call.params else None
    plan = plan_import(call, data, only_vhost)
    await apply_plan(call, plan)
    return no_content()
