"""The broker: virtual hosts and users of one node."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from core.engine.direct_reply import ReplyRegistry
from core.engine.node_stats import NodeStats
from core.engine.vhost import VirtualHost
from core.model.clock import AsyncioScheduler, Scheduler
from core.model.errors import AccessRefused, NotAllowed

if TYPE_CHECKING:
    from collections.abc import Callable

    from core.durable.durability import Durability
    from core.durable.group_commit import GroupCommitter
    from core.model.policy import Policy
    from core.ports.coordinator import Cluster


def _hash(password: str, salt: bytes) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", password.encode("utf-8"), salt, 1)


@dataclass
class User:
    name: str
    salt: bytes
    password_hash: bytes
    tags: tuple[str, ...] = ()
    vhosts: set[str] = field(default_factory=set)  # empty: no vhost at all
    loopback_only: bool = False

    @classmethod
    def create(cls, name: str, password: str, **kwargs: object) -> User:
        salt = os.urandom(16)
        return cls(name, salt, _hash(password, salt), **kwargs)  # type: ignore[arg-type]

    def check_password(self, password: str) -> bool:
        return hmac.compare_digest(_hash(password, self.salt), self.password_hash)


def is_loopback(address: str | None) -> bool:
    if address is None:
        return True  # in-process callers (tests of the state machine)
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


class Broker:
    """Everything one node serves: vhosts (with their topology) and users."""

    def __init__(
        self,
        node_id: str = "leveret",
        default_user: tuple[str, str] | None = ("guest", "guest"),
        scheduler: Scheduler | None = None,
    ) -> None:
        self.node_id = node_id
        self.scheduler: Scheduler = scheduler or AsyncioScheduler()
        self.vhosts: dict[str, VirtualHost] = {}
        self.users: dict[str, User] = {}
        self.reply_to = ReplyRegistry()
        self.stats = NodeStats()  # message counters for /metrics (leveret/http/metrics.py)
        self.durability: Durability | None = None  # set when a store is configured
        self.committer: GroupCommitter | None = None
        # Set by the node's memory monitor; the front ends stop reading from publishers.
        self.memory_alarm = False
        # Cluster mode (coordination/etcd.py): shared metadata, remote queues.
        self.cluster: Cluster | None = None
        # Forwarded publishes wait at a slow owner: front ends stop reading from publishers.
        self.forward_congested = False
        self.flow_listeners: list[Callable[[bool], None]] = []
        # Persists policies set through a vhost (core.durable.Durability.policy_changed): (policy, cleared).
        self.policy_writer: Callable[[Policy, bool], None] | None = None
        self.add_vhost("/")
        if default_user is not None:
            name, password = default_user
            # As in RabbitMQ, the well-known default account only works from loopback.
            self.add_user(name, password, tags=("administrator",), vhosts={"/"}, loopback_only=True)

    def set_forward_congestion(self, congested: bool) -> None:
        if congested != self.forward_congested:
            self.forward_congested = congested
            for listener in list(self.flow_listeners):
                listener(congested)

    def add_vhost(self, name: str) -> VirtualHost:
        vh = self.vhosts.get(name)
        if vh is None:
            vh = self.vhosts[name] = VirtualHost(name, self.scheduler)
            vh.durability = self.durability
            vh.policy_writer = self.policy_writer
        return vh

    def set_policy_writer(self, writer: Callable[[Policy, bool], None] | None) -> None:
        """Where policies set on any vhost, now or later, are written (single node and cluster alike)."""
        self.policy_writer = writer
        for vh in self.vhosts.values():
            vh.policy_writer = writer

    def add_user(
        self,
        name: str,
        password: str,
        tags: tuple[str, ...] = (),
        vhosts: set[str] | None = None,
        loopback_only: bool = False,
    ) -> User:
        user = User.create(name, password, tags=tags, vhosts=set(vhosts or ()), loopback_only=loopback_only)
        self.users[name] = user
        return user

    def authenticate(self, username: str, password: str, peer_host: str | None) -> User:
        user = self.users.get(username)
        if user is None or not user.check_password(password):
            raise AccessRefused("Login was refused using authentication mechanism PLAIN")
        if user.loopback_only and not is_loopback(peer_host):
            raise AccessRefused(f"user '{username}' can only connect via localhost")
        return user

    def open_vhost(self, user: User, name: str) -> VirtualHost:
        vh = self.vhosts.get(name)
        if vh is None:
            raise NotAllowed(f"vhost {name} not found")
        if name not in user.vhosts:
            raise NotAllowed(f"access to vhost '{name}' refused for user '{user.name}'")
        return vh
