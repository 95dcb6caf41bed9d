"""The coordinator's metadata side on a single node (coordination/local.py, coordination/metadata.py).

Against a real SQLite store: users, vhosts and limits applied at once and
stored; policies applied to live queues and stored; runtime parameters stored
and delivered to this node's listeners (once per change); holds always this
node's; the node is the only member and owns every queue. A second coordinator
on the same store (a restart) finds what the first one wrote.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from coordination.local import LocalCoordinator
from core.durable.durability import Durability
from core.durable.group_commit import GroupCommitter
from core.engine.broker import Broker, Permission, User
from core.model.errors import NotFound
from core.model.policy import Policy
from core.ports.coordinator import GLOBAL, Coordinator
from persistence.sqlite import SQLiteStore


class Node:
    def __init__(self, store: SQLiteStore) -> None:
        self.store = store
        self.coordinator = LocalCoordinator("n1")
        self.broker = Broker(node_id="n1", coordinator=self.coordinator, default_user=None)
        self.committer = GroupCommitter(store)
        self.broker.committer = self.committer
        self.durability = Durability(store, self.committer)
        self.broker.set_policy_writer(self.durability.policy_changed)
        self.coordinator.attach(self.broker, store)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteStore]:
    s = SQLiteStore(str(tmp_path / "leveret.sqlite3"))
    await s.open()
    try:
        yield s
    finally:
        await s.close()


async def test_the_local_coordinator_is_a_coordinator(store: SQLiteStore) -> None:
    coordinator: Coordinator = Node(store).coordinator  # mypy checks the whole port
    assert coordinator.node_id == "n1"


async def test_users_with_permissions_and_limits_apply_at_once_and_are_stored(store: SQLiteStore) -> None:
    node = Node(store)
    deleted: list[str] = []
    node.broker.on_user_deleted.append(deleted.append)
    user = User.create("ann", "secret", tags=("management",), vhosts={"/"})
    user.permissions["/"] = Permission("^ann-", "^ann-", ".*")
    user.topic_permissions["/"] = {"amq.topic": ("^ann\\.", ".*")}
    user.limits = {"max-connections": 3}
    await node.coordinator.save_user(user)
    assert node.broker.users["ann"] is user
    [record] = await store.load_users()
    assert (record.name, record.tags, record.vhosts) == ("ann", ["management"], ["/"])
    assert record.permissions == user.grants_record()
    # A restart: the store gives the same user back, grants and limits included.
    again = Node(store)
    await again.durability.restore_users(again.broker)
    back = again.broker.users["ann"]
    assert back.permission("/") == Permission("^ann-", "^ann-", ".*")
    assert back.topic_permissions == {"/": {"amq.topic": ("^ann\\.", ".*")}} and back.limits == {"max-connections": 3}
    assert await node.coordinator.delete_user("ann")
    assert deleted == ["ann"] and "ann" not in node.broker.users and await store.load_users() == []
    assert not await node.coordinator.delete_user("ann")


async def test_vhosts_and_their_limits(store: SQLiteStore) -> None:
    node = Node(store)
    made: list[str] = []
    node.coordinator.on_vhost.append(lambda vh: made.append(vh.name))
    vh = node.coordinator.add_vhost("orders")
    assert node.broker.vhosts["orders"] is vh and node.coordinator.add_vhost("orders") is vh and made == ["orders"]
    await node.coordinator.save_vhost("orders")
    await node.coordinator.set_vhost_limits("orders", {"max-queues": 2})
    assert node.broker.vhost_limits["orders"] == {"max-queues": 2}
    assert "orders" in await store.load_vhosts() and (await store.load_vhost_limits())["orders"] == {"max-queues": 2}
    await node.coordinator.set_vhost_limits("orders", {})
    assert "orders" not in node.broker.vhost_limits and "orders" not in await store.load_vhost_limits()
    await node.coordinator.set_vhost_limits("orders", {"max-connections": 1})
    assert await node.coordinator.delete_vhost("orders")
    assert "orders" not in await store.load_vhosts() and "orders" not in node.broker.vhost_limits
    assert "orders" not in await store.load_vhost_limits()


async def test_policies_and_operator_policies_apply_to_live_queues_and_are_stored(store: SQLiteStore) -> None:
    node = Node(store)
    vh = node.broker.vhosts["/"]
    q = vh.declare_queue("cap-me", None, durable=False)
    policy = Policy.create("/", "cap", "^cap-", {"max-length": 2}, "queues")
    operator = Policy.create("/", "cap", ".*", {"max-length": 1}, operator=True)
    assert not await node.coordinator.set_policy(policy)
    assert await node.coordinator.set_policy(policy)  # replaced: True, as the HTTP API's 204
    assert not await node.coordinator.set_policy(operator)
    assert vh.policies == {"cap": policy} and vh.operator_policies == {"cap": operator}
    assert vh.policies_of(q) == (policy, operator)
    await node.committer.drain()
    assert sorted(await store.load_policies(), key=lambda p: p.operator) == [policy, operator]
    assert await node.coordinator.clear_policy("/", "cap", operator=True)
    assert not await node.coordinator.clear_policy("/", "cap", operator=True)
    await node.committer.drain()
    assert await store.load_policies() == [policy]
    with pytest.raises(NotFound):
        await node.coordinator.set_policy(Policy.create("nowhere", "p", ".*", {"max-length": 1}))


async def test_parameters_are_stored_and_delivered_once_per_change(store: SQLiteStore) -> None:
    await store.save_parameter("/", "shovel", "old", {"src-uri": "amqp://"})  # stored before this node started
    node = Node(store)
    seen: list[tuple[str, str, str, Any]] = []
    assert await node.coordinator.parameters() == {("/", "shovel", "old"): {"src-uri": "amqp://"}}
    node.coordinator.on_parameter(lambda v, c, n, value: seen.append((v, c, n, value)))
    await node.coordinator.set_parameter("/", "federation-upstream", "up", {"uri": "amqp://h/"})
    await node.coordinator.set_parameter("/", "federation-upstream", "up", {"uri": "amqp://h/"})  # no change
    await node.coordinator.set_parameter("", GLOBAL, "cluster_name", "east")
    await node.coordinator.clear_parameter("/", "shovel", "old")
    await node.coordinator.clear_parameter("/", "shovel", "old")  # gone already: nothing to tell
    assert seen == [("/", "federation-upstream", "up", {"uri": "amqp://h/"}), ("", GLOBAL, "cluster_name", "east"),
                    ("/", "shovel", "old", None)]
    stored = {(v, c, n): value for v, c, n, value in await store.load_parameters()}
    assert stored == {("/", "federation-upstream", "up"): {"uri": "amqp://h/"}, ("", GLOBAL, "cluster_name"): "east"}
    assert await node.coordinator.parameters() == stored
    assert await Node(store).coordinator.parameters() == stored  # a restart reads them back


async def test_a_listener_that_fails_does_not_keep_the_change_from_the_others(store: SQLiteStore) -> None:
    node = Node(store)
    seen: list[str] = []

    def broken(*_: Any) -> None:
        raise RuntimeError("a bug")

    node.coordinator.on_parameter(broken)
    node.coordinator.on_parameter(lambda v, c, n, value: seen.append(n))
    await node.coordinator.set_parameter("/", "shovel", "s", {"src-uri": "amqp://"})
    assert seen == ["s"]


async def test_one_node_holds_everything_and_owns_every_queue(store: SQLiteStore) -> None:
    node = Node(store)
    coordinator = node.coordinator
    coordinator.region = "eu"
    assert await coordinator.hold("shovels", "/", "s") and await coordinator.holding("shovels", "/", "s")
    assert await coordinator.holder("federation", "/", "x/u") == "n1"
    await coordinator.release("shovels", "/", "s")
    vh = node.broker.vhosts["/"]
    vh.declare_queue("transient", None, durable=False)
    vh.declare_queue("durable", None, durable=True)
    coordinator.add_vhost("other").declare_queue("third", None, durable=False)
    assert coordinator.owner_counts() == {"n1": 3}
    [member] = coordinator.members()
    assert (member.id, member.region, member.queues, member.draining) == ("n1", "eu", 3, False)
    assert member.as_dict() == {"id": "n1", "region": "eu", "grpc": "", "amqp": "", "queues": 3, "draining": False}
