"""The cluster's copy of users, vhosts, policies and parameters: etcd keys every node's watch applies.

coordination/metadata.py's ``SharedRecords`` on etcd, for a node (coordination/etcd.py)
and for the CLI (``leveret users --etcd``), which writes the same records without
joining the cluster. Values are coordination/keys.py's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from coordination.keys import Layout, dumps, policy_value, user_value
from core.ports.coordinator import ParameterKey

if TYPE_CHECKING:
    import aetcd

    from core.engine.broker import User
    from core.model.policy import Policy

TIMEOUT = 10.0


class EtcdRecords:
    def __init__(self, client: Callable[[], aetcd.Client], layout: Layout) -> None:
        self._client = client  # the current client: a node reconnects to another endpoint at times
        self.keys = layout

    async def _put(self, key: bytes, value: bytes) -> None:
        await asyncio.wait_for(self._client().put(key, value), TIMEOUT)

    async def _delete(self, key: bytes) -> bool:
        return bool(await asyncio.wait_for(self._client().delete(key), TIMEOUT))

    async def put_user(self, user: User) -> None:
        await self._put(self.keys.user(user.name), user_value(user))

    async def delete_user(self, name: str) -> bool:
        return await self._delete(self.keys.user(name))

    async def put_vhost(self, name: str, limits: dict[str, int]) -> None:
        await self._put(self.keys.vhost(name), dumps({"limits": limits} if limits else {}))

    async def delete_vhost(self, name: str) -> bool:
        return await self._delete(self.keys.vhost(name))

    async def put_policy(self, policy: Policy) -> None:
        await self._put(self.keys.policy(policy.vhost, policy.name, policy.operator), policy_value(policy))

    async def delete_policy(self, vhost: str, name: str, operator: bool) -> None:
        await self._delete(self.keys.policy(vhost, name, operator))

    async def put_parameter(self, key: ParameterKey, value: Any) -> None:
        await self._put(self.keys.parameter(*key), json.dumps({"value": value}, sort_keys=True).encode())

    async def delete_parameter(self, key: ParameterKey) -> None:
        await self._delete(self.keys.parameter(*key))
