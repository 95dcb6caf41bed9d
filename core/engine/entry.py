"""The entry checks of a publish, for every front end: who may publish what, where.

AMQP's ``basic.publish``, the management API's publish and the gRPC API's
Push / PushBatch / Streams.Publish all refuse the same things with the same
reasons before a message reaches the one publish path (core/engine/publish.py):

- ``user-id`` other than the authenticated user's (406, as RabbitMQ);
- ``expiration`` that is not a non-negative integer of milliseconds (406);
- no write permission on the exchange (403), checked before the exchange is
  looked up, as RabbitMQ does, so a refused user learns nothing of names;
- an exchange that does not exist (404), or one that is internal (403);
- on a topic exchange, a routing key the user's topic permissions refuse (403).

Each front end maps the refusals to its own answer (an AMQP channel close, a
gRPC status, an HTTP status). The AMQP channel calls ``admit`` once per
publish, so it costs what the checks did when they were written in the
channel (one dict lookup for a cached permission) and one call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.engine import access
from core.model.errors import AccessRefused, NotFound, PreconditionFailed

if TYPE_CHECKING:
    from core.engine.exchange import Exchange
    from core.engine.vhost import VirtualHost
    from core.model.properties import PropertySummary

DEFAULT_EXCHANGE = access.DEFAULT_EXCHANGE


def check_properties(summary: PropertySummary, username: str) -> None:
    """The properties a publisher may not set: another user's id, an expiration that is no TTL."""
    user_id = summary.user_id
    if user_id is not None and user_id != username:
        raise PreconditionFailed(f"user_id property set to '{user_id}' but authenticated user was '{username}'")
    expiration = summary.expiration
    if expiration is not None and not expiration.isdigit():
        raise PreconditionFailed(f"invalid expiration '{expiration}': {{error,no_integer}}")


def target(vhost: VirtualHost, grants: access.Grants, exchange_name: str, routing_key: str) -> Exchange | None:
    """The exchange a publish goes through (None: the default exchange), once the user may publish there."""
    if not grants.write.get(exchange_name or DEFAULT_EXCHANGE, False):
        access.publish(grants, exchange_name)  # before the lookup, as RabbitMQ
    if exchange_name == "" or exchange_name == DEFAULT_EXCHANGE:
        return None
    exchange = vhost.exchanges.get(exchange_name)
    if exchange is None:
        raise NotFound(f"no exchange '{exchange_name}' in vhost '{vhost.name}'")
    if exchange.internal:
        raise AccessRefused(f"cannot publish to internal exchange '{exchange_name}' in vhost '{vhost.name}'")
    if exchange.type == "topic":
        access.check_topic(grants, "write", exchange_name, routing_key)
    return exchange


def admit(vhost: VirtualHost, grants: access.Grants, username: str, exchange_name: str, routing_key: str,
          summary: PropertySummary) -> Exchange | None:
    """Every entry check of one publish, in RabbitMQ's order: the properties, then the exchange."""
    if summary.user_id is not None or summary.expiration is not None:
        check_properties(summary, username)
    if exchange_name == "" and grants.write.get(DEFAULT_EXCHANGE, False):
        return None  # the commonest publish (the default exchange, permission cached): no call more
    return target(vhost, grants, exchange_name, routing_key)
