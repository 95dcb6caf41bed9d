"""MQTT connections as the management API shows them, in the shape of RabbitMQ's MQTT plugin.

RabbitMQ 3.10's rabbitmq_mqtt lists a connection with protocol "MQTT 3.1.1" and
client_properties {"client_id": ..., "product": "MQTT client"} (and the same client id under
variable_map); the keys AMQP connections carry (leveret/http/views.py) are kept so the console
and tools that read both need no second case.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from mqtt_frontend import codec

if TYPE_CHECKING:
    from mqtt_frontend.server import Link

PROTOCOLS = {codec.V311: "MQTT 3.1.1", codec.V5: "MQTT 5.0"}


def mqtt_connection_name(link: Link) -> str:
    """RabbitMQ's name for a network connection: "peer host:port -> local host:port"."""
    peer = link.conn.peer or ("?", 0)
    here = f"{link.local[0]}:{link.local[1]}" if link.local else "?"
    return f"{peer[0]}:{peer[1]} -> {here}"


def mqtt_connection_json(link: Link, node: str) -> dict[str, Any]:
    conn = link.conn
    peer = conn.peer or ("", 0)
    local = link.local
    return {
        "name": mqtt_connection_name(link), "node": node, "type": "network",
        "protocol": PROTOCOLS.get(conn.level, "MQTT"),
        "user": conn.username, "vhost": conn.vhost.name if conn.vhost is not None else None,
        "state": "blocked" if conn.blocked else "running",
        "channels": 0, "peer_host": peer[0], "peer_port": peer[1],
        "host": local[0] if local else "", "port": local[1] if local else 0,
        "client_properties": {"client_id": conn.client_id, "product": "MQTT client"},
        "variable_map": {"client_id": conn.client_id},
        "timeout": conn.keep_alive, "frame_max": 0, "channel_max": 0,
        "ssl": link.tls, "leveret_transport": link.transport,
        # opened_at is on the connection's monotonic clock
        "connected_at": int((time.time() - (time.monotonic() - conn.opened_at)) * 1000),
    }
