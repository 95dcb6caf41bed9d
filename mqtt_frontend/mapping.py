"""MQTT 5 properties as AMQP properties and back, as RabbitMQ 3.13 maps them.

A message is kept in the engine as AMQP basic properties (core/model/properties.py), so an AMQP
consumer sees what an MQTT publisher sent and the other way round: content type <-> content_type,
response topic <-> reply_to (as a routing key), correlation data <-> correlation_id (or the header
x-correlation-id when it is not UTF-8), user properties <-> headers, message expiry <-> expiration.
QoS is the delivery mode (2 for QoS 1). A plain publish (no property, no retain) shares one
constant property encoding per QoS, which the delivery recognises by identity.
"""

from __future__ import annotations

from typing import Any

from core.model import properties
from core.model.message import Message
from mqtt_frontend import topics
from mqtt_frontend.retained import QOS_HEADER

# Headers that carry MQTT facts AMQP has no property for (as RabbitMQ's x-mqtt-publish-qos).
H_RETAIN, H_PFI, H_CORRELATION = "x-mqtt-retain", "x-mqtt-payload-format", "x-correlation-id"
INTERNAL_HEADERS = frozenset({H_RETAIN, H_PFI, H_CORRELATION, QOS_HEADER})

# The property bytes of a plain publish: delivery mode 1 (QoS 0) or 2 (QoS 1).
PLAIN_PROPS = {0: properties.encode({"delivery_mode": 1}), 1: properties.encode({"delivery_mode": 2})}
PLAIN_SUMMARY = {q: properties.scan(p) for q, p in PLAIN_PROPS.items()}
PLAIN_FLAGS = 0x1000


def to_amqp(qos: int, retain: bool, props: dict[str, Any]) -> bytes:
    """The MQTT 5 properties as AMQP properties, as RabbitMQ 3.13 maps them."""
    amqp: dict[str, Any] = {"delivery_mode": 2 if qos else 1}
    headers: dict[str, Any] = {}
    for name, value in props.get("user_property", ()):
        headers[name] = value
    if retain:
        headers[H_RETAIN] = True
    if "payload_format" in props:
        headers[H_PFI] = props["payload_format"]
    if "content_type" in props:
        amqp["content_type"] = props["content_type"][:255]
    if "response_topic" in props:
        amqp["reply_to"] = topics.to_routing_key(props["response_topic"])[:255]
    if "correlation_data" in props:
        data = props["correlation_data"]
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        if text is not None and len(data) <= 255:
            amqp["correlation_id"] = text
        else:
            headers[H_CORRELATION] = data
    expiry = props.get("message_expiry")
    if expiry is not None:
        amqp["expiration"] = str(expiry * 1000)
    if headers:
        amqp["headers"] = headers
    return properties.encode(amqp)


def to_mqtt(m: Message, expiry: int | None) -> dict[str, Any]:
    props: dict[str, Any] = {}
    if expiry is not None:
        props["message_expiry"] = expiry
    flags = int.from_bytes(m.props[:2], "big")
    if not flags & ~PLAIN_FLAGS:
        return props
    amqp = properties.decode(m.props)
    if "content_type" in amqp:
        props["content_type"] = amqp["content_type"]
    if "reply_to" in amqp:
        props["response_topic"] = topics.to_topic(amqp["reply_to"])
    if "correlation_id" in amqp:
        props["correlation_data"] = amqp["correlation_id"].encode("utf-8")
    headers = amqp.get("headers") or {}
    if H_CORRELATION in headers and isinstance(headers[H_CORRELATION], (bytes, bytearray)):
        props["correlation_data"] = bytes(headers[H_CORRELATION])
    if headers.get(H_PFI) in (0, 1):
        props["payload_format"] = headers[H_PFI]
    users = [(str(k), _text(v)) for k, v in headers.items() if k not in INTERNAL_HEADERS]
    if users:
        props["user_property"] = users
    return props


def retain_flag(m: Message) -> bool:
    return m.summary.headers_at >= 0 and m.headers.get(H_RETAIN) is True


def _text(value: Any) -> str:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    return str(value)
