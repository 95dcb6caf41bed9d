"""The broker: virtual hosts and users of one node."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import ipaddress
import os
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from core.engine import limits, passwords
from core.engine.access import AccessTable
from core.engine.alarms import DISK, MEMORY, Alarms
from core.engine.direct_reply import ReplyRegistry
from core.engine.login_throttle import LoginThrottle
from core.engine.node_stats import NodeStats
from core.engine.vhost import VirtualHost
from core.model.clock import AsyncioScheduler, Scheduler
from core.model.errors import AccessRefused, NotAllowed

if TYPE_CHECKING:
    from collections.abc import Callable

    from core.durable.durability import Durability
    from core.durable.group_commit import GroupCommitter
    from core.model.policy import Policy
    from core.ports.coordinator import Coordinator


# Threads for password checks (argon2id releases the GIL): bounded, and at most half the cores,
# so a burst of logins neither stalls the event loop nor takes every core from it.
KDF_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))

# RabbitMQ's password_hash is base64(4-byte salt + digest): the salt's length tells the kind
# apart (core/engine/passwords.py), so the store needs no new column.
RABBIT_SALT_BYTES = passwords.RABBIT_SALT_BYTES
RABBIT_SHA256 = "rabbit_password_hashing_sha256"


@dataclass(frozen=True)
class Permission:
    """RabbitMQ's configure/write/read regular expressions of a user in one vhost."""

    configure: str = ".*"
    write: str = ".*"
    read: str = ".*"


@dataclass
class User:
    name: str
    salt: bytes
    password_hash: bytes
    tags: tuple[str, ...] = ()
    vhosts: set[str] = field(default_factory=set)  # empty: no vhost at all
    # Kept in stored records for their schema only; never consulted: which users may log in from
    # loopback only is the node's list (Broker.loopback_users, RabbitMQ's loopback_users), so a
    # re-created or imported guest is loopback-only too, and a renamed default user is not.
    loopback_only: bool = False
    # The regexes set with the management API (a vhost in ``vhosts`` without an entry
    # here has ".*" for all three); topic permissions: vhost -> exchange -> (write, read).
    permissions: dict[str, Permission] = field(default_factory=dict)
    topic_permissions: dict[str, dict[str, tuple[str, str]]] = field(default_factory=dict)
    # RabbitMQ's user limits: max-connections, max-channels (core/engine/limits.py).
    limits: dict[str, int] = field(default_factory=dict)

    @classmethod
    def create(cls, name: str, password: str, **kwargs: object) -> User:
        salt, record = passwords.new_record(password)
        return cls(name, salt, record, **kwargs)  # type: ignore[arg-type]

    @classmethod
    def from_rabbit_hash(cls, name: str, password_hash: str, **kwargs: object) -> User:
        """A user from RabbitMQ's definitions: ``password_hash`` is base64(salt + SHA-256(salt + password))."""
        raw = base64.b64decode(password_hash, validate=True)
        if len(raw) != RABBIT_SALT_BYTES + hashlib.sha256().digest_size:
            raise ValueError(f"password_hash of user '{name}' is not a {RABBIT_SHA256} hash")
        return cls(name, raw[:RABBIT_SALT_BYTES], raw[RABBIT_SALT_BYTES:], **kwargs)  # type: ignore[arg-type]

    def rabbit_hash(self) -> str | None:
        """The hash in RabbitMQ's format, when this user has one (else None: RabbitMQ could not check it).

        Only users imported from RabbitMQ that have not logged in here since have one: a
        login re-hashes the record with the node's slow KDF (argon2id), which RabbitMQ
        cannot check, so such users export under ``leveret_users``.
        """
        if len(self.salt) != RABBIT_SALT_BYTES:
            return None
        return base64.b64encode(self.salt + self.password_hash).decode("ascii")

    def check_password(self, password: str) -> bool:
        return passwords.verify(self.salt, self.password_hash, password)[0]

    def grants_record(self) -> dict[str, Any]:
        """The permission regexes as stored (users.permissions, etcd's user record)."""
        return {"vhosts": {v: [p.configure, p.write, p.read] for v, p in sorted(self.permissions.items())},
                "topics": {v: {x: [w, r] for x, (w, r) in sorted(per.items())}
                           for v, per in sorted(self.topic_permissions.items()) if per},
                "limits": dict(sorted(self.limits.items()))}

    def load_grants(self, record: dict[str, Any]) -> None:
        """Back from ``grants_record`` (a record without it, from before permissions were kept: ".*")."""
        vhosts = record.get("vhosts") or {}
        topics = record.get("topics") or {}
        self.permissions = {str(v): Permission(*(str(x) for x in p[:3])) for v, p in vhosts.items()
                            if isinstance(p, list) and len(p) == 3}
        self.topic_permissions = {str(v): {str(x): (str(wr[0]), str(wr[1])) for x, wr in per.items()
                                           if isinstance(wr, list) and len(wr) == 2}
                                  for v, per in topics.items() if isinstance(per, dict)}
        user_limits = record.get("limits") or {}
        self.limits = {str(k): int(n) for k, n in user_limits.items() if k in limits.USER_LIMITS}

    def permission(self, vhost: str) -> Permission | None:
        if vhost not in self.vhosts:
            return None
        return self.permissions.get(vhost) or Permission()


def _lower_priority() -> None:
    """A KDF thread yields the CPU to the event loop's: on a busy machine the scheduler would
    otherwise share a core between them and the loop would wait (Linux: a thread is a task)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


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
        coordinator: Coordinator | None = None,
        loopback_users: frozenset[str] = frozenset({"guest"}),
    ) -> None:
        self.node_id = node_id
        # RabbitMQ's loopback_users: these names log in from loopback addresses only, whatever
        # their record says or wherever it came from (created, re-created, imported).
        self.loopback_users = loopback_users
        self.scheduler: Scheduler = scheduler or AsyncioScheduler()
        self.vhosts: dict[str, VirtualHost] = {}
        self.users: dict[str, User] = {}
        self.reply_to = ReplyRegistry()
        self.stats = NodeStats()  # message counters for /metrics (leveret/http/metrics.py)
        self.durability: Durability | None = None  # set when a store is configured
        self.committer: GroupCommitter | None = None
        # Raised by the node's resource monitors (leveret/node/resources.py): the front ends stop
        # reading from publishers, gRPC pushes and forwarded batches wait (core/engine/alarms.py).
        self.alarms = Alarms()
        # Declarations and queue operations of the front ends: coordination/local.py on a
        # single node, coordination/etcd.py in a cluster (core/ports/coordinator.py).
        self._coordinator = coordinator
        # Forwarded publishes wait at a slow owner: front ends stop reading from publishers.
        self.forward_congested = False
        self.flow_listeners: list[Callable[[bool], None]] = []
        # Failed logins per peer address (the front ends wait its delay before refusing).
        self.login_throttle = LoginThrottle()
        self.recent_logins = passwords.RecentLogins()
        self._kdf_threads: ThreadPoolExecutor | None = None  # made on the first login()
        # Told when a login re-hashed a user's old password record: the node persists it.
        self.on_user_rehashed: list[Callable[[User], None]] = []
        # Persists policies set through a vhost (core.durable.Durability.policy_changed): (policy, cleared).
        self.policy_writer: Callable[[Policy, bool], None] | None = None
        # Permission answers per (user, vhost), emptied when a user changes (core/engine/access.py).
        self.access = AccessTable(self)
        # Told when a user is deleted: the front ends close its connections (320, as RabbitMQ).
        self.on_user_deleted: list[Callable[[str], None]] = []
        # Told after any change to a user (permissions, tags, password record, deletion): what runs
        # on the user's behalf outside AMQP (gRPC subscriptions and watches, shovels, federation
        # links) checks again that it may go on.
        self.on_user_changed: list[Callable[[str], None]] = []
        # Shovels and federation links whose URI has no host log in to this node as the user who set
        # them with this in-process password (leveret/links/identity.py), from loopback only; it never
        # leaves the process, so no user's password is needed or stored for them.
        self.link_token = secrets.token_urlsafe(32)
        # Vhost limits (vhost -> max-connections/max-queues) and the open connections they count.
        self.vhost_limits: dict[str, dict[str, int]] = {}
        self.limits = limits.Tracker()
        self.add_vhost("/")
        if default_user is not None:
            name, password = default_user
            # Loopback-only when its name is in loopback_users (guest by default), as RabbitMQ's
            # default user: a container's RABBITMQ_DEFAULT_USER=admin logs in from anywhere.
            self.add_user(name, password, tags=("administrator",), vhosts={"/"})

    @property
    def memory_alarm(self) -> bool:
        return MEMORY in self.alarms.raised

    @property
    def disk_alarm(self) -> bool:
        return DISK in self.alarms.raised

    @property
    def coordinator(self) -> Coordinator:
        """Declarations, queue operations, users, vhosts, policies, parameters, holds, members
        (core/ports/coordinator.py). Core never builds one itself: it must not import coordination/,
        so whoever builds the broker for a front end passes one."""
        if self._coordinator is None:
            raise RuntimeError("this broker has no coordinator: build it with "
                               "Broker(coordinator=coordination.local.LocalCoordinator(node_id))")
        return self._coordinator

    @coordinator.setter
    def coordinator(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator

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
            vh.stats = self.stats  # queue churn counts node-wide
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
        self.put_user(user)
        return user

    def put_user(self, user: User) -> None:
        """Add or replace a user (new password, tags, permissions): applies to open connections at once."""
        self.users[user.name] = user
        self.access.user_changed(user.name)
        self._tell_user_changed(user.name)

    def user_changed(self, name: str) -> None:
        """A user's permissions were changed in place."""
        self.access.user_changed(name)
        self._tell_user_changed(name)

    def _tell_user_changed(self, name: str) -> None:
        for listener in list(self.on_user_changed):
            listener(name)

    def delete_user(self, name: str) -> bool:
        """Remove a user; its open connections are closed by the front ends' listeners."""
        found = self.users.pop(name, None) is not None
        self.access.user_changed(name)
        if found:
            for listener in list(self.on_user_deleted):
                listener(name)
            self._tell_user_changed(name)
        return found

    async def login(self, username: str, password: str, peer_host: str | None) -> User:
        """``authenticate`` off the event loop: the address's turn and delay first (login_throttle),
        then the KDF in the broker's threads. The user, or AccessRefused."""
        user = self.users.get(username)
        if (user is not None and is_loopback(peer_host)
                and hmac.compare_digest(password.encode(), self.link_token.encode())):
            return user  # a shovel or federation link acting as its owner (leveret/links/identity.py)
        async with self.login_throttle.turn(peer_host):
            user = self.users.get(username)
            if user is not None and self.recent_logins.known(username, user.password_hash, password):
                return self._logged_in(user, username, password, peer_host, None)
            if self._kdf_threads is None:
                self._kdf_threads = ThreadPoolExecutor(KDF_THREADS, thread_name_prefix="leveret-kdf",
                                                       initializer=_lower_priority)
            record = (user.salt, user.password_hash) if user is not None else None
            ok, rehash = await asyncio.get_running_loop().run_in_executor(
                self._kdf_threads, passwords.check, record, password)
            if self.users.get(username) is not user:  # changed or deleted while it was checked
                user, ok, rehash = self.users.get(username), False, False
            if user is None or not ok:
                self.login_throttle.failed(peer_host)
                raise AccessRefused("Login was refused using authentication mechanism PLAIN")
            new = None
            if rehash and (username not in self.loopback_users or is_loopback(peer_host)):
                new = await asyncio.get_running_loop().run_in_executor(
                    self._kdf_threads, passwords.new_record, password)
            return self._logged_in(user, username, password, peer_host, new)

    def authenticate(self, username: str, password: str, peer_host: str | None) -> User:
        """The user, or AccessRefused; a failure counts against ``peer_host`` (``login_throttle``).
        On the caller's thread: the front ends that can wait use ``login``."""
        user = self.users.get(username)
        if (user is not None and is_loopback(peer_host)
                and hmac.compare_digest(password.encode(), self.link_token.encode())):
            return user  # a shovel or federation link acting as its owner (leveret/links/identity.py)
        if user is not None and self.recent_logins.known(username, user.password_hash, password):
            ok, rehash = True, False
        else:
            ok, rehash = passwords.check((user.salt, user.password_hash) if user else None, password)
        if user is None or not ok:
            self.login_throttle.failed(peer_host)
            raise AccessRefused("Login was refused using authentication mechanism PLAIN")
        new = passwords.new_record(password) if rehash and (username not in self.loopback_users
                                                            or is_loopback(peer_host)) else None
        return self._logged_in(user, username, password, peer_host, new)

    def _logged_in(self, user: User, username: str, password: str, peer_host: str | None,
                   new_record: tuple[bytes, bytes] | None) -> User:
        """The password matched: the loopback rule, an old record replaced by ``new_record``."""
        if username in self.loopback_users and not is_loopback(peer_host):
            raise AccessRefused(f"user '{username}' can only connect via localhost")
        if new_record is not None:
            user.salt, user.password_hash = new_record
            for listener in list(self.on_user_rehashed):
                listener(user)
        self.recent_logins.remember(username, user.password_hash, password)
        return user

    def authenticate_external(self, username: str, peer_host: str | None) -> User:
        """SASL EXTERNAL: the name comes from a client certificate the TLS layer verified."""
        user = self.users.get(username)
        if user is None:
            self.login_throttle.failed(peer_host)
            raise AccessRefused(f"no user '{username}' for the client certificate's name (EXTERNAL)")
        if username in self.loopback_users and not is_loopback(peer_host):
            raise AccessRefused(f"user '{username}' can only connect via localhost")
        return user

    def open_vhost(self, user: User, name: str) -> VirtualHost:
        vh = self.vhosts.get(name)
        if vh is None:
            raise NotAllowed(f"vhost {name} not found")
        if name not in user.vhosts:
            raise NotAllowed(f"access to vhost '{name}' refused for user '{user.name}'")
        return vh
