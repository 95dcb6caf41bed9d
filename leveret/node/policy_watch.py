"""Policies written straight to the store with no node involved, applied to this node's live queues.

A policy set through any node goes through the coordinator, which applies it
on every node of a cluster from the etcd watch (coordination/metadata.py).
What no coordinator sees are the commands that write the store with no node
running or asked: ``leveret policies`` and ``leveret retention policy set``.
For those (and only those) this task reads the store's policies every
``poll`` seconds and applies what changed *between two reads of the store*,
not the difference between the store and memory: a policy this node set a
moment ago and whose write is still in the group committer's queue is then
never undone by a read that predates it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from core.engine.broker import Broker
from core.model.policy import Policy
from core.model.tasks import stop_task
from core.ports.store import MessageStore
from leveret.node.background import poll_store

log = logging.getLogger("leveret.policies")

Key = tuple[str, bool, str]  # (vhost, operator, name)


class PolicyWatch:
    def __init__(self, broker: Broker, store: MessageStore, poll: float = 0.5) -> None:
        self.broker = broker
        self.store = store
        self.poll = poll
        self.applied = 0  # changes taken from the store (for tests and logs)
        self._seen: dict[Key, Policy] = {}
        self._task: asyncio.Task[None] | None = None
        # Told of each change seen in the store (None: removed): in a cluster the coordinator brings
        # etcd's copy in line, so a node that restarts does not bring back a policy cleared here.
        self.on_store_change: list[Callable[[Key, Policy | None], None]] = []
        self._stored: dict[Key, Policy] = {}  # the last read of the store, whatever was applied of it

    async def start(self) -> None:
        self._seen = self._stored = await self._read()  # what start-up restored already
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        await stop_task(self._task)

    async def _read(self) -> dict[Key, Policy]:
        return {(p.vhost, p.operator, p.name): p for p in await self.store.load_policies()}

    async def _run(self) -> None:
        async for current in poll_store(self._read, self.poll, log, "policies unavailable from the store; retrying"):
            if current is not None:
                self.apply_changes(current)

    def apply_changes(self, current: dict[Key, Policy]) -> None:
        seen, stored = self._seen, current
        for key, policy in stored.items():
            if self._stored.get(key) != policy:
                self._tell(key, policy)
            if seen.get(key) == policy:
                continue
            vh = self.broker.vhosts.get(policy.vhost)
            if vh is None:
                current = {k: v for k, v in current.items() if k != key}  # retried once the vhost exists
                continue
            vh.set_policy(policy, restoring=True)
            self.applied += 1
        for key in self._stored.keys() - stored.keys():
            self._tell(key, None)
        for key in seen.keys() - current.keys():
            vhost, operator, name = key
            vh = self.broker.vhosts.get(vhost)
            if vh is not None and vh.clear_policy(name, operator, restoring=True):
                self.applied += 1
        self._seen, self._stored = current, stored

    def _tell(self, key: Key, policy: Policy | None) -> None:
        for listener in list(self.on_store_change):
            listener(key, policy)
