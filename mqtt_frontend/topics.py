"""MQTT topics and filters, and their mapping onto ``amq.topic`` routing keys as RabbitMQ maps them.

A topic's levels are separated by ``/``, an AMQP routing key's words by ``.``;
the two are swapped (``a/b.c`` <-> ``a.b/c``), ``+`` becomes ``*`` and ``#``
stays. ``amq.topic`` then does the routing; the session matches a delivery
against its own filters again only for what AMQP cannot say: which
subscriptions matched (QoS, identifiers, no-local), and that a ``$`` topic is
not matched by a wildcard at its first level (MQTT-4.7.2-1).
"""

from __future__ import annotations

from functools import lru_cache

from mqtt_frontend.codec import MalformedPacket, PacketError, ProtocolError

TOPIC_NAME_INVALID = 0x90
TOPIC_FILTER_INVALID = 0x8F
EXCHANGE = "amq.topic"
SHARE_PREFIX = "$share/"

_TO_KEY = str.maketrans({"/": ".", ".": "/", "+": "*"})
_TO_TOPIC = str.maketrans({".": "/", "/": "."})


def check_topic(topic: str) -> None:
    """A PUBLISH topic name: not empty, no wildcard (MQTT-3.3.2-2)."""
    if not topic:
        raise ProtocolError("empty topic name", TOPIC_NAME_INVALID)
    if "+" in topic or "#" in topic:
        raise PacketError(f"wildcard in the topic name of a PUBLISH: {topic[:100]!r}", TOPIC_NAME_INVALID)
    if len(topic.encode("utf-8")) > 65535:
        raise MalformedPacket("topic longer than 65535 bytes")


def check_filter(topic_filter: str) -> None:
    """A SUBSCRIBE filter: ``#`` only last and alone in its level, ``+`` alone in its level."""
    if not topic_filter:
        raise ProtocolError("empty topic filter", TOPIC_FILTER_INVALID)
    levels = topic_filter.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            raise ProtocolError(f"'#' not alone at the end of filter {topic_filter[:100]!r}", TOPIC_FILTER_INVALID)
        if "+" in level and level != "+":
            raise ProtocolError(f"'+' not alone in a level of filter {topic_filter[:100]!r}", TOPIC_FILTER_INVALID)


def split_shared(topic_filter: str) -> tuple[str | None, str]:
    """``$share/group/filter`` -> (group, filter); any other filter -> (None, filter)."""
    if not topic_filter.startswith(SHARE_PREFIX):
        return None, topic_filter
    rest = topic_filter[len(SHARE_PREFIX):]
    group, sep, inner = rest.partition("/")
    if not sep or not group or "+" in group or "#" in group or not inner:
        raise ProtocolError(f"malformed shared subscription {topic_filter[:100]!r}", TOPIC_FILTER_INVALID)
    return group, inner


@lru_cache(maxsize=4096)
def to_routing_key(topic: str) -> str:
    return topic.translate(_TO_KEY)


@lru_cache(maxsize=4096)
def to_topic(routing_key: str) -> str:
    return routing_key.translate(_TO_TOPIC)


@lru_cache(maxsize=4096)
def _levels(text: str) -> tuple[str, ...]:
    return tuple(text.split("/"))


def matches(topic_filter: str, topic: str) -> bool:
    """MQTT's matching, with the ``$`` rule (a wildcard first level never matches a ``$`` topic)."""
    if topic_filter == topic:
        return True
    f = _levels(topic_filter)
    t = _levels(topic)
    if topic.startswith("$") and f[0] in ("+", "#"):
        return False
    for i, level in enumerate(f):
        if level == "#":
            return True
        if i >= len(t):
            return False
        if level != "+" and level != t[i]:
            return False
    return len(f) == len(t) or (len(f) == len(t) + 1 and f[-1] == "#")
