"""Who a shovel or a federation link acts as: the user who set its parameter.

A URI without a host (``amqp://``, ``amqp:///%2F``) is this node, RabbitMQ's
direct connection. Such a link used to log in as ``guest:guest`` from
loopback, an administrator: a ``policymaker`` of vhost ``A`` could shovel a
queue of ``/`` into ``A``. Now, as RabbitMQ records the acting user of a
parameter, the management API stamps the setter's name on the value
(``"user"``), and a direct URI:

- at set time needs that user to have access to the URI's vhost (403 with
  the reason otherwise, nothing stored);
- at every (re)connect logs in *as that user* (with the node's in-process
  link token, ``Broker.link_token``: the owner's password is never needed or
  stored), so every declare, consume and publish is checked against the
  owner's permissions by the AMQP front end like any client's;
- stops with a clear status when the owner is deleted or loses the vhost
  (checked before each connect and whenever the owner changes).

A URI with a host carries its own credentials, except that a non-administrator
may not point one at this node with the default user's (well-known)
credentials, which would be the same escalation by another road.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from leveret.links.federation.spec import UPSTREAM
from leveret.links.shovel.spec import COMPONENT, ParameterError, redact

if TYPE_CHECKING:
    from core.engine.broker import Broker, User

OWNER_KEY = "user"  # the parameter value's key naming its owner (RabbitMQ's acting user)


class LinkForbidden(ParameterError):
    """The setter may not create this link (the management API answers 403 with this text)."""


def is_direct(uri: str) -> bool:
    """A URI without a host: this node."""
    return not urlsplit(uri).hostname


def uri_vhost(uri: str) -> str:
    """The vhost a URI names (RabbitMQ: no path, or ``/``, is the default vhost ``/``)."""
    path = urlsplit(uri).path
    return unquote(path[1:]) if len(path) > 1 else "/"


def owner_of(value: Any) -> str | None:
    owner = value.get(OWNER_KEY) if isinstance(value, dict) else None
    return owner if isinstance(owner, str) and owner else None


def without_owner(component: str, value: Any) -> Any:
    """A parameter's value as the API shows and exports it: RabbitMQ's keys only (its validation refuses
    others, and tools compare values), so the owner stays in the store; an import makes the importing
    user the owner."""
    if component in (COMPONENT, UPSTREAM) and isinstance(value, dict) and OWNER_KEY in value:
        return {k: v for k, v in value.items() if k != OWNER_KEY}
    return value


def stamped(broker: Broker, value: Any, acting: User) -> Any:
    """``value`` with its owner: the acting user. An administrator may name another existing user (a
    definitions import keeps the owners it exports); anyone else's ``"user"`` is overwritten."""
    if not isinstance(value, dict):
        return value
    named = owner_of(value)
    if named is not None and "administrator" in acting.tags and named in broker.users:
        return value
    return {**value, OWNER_KEY: acting.name}


def _is_loopback(host: str) -> bool:
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_unspecified


def check_set(broker: Broker, owner: str, uris: Iterable[str], default_user: str) -> None:
    """LinkForbidden when the parameter's owner may not create a link with these URIs."""
    user = broker.users.get(owner)
    if user is None:
        raise LinkForbidden(f"user '{owner}' does not exist")
    for uri in uris:
        parts = urlsplit(uri)
        if not parts.hostname:
            reason = refusal(broker, owner, uri)
            if reason is not None:
                raise LinkForbidden(f"{reason}: a URI without a host ({redact(uri)}) connects to this node as the "
                                    "user who sets the parameter")
        elif (_is_loopback(parts.hostname) and unquote(parts.username or "") == default_user
              and "administrator" not in user.tags):
            raise LinkForbidden(f"only an administrator may point a link at this node with the default user "
                                f"'{default_user}' ({redact(uri)}); use a URI without a host, which acts as you")


def refusal(broker: Broker, owner: str | None, uri: str) -> str | None:
    """Why a link may not connect to ``uri`` as ``owner`` now (None: it may; a URI with a host always may)."""
    if not is_direct(uri):
        return None
    if owner is None:
        return ("no owner is recorded for this parameter (set before owners were): a URI without a host acts as "
                "the user who set it; set the parameter again")
    user = broker.users.get(owner)
    if user is None:
        return f"user '{owner}', who set this parameter, no longer exists"
    vhost = uri_vhost(uri)
    if vhost not in broker.vhosts:
        return f"vhost '{vhost}' does not exist"
    if vhost not in user.vhosts:
        return f"user '{owner}' may not access vhost '{vhost}'"
    return None


def credentials(broker: Broker, owner: str | None, uri: str) -> tuple[str, str] | None:
    """For a direct URI its owner's login (name and the node's link token), after ``refusal`` (PermissionError)."""
    if not is_direct(uri):
        return None
    reason = refusal(broker, owner, uri)
    if reason is not None:
        raise PermissionError(reason)
    assert owner is not None
    return owner, broker.link_token
