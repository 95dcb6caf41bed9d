"""Overview, nodes, vhosts, users, permissions, policies, parameters and health checks."""

from __future__ import annotations

import base64
import binascii
import os
import socket
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from core.engine import access, limits
from core.engine.broker import RABBIT_SHA256, Permission, User
from core.engine.stats import QUEUE_FIELDS, queue_counters
from core.model import patterns
from core.model.policy import Policy, PolicyError
from leveret import __version__
from leveret.http import api_operator, api_shovels, listing
from leveret.http.api_topology import _refusal, owner_counts
from leveret.http.errors import bad_request, not_found
from leveret.http.rates import add_stats, stats_json
from leveret.http.responses import created, json_response, no_content
from leveret.http.views import LEVERET_PHC, queue_counts, user_json
from leveret.links import identity
from leveret.node import resources
from leveret.node.regions import regions_of

if TYPE_CHECKING:
    from core.engine.vhost import VirtualHost
    from core.ports.coordinator import Member
    from leveret.http.routing import Router
    from leveret.http.server import Call


PRODUCT = "Leveret"
# The RabbitMQ management API level Leveret imitates, as "rabbitmq_api_version" beside Leveret's own
# version (rabbitmq_version, product_version, management_version: what AMQP and Prometheus say too).
# rabbitmqadmin 3.10.8 reads only rabbitmq_version, to print it in `show overview`.
RABBIT_COMPAT_VERSION = "3.13.7"
TAGS = ("administrator", "monitoring", "policymaker", "management", "impersonator")


def register(r: Router) -> None:
    r.add("overview", GET=(overview, "management"))
    r.add("nodes", GET=(nodes, "monitoring"))
    r.add("nodes/{node}", GET=(node_one, "monitoring"))
    r.add("whoami", GET=(whoami, "management"))
    r.add("extensions", GET=(extensions, "management"))
    r.add("vhosts", GET=(vhosts, "management"))
    r.add("vhosts/{vhost}", GET=(vhost_get, "management"), PUT=(vhost_put, "administrator"),
          DELETE=(vhost_delete, "administrator"))
    r.add("vhosts/{vhost}/permissions", GET=(vhost_permissions, "administrator"))
    r.add("users", GET=(users, "administrator"))
    r.add("users/without-permissions", GET=(users_without_permissions, "administrator"))
    r.add("users/{user}", GET=(user_get, "administrator"), PUT=(user_put, "administrator"),
          DELETE=(user_delete, "administrator"))
    r.add("users/{user}/permissions", GET=(user_permissions, "administrator"))
    r.add("permissions", GET=(permissions, "administrator"))
    r.add("permissions/{vhost}/{user}", GET=(permission_get, "administrator"),
          PUT=(permission_put, "administrator"), DELETE=(permission_delete, "administrator"))
    r.add("topic-permissions", GET=(topic_permissions, "administrator"))
    r.add("topic-permissions/{vhost}/{user}", GET=(topic_permission_get, "administrator"),
          PUT=(topic_permission_put, "administrator"), DELETE=(topic_permission_delete, "administrator"))
    for kind in ("policies", "operator-policies"):
        access = "policymaker" if kind == "policies" else "administrator"
        r.add(kind, GET=(policies, "policymaker"))
        r.add(kind + "/{vhost}", GET=(policies, "policymaker"))
        r.add(kind + "/{vhost}/{name}", GET=(policy_get, "policymaker"), PUT=(policy_put, access),
              DELETE=(policy_delete, access))
    r.add("parameters", GET=(parameters, "policymaker"))
    r.add("parameters/{component}", GET=(parameters, "policymaker"))
    r.add("parameters/{component}/{vhost}", GET=(parameters, "policymaker"))
    r.add("parameters/{component}/{vhost}/{name}", GET=(parameter_get, "policymaker"),
          PUT=(parameter_put, "policymaker"), DELETE=(parameter_delete, "policymaker"))
    r.add("health/checks/alarms", GET=(health_alarms, "monitoring"))
    r.add("health/checks/local-alarms", GET=(health_alarms, "monitoring"))
    r.add("health/checks/port-listener/{port}", GET=(health_port, "monitoring"))
    r.add("health/checks/virtual-hosts", GET=(health_vhosts, "monitoring"))
    r.add("health/checks/node-is-quorum-critical", GET=(health_ok, "monitoring"))
    r.add("health/checks/node-is-mirror-sync-critical", GET=(health_ok, "monitoring"))
    r.add("aliveness-test/{vhost}", GET=(aliveness, "management"))


# -- overview and nodes ---------------------------------------------------------
async def _totals(vhosts: list[VirtualHost], call: Call) -> tuple[dict[str, int], dict[str, Any], int]:
    """Message totals of these vhosts for the whole cluster: a queue another node owns counts
    as its owner reports it (as /api/queues shows it), not as this node's proxy sees it."""
    owned_elsewhere = await owner_counts(call, [q for vh in vhosts for q in vh.queues.values()])
    ready = unacked = consumers = 0
    counts = [0, 0, 0, 0]
    rates = [0.0, 0.0, 0.0, 0.0]
    for vh in vhosts:
        for q in vh.queues.values():
            r, u, c = queue_counts(q)
            if id(q) in owned_elsewhere:
                r, u, c = owned_elsewhere[id(q)][0], 0, owned_elsewhere[id(q)][1]
            ready += r
            unacked += u
            consumers += c
            add_stats(counts, queue_counters(q))  # type: ignore[arg-type]
            add_stats(rates, call.api.rates.rates(("q", vh.name, q.name), 4))
    totals = {"messages": ready + unacked, "messages_ready": ready, "messages_unacknowledged": unacked}
    stats = stats_json(QUEUE_FIELDS, tuple(int(c) for c in counts), tuple(round(r, 1) for r in rates))
    return totals, stats, consumers


def _listeners(call: Call) -> list[dict[str, Any]]:
    cfg = call.node.config
    out = [{"node": call.node_name, "protocol": "amqp", "ip_address": cfg.bind, "port": call.node.amqp.port}]
    out.append({"node": call.node_name, "protocol": "http", "ip_address": cfg.bind, "port": call.api.port})
    return out


async def overview(call: Call) -> dict[str, Any]:
    vhosts = call.visible_vhosts()
    totals, _, consumers = await _totals(vhosts, call)
    conns = [p for p in call.node.amqp.connections if p.conn is not None and p.conn.vhost is not None
             and (call.sees_all or p.conn.username == call.user.name)]
    return {
        "management_version": __version__, "rates_mode": "basic",
        "product_name": PRODUCT, "product_version": __version__, "rabbitmq_version": __version__,
        "rabbitmq_api_version": RABBIT_COMPAT_VERSION,
        "erlang_version": "none (Python)", "cluster_name": cluster_name_of(call),
        "node": call.node_name, "exchange_types": [
            {"name": t, "description": "", "enabled": True}
            for t in ("direct", "fanout", "topic", "headers", "x-consistent-hash")],
        # This node's channels, as RabbitMQ counts them: a publish nothing routes counts too.
        "message_stats": call.api.rates.node_stats(call.broker.stats),
        "churn_rates": call.api.rates.churn_rates(call.broker.stats),
        "queue_totals": {**totals, **call.api.rates.totals_details()},
        "object_totals": {
            "connections": len(conns), "channels": sum(len(p.conn.channels) for p in conns if p.conn),
            "exchanges": sum(len(vh.exchanges) + 1 for vh in vhosts),
            "queues": sum(len(vh.queues) for vh in vhosts), "consumers": consumers},
        "listeners": _listeners(call), "contexts": [
            {"node": call.node_name, "description": "RabbitMQ Management", "path": "/", "port": str(call.api.port)}],
        # Not in RabbitMQ's overview (it has no regions): the nodes per region (docs/notes/region.md).
        "regions": regions_of([{"id": n["name"], "region": n.get("region", ""), "queues": n.get("owned_queues", 0),
                                "draining": bool(n.get("being_drained"))} for n in _all_nodes(call)]),
    }


def cluster_name_of(call: Call) -> str:
    """As /api/cluster-name answers it (leveret/http/api_federation.py): the stored name, else the default."""
    federation = call.node.federation
    return federation.cluster_name() if federation is not None else call.node.config.cluster


def _node_json(call: Call) -> dict[str, Any]:
    watermark = getattr(call.node, "watermark_bytes", None)
    return {
        "name": call.node_name, "type": "disc", "running": True, "os_pid": str(os.getpid()),
        # What the memory alarm compares with mem_limit (leveret/node/resources.py); RSS is mem_rss.
        "mem_used": resources.memory_use(call.broker, call.node.amqp, call.node.mqtt).total,
        "mem_limit": watermark() if callable(watermark) else 0,
        "mem_alarm": call.broker.memory_alarm, "disk_free_alarm": call.broker.disk_alarm,
        "fd_used": resources.open_fds(),
        "sockets_used": len(call.node.amqp.connections), "proc_used": 1, "processors": os.cpu_count() or 1,
        "uptime": int((time.time() - call.api.started_at) * 1000), "partitions": [],
        "run_queue": 0, "rates_mode": "basic",
        "being_drained": call.broker.coordinator.draining,
        "region": call.node.config.region,
        "owned_queues": _owned_here(call),
        "applications": [{"name": "leveret", "description": PRODUCT, "version": __version__}],
        **api_operator.node_extras(call),
    }


def _owned_here(call: Call) -> int:
    return call.broker.coordinator.owner_counts().get(call.node_name, 0)


def _peer_json(call: Call, info: Member) -> dict[str, Any]:
    """Another member of the cluster, as etcd knows it (its own figures are on its own API)."""
    return {"name": info.id, "type": "disc", "running": True, "being_drained": info.draining,
            "uptime": int((time.time() - info.started) * 1000) if info.started else 0,
            "region": info.region, "owned_queues": info.queues, "amqp_address": info.amqp,
            "rates_mode": "basic", "partitions": []}


def _all_nodes(call: Call) -> list[dict[str, Any]]:
    out = [_node_json(call)]
    out.extend(_peer_json(call, info) for info in call.broker.coordinator.members() if info.id != call.node_name)
    return out


async def nodes(call: Call) -> Any:
    return listing.apply(_all_nodes(call), call.query)


async def node_one(call: Call) -> dict[str, Any]:
    for node in _all_nodes(call):
        if node["name"] == call.params["node"]:
            return node
    raise not_found(f"node '{call.params['node']}' not found")


async def whoami(call: Call) -> dict[str, Any]:
    return {"name": call.user.name, "tags": list(call.user.tags)}


async def extensions(call: Call) -> list[Any]:
    return []


# -- vhosts ---------------------------------------------------------------------
async def _vhost_json(vh: VirtualHost, call: Call) -> dict[str, Any]:
    totals, stats, _ = await _totals([vh], call)
    return {"name": vh.name, "description": vh.description, "tags": list(vh.tags),
            "default_queue_type": "classic", "metadata": {"description": vh.description, "tags": list(vh.tags)},
            "tracing": False, "cluster_state": {call.node_name: "running"}, "message_stats": stats, **totals}


async def vhosts(call: Call) -> Any:
    return listing.apply([await _vhost_json(vh, call) for vh in call.visible_vhosts()], call.query)


async def vhost_get(call: Call) -> dict[str, Any]:
    return await _vhost_json(call.vhost(), call)


# "vhost": rabbitmqadmin sends it with every declare, and RabbitMQ ignores it.
VHOST_FIELDS = frozenset({"name", "description", "tags", "tracing", "default_queue_type", "metadata",
                          "protected_from_deletion", "vhost"})


def _tags(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return tuple(t.strip() for t in value.split(",") if t.strip())
    if isinstance(value, list) and all(isinstance(t, str) for t in value):
        return tuple(value)
    raise bad_request(f"{what} must be a comma-separated string or a list of strings")


async def vhost_put(call: Call) -> web.Response:
    body = await call.body(VHOST_FIELDS)
    description = body.get("description", "")
    if not isinstance(description, str):
        raise bad_request("description must be a string")
    tags = _tags(body.get("tags"), "tags")
    name = call.params["vhost"]
    if not name:
        raise bad_request("a vhost name cannot be empty")
    existed = name in call.broker.vhosts
    vh = call.broker.coordinator.add_vhost(name)
    vh.description, vh.tags = description, tags
    if not existed:
        await call.broker.coordinator.save_vhost(name)
        # As RabbitMQ does: whoever creates a vhost over HTTP gets full permissions in it.
        call.user.vhosts.add(name)
        call.user.permissions[name] = Permission()
        await save_user(call, call.user)
    return created(existed)


async def vhost_delete(call: Call) -> web.Response:
    from leveret.http import declare

    vh = call.vhost()
    # As RabbitMQ does: the vhost's connections are closed first, so none works on in a vhost that is gone.
    for proto in list(call.node.amqp.connections):
        conn = proto.conn
        if conn is not None and conn.vhost is vh:
            conn.close(320, f"CONNECTION_FORCED - vhost '{vh.name}' is deleted")
            proto._flush()
    for name in list(vh.queues):
        await declare.delete_queue(call.broker, vh, name, False, False)
    call.broker.vhosts.pop(vh.name, None)
    for user in call.broker.users.values():
        user.vhosts.discard(vh.name)
        user.permissions.pop(vh.name, None)
        user.topic_permissions.pop(vh.name, None)
    await call.broker.coordinator.delete_vhost(vh.name)
    return no_content()


# -- users ----------------------------------------------------------------------
async def users(call: Call) -> Any:
    return listing.apply([user_json(u) for u in call.broker.users.values()], call.query)


async def users_without_permissions(call: Call) -> Any:
    return [user_json(u) for u in call.broker.users.values() if not u.vhosts]


def _user(call: Call) -> User:
    user = call.broker.users.get(call.params["user"])
    if user is None:
        raise not_found(f"user '{call.params['user']}' not found")
    return user


async def user_get(call: Call) -> dict[str, Any]:
    return user_json(_user(call))


USER_FIELDS = frozenset({"name", "password", "password_hash", "hashing_algorithm", "tags", "limits",
                         "vhost"})  # rabbitmqadmin sends "vhost" with every declare; RabbitMQ ignores it


def _user_limits(body: dict[str, Any], old: User | None) -> dict[str, int]:
    """A definitions file's user "limits" (RabbitMQ exports them there); without it the old ones stay."""
    if "limits" not in body:
        return dict(old.limits) if old else {}
    try:
        return limits.parse("user-limits", body["limits"] or {}, limits.USER_LIMITS)
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def user_from_json(name: str, body: dict[str, Any], old: User | None) -> User:
    """A user from a PUT body or a definitions file entry (400 for what cannot be used)."""
    tags = _tags(body.get("tags"), "tags")
    kwargs: dict[str, Any] = {"tags": tags, "vhosts": set(old.vhosts) if old else set(),
                              "loopback_only": old.loopback_only if old else False,
                              "permissions": dict(old.permissions) if old else {},
                              "topic_permissions": dict(old.topic_permissions) if old else {},
                              "limits": _user_limits(body, old)}
    if "password" in body:
        if not isinstance(body["password"], str):
            raise bad_request("password must be a string")
        # Made the RabbitMQ way, so /api/definitions carries it to a RabbitMQ (docs/MANAGEMENT.md).
        return User.create(name, body["password"], **kwargs)
    if "password_hash" in body:
        algorithm = body.get("hashing_algorithm") or RABBIT_SHA256
        password_hash = body["password_hash"]
        if not isinstance(password_hash, str):
            raise bad_request("password_hash must be a string")
        if password_hash == "":
            # RabbitMQ: an empty hash means no password login (certificates only).
            raw = os.urandom(36)
            return User(name, raw[:4], raw[4:], **kwargs)
        if algorithm == RABBIT_SHA256:
            try:
                return User.from_rabbit_hash(name, password_hash, **kwargs)
            except binascii.Error:
                raise bad_request(f"password_hash of user '{name}' is not base64") from None
            except ValueError as exc:
                raise bad_request(str(exc)) from None
        if algorithm == LEVERET_PHC:
            if not password_hash.startswith("$"):
                raise bad_request(f"password_hash of user '{name}' is not a PHC string ($argon2id$...)")
            return User(name, b"", password_hash.encode("ascii"), **kwargs)
        if algorithm == "leveret_pbkdf2_sha256":
            try:
                raw = base64.b64decode(password_hash, validate=True)
            except binascii.Error:
                raise bad_request(f"password_hash of user '{name}' is not base64") from None
            if len(raw) != 48:
                raise bad_request(f"password_hash of user '{name}' is not a leveret_pbkdf2_sha256 hash")
            return User(name, raw[:16], raw[16:], **kwargs)
        raise bad_request(f"unsupported hashing_algorithm '{algorithm}': use {RABBIT_SHA256}")
    if old is not None:
        return User(name, old.salt, old.password_hash, **kwargs)  # tags only
    raise bad_request("password or password_hash is required")


async def save_user(call: Call, user: User) -> None:
    """Applied here, stored, and on every node of a cluster (the coordinator's metadata side)."""
    await call.broker.coordinator.save_user(user)


async def user_put(call: Call) -> web.Response:
    body = await call.body(USER_FIELDS)
    name = call.params["user"]
    old = call.broker.users.get(name)
    user = user_from_json(name, body, old)
    await save_user(call, user)
    return created(old is not None)


async def user_delete(call: Call) -> web.Response:
    user = _user(call)
    await call.broker.coordinator.delete_user(user.name)
    return no_content()


# -- permissions ----------------------------------------------------------------
def _permission_json(user: User, vhost: str) -> dict[str, Any]:
    p = user.permission(vhost) or Permission()
    return {"user": user.name, "vhost": vhost, "configure": p.configure, "write": p.write, "read": p.read}


def _all_permissions(call: Call) -> list[dict[str, Any]]:
    return [_permission_json(u, v) for u in call.broker.users.values() for v in sorted(u.vhosts)
            if v in call.broker.vhosts]


async def permissions(call: Call) -> Any:
    return _all_permissions(call)


async def vhost_permissions(call: Call) -> Any:
    vh = call.vhost()
    return [p for p in _all_permissions(call) if p["vhost"] == vh.name]


async def user_permissions(call: Call) -> Any:
    user = _user(call)
    return [p for p in _all_permissions(call) if p["user"] == user.name]


async def permission_get(call: Call) -> dict[str, Any]:
    vh, user = call.vhost(), _user(call)
    if vh.name not in user.vhosts:
        raise not_found(f"user '{user.name}' has no permissions in vhost '{vh.name}'")
    return _permission_json(user, vh.name)


def check_regex(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise bad_request(f"{what} must be a string (a regular expression)")
    try:
        return patterns.check(value)  # RE2 (core/model/patterns.py): what the checks will run
    except patterns.PatternError as exc:
        raise bad_request(f"{what} {value!r} is {exc}") from None


PERMISSION_FIELDS = frozenset({"configure", "write", "read", "user", "vhost"})


def permission_from_json(body: dict[str, Any]) -> Permission:
    for key in ("configure", "write", "read"):
        if key not in body:
            raise bad_request(f"{key} is required")
    return Permission(check_regex(body["configure"], "configure"), check_regex(body["write"], "write"),
                      check_regex(body["read"], "read"))


async def permission_put(call: Call) -> web.Response:
    body = await call.body(PERMISSION_FIELDS)
    vh, user = call.vhost(), _user(call)
    perm = permission_from_json(body)
    existed = vh.name in user.vhosts
    user.vhosts.add(vh.name)
    user.permissions[vh.name] = perm
    await save_user(call, user)
    return created(existed)


async def permission_delete(call: Call) -> web.Response:
    vh, user = call.vhost(), _user(call)
    user.vhosts.discard(vh.name)
    user.permissions.pop(vh.name, None)
    await save_user(call, user)
    return no_content()


def _topic_json(call: Call) -> list[dict[str, Any]]:
    return [{"user": u.name, "vhost": v, "exchange": x, "write": w, "read": r}
            for u in call.broker.users.values() for v, per in u.topic_permissions.items()
            for x, (w, r) in per.items()]


async def topic_permissions(call: Call) -> Any:
    return _topic_json(call)


async def topic_permission_get(call: Call) -> Any:
    vh, user = call.vhost(), _user(call)
    found = [t for t in _topic_json(call) if t["user"] == user.name and t["vhost"] == vh.name]
    if not found:
        raise not_found()
    return found


TOPIC_FIELDS = frozenset({"exchange", "write", "read", "user", "vhost"})


async def topic_permission_put(call: Call) -> web.Response:
    body = await call.body(TOPIC_FIELDS)
    vh, user = call.vhost(), _user(call)
    exchange = body.get("exchange")
    if not isinstance(exchange, str) or not exchange:
        raise bad_request("exchange is required")
    write, read = check_regex(body.get("write", ".*"), "write"), check_regex(body.get("read", ".*"), "read")
    per = user.topic_permissions.setdefault(vh.name, {})
    existed = exchange in per
    per[exchange] = (write, read)
    await save_user(call, user)  # stored, and open connections see it at once
    return created(existed)


async def topic_permission_delete(call: Call) -> web.Response:
    vh, user = call.vhost(), _user(call)
    user.topic_permissions.pop(vh.name, None)
    await save_user(call, user)
    return no_content()


# -- policies -------------------------------------------------------------------
def _operator(call: Call) -> bool:
    return call.request.path.startswith("/api/operator-policies")


def _store(vh: VirtualHost, operator: bool) -> dict[str, Policy]:
    return vh.operator_policies if operator else vh.policies


async def policies(call: Call) -> Any:
    operator = _operator(call)
    vhosts = [call.vhost()] if "vhost" in call.params else call.visible_vhosts()
    return listing.apply([p.as_rabbitmq() for vh in vhosts for p in _store(vh, operator).values()], call.query)


async def policy_get(call: Call) -> dict[str, Any]:
    policy = _store(call.vhost(), _operator(call)).get(call.params["name"])
    if policy is None:
        raise not_found(f"policy '{call.params['name']}' not found")
    return policy.as_rabbitmq()


POLICY_FIELDS = frozenset({"pattern", "definition", "priority", "apply-to", "name", "vhost", "component"})


def policy_from_json(vhost: str, name: str, body: dict[str, Any], operator: bool = False) -> Policy:
    """A validated policy (400 naming what is wrong); nothing is stored here."""
    pattern = check_regex(body.get("pattern"), "pattern")
    priority = body.get("priority", 0)
    if isinstance(priority, str):
        try:
            priority = int(priority)
        except ValueError:
            raise bad_request(f"priority must be an integer, got {priority!r}") from None
    try:
        return Policy.create(vhost, name, pattern, body.get("definition"),  # type: ignore[arg-type]
                             apply_to=body.get("apply-to") or "all", priority=priority, operator=operator)
    except PolicyError as exc:
        raise bad_request(str(exc)) from None


async def policy_put(call: Call) -> web.Response:
    body = await call.body(POLICY_FIELDS)
    vh = call.vhost(write=True)
    operator = _operator(call)
    policy = policy_from_json(vh.name, call.params["name"], body, operator)
    # Applied to live queues and exchanges, stored, and applied by every node of a cluster.
    return created(await call.broker.coordinator.set_policy(policy))


async def policy_delete(call: Call) -> web.Response:
    vh = call.vhost(write=True)
    if not await call.broker.coordinator.clear_policy(vh.name, call.params["name"], _operator(call)):
        raise not_found(f"policy '{call.params['name']}' not found")
    return no_content()


# -- parameters -----------------------------------------------------------------
def _parameter_json(vh: VirtualHost, component: str, name: str, value: Any) -> dict[str, Any]:
    return {"vhost": vh.name, "component": component, "name": name,
            "value": identity.without_owner(component, value)}


async def parameters(call: Call) -> Any:
    vhosts = [call.vhost()] if "vhost" in call.params else call.visible_vhosts()
    component = call.params.get("component")
    return listing.apply([_parameter_json(vh, c, n, v) for vh in vhosts for (c, n), v in vh.parameters.items()
                          if component in (None, c)], call.query)


async def parameter_get(call: Call) -> dict[str, Any]:
    vh, key = call.vhost(), (call.params["component"], call.params["name"])
    if key not in vh.parameters:
        raise not_found()
    return _parameter_json(vh, *key, vh.parameters[key])


async def parameter_put(call: Call) -> web.Response:
    body = await call.body(frozenset({"value", "component", "name", "vhost"}))
    if "value" not in body:
        raise bad_request("value is required")
    vh, key = call.vhost(write=True), (call.params["component"], call.params["name"])
    existed = key in vh.parameters
    # Validated (a shovel's or federation upstream's definition: 400), stored, and applied at once.
    await api_shovels.set_parameter(call, vh.name, *key, body["value"])
    return created(existed)


async def parameter_delete(call: Call) -> web.Response:
    vh = call.vhost(write=True)
    if not await api_shovels.clear_parameter(call, vh.name, call.params["component"], call.params["name"]):
        raise not_found()
    return no_content()


# -- health ---------------------------------------------------------------------
async def health_ok(call: Call) -> dict[str, Any]:
    return {"status": "ok"}


async def health_alarms(call: Call) -> Any:
    if call.broker.alarms.raised:
        return json_response({"status": "failed", "reason": "resource alarm(s) in effect in the cluster",
                              "alarms": [{"node": call.node_name, "resource": r}
                                         for r in sorted(call.broker.alarms.raised)]}, status=503)
    return {"status": "ok"}


async def health_port(call: Call) -> Any:
    raw = call.params["port"]
    try:
        port = int(raw)
    except ValueError:
        raise bad_request(f"port must be an integer, got {raw!r}") from None
    listening = {call.node.amqp.port, call.api.port}
    if port in listening:
        host = call.node.config.bind if call.node.config.bind not in ("0.0.0.0", "::", "") else "127.0.0.1"
        try:
            socket.create_connection((host, port), timeout=1).close()
            return {"status": "ok", "port": port}
        except OSError as exc:
            reason = f"port {port} does not accept connections: {exc}"
    else:
        reason = f"no listener on port {port}"
    return json_response({"status": "failed", "reason": reason, "missing": port,
                          "ports": sorted(listening)}, status=503)


async def health_vhosts(call: Call) -> dict[str, Any]:
    return {"status": "ok"}


async def aliveness(call: Call) -> Any:
    """RabbitMQ's aliveness test: declare ``aliveness-test``, publish to it and get the message back."""
    from core.engine import publish
    from core.model.message import Message
    from leveret.http import declare

    vh = call.vhost(write=True)
    # It declares, publishes and gets as the calling user: the same permission checks as any declare
    # (a user may not create a queue in a vhost it may only look at, administrator or not).
    grants = call.grants(vh)
    with _refusal():
        access.declare_queue(grants, "aliveness-test", {})
        access.publish(grants, "")
        access.read_queue(grants, "aliveness-test")
    q = await declare.declare_queue(call.broker, vh, "aliveness-test", False, False, {})
    outcome = publish.publish(call.broker, vh, None, Message("", q.name, b"\x00\x00", b"test_message",
                                                             node=call.node_name))
    await outcome.wait()
    qm = q.default.get(no_ack=True)
    if qm is None or qm.message.body != b"test_message":
        return json_response({"status": "failed", "reason": "the test message did not come back"}, status=503)
    return {"status": "ok"}
