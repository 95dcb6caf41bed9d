"""Permissions and limits in both stores (migration 030), through the store contract's fixtures."""

from __future__ import annotations

from core.ports.store import MessageStore, UserRecord
from tests.test_store_contract import Opened, backend, make_store, opened, store  # noqa: F401 - fixtures

GRANTS = {"vhosts": {"v": ["^c", "^w", ""]}, "topics": {"v": {"amq.topic": ["^a", "^b"]}},
          "limits": {"max-channels": 3}}


async def test_user_permissions_round_trip(opened: Opened) -> None:  # noqa: F811 - the fixture
    s = await opened()
    await s.save_user(UserRecord("u", b"s", b"h", ["management"], ["v"], False, GRANTS))
    await s.save_user(UserRecord("old", b"s", b"h"))  # written as before migration 030
    await opened.close(s)
    s = await opened()
    users = {u.name: u for u in await s.load_users()}
    assert users["u"].permissions == GRANTS and users["u"].vhosts == ["v"]
    assert users["old"].permissions == {}


async def test_vhost_limits_round_trip_and_clear(store: MessageStore) -> None:  # noqa: F811 - the fixture
    await store.save_vhost("v")
    await store.save_vhost_limits("v", {"max-connections": 2, "max-queues": 0})
    await store.save_vhost_limits("w", {"max-queues": 1})
    await store.save_vhost_limits("w", {"max-queues": 5})  # replaced
    assert await store.load_vhost_limits() == {"v": {"max-connections": 2, "max-queues": 0},
                                               "w": {"max-queues": 5}}
    await store.save_vhost_limits("v", {})
    assert await store.load_vhost_limits() == {"w": {"max-queues": 5}}
