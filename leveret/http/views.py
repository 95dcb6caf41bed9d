"""JSON views of engine and front-end objects, with RabbitMQ's field names."""

from __future__ import annotations

import base64
import datetime
import decimal
import hashlib
import json
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, quote_plus

from core.engine.exchange import Binding, Exchange
from core.engine.paging import MESSAGE_BYTES, PagedReady
from core.engine.policy import effective_definition
from core.engine.queue import Queue
from core.engine.stats import exchange_counters, queue_counters
from core.engine.stream import StreamQueue
from core.model import properties
from core.model.policy import Policy

if TYPE_CHECKING:
    from amqp_frontend.channel import Channel
    from amqp_frontend.server import AMQPProtocol
    from core.engine.broker import User
    from core.engine.vhost import VirtualHost
    from leveret.http.rates import RateSampler


def jsonable(value: Any) -> Any:
    """AMQP field values (bytes, Decimal, datetime) as JSON values."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, datetime.datetime):
        return int(value.timestamp())
    return value


def queue_counts(q: Queue) -> tuple[int, int, int]:
    """(messages ready, unacknowledged, consumers) as this node sees them."""
    ch = q.default
    return len(ch.ready), ch.unacked, len(ch.consumers)


def queue_json(q: Queue, node: str, rates: RateSampler, owner_counts: tuple[int, int] | None = None,
               policies: tuple[Policy | None, Policy | None] = (None, None)) -> dict[str, Any]:
    """``owner_counts``: (messages ready, consumers) from the owner of a queue another node owns;
    ``policies``: the (policy, operator policy) that apply to it (``VirtualHost.policies_of``)."""
    ready, unacked, consumers = queue_counts(q)
    if q.remote is not None:
        node = q.remote.owner or node
        if owner_counts is not None:
            ready, unacked, consumers = owner_counts[0], 0, owner_counts[1]
    policy, operator = policies
    return {
        "name": q.name, "vhost": q.vhost, "durable": q.durable, "auto_delete": q.auto_delete,
        "exclusive": q.exclusive, "arguments": jsonable(q.arguments), "node": node,
        "type": "stream" if isinstance(q, StreamQueue) else q.args.queue_type, "state": "running",
        "messages": ready + unacked, "messages_ready": ready, "messages_unacknowledged": unacked,
        "message_bytes_ready": q.default.ready_bytes, "consumers": consumers,
        "policy": policy.name if policy else None, "operator_policy": operator.name if operator else None,
        "effective_policy_definition": effective_definition(policy, operator), "exclusive_consumer_tag": None,
        "message_stats": rates.queue_stats(q.vhost, q.name, queue_counters(q)),
        **rates.depth_details(q.vhost, q.name), **queue_extras(q, consumers, ready),
    }


def queue_extras(q: Queue, consumers: int, ready: int) -> dict[str, Any]:
    """The fields RabbitMQ's queue view adds that tools and the console read, from what Leveret keeps."""
    ch = q.default
    in_memory = ch.ready.mem if isinstance(ch.ready, PagedReady) else ch.ready
    head = in_memory[0] if len(in_memory) else None
    stamp = properties.decode(head.message.props).get("timestamp") if head is not None else None
    # What a consumer could take now (RabbitMQ samples how often its consumers could): 1.0 when
    # some consumer has credit or nothing waits, 0.0 when messages wait and no consumer takes them.
    if consumers == 0:
        utilisation: float | None = None
    elif ready == 0 or any(c.sink.has_credit(c) for c in ch.consumers):
        utilisation = 1.0
    else:
        utilisation = 0.0
    return {
        # The bodies the memory alarm counts for this queue plus Leveret's per-message estimate.
        "memory": ch.memory_bytes + len(in_memory) * MESSAGE_BYTES,
        "head_message_timestamp": stamp if stamp is not None else "",
        "consumer_utilisation": utilisation, "consumer_capacity": utilisation or 0.0,
        # Counted over the messages held in memory (paged-out messages are not read back for it).
        "messages_persistent": sum(1 for qm in in_memory if qm.message.persistent) if q.durable else 0,
        "message_bytes": ch.ready_bytes, "messages_paged_out": ch.ready.paged if isinstance(ch.ready, PagedReady)
        else 0,
    }


def exchange_json(vhost: str, x: Exchange | None, rates: RateSampler, default_published_in: int = 0) -> dict[str, Any]:
    """``default_published_in``: the vhost's count for the default exchange (``x`` None)."""
    if x is None:  # the default exchange, named "" here as in RabbitMQ
        return {"name": "", "vhost": vhost, "type": "direct", "durable": True, "auto_delete": False,
                "internal": False, "arguments": {}, "user_who_performed_action": "rmq-internal",
                "message_stats": rates.exchange_stats(vhost, "", (default_published_in,))}
    return {
        "name": x.name, "vhost": vhost, "type": x.type, "durable": x.durable, "auto_delete": x.auto_delete,
        "internal": x.internal, "arguments": jsonable(x.arguments), "user_who_performed_action": "",
        "message_stats": rates.exchange_stats(vhost, x.name, exchange_counters(x)),
    }


def _quote_binding(text: str) -> str:
    # RabbitMQ's quote_binding: quote_plus, then "~" (the key/arguments separator) escaped too.
    return quote_plus(text).replace("~", "%7E")


def properties_key(routing_key: str, arguments: dict[str, Any]) -> str:
    """What names a binding in a URL (RabbitMQ's ``pack_binding_props``): the key, "~" and an arguments hash."""
    if not arguments:
        return "~" if routing_key == "" else _quote_binding(routing_key)
    digest = hashlib.sha1(json.dumps(jsonable(arguments), sort_keys=True).encode()).digest()[:12]
    return _quote_binding(routing_key) + "~" + base64.urlsafe_b64encode(digest).decode().rstrip("=")


def binding_json(vhost: str, b: Binding) -> dict[str, Any]:
    kind = "exchange" if isinstance(b.destination, Exchange) else "queue"
    return {"source": b.source.name, "vhost": vhost, "destination": b.destination.name,
            "destination_type": kind, "routing_key": b.routing_key, "arguments": jsonable(b.arguments),
            "properties_key": properties_key(b.routing_key, b.arguments)}


def default_binding_json(vhost: str, q: Queue) -> dict[str, Any]:
    return {"source": "", "vhost": vhost, "destination": q.name, "destination_type": "queue",
            "routing_key": q.name, "arguments": {}, "properties_key": _quote_binding(q.name)}


def vhost_bindings(vh: VirtualHost) -> list[dict[str, Any]]:
    out = [default_binding_json(vh.name, q) for q in vh.queues.values()]
    for x in vh.exchanges.values():
        out.extend(binding_json(vh.name, b) for b in x.bindings.values())
    return out


LEVERET_PHC = "leveret_phc"


def user_json(user: User) -> dict[str, Any]:
    rabbit = user.rabbit_hash()
    if rabbit is not None:
        password_hash, algorithm = rabbit, "rabbit_password_hashing_sha256"
    elif not user.salt:
        # The node's slow KDF (argon2id, or PBKDF2-SHA256 600k): its PHC string, which
        # Leveret re-imports and RabbitMQ cannot check (so it goes under leveret_users).
        password_hash, algorithm = user.password_hash.decode("ascii"), LEVERET_PHC
    else:
        # Leveret's own hash (salt + PBKDF2): kept so a Leveret export re-imports into Leveret.
        password_hash = base64.b64encode(user.salt + user.password_hash).decode("ascii")
        algorithm = "leveret_pbkdf2_sha256"
    return {"name": user.name, "password_hash": password_hash, "hashing_algorithm": algorithm,
            "tags": list(user.tags), "limits": dict(user.limits)}


def connection_name(proto: AMQPProtocol) -> str:
    conn = proto.conn
    peer = conn.peer if conn is not None and conn.peer else ("?", 0)
    local = proto.transport.get_extra_info("sockname") if proto.transport is not None else None
    here = f"{local[0]}:{local[1]}" if local else "?"
    return f"{peer[0]}:{peer[1]} -> {here}"


def connection_json(proto: AMQPProtocol, node: str, rates: RateSampler | None = None) -> dict[str, Any]:
    conn = proto.conn
    assert conn is not None
    peer = conn.peer or ("", 0)
    local = proto.transport.get_extra_info("sockname") if proto.transport is not None else None
    return {
        "name": connection_name(proto), "node": node, "type": "network", "protocol": "AMQP 0-9-1",
        "user": conn.username, "vhost": conn.vhost.name if conn.vhost is not None else None,
        # RabbitMQ's states: "blocked" (memory or disk alarm), "flow" (flow control holds
        # it: core/engine/flow.py), "running"; and how long and how often it was held.
        "state": conn.flow_state, "leveret_flow_seconds": round(conn.flow_seconds, 3),
        "leveret_flow_count": conn.flow_count,
        "channels": len(conn.channels), "peer_host": peer[0], "peer_port": peer[1],
        "host": local[0] if local else "", "port": local[1] if local else 0,
        "client_properties": jsonable(conn.client_properties), "timeout": conn.heartbeat,
        "frame_max": conn.frame_max, "channel_max": conn.channel_max,
        "auth_mechanism": conn.auth_mechanism or "PLAIN",
        "ssl": proto.transport is not None and proto.transport.get_extra_info("ssl_object") is not None,
        "connected_at": int(_wall_clock_of(conn.opened_at) * 1000),
        **(rates.connection_octets(proto) if rates is not None else {}),
    }


def _wall_clock_of(monotonic_at: float) -> float:
    """A time.monotonic() instant (the connection's clock) as Unix time."""
    return time.time() - (time.monotonic() - monotonic_at)


def channel_json(proto: AMQPProtocol, ch: Channel, node: str, rates: RateSampler | None = None) -> dict[str, Any]:
    conn = proto.conn
    assert conn is not None
    peer = conn.peer or ("", 0)
    name = connection_name(proto)
    return {
        "name": f"{name} ({ch.number})", "number": ch.number, "node": node, "user": conn.username,
        "vhost": ch.vhost.name if ch.vhost is not None else None, "state": "running",
        "connection_details": {"name": name, "peer_host": peer[0], "peer_port": peer[1]},
        "consumer_count": len(ch.consumers), "messages_unacknowledged": len(ch.unacked),
        "prefetch_count": ch.prefetch_per_consumer, "global_prefetch_count": ch.prefetch_global,
        "confirm": ch.confirm, "transactional": ch.tx is not None,
        **({"message_stats": rates.channel_stats(ch)} if rates is not None else {}),
    }


def consumers_json(proto: AMQPProtocol, ch: Channel, node: str = "") -> list[dict[str, Any]]:
    conn = proto.conn
    assert conn is not None
    peer = conn.peer or ("", 0)
    name = connection_name(proto)
    details = {"name": f"{name} ({ch.number})", "number": ch.number, "connection_name": name,
               "peer_host": peer[0], "peer_port": peer[1], "user": conn.username, "node": node}
    return [{
        "consumer_tag": c.tag, "queue": {"name": c.queue.name, "vhost": c.queue.vhost},
        "channel_details": details, "ack_required": not c.no_ack, "exclusive": c.exclusive,
        "prefetch_count": c.prefetch, "arguments": jsonable(c.arguments), "active": True,
        "activity_status": "up",  # no "consumer_timeout": None: rabbitmqadmin's table cannot print it
    } for c in ch.consumers.values()]


def quote_name(name: str) -> str:
    return quote(name, safe="")
