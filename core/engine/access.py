"""RabbitMQ's permission model: one check per operation, used by every front end.

Each user has, per vhost, three regular expressions (configure, write, read)
matched against exchange and queue names, and optionally per topic exchange
two more (write, read) matched against routing keys. The table (RabbitMQ's
access-control guide; docs/SECURITY.md has it too):

    operation                     configure      write            read
    exchange.declare              exchange       AE (if any)      exchange (if AE)
    exchange.declare passive      -              -                -
    exchange.delete               exchange       -                -
    queue.declare                 queue          DLX (if any)     queue (if DLX)
    queue.declare passive         -              -                -
    queue.delete                  queue          -                -
    exchange.bind/unbind          -              destination      source
    queue.bind/unbind             -              queue            exchange
    basic.publish                 -              exchange         -
    basic.get/consume, purge      -              -                queue

Matching as RabbitMQ's ``rabbit_auth_backend_internal``: ``re:run`` is a search,
not anchored (so ``"q"`` allows ``"aqa"``; operators write ``^q$``); an empty
expression means ``^$`` (nothing but the empty name); the default exchange is
checked as ``amq.default``. Topic expressions expand ``{username}`` and
``{vhost}``; an exchange without topic permissions allows every key.

The hot path (a publish) pays one dict lookup: every answer is cached per
(user, vhost) in a ``Grants`` that the connection keeps; a change to the user
(permissions, deletion, a new password record) empties its ``Grants`` in place,
so open connections see it at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from core.model import patterns
from core.model.errors import AccessRefused

if TYPE_CHECKING:
    from core.engine.broker import Broker

DEFAULT_EXCHANGE = "amq.default"
# A client could make the caches grow without end with ever new names or routing keys:
# past this many answers a table starts again (a refill costs one regex search each).
MAX_CACHED = 10_000


def _matches(pattern: str, name: str) -> bool:
    """RabbitMQ's regex rule: "" is "^$"; an expression that does not compile allows nothing.
    Matched by RE2 in linear time (core/model/patterns.py): a user's pattern cannot stall the node."""
    return patterns.search(pattern or "^$", name)


def resource_text(kind: str, name: str, vhost: str) -> str:
    return f"{kind} '{name}' in vhost '{vhost}'"


class Grants:
    """The answers for one user in one vhost: name -> allowed, per permission."""

    __slots__ = ("broker", "user", "vhost", "configure", "write", "read", "_topics")

    def __init__(self, broker: Broker, user: str, vhost: str) -> None:
        self.broker = broker
        self.user = user
        self.vhost = vhost
        self.configure: dict[str, bool] = {}
        self.write: dict[str, bool] = {}
        self.read: dict[str, bool] = {}
        # exchange -> {(routing key, "write"|"read") -> allowed}; None until first needed.
        self._topics: dict[str, dict[tuple[str, str], bool]] | None = None

    def reset(self) -> None:
        self.configure.clear()
        self.write.clear()
        self.read.clear()
        self._topics = None

    def allowed(self, permission: str, name: str) -> bool:
        table: dict[str, bool] = getattr(self, permission)
        ok = table.get(name)
        if ok is None:
            user = self.broker.users.get(self.user)
            perm = user.permission(self.vhost) if user is not None else None
            ok = perm is not None and _matches(getattr(perm, permission), name)
            if len(table) >= MAX_CACHED:
                table.clear()
            table[name] = ok
        return ok

    def topic_allowed(self, permission: str, exchange: str, routing_key: str) -> bool:
        topics = self._topics
        if topics is None:
            user = self.broker.users.get(self.user)
            if user is not None and not user.topic_permissions.get(self.vhost):
                return True  # the usual case: no topic permission in this vhost (not cached: a user may get one)
            topics = self._topics = {}
        cache = topics.get(exchange)
        if cache is None:
            cache = topics[exchange] = {}
        key = (routing_key, permission)
        ok = cache.get(key)
        if ok is None:
            user = self.broker.users.get(self.user)
            ok = user is not None and _topic_match(user.topic_permissions, self.user, self.vhost, exchange,
                                                   permission, routing_key)
            if len(cache) >= MAX_CACHED:
                cache.clear()
            cache[key] = ok
        return ok


def _topic_match(topic_permissions: dict[str, dict[str, tuple[str, str]]], user: str, vhost: str,
                 exchange: str, permission: str, routing_key: str) -> bool:
    per = topic_permissions.get(vhost, {}).get(exchange)
    if per is None:
        return True  # no topic permission for this exchange: every key, as RabbitMQ
    pattern = per[0] if permission == "write" else per[1]
    pattern = (pattern or "^$").replace("{username}", patterns.escape(user)).replace("{vhost}",
                                                                             patterns.escape(vhost))
    return _matches(pattern, routing_key)


class AccessTable:
    """Every ``Grants`` of a broker, so that a change to a user reaches the open connections."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self._grants: dict[tuple[str, str], Grants] = {}

    def grants(self, user: str, vhost: str) -> Grants:
        g = self._grants.get((user, vhost))
        if g is None:
            g = self._grants[(user, vhost)] = Grants(self.broker, user, vhost)
        return g

    def user_changed(self, user: str) -> None:
        for (name, _), g in self._grants.items():
            if name == user:
                g.reset()


# -- the checks, one per operation ------------------------------------------------
def _refuse(g: Grants, kind: str, name: str) -> AccessRefused:
    return AccessRefused(f"access to {resource_text(kind, name, g.vhost)} refused for user '{g.user}'")


def check(g: Grants, permission: str, kind: str, name: str) -> None:
    if kind == "exchange" and name == "":
        name = DEFAULT_EXCHANGE
    if not g.allowed(permission, name):
        raise _refuse(g, kind, name)


def check_topic(g: Grants, permission: str, exchange: str, routing_key: str) -> None:
    """For topic exchanges only (the caller knows the type): routing key against the topic regexes."""
    if not g.topic_allowed(permission, exchange, routing_key):
        raise AccessRefused(f"access to topic '{routing_key}' in exchange '{exchange}' in vhost "
                            f"'{g.vhost}' refused for user '{g.user}'")


def publish(g: Grants, exchange: str) -> None:
    """basic.publish: write on the exchange. The hot path: one dict lookup when cached."""
    if not g.write.get(exchange or DEFAULT_EXCHANGE, False):
        check(g, "write", "exchange", exchange)


def _argument_name(value: str | bytes) -> str:
    """An exchange named by a declaration argument, decoded as the queue and exchange arguments
    decode it (core/engine/queue_args.py: undecodable bytes replaced), so the name checked here
    is the name used; a client's bad bytes are never an internal error (found by bench.fuzz)."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def declare_exchange(g: Grants, name: str, arguments: dict[str, Any]) -> None:
    check(g, "configure", "exchange", name)
    ae = arguments.get("alternate-exchange")
    if isinstance(ae, (str, bytes)):  # read on the exchange first, as rabbit_channel does
        check(g, "read", "exchange", name)
        check(g, "write", "exchange", _argument_name(ae))


def declare_queue(g: Grants, name: str, arguments: dict[str, Any]) -> None:
    check(g, "configure", "queue", name)
    dlx = arguments.get("x-dead-letter-exchange")
    if isinstance(dlx, (str, bytes)):
        check(g, "read", "queue", name)
        check(g, "write", "exchange", _argument_name(dlx))


def delete_exchange(g: Grants, name: str) -> None:
    check(g, "configure", "exchange", name)


def delete_queue(g: Grants, name: str) -> None:
    check(g, "configure", "queue", name)


def bind(g: Grants, source: str, kind: str, destination: str) -> None:
    """queue.bind/unbind, exchange.bind/unbind: write on the destination, read on the source.

    The default exchange is not checked here: RabbitMQ refuses binding to or from it before any
    permission ("operation not permitted on the default exchange"), as the vhost does next.
    """
    if source == "" or (kind == "exchange" and destination == ""):
        return
    check(g, "write", kind, destination)
    check(g, "read", "exchange", source)


def read_queue(g: Grants, name: str) -> None:
    """basic.get, basic.consume, queue.purge."""
    check(g, "read", "queue", name)
