"""Connections (AMQP and MQTT: list, close), channels and consumers."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from aiohttp import web

from leveret.http import listing
from leveret.http.errors import not_authorised, not_found
from leveret.http.mqtt_views import mqtt_connection_json, mqtt_connection_name
from leveret.http.responses import no_content
from leveret.http.views import channel_json, connection_json, connection_name, consumers_json
from mqtt_frontend import codec
from mqtt_frontend.server import Link

if TYPE_CHECKING:
    from amqp_frontend.server import AMQPProtocol
    from leveret.http.routing import Router
    from leveret.http.server import Call


log = logging.getLogger("leveret.http")


def register(r: Router) -> None:
    r.add("connections", GET=(connections, "management"))
    r.add("vhosts/{vhost}/connections", GET=(connections, "management"))
    r.add("connections/{name}", GET=(connection_get, "management"), DELETE=(connection_close, "management"))
    r.add("connections/{name}/channels", GET=(connection_channels, "management"))
    r.add("channels", GET=(channels, "management"))
    r.add("vhosts/{vhost}/channels", GET=(channels, "management"))
    r.add("channels/{name}", GET=(channel_get, "management"))
    r.add("consumers", GET=(consumers, "management"))
    r.add("consumers/{vhost}", GET=(consumers, "management"))


def _open(call: Call) -> list[AMQPProtocol]:
    """Connections past the handshake this user may see (its own, or all for monitoring/administrator)."""
    vhost = call.vhost().name if "vhost" in call.params else None
    out = []
    for proto in list(call.node.amqp.connections):
        conn = proto.conn
        if conn is None or conn.vhost is None or proto.transport is None:
            continue
        if vhost is not None and conn.vhost.name != vhost:
            continue
        if call.sees_all or conn.username == call.user.name:
            out.append(proto)
    return out


def _open_mqtt(call: Call) -> list[Link]:
    """MQTT connections past CONNACK (TCP, TLS and WebSocket alike), by the same visibility rule."""
    vhost = call.vhost().name if "vhost" in call.params else None
    out = []
    for link in call.node.mqtt.open_links():
        conn = link.conn
        if conn.vhost is None:
            continue
        if vhost is not None and conn.vhost.name != vhost:
            continue
        if call.sees_all or conn.username == call.user.name:
            out.append(link)
    return out


async def connections(call: Call) -> Any:
    node = call.node_name
    rows = [connection_json(p, node, call.api.rates) for p in _open(call)]
    rows += [mqtt_connection_json(link, node) for link in _open_mqtt(call)]
    return listing.apply(rows, call.query)


def _connection(call: Call) -> AMQPProtocol | Link:
    name = call.params["name"]
    for proto in _open(call):
        if connection_name(proto) == name:
            return proto
    for link in _open_mqtt(call):
        if mqtt_connection_name(link) == name:
            return link
    raise not_found(f"connection '{name}' not found")


def _amqp_connection(call: Call) -> AMQPProtocol:
    found = _connection(call)
    if isinstance(found, Link):  # an MQTT connection has no channels
        raise not_found(f"connection '{call.params['name']}' has no channels")
    return found


async def connection_get(call: Call) -> dict[str, Any]:
    found = _connection(call)
    if isinstance(found, Link):
        return mqtt_connection_json(found, call.node_name)
    return connection_json(found, call.node_name, call.api.rates)


async def connection_close(call: Call) -> web.Response:
    """Close with 320 CONNECTION_FORCED and the X-Reason header's text, as RabbitMQ does.

    An MQTT 5 connection gets a DISCONNECT with reason 0x98 (administrative action) and the text;
    a 3.1.1 one has no server DISCONNECT, its socket is closed.
    """
    found = _connection(call)
    username = found.conn.username if isinstance(found, Link) else found.conn.username if found.conn else ""
    # Reading every connection is a monitoring user's right; closing one is its owner's or an
    # administrator's (RabbitMQ's is_authorized_user: DELETE needs the administrator tag).
    if username != call.user.name and not call.has("administrator"):
        raise not_authorised("User not authorised to access object")
    reason = call.request.headers.get("X-Reason", "Closed via management plugin")
    log.info("connection closed through the management API",
             extra={"connection": call.params["name"], "user": call.user.name, "reason": reason})
    if isinstance(found, Link):
        found.conn.close(codec.ADMINISTRATIVE_ACTION, reason[:200])
        found.flush()
    elif found.conn is not None:
        found.conn.close(320, f"CONNECTION_FORCED - {reason}"[:255])
        found._flush()
    return no_content()


async def connection_channels(call: Call) -> Any:
    proto = _amqp_connection(call)
    assert proto.conn is not None
    return [channel_json(proto, ch, call.node_name, call.api.rates) for ch in proto.conn.channels.values()]


def _all_channels(call: Call) -> list[dict[str, Any]]:
    node = call.node_name
    return [channel_json(p, ch, node, call.api.rates) for p in _open(call) if p.conn is not None
            for ch in p.conn.channels.values()]


async def channels(call: Call) -> Any:
    return listing.apply(_all_channels(call), call.query)


async def channel_get(call: Call) -> dict[str, Any]:
    for ch in _all_channels(call):
        if ch["name"] == call.params["name"]:
            return ch
    raise not_found(f"channel '{call.params['name']}' not found")


async def consumers(call: Call) -> Any:
    vhost = call.vhost().name if "vhost" in call.params else None
    out: list[dict[str, Any]] = []
    for proto in _open(call):
        assert proto.conn is not None
        for ch in proto.conn.channels.values():
            out.extend(c for c in consumers_json(proto, ch, call.node_name)
                       if vhost is None or c["queue"]["vhost"] == vhost)
    return listing.apply(out, call.query, default_sort=None)
