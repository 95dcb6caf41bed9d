"""Queues, exchanges, bindings; publish and get; a queue's native channels."""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from aiohttp import web

from core.engine import access, entry, limits, publish
from core.engine.exchange import Exchange
from core.engine.queue import Queue
from core.engine.topic import topic_matches
from core.model import properties
from core.model.errors import AccessRefused, PreconditionFailed, ResourceLocked
from core.model.message import Message
from core.model.policy import Policy
from leveret.http import declare, listing
from leveret.http.errors import HttpError, bad_request, not_found
from leveret.http.responses import created, json_response, no_content
from leveret.http.views import (
    binding_json,
    default_binding_json,
    exchange_json,
    jsonable,
    properties_key,
    queue_json,
    vhost_bindings,
)

if TYPE_CHECKING:
    from core.engine.vhost import VirtualHost
    from leveret.http.routing import Router
    from leveret.http.server import Call



def register(r: Router) -> None:
    r.add("queues", GET=(queues, "management"))
    r.add("queues/{vhost}", GET=(queues, "management"))
    r.add("queues/{vhost}/{name}", GET=(queue_get, "management"), PUT=(queue_put, "management"),
          DELETE=(queue_delete, "management"))
    r.add("queues/{vhost}/{name}/contents", DELETE=(queue_purge, "management"))
    r.add("queues/{vhost}/{name}/get", POST=(queue_get_messages, "management"))
    r.add("queues/{vhost}/{name}/bindings", GET=(queue_bindings, "management"))
    r.add("queues/{vhost}/{name}/channels", GET=(channels_list, "management"), POST=(channel_create, "management"))
    r.add("queues/{vhost}/{name}/channels/{channel}", GET=(channel_get, "management"),
          DELETE=(channel_delete, "management"))
    r.add("exchanges", GET=(exchanges, "management"))
    r.add("exchanges/{vhost}", GET=(exchanges, "management"))
    r.add("exchanges/{vhost}/{name}", GET=(exchange_get, "management"), PUT=(exchange_put, "management"),
          DELETE=(exchange_delete, "management"))
    r.add("exchanges/{vhost}/{name}/publish", POST=(exchange_publish, "management"))
    r.add("exchanges/{vhost}/{name}/bindings/source", GET=(exchange_bindings_source, "management"))
    r.add("exchanges/{vhost}/{name}/bindings/destination", GET=(exchange_bindings_destination, "management"))
    r.add("bindings", GET=(bindings, "management"))
    r.add("bindings/{vhost}", GET=(bindings, "management"))
    for kind in ("q", "e"):
        r.add(f"bindings/{{vhost}}/e/{{source}}/{kind}/{{dest}}", GET=(binding_list, "management"),
              POST=(binding_create, "management"))
        r.add(f"bindings/{{vhost}}/e/{{source}}/{kind}/{{dest}}/{{props}}", GET=(binding_get, "management"),
              DELETE=(binding_delete, "management"))


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    """A boolean field; rabbitmqadmin sends "true"/"false" as strings."""
    value = body.get(key, default)
    if isinstance(value, bool):
        return value
    if value is None:
        return default
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise bad_request(f"{key} must be true or false, got {value!r}")


def _arguments(body: dict[str, Any]) -> dict[str, Any]:
    args = body.get("arguments") or {}
    if not isinstance(args, dict):
        raise bad_request("arguments must be a JSON object")
    return args


# -- queues ---------------------------------------------------------------------
def _queues_of(call: Call) -> list[Queue]:
    vhosts = [call.vhost()] if "vhost" in call.params else call.visible_vhosts()
    return [q for vh in vhosts for q in vh.queues.values()]


OWNER_COUNTS_TIMEOUT = 5.0
OWNER_COUNTS_CONCURRENCY = 64


async def owner_counts(call: Call, queues: list[Queue]) -> dict[int, tuple[int, int]]:
    """In a cluster, the owners' (messages, consumers) of the queues other nodes own, by id(queue).

    Asked concurrently (at most OWNER_COUNTS_CONCURRENCY at a time); a queue
    whose owner does not answer within OWNER_COUNTS_TIMEOUT keeps this node's view.
    """
    coordinator = call.broker.coordinator
    remote = [q for q in queues if q.remote is not None]  # only a cluster has them
    if not remote:
        return {}
    gate = asyncio.Semaphore(OWNER_COUNTS_CONCURRENCY)
    found: dict[int, tuple[int, int]] = {}

    async def one(q: Queue) -> None:
        async with gate:
            found[id(q)] = await coordinator.counts(q)

    try:
        await asyncio.wait_for(asyncio.gather(*(one(q) for q in remote)), timeout=OWNER_COUNTS_TIMEOUT)
    except TimeoutError:
        pass  # what arrived in time is used
    return found


async def queues(call: Call) -> Any:
    node, rates = call.node_name, call.api.rates
    qs = _queues_of(call)
    counts = await owner_counts(call, qs)
    return listing.apply([queue_json(q, node, rates, counts.get(id(q)), _policies(call, q)) for q in qs], call.query)


def _policies(call: Call, q: Queue) -> tuple[Policy | None, Policy | None]:
    vh = call.broker.vhosts.get(q.vhost)
    return vh.policies_of(q) if vh is not None else (None, None)


def _queue(call: Call, write: bool = False) -> tuple[VirtualHost, Queue]:
    vh = call.vhost(write=write)
    q = vh.queues.get(call.params["name"])
    if q is None:
        raise not_found(f"no queue '{call.params['name']}' in vhost '{vh.name}'")
    return vh, q


def _not_locked(vh: VirtualHost, q: Queue) -> None:
    """Get, purge, delete and native channels after the permission check, as AMQP orders them: another
    connection's exclusive queue is locked. No HTTP request owns a connection, so every exclusive queue
    is. RabbitMQ's management API runs these as AMQP methods and answers the channel error 405 as 400
    with the AMQP text."""
    if q.exclusive_owner is not None:
        try:
            vh.get_queue(q.name, owner=None)
        except ResourceLocked as exc:
            raise bad_request(f"405 {exc.reply_text}") from None


async def queue_get(call: Call) -> dict[str, Any]:
    _, q = _queue(call)
    counts = await owner_counts(call, [q])
    return queue_json(q, call.node_name, call.api.rates, counts.get(id(q)), _policies(call, q))


QUEUE_FIELDS = frozenset({"durable", "auto_delete", "arguments", "node", "name", "vhost", "queue_type", "type",
                          "exclusive"})


async def queue_put(call: Call) -> web.Response:
    body = await call.body(QUEUE_FIELDS)
    vh = call.vhost(write=True)
    name = call.params["name"]
    if not name:
        raise bad_request("a queue name cannot be empty over HTTP")
    args = dict(_arguments(body))
    queue_type = body.get("queue_type") or body.get("type")
    if queue_type is not None:
        if queue_type not in ("classic", "stream", "quorum"):
            raise bad_request(f"unknown queue type {queue_type!r}")
        args.setdefault("x-queue-type", queue_type)
    if _bool(body, "exclusive", False):
        raise bad_request("exclusive queues cannot be declared over HTTP")
    with _refusal():
        access.declare_queue(call.grants(vh), name, args)
    limits.check_queue(vh.name, call.broker.vhost_limits.get(vh.name, {}), vh.queues, name)
    existed = name in vh.queues
    await declare.declare_queue(call.broker, vh, name, _bool(body, "durable", True),
                                _bool(body, "auto_delete", False), args)
    return created(existed)


async def queue_delete(call: Call) -> web.Response:
    vh, q = _queue(call, write=True)
    with _refusal():
        access.delete_queue(call.grants(vh), q.name)
    _not_locked(vh, q)
    await declare.delete_queue(call.broker, vh, q.name, _flag(call, "if-unused"), _flag(call, "if-empty"))
    return no_content()


def _flag(call: Call, name: str) -> bool:
    return call.query.get(name, "false").lower() == "true"


async def queue_purge(call: Call) -> web.Response:
    vh, q = _queue(call, write=True)
    with _refusal():
        access.read_queue(call.grants(vh), q.name)
    _not_locked(vh, q)
    await declare.purge_queue(call.broker, q)
    return no_content()


GET_FIELDS = frozenset({"count", "ackmode", "encoding", "truncate", "requeue", "vhost", "name", "queue",
                        "payload_file"})
ACKMODES = ("ack_requeue_true", "ack_requeue_false", "reject_requeue_true", "reject_requeue_false")


def _int(body: dict[str, Any], key: str, default: int | None) -> int | None:
    value = body.get(key, default)
    if value is None or value == "":
        return default
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise bad_request(f"{key} must be an integer, got {value!r}") from None
    if n < 0:
        raise bad_request(f"{key} must not be negative")
    return n


def message_properties_json(raw: bytes) -> dict[str, Any]:
    try:
        props = properties.decode(raw)
    except properties.PropertiesError:
        return {}
    return jsonable(props)  # type: ignore[no-any-return]


async def queue_get_messages(call: Call) -> list[dict[str, Any]]:
    body = await call.body(GET_FIELDS)
    count = _int(body, "count", 1) or 0
    ackmode = body.get("ackmode", "ack_requeue_true")
    if ackmode not in ACKMODES:
        raise bad_request(f"ackmode must be one of {', '.join(ACKMODES)}, got {ackmode!r}")
    encoding = body.get("encoding", "auto")
    if encoding not in ("auto", "base64"):
        raise bad_request(f"encoding must be auto or base64, got {encoding!r}")
    truncate = _int(body, "truncate", None)
    vh, q = _queue(call, write=True)
    with _refusal("get"):
        access.read_queue(call.grants(vh), q.name)
    _not_locked(vh, q)
    if q.remote is not None and ackmode != "ack_requeue_false":
        raise bad_request(f"queue '{q.name}' is owned by node {q.remote.owner}: get with ackmode "
                          "ack_requeue_false here, or ask that node's API")
    requeue = ackmode.endswith("true")
    taken = []
    out = []
    for _ in range(count):
        # ack_requeue_false is a get without ack, as RabbitMQ does it (its get_no_ack): gone at
        # once, counted in deliver_get and never in ack. The coordinator's get is basic.get's: it
        # counts as use for x-expires, waits while the head is read from the store (paging), and
        # on a queue another node owns takes the message at its owner (for good: ack_requeue_false).
        no_ack = ackmode == "ack_requeue_false"
        qm, left = await call.broker.coordinator.get(q, no_ack)
        if qm is not None and not no_ack:
            taken.append(qm)
        if qm is None:
            break
        payload = qm.message.body
        if truncate is not None:
            payload = payload[:truncate]
        text: str | None = None
        if encoding == "auto":
            try:
                text = payload.decode("utf-8")
            except UnicodeDecodeError:
                text = None
        out.append({
            "payload_bytes": len(qm.message.body), "redelivered": qm.redelivered,
            "exchange": qm.message.exchange, "routing_key": qm.message.routing_key,
            "message_count": left, "properties": message_properties_json(qm.message.props),
            "payload": text if text is not None else base64.b64encode(payload).decode("ascii"),
            "payload_encoding": "string" if text is not None else "base64",
        })
    if requeue:
        q.default.requeue([(qm, None) for qm in taken])
    elif taken:  # reject_requeue_false: dead-lettered where the queue says so
        q.default.discard([(qm, None) for qm in taken])
    # The message_count each item reports is what was left after it, as RabbitMQ's basic.get gives.
    return out


async def queue_bindings(call: Call) -> list[dict[str, Any]]:
    vh, q = _queue(call)
    return [b for b in vhost_bindings(vh) if b["destination_type"] == "queue" and b["destination"] == q.name]


# -- native channels --------------------------------------------------------------
def _channel_json(q: Queue, ch: Any) -> dict[str, Any]:
    kind_topic = getattr(ch, "grpc_filter", None) or getattr(ch, "http_filter", None)
    return {"name": ch.name or "default", "queue": q.name, "vhost": q.vhost, "default": ch is q.default,
            "messages_ready": len(ch.ready), "messages_unacknowledged": ch.unacked,
            "consumers": len(ch.consumers), "topic": kind_topic[1] if kind_topic else ""}


async def channels_list(call: Call) -> Any:
    _, q = _queue(call)
    return listing.apply([_channel_json(q, ch) for ch in q.channels], call.query, default_sort=None)


def _find_channel(q: Queue, name: str) -> Any:
    for ch in q.channels:
        if (ch.name or "default") == name:
            return ch
    raise not_found(f"no channel '{name}' on queue '{q.name}'")


async def channel_get(call: Call) -> dict[str, Any]:
    _, q = _queue(call)
    return _channel_json(q, _find_channel(q, call.params["channel"]))


async def channel_create(call: Call) -> web.Response:
    body = await call.body(frozenset({"name", "topic"}))
    vh, q = _queue(call, write=True)
    with _refusal():
        access.check(call.grants(vh), "configure", "queue", q.name)
    _not_locked(vh, q)
    name, topic = body.get("name"), body.get("topic", "")
    if not isinstance(name, str) or not name or "/" in name or name == "default":
        raise bad_request("name is required: a channel name without '/', other than 'default'")
    if not isinstance(topic, str):
        raise bad_request("topic must be a string (a routing key, or a pattern with * and #)")
    if q.remote is not None or type(q) is not Queue:
        raise bad_request(f"queue '{q.name}' cannot take extra channels here (a stream, or owned elsewhere)")
    if any(ch.name == name for ch in q.channels):
        raise bad_request(f"channel '{name}' already exists on '{q.name}'")
    accepts = None
    if topic:
        accepts = (lambda rk: topic_matches(topic, rk)) if ("*" in topic or "#" in topic) else topic.__eq__
    ch = q.add_channel(name, accepts)
    ch.http_filter = ("auto", topic)  # type: ignore[attr-defined]
    return json_response(_channel_json(q, ch), status=201)


async def channel_delete(call: Call) -> web.Response:
    vh, q = _queue(call, write=True)
    with _refusal():
        access.check(call.grants(vh), "configure", "queue", q.name)
    _not_locked(vh, q)
    ch = _find_channel(q, call.params["channel"])
    if ch is q.default:
        raise bad_request("the default channel goes with its queue")
    q.remove_channel(ch)
    return no_content()


# -- exchanges --------------------------------------------------------------------
def _exchanges_of(call: Call) -> list[tuple[str, Exchange | None]]:
    vhosts = [call.vhost()] if "vhost" in call.params else call.visible_vhosts()
    out: list[tuple[str, Exchange | None]] = []
    for vh in vhosts:
        out.append((vh.name, None))
        out.extend((vh.name, x) for x in vh.exchanges.values())
    return out


async def exchanges(call: Call) -> Any:
    rates = call.api.rates
    return listing.apply([exchange_json(v, x, rates) for v, x in _exchanges_of(call)], call.query)


def _exchange(call: Call, write: bool = False) -> tuple[VirtualHost, Exchange | None]:
    vh = call.vhost(write=write)
    name = call.params["name"]
    if name in ("", "amq.default"):
        return vh, None
    x = vh.exchanges.get(name)
    if x is None:
        raise not_found(f"no exchange '{name}' in vhost '{vh.name}'")
    return vh, x


async def exchange_get(call: Call) -> dict[str, Any]:
    vh, x = _exchange(call)
    return exchange_json(vh.name, x, call.api.rates)


EXCHANGE_FIELDS = frozenset({"type", "durable", "auto_delete", "internal", "arguments", "name", "vhost",
                             "user_who_performed_action"})


async def exchange_put(call: Call) -> web.Response:
    body = await call.body(EXCHANGE_FIELDS)
    vh = call.vhost(write=True)
    name = call.params["name"]
    type_ = body.get("type")
    if not isinstance(type_, str) or not type_:
        raise bad_request("type is required")
    with _refusal():
        access.declare_exchange(call.grants(vh), name, _arguments(body))
    existed = name in vh.exchanges
    await declare.declare_exchange(call.broker, vh, name, type_, _bool(body, "durable", True),
                                   _bool(body, "auto_delete", False), _bool(body, "internal", False),
                                   _arguments(body))
    return created(existed)


async def exchange_delete(call: Call) -> web.Response:
    vh, x = _exchange(call, write=True)
    if x is None:
        raise bad_request("the default exchange cannot be deleted")
    with _refusal():
        access.delete_exchange(call.grants(vh), x.name)
    await declare.delete_exchange(call.broker, vh, x.name, _flag(call, "if-unused"))
    return no_content()


PUBLISH_FIELDS = frozenset({"routing_key", "payload", "payload_encoding", "properties", "vhost", "name",
                            "exchange", "props"})


async def exchange_publish(call: Call) -> dict[str, Any]:
    body = await call.body(PUBLISH_FIELDS)
    vh, x = _exchange(call, write=True)
    routing_key = body.get("routing_key")
    if not isinstance(routing_key, str):
        raise bad_request("routing_key is required (a string)")
    # The entry checks every front end makes (core/engine/entry.py), answered as RabbitMQ's API answers them.
    with _refusal("publish"):
        entry.target(vh, call.grants(vh), "" if x is None else x.name, routing_key)
    payload = body.get("payload", "")
    if not isinstance(payload, str):
        raise bad_request("payload must be a string")
    encoding = body.get("payload_encoding", "string")
    if encoding == "string":
        data = payload.encode("utf-8")
    elif encoding == "base64":
        try:
            data = base64.b64decode(payload, validate=True)
        except binascii.Error:
            raise bad_request("payload is not valid base64") from None
    else:
        raise bad_request(f"payload_encoding must be string or base64, got {encoding!r}")
    props = body.get("properties") or {}
    if not isinstance(props, dict):
        raise bad_request("properties must be a JSON object")
    unknown = sorted(set(props) - {name for _, name, _ in properties.FIELDS})
    if unknown:
        raise bad_request(f"unknown message properties: {', '.join(unknown)}")
    try:
        raw = properties.encode(props)
    except (properties.PropertiesError, TypeError, ValueError) as exc:
        raise bad_request(f"properties do not encode: {exc}") from None
    summary = properties.scan(raw)
    try:
        entry.check_properties(summary, call.user.name)  # as over AMQP: no other user's id, a TTL in ms
    except PreconditionFailed as exc:
        raise bad_request(exc.text) from None
    message = Message(x.name if x else "", routing_key, raw, data, summary, node=call.node_name)
    # The one publish path (core/engine/publish.py): answered once the message is where the
    # confirm rule says (committed for a persistent message on a durable queue, at its owner).
    outcome = publish.publish(call.broker, vh, x, message)
    return {"routed": outcome.routed and await outcome.wait()}


def _exchange_bindings(call: Call, as_source: bool) -> list[dict[str, Any]]:
    vh, x = _exchange(call)
    if x is None:
        return [default_binding_json(vh.name, q) for q in vh.queues.values()] if as_source else []
    out = []
    for other in vh.exchanges.values():
        for b in other.bindings.values():
            if (as_source and b.source is x) or (not as_source and b.destination is x):
                out.append(binding_json(vh.name, b))
    return out


async def exchange_bindings_source(call: Call) -> list[dict[str, Any]]:
    return _exchange_bindings(call, True)


async def exchange_bindings_destination(call: Call) -> list[dict[str, Any]]:
    return _exchange_bindings(call, False)


# -- bindings ---------------------------------------------------------------------
async def bindings(call: Call) -> Any:
    vhosts = [call.vhost()] if "vhost" in call.params else call.visible_vhosts()
    return listing.apply([b for vh in vhosts for b in vhost_bindings(vh)], call.query, default_sort=None)


def _dest_kind(call: Call) -> str:
    return "queue" if call.request.raw_path.split("?")[0].split("/")[6] == "q" else "exchange"


def _between(call: Call) -> list[dict[str, Any]]:
    vh = call.vhost()
    source, dest, kind = call.params["source"], call.params["dest"], _dest_kind(call)
    if source not in vh.exchanges and source not in ("", "amq.default"):
        raise not_found(f"no exchange '{source}' in vhost '{vh.name}'")
    if (kind == "queue" and dest not in vh.queues) or (kind == "exchange" and dest not in vh.exchanges):
        raise not_found(f"no {kind} '{dest}' in vhost '{vh.name}'")
    return [b for b in vhost_bindings(vh) if b["source"] == source and b["destination"] == dest
            and b["destination_type"] == kind]


async def binding_list(call: Call) -> list[dict[str, Any]]:
    return _between(call)


async def binding_get(call: Call) -> dict[str, Any]:
    for b in _between(call):
        if b["properties_key"] == call.params["props"]:
            return b
    raise not_found("binding not found")


BINDING_FIELDS = frozenset({"routing_key", "arguments", "vhost", "source", "destination", "destination_type"})


async def binding_create(call: Call) -> web.Response:
    body = await call.body(BINDING_FIELDS)
    _between(call)  # 404 for a missing source or destination
    vh = call.vhost(write=True)
    source, dest, kind = call.params["source"], call.params["dest"], _dest_kind(call)
    if source in ("", "amq.default"):
        raise bad_request("operation not permitted on the default exchange")
    routing_key = body.get("routing_key", "")
    if not isinstance(routing_key, str):
        raise bad_request("routing_key must be a string")
    args = _arguments(body)
    _check_bind(call, vh, source, kind, dest, routing_key)
    await declare.bind(call.broker, vh, source, kind, dest, routing_key, args, add=True)
    location = properties_key(routing_key, args)
    return web.Response(status=201, headers={"Location": location})


async def binding_delete(call: Call) -> web.Response:
    found = await binding_get(call)
    vh = call.vhost(write=True)
    _check_bind(call, vh, found["source"], found["destination_type"], found["destination"], found["routing_key"])
    await declare.bind(call.broker, vh, found["source"], found["destination_type"], found["destination"],
                       found["routing_key"], _raw_arguments(vh, found), add=False)
    return no_content()


def _check_bind(call: Call, vh: VirtualHost, source: str, kind: str, dest: str, routing_key: str) -> None:
    """As queue.bind/exchange.bind: write on the destination, read on the source (and its topic keys)."""
    g = call.grants(vh)
    with _refusal():
        access.bind(g, source, kind, dest)
        x = vh.exchanges.get(source)
        if x is not None and x.type == "topic":
            access.check_topic(g, "read", source, routing_key)


@contextmanager
def _refusal(style: str = "") -> Iterator[None]:
    """A permission refusal answered as RabbitMQ 3.10.8's management API answers it (checked against one):
    401 not_authorised "Access refused." for declarations, deletions, purges and bindings; 401 with the
    AMQP text for a get; 400 with "403 ACCESS_REFUSED - ..." for a publish."""
    try:
        yield
    except AccessRefused as exc:
        if style == "publish":
            raise bad_request(f"403 ACCESS_REFUSED - {exc.text}") from None
        raise HttpError(401, "not_authorised", f"ACCESS_REFUSED - {exc.text}" if style == "get"
                        else "Access refused.") from None


def _raw_arguments(vh: VirtualHost, found: dict[str, Any]) -> dict[str, Any]:
    """The binding's arguments as the engine holds them (the JSON view may have decoded bytes)."""
    x = vh.exchanges[found["source"]]
    for b in x.bindings.values():
        if b.destination.name == found["destination"] and b.routing_key == found["routing_key"] and \
                binding_json(vh.name, b)["properties_key"] == found["properties_key"]:
            return b.arguments
    return {}
