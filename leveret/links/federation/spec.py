"""Federation upstreams and upstream sets (runtime parameters), validated; the links a policy asks for.

The keys and defaults are RabbitMQ's ``federation-upstream`` component's. A
``federation-upstream-set`` is a list of ``{"upstream": name}`` objects, each
of which may override the upstream's own keys (RabbitMQ's format). The policy
keys ``federation-upstream`` (one upstream's name) and
``federation-upstream-set`` (a set's name, or ``all``: every upstream of the
vhost) make an exchange federated: one link per exchange and upstream.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from leveret.links.shovel.spec import ACK_MODES, ParameterError

UPSTREAM = "federation-upstream"
UPSTREAM_SET = "federation-upstream-set"
COMPONENTS = frozenset({UPSTREAM, UPSTREAM_SET})
# Keys RabbitMQ accepts that Leveret takes and ignores: queue federation's
# ("queue", "consumer-tag"), and options that have no meaning without Erlang
# mirroring ("ha-policy") or that only change round trips ("bind-nowait").
IGNORED = frozenset({"queue", "consumer-tag", "ha-policy", "bind-nowait"})
KNOWN = frozenset({"uri", "exchange", "max-hops", "expires", "message-ttl", "prefetch-count", "reconnect-delay",
                   "ack-mode", "trust-user-id", "user"}) | IGNORED  # user: who set it (links/identity.py)


class FederationError(ParameterError):
    """Not a valid upstream or upstream set (the management API answers 400 with this text)."""


@dataclass(frozen=True)
class Upstream:
    """One ``federation-upstream`` parameter (or a set's entry: the upstream with its overrides)."""

    name: str
    uris: tuple[str, ...]
    exchange: str | None  # None: the federated exchange's own name
    max_hops: int
    expires: int | None  # ms, the upstream queue's x-expires
    message_ttl: int | None  # ms, its x-message-ttl
    prefetch: int
    reconnect_delay: float
    ack_mode: str
    trust_user_id: bool
    owner: str | None = None  # the user who set the upstream: a URI without a host acts as this user


def _uris(value: dict[str, Any]) -> tuple[str, ...]:
    from urllib.parse import urlsplit

    raw = value.get("uri")
    uris = [raw] if isinstance(raw, str) else raw
    if not isinstance(uris, list) or not uris or not all(isinstance(u, str) for u in uris):
        raise FederationError("uri must be a URI or a non-empty list of URIs")
    for uri in uris:
        if urlsplit(uri).scheme not in ("amqp", "amqps"):
            raise FederationError(f"uri: {uri!r} is not an amqp:// or amqps:// URI")
    return tuple(uris)


def _int(value: dict[str, Any], key: str, default: int | None, minimum: int) -> int | None:
    v = value.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise FederationError(f"{key} must be an integer >= {minimum}")
    return v


def parse_upstream(name: str, value: Any) -> Upstream:
    """A ``federation-upstream`` parameter's value as the management API received it (a JSON object)."""
    if not isinstance(value, dict):
        raise FederationError("a federation upstream's value must be a JSON object")
    unknown = sorted(set(value) - KNOWN)
    if unknown:
        raise FederationError(f"unknown federation-upstream keys: {', '.join(unknown)}")
    exchange = value.get("exchange")
    if exchange is not None and not isinstance(exchange, str):
        raise FederationError("exchange must be a string")
    ack_mode = value.get("ack-mode", "on-confirm")
    if ack_mode not in ACK_MODES:
        raise FederationError(f"ack-mode must be one of {', '.join(ACK_MODES)}")
    trust = value.get("trust-user-id", False)
    if not isinstance(trust, bool):
        raise FederationError("trust-user-id must be true or false")
    delay = value.get("reconnect-delay", 5)
    if isinstance(delay, bool) or not isinstance(delay, (int, float)) or delay < 0:
        raise FederationError("reconnect-delay must be a number >= 0")
    return Upstream(
        name=name, uris=_uris(value), exchange=exchange or None,
        max_hops=_int(value, "max-hops", 1, 1) or 1,
        expires=_int(value, "expires", None, 1), message_ttl=_int(value, "message-ttl", None, 0),
        prefetch=_int(value, "prefetch-count", 1000, 1) or 1000,
        reconnect_delay=float(delay), ack_mode=ack_mode, trust_user_id=trust,
        owner=value["user"] if isinstance(value.get("user"), str) and value["user"] else None,
    )


def parse_set(value: Any) -> list[dict[str, Any]]:
    """A ``federation-upstream-set`` value: a list of ``{"upstream": name, ...overrides}``."""
    if not isinstance(value, list):
        raise FederationError("a federation upstream set's value must be a JSON list of {\"upstream\": name}")
    for entry in value:
        if not isinstance(entry, dict) or not isinstance(entry.get("upstream"), str) or not entry["upstream"]:
            raise FederationError("each entry of an upstream set must be an object with an \"upstream\" name")
        unknown = sorted(set(entry) - KNOWN - {"upstream"} | ({"user"} & set(entry)))  # the owner is the upstream's
        if unknown:
            raise FederationError(f"unknown keys in the set's entry for {entry['upstream']!r}: {', '.join(unknown)}")
    return value


def validate(component: str, name: str, value: Any) -> None:
    if component == UPSTREAM:
        parse_upstream(name, value)
    elif component == UPSTREAM_SET:
        if name == "all":
            raise FederationError("\"all\" is reserved: the set of every upstream of the vhost")
        for entry in parse_set(value):
            # An override must itself be valid: checked on a dummy uri when it gives none.
            parse_upstream(entry["upstream"], {"uri": "amqp://", **{k: v for k, v in entry.items() if k != "upstream"}})


@dataclass(frozen=True)
class LinkSpec:
    """One link: the downstream exchange (as it is now) and one upstream, as a policy resolved them."""

    vhost: str
    exchange: str
    exchange_type: str
    durable: bool
    policy: str
    upstream: Upstream

    @property
    def upstream_exchange(self) -> str:
        return self.upstream.exchange or self.exchange

    @property
    def id(self) -> str:
        """A stable short id (RabbitMQ shows a hash of the link's identity too)."""
        return hashlib.sha1(f"{self.vhost}\0{self.exchange}\0{self.upstream.name}".encode()).hexdigest()[:8]


def upstreams_of(definition: dict[str, Any], upstreams: dict[str, Any], sets: dict[str, Any]) -> Iterable[Upstream]:
    """The upstreams a policy definition names, from the vhost's stored parameters (invalid ones skipped)."""
    name = definition.get(UPSTREAM)
    set_name = definition.get(UPSTREAM_SET)
    entries: list[dict[str, Any]]
    if isinstance(name, str):
        entries = [{"upstream": name}]
    elif set_name == "all":
        entries = [{"upstream": n} for n in sorted(upstreams)]
    elif isinstance(set_name, str) and isinstance(sets.get(set_name), list):
        entries = [e for e in sets[set_name] if isinstance(e, dict)]
    else:
        return []
    out = []
    for entry in entries:
        base = upstreams.get(str(entry.get("upstream")))
        if not isinstance(base, dict):
            continue  # an upstream not defined (yet): no link, as in RabbitMQ
        try:
            # The upstream's own owner stands: a set names upstreams, it does not act for them.
            out.append(parse_upstream(entry["upstream"],
                                      {**base, **{k: v for k, v in entry.items() if k not in ("upstream", "user")}}))
        except FederationError:
            continue
    return out
