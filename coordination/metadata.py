"""The metadata side of both coordinators: one place where users, vhosts, limits, policies and parameters are written.

Every write goes the same way, whoever asks (the management API, ``leveret users``,
a login that re-hashed a password, a shovel that finished): the broker's tables
here change at once, the store keeps the record across restarts, and in a
cluster ``shared`` (coordination/etcd_records.py: etcd) carries it to every
other node, whose watch applies it (coordination/etcd.py). On a single node
``shared`` is None and this node delivers its own parameter changes to its
listeners; in a cluster the watch delivers everybody's, this node's included
(a change seen twice is delivered once).

Policies are the store's, as they were: the ``leveret policies`` and
``leveret retention policy`` commands write the store with no node running,
which leveret/node/policy_watch.py picks up; a policy set through a node goes
to etcd too, so the other nodes apply it from their watch at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from core.model.errors import NotFound
from core.ports.coordinator import ParameterKey, ParameterListener
from core.ports.store import UserRecord

if TYPE_CHECKING:
    from core.engine.broker import Broker, User
    from core.engine.vhost import VirtualHost
    from core.model.policy import Policy
    from core.ports.store import MessageStore

log = logging.getLogger("leveret.metadata")


class SharedRecords(Protocol):
    """The cluster's copy of the metadata (etcd), written after the store."""

    async def put_user(self, user: User) -> None: ...

    async def delete_user(self, name: str) -> bool: ...

    async def put_vhost(self, name: str, limits: dict[str, int]) -> None: ...

    async def delete_vhost(self, name: str) -> bool: ...

    async def put_policy(self, policy: Policy) -> None: ...

    async def delete_policy(self, vhost: str, name: str, operator: bool) -> None: ...

    async def put_parameter(self, key: ParameterKey, value: Any) -> None: ...

    async def delete_parameter(self, key: ParameterKey) -> None: ...


def user_record(user: User) -> UserRecord:
    return UserRecord(user.name, user.salt, user.password_hash, list(user.tags), sorted(user.vhosts),
                      user.loopback_only, user.grants_record())


class StoredMetadata:
    """Applied to ``broker`` here, written to ``store`` (when the node has one) and to ``shared`` (a cluster)."""

    def __init__(self, broker: Broker | None = None, store: MessageStore | None = None,
                 shared: SharedRecords | None = None) -> None:
        self._broker = broker
        self.store = store
        self.shared = shared
        # Told of each vhost made here (the etcd coordinator watches its queues and exchanges).
        self.on_vhost: list[Callable[[VirtualHost], None]] = []
        self._parameters: dict[ParameterKey, Any] | None = None  # loaded from the store on first use
        self._listeners: list[ParameterListener] = []

    @property
    def broker(self) -> Broker:
        if self._broker is None:
            raise RuntimeError("this coordinator has no broker: attach(broker) first")
        return self._broker

    def attach(self, broker: Broker, store: MessageStore | None = None) -> None:
        """The broker whose tables the metadata applies to, and the store that keeps it (once open)."""
        self._broker = broker
        if store is not None:
            self.store = store

    # -- users ------------------------------------------------------------------------
    async def save_user(self, user: User) -> None:
        self.broker.put_user(user)  # open connections see the change at once (core/engine/access.py)
        if self.store is not None:
            await self.store.save_user(user_record(user))
        if self.shared is not None:
            await self.shared.put_user(user)

    async def delete_user(self, name: str) -> bool:
        found = self.broker.delete_user(name)  # its open connections close (320)
        if self.store is not None:
            found = await self.store.delete_user(name) or found
        if self.shared is not None:
            found = await self.shared.delete_user(name) or found
        return found

    # -- vhosts and their limits ----------------------------------------------------------
    def add_vhost(self, name: str) -> VirtualHost:
        vh = self.broker.vhosts.get(name)
        if vh is None:
            vh = self.broker.add_vhost(name)
            for hook in list(self.on_vhost):
                hook(vh)
        return vh

    async def save_vhost(self, name: str) -> None:
        if self.store is not None:
            await self.store.save_vhost(name)
        if self.shared is not None:
            await self.shared.put_vhost(name, self.broker.vhost_limits.get(name, {}))

    async def delete_vhost(self, name: str) -> bool:
        self.broker.vhost_limits.pop(name, None)  # its limits go with it, as in RabbitMQ
        found = False
        if self.store is not None:
            await self.store.save_vhost_limits(name, {})
            found = await self.store.delete_vhost(name)
        if self.shared is not None:  # running nodes keep theirs until they restart
            found = await self.shared.delete_vhost(name) or found
        return found

    async def set_vhost_limits(self, name: str, limits: dict[str, int]) -> None:
        if limits:
            self.broker.vhost_limits[name] = dict(limits)
        else:
            self.broker.vhost_limits.pop(name, None)
        if self.store is not None:
            await self.store.save_vhost_limits(name, limits)
        if self.shared is not None:
            await self.shared.put_vhost(name, limits)

    # -- policies -------------------------------------------------------------------------
    def _vhost(self, name: str) -> VirtualHost:
        vh = self.broker.vhosts.get(name)
        if vh is None:
            raise NotFound(f"no vhost '{name}'")
        return vh

    async def set_policy(self, policy: Policy) -> bool:
        vh = self._vhost(policy.vhost)
        existed = policy.name in (vh.operator_policies if policy.operator else vh.policies)
        vh.set_policy(policy)  # applied to live queues and exchanges; stored (Broker.policy_writer)
        if self.shared is not None:
            await self.shared.put_policy(policy)
        return existed

    async def clear_policy(self, vhost: str, name: str, operator: bool) -> bool:
        if not self._vhost(vhost).clear_policy(name, operator=operator):
            return False
        if self.shared is not None:
            await self.shared.delete_policy(vhost, name, operator)
        return True

    # -- runtime and global parameters -------------------------------------------------------
    async def parameters(self) -> dict[ParameterKey, Any]:
        if self._parameters is None:
            loaded = await self.store.load_parameters() if self.store is not None else []
            if self._parameters is None:  # not filled by a delivery meanwhile
                self._parameters = {(v, c, n): value for v, c, n, value in loaded}
        return dict(self._parameters)

    async def set_parameter(self, vhost: str, component: str, name: str, value: Any) -> None:
        if self.store is not None:
            await self.store.save_parameter(vhost, component, name, value)
        if self.shared is not None:
            await self.shared.put_parameter((vhost, component, name), value)
        self.deliver((vhost, component, name), value)

    async def clear_parameter(self, vhost: str, component: str, name: str) -> None:
        if self.store is not None:
            await self.store.delete_parameter(vhost, component, name)
        if self.shared is not None:
            await self.shared.delete_parameter((vhost, component, name))
        self.deliver((vhost, component, name), None)

    def on_parameter(self, listener: ParameterListener) -> None:
        self._listeners.append(listener)

    def deliver(self, key: ParameterKey, value: Any) -> None:
        """A parameter as it is now (None: cleared), told to the listeners once per change."""
        table = self._parameters if self._parameters is not None else {}
        if table.get(key) == value and (value is not None or key not in table):
            return
        if value is None:
            table.pop(key, None)
        else:
            table[key] = value
        if self._parameters is None:
            self._parameters = table
        for listener in list(self._listeners):
            try:
                listener(*key, value)
            except Exception:  # one listener's bug must not keep the others (or the watch) from the change
                log.exception("a parameter listener failed", extra={"vhost": key[0], "component": key[1]})

    def forget_parameters(self, keep: set[ParameterKey]) -> None:
        """After a resync: the parameters not in ``keep`` are gone."""
        for key in [k for k in (self._parameters or {}) if k not in keep]:
            self.deliver(key, None)
