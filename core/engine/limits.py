"""RabbitMQ's vhost limits (max-connections, max-queues) and user limits (max-connections, max-channels).

A limit is an integer; a negative one means no limit, 0 allows none (as RabbitMQ).
The texts are RabbitMQ 3.10.8's, taken from a running node:

- vhost max-connections, 530 at connection.open: "access to vhost 'v' refused for
  user 'u': connection limit (N) is reached"
- user max-connections, 530 at connection.open: "connection refused for user 'u':
  user connection limit (N) is reached"
- user max-channels, 530 at channel.open: "number of channels opened for user 'u'
  has reached the maximum allowed user limit of (N)"
- vhost max-queues, 406 at queue.declare: "cannot declare queue 'q': queue limit
  in vhost 'v' (N) is reached"

Counted on this node (the open AMQP connections it serves), as a single RabbitMQ node does.
"""

from __future__ import annotations

from typing import Any

from core.model.errors import NotAllowed, PreconditionFailed

VHOST_LIMITS = ("max-connections", "max-queues")
USER_LIMITS = ("max-connections", "max-channels")


def parse(kind: str, body: Any, known: tuple[str, ...]) -> dict[str, int]:
    """Limits from JSON ({"max-connections": 10}); ValueError with RabbitMQ's words for what is wrong."""
    if not isinstance(body, dict):
        raise ValueError(f"{kind} must be a JSON object")
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise ValueError(f"Unrecognised terms {unknown} in {kind}")
    out: dict[str, int] = {}
    for name, value in body.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} should be a number, actually was {value!r}")
        out[name] = value
    return out


def _reached(limits: dict[str, int], name: str, count: int) -> int | None:
    limit = limits.get(name)
    if limit is None or limit < 0 or count < limit:
        return None
    return limit


class Tracker:
    """The open (past connection.open) AMQP connections of this node, per vhost and per user."""

    def __init__(self) -> None:
        self.by_vhost: dict[str, set[Any]] = {}
        self.by_user: dict[str, set[Any]] = {}

    def check_connection(self, user: str, user_limits: dict[str, int], vhost: str,
                         vhost_limits: dict[str, int]) -> None:
        # The vhost's limit first, then the user's, as RabbitMQ 3.10.8 (checked).
        limit = _reached(vhost_limits, "max-connections", len(self.by_vhost.get(vhost, ())))
        if limit is not None:
            raise NotAllowed(f"access to vhost '{vhost}' refused for user '{user}': "
                             f"connection limit ({limit}) is reached")
        limit = _reached(user_limits, "max-connections", len(self.by_user.get(user, ())))
        if limit is not None:
            raise NotAllowed(f"connection refused for user '{user}': user connection limit ({limit}) is reached")

    def opened(self, conn: Any, user: str, vhost: str) -> None:
        self.by_user.setdefault(user, set()).add(conn)
        self.by_vhost.setdefault(vhost, set()).add(conn)

    def closed(self, conn: Any, user: str, vhost: str) -> None:
        for table, key in ((self.by_user, user), (self.by_vhost, vhost)):
            conns = table.get(key)
            if conns is not None:
                conns.discard(conn)
                if not conns:
                    del table[key]

    def check_channel(self, user: str, user_limits: dict[str, int]) -> None:
        """Before a channel.open: channels of all this user's connections here (only when limited)."""
        if "max-channels" not in user_limits:
            return
        count = sum(len(conn.channels) for conn in self.by_user.get(user, ()))
        limit = _reached(user_limits, "max-channels", count)
        if limit is not None:
            raise NotAllowed(f"number of channels opened for user '{user}' has reached the maximum "
                             f"allowed user limit of ({limit})")


def check_queue(vhost: str, vhost_limits: dict[str, int], queues: dict[str, Any], name: str) -> None:
    """Before declaring a queue that does not exist yet."""
    if "max-queues" not in vhost_limits or name in queues:
        return
    limit = _reached(vhost_limits, "max-queues", len(queues))
    if limit is not None:
        raise PreconditionFailed(f"cannot declare queue '{name}': queue limit in vhost '{vhost}' ({limit}) is reached")
