"""A shovel's runtime parameter, validated into a ``ShovelSpec`` (bad input: ``ShovelError``, HTTP 400).

The keys and their defaults are RabbitMQ's dynamic shovel's (protocol 0-9-1
only): one source (a queue, or an exchange and routing key), one destination
(a queue, or an exchange and routing key), an acknowledgement mode, and when
to delete itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

COMPONENT = "shovel"
ACK_MODES = ("on-confirm", "on-publish", "no-ack")
KNOWN = frozenset({
    "src-uri", "src-queue", "src-exchange", "src-exchange-key", "src-prefetch-count", "src-delete-after",
    "src-protocol", "src-queue-args",
    "dest-uri", "dest-queue", "dest-exchange", "dest-exchange-key", "dest-protocol", "dest-add-forward-headers",
    "dest-add-timestamp-header", "dest-publish-properties", "dest-queue-args",
    "ack-mode", "reconnect-delay", "add-forward-headers", "delete-after", "prefetch-count",
    "user",  # who set it (stamped by the management API; leveret/links/identity.py)
})


class ParameterError(ValueError):
    """A runtime parameter that cannot be accepted, of any component (the management API answers 400)."""


class ShovelError(ParameterError):
    """The parameter is not a valid shovel definition (the management API answers 400 with this text)."""


@dataclass(frozen=True)
class ShovelSpec:
    vhost: str
    name: str
    src_uris: tuple[str, ...]
    dest_uris: tuple[str, ...]
    src_queue: str | None
    src_exchange: str | None
    src_exchange_key: str
    dest_queue: str | None
    dest_exchange: str | None
    dest_exchange_key: str | None  # None: keep the message's own routing key
    ack_mode: str
    prefetch: int
    reconnect_delay: float
    delete_after: int | str | None  # None: never; a count; "queue-length": what the queue held at start
    forward_headers: bool
    timestamp_header: bool = False
    publish_properties: tuple[tuple[str, Any], ...] = ()  # (pamqp attribute, value) set on every message
    src_queue_args: tuple[tuple[str, Any], ...] = ()  # arguments when the shovel declares the source queue
    dest_queue_args: tuple[tuple[str, Any], ...] = ()
    owner: str | None = None  # the user who set it: a URI without a host acts as this user


def _uris(value: dict[str, Any], key: str) -> tuple[str, ...]:
    raw = value.get(key)
    uris = [raw] if isinstance(raw, str) else raw
    if not isinstance(uris, list) or not uris or not all(isinstance(u, str) for u in uris):
        raise ShovelError(f"{key} must be a URI or a non-empty list of URIs")
    for uri in uris:
        if urlsplit(uri).scheme not in ("amqp", "amqps"):
            raise ShovelError(f"{key}: {uri!r} is not an amqp:// or amqps:// URI")
    return tuple(uris)


def _opt_str(value: dict[str, Any], key: str) -> str | None:
    v = value.get(key)
    if v is not None and not isinstance(v, str):
        raise ShovelError(f"{key} must be a string")
    return v


# dest-publish-properties: RabbitMQ's names -> pamqp's Basic.Properties attributes.
PROPERTIES = {"content_type": "content_type", "content_encoding": "content_encoding", "headers": "headers",
              "delivery_mode": "delivery_mode", "priority": "priority", "correlation_id": "correlation_id",
              "reply_to": "reply_to", "expiration": "expiration", "message_id": "message_id",
              "timestamp": "timestamp", "type": "message_type", "user_id": "user_id", "app_id": "app_id",
              "cluster_id": "cluster_id"}


def _table(value: dict[str, Any], key: str) -> dict[str, Any]:
    v = value.get(key, {})
    if not isinstance(v, dict):
        raise ShovelError(f"{key} must be a JSON object")
    return v


def _properties(value: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    props = _table(value, "dest-publish-properties")
    unknown = sorted(set(props) - set(PROPERTIES))
    if unknown:
        raise ShovelError(f"dest-publish-properties: unknown properties {', '.join(unknown)}")
    if "headers" in props and not isinstance(props["headers"], dict):
        raise ShovelError("dest-publish-properties: headers must be a JSON object")
    if "timestamp" in props:  # seconds in JSON; pamqp takes a datetime
        stamp = props["timestamp"]
        if isinstance(stamp, bool) or not isinstance(stamp, int):
            raise ShovelError("dest-publish-properties: timestamp must be an integer (seconds)")
        props = {**props, "timestamp": datetime.fromtimestamp(stamp, UTC)}
    return tuple(sorted((PROPERTIES[k], v) for k, v in props.items()))


def _number(value: dict[str, Any], key: str, default: float, minimum: float) -> float:
    v = value.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < minimum:
        raise ShovelError(f"{key} must be a number >= {minimum:g}")
    return float(v)


def parse(vhost: str, name: str, value: Any) -> ShovelSpec:
    """The parameter's value as the management API received it (a JSON object)."""
    if not isinstance(value, dict):
        raise ShovelError("a shovel's value must be a JSON object")
    unknown = sorted(set(value) - KNOWN)
    if unknown:
        raise ShovelError(f"unknown shovel keys: {', '.join(unknown)}")
    for side in ("src", "dest"):
        if value.get(f"{side}-protocol", "amqp091") != "amqp091":
            raise ShovelError(f"{side}-protocol: only amqp091 is supported")
    src_queue, src_exchange = _opt_str(value, "src-queue"), _opt_str(value, "src-exchange")
    if (src_queue is None) == (src_exchange is None):
        raise ShovelError("give exactly one of src-queue and src-exchange")
    dest_queue, dest_exchange = _opt_str(value, "dest-queue"), _opt_str(value, "dest-exchange")
    if dest_queue is not None and dest_exchange is not None:
        raise ShovelError("give at most one of dest-queue and dest-exchange")
    ack_mode = value.get("ack-mode", "on-confirm")
    if ack_mode not in ACK_MODES:
        raise ShovelError(f"ack-mode must be one of {', '.join(ACK_MODES)}")
    delete_after: int | str | None = value.get("src-delete-after", value.get("delete-after", "never"))
    if delete_after == "never":
        delete_after = None
    elif delete_after != "queue-length" and (
            isinstance(delete_after, bool) or not isinstance(delete_after, int) or delete_after < 1):
        raise ShovelError("src-delete-after must be \"never\", \"queue-length\" or a positive integer")
    if delete_after == "queue-length" and src_queue is None:
        raise ShovelError("src-delete-after \"queue-length\" needs a src-queue")
    forward = value.get("dest-add-forward-headers", value.get("add-forward-headers", False))
    stamp = value.get("dest-add-timestamp-header", False)
    if not isinstance(forward, bool) or not isinstance(stamp, bool):
        raise ShovelError("dest-add-forward-headers and dest-add-timestamp-header must be true or false")
    return ShovelSpec(
        vhost=vhost, name=name, src_uris=_uris(value, "src-uri"), dest_uris=_uris(value, "dest-uri"),
        src_queue=src_queue, src_exchange=src_exchange,
        src_exchange_key=(_opt_str(value, "src-exchange-key") or "#") if src_exchange is not None else "",
        dest_queue=dest_queue, dest_exchange=dest_exchange, dest_exchange_key=_opt_str(value, "dest-exchange-key"),
        ack_mode=ack_mode,
        prefetch=int(_number(value, "src-prefetch-count", value.get("prefetch-count", 1000), 1)),
        reconnect_delay=_number(value, "reconnect-delay", 5, 0),
        delete_after=delete_after, forward_headers=forward, timestamp_header=stamp,
        publish_properties=_properties(value),
        src_queue_args=tuple(sorted(_table(value, "src-queue-args").items())),
        dest_queue_args=tuple(sorted(_table(value, "dest-queue-args").items())),
        owner=_opt_str(value, "user") or None,
    )


# RabbitMQ's TLS query parameters (cacertfile, verify=verify_none, ...) -> aiormq's (cafile, no_verify_ssl).
_TLS_QUERY = {"cacertfile": "cafile", "certfile": "certfile", "keyfile": "keyfile"}


def client_uri(uri: str, local_port: int, login: tuple[str, str] | None = None) -> str:
    """The URI as aiormq takes it; ``amqp://`` with no host is this node (RabbitMQ: the local broker),
    entered with ``login`` (the parameter owner's name and the node's link token: identity.py), never
    with credentials of the URI's or a default user's."""
    parts = urlsplit(uri)
    netloc = parts.netloc
    if not parts.hostname:
        if login is None:
            raise ValueError(f"{redact(uri)} is this node: it needs the login of the parameter's owner")
        netloc = f"{quote(login[0], safe='')}:{quote(login[1], safe='')}@127.0.0.1:{local_port}"
    query = []
    for k, v in parse_qsl(parts.query):
        if k in _TLS_QUERY:
            query.append((_TLS_QUERY[k], v))
        elif k == "verify":
            query.append(("no_verify_ssl", "1" if v == "verify_none" else "0"))
        elif k in ("heartbeat", "connection_timeout", "channel_max", "frame_max", "cafile", "no_verify_ssl"):
            query.append((k, v))
    return urlunsplit((parts.scheme, netloc, parts.path, urlencode(query), ""))


def redact(uri: str) -> str:
    """The URI without its password (status JSON, logs)."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    netloc = f"{parts.username}:***@{parts.netloc.rpartition('@')[2]}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
