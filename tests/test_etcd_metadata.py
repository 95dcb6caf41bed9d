"""The coordinator's metadata side on etcd: what one node writes, the other applies from its watch.

Two etcd coordinators (coordination/etcd.py) of one cluster in this process,
each with its own broker and store, against a real etcd: users, vhost limits,
policies, runtime parameters and named holds written through one reach the
other through its watch (nothing polls), and members and owner counts are the
cluster's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from coordination.etcd import ClusterSettings, EtcdCoordinator
from core.cluster.auth import PeerAuth
from core.durable.group_commit import GroupCommitter
from core.engine.broker import Broker, Permission, User
from core.model.policy import Policy
from persistence.sqlite import SQLiteStore
from tests.etcd import EtcdServer
from tests.etcd import etcd_server_fixture as etcd_server_fixture  # the module-scoped `etcd_server`

APPLIED_WITHIN = 10.0  # a watch event takes milliseconds; the machine is shared and slow at times


@dataclass
class Member:
    broker: Broker
    store: SQLiteStore
    cluster: EtcdCoordinator


async def _member(etcd: EtcdServer, path: Path, node: str, cluster: str) -> Member:
    store = SQLiteStore(str(path / f"{node}.sqlite3"))
    await store.open()
    committer = GroupCommitter(store)
    broker = Broker(node_id=node, default_user=None)
    broker.committer = committer
    settings = ClusterSettings(endpoints=[etcd.url], cluster=cluster, node_id=node, region="r1",
                               auth=PeerAuth(secret=b"s" * 32))
    coordinator = EtcdCoordinator(broker, store, committer, settings)
    broker.coordinator = coordinator
    await coordinator.start()
    return Member(broker, store, coordinator)


@pytest.fixture
async def pair(etcd_server: EtcdServer, tmp_path: Path) -> AsyncIterator[tuple[Member, Member]]:
    name = f"meta{time.monotonic_ns()}"
    one = await _member(etcd_server, tmp_path, "n1", name)
    two = await _member(etcd_server, tmp_path, "n2", name)
    try:
        yield one, two
    finally:
        for m in (one, two):
            await m.cluster.stop(handover=False)
            await m.store.close()


async def until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + APPLIED_WITHIN
    while not check():
        assert time.monotonic() < deadline, f"{what} not applied within {APPLIED_WITHIN} s"
        await asyncio.sleep(0.01)


async def test_users_and_vhost_limits_written_on_one_node_apply_on_the_other(pair: tuple[Member, Member]) -> None:
    one, two = pair
    user = User.create("ann", "secret", vhosts={"/"})
    user.permissions["/"] = Permission("^ann-", ".*", ".*")
    user.limits = {"max-channels": 2}
    await one.cluster.save_user(user)
    await until(lambda: "ann" in two.broker.users, "the user")
    there = two.broker.users["ann"]
    assert there.check_password("secret") and there.permission("/") == Permission("^ann-", ".*", ".*")
    assert there.limits == {"max-channels": 2}
    assert [r.name for r in await one.store.load_users()] == ["ann"]  # and stored by the node that wrote it
    one.cluster.add_vhost("orders")
    await one.cluster.save_vhost("orders")
    await one.cluster.set_vhost_limits("orders", {"max-queues": 3})
    await until(lambda: two.broker.vhost_limits.get("orders") == {"max-queues": 3}, "the vhost limits")
    assert "orders" in two.broker.vhosts
    assert await one.cluster.delete_user("ann")
    await until(lambda: "ann" not in two.broker.users, "the user's deletion")


async def test_policies_apply_on_every_node(pair: tuple[Member, Member]) -> None:
    one, two = pair
    q = two.broker.vhosts["/"].declare_queue("cap-here", None, durable=False)
    policy = Policy.create("/", "cap", "^cap-", {"max-length": 2}, "queues")
    assert not await one.cluster.set_policy(policy)
    await until(lambda: two.broker.vhosts["/"].policies.get("cap") == policy, "the policy")
    assert two.broker.vhosts["/"].policies_of(q)[0] == policy
    assert await one.cluster.clear_policy("/", "cap", operator=False)
    await until(lambda: "cap" not in two.broker.vhosts["/"].policies, "the policy's removal")


async def test_parameters_are_delivered_to_the_other_nodes_listeners(pair: tuple[Member, Member]) -> None:
    one, two = pair
    seen: list[tuple[str, str, str, Any]] = []
    two.cluster.on_parameter(lambda v, c, n, value: seen.append((v, c, n, value)))
    await one.cluster.set_parameter("/", "shovel", "move", {"src-uri": "amqp://"})
    await until(lambda: len(seen) == 1, "the parameter")
    await one.cluster.set_parameter("", "global", "cluster_name", "east")
    await one.cluster.clear_parameter("/", "shovel", "move")
    await until(lambda: len(seen) == 3, "two more changes")
    assert seen == [("/", "shovel", "move", {"src-uri": "amqp://"}), ("", "global", "cluster_name", "east"),
                    ("/", "shovel", "move", None)]
    assert await two.cluster.parameters() == {("", "global", "cluster_name"): "east"}


async def test_a_named_hold_is_one_nodes_and_its_release_wakes_the_others(pair: tuple[Member, Member]) -> None:
    one, two = pair
    woken: list[str] = []
    two.cluster.on_holds_changed("shovels", lambda: woken.append("shovels"))
    assert await one.cluster.hold("shovels", "/", "move")
    assert not await two.cluster.hold("shovels", "/", "move")
    assert await two.cluster.holder("shovels", "/", "move") == "n1"
    assert await one.cluster.holding("shovels", "/", "move") and not await two.cluster.holding("shovels", "/", "move")
    woken.clear()
    await one.cluster.release("shovels", "/", "move")
    await until(lambda: bool(woken), "the release's wake-up")
    assert await two.cluster.hold("shovels", "/", "move")
    assert await one.cluster.holder("shovels", "/", "move") == "n2"


async def test_members_and_owner_counts_are_the_clusters(pair: tuple[Member, Member]) -> None:
    one, two = pair
    await until(lambda: len(one.cluster.members()) == 2, "both members")
    assert [(m.id, m.region, m.queues) for m in one.cluster.members()] == [("n1", "r1", 0), ("n2", "r1", 0)]
    await two.cluster.declare_queue(two.broker.vhosts["/"], "mine", None, False, False, False, {})
    await until(lambda: one.cluster.owner_counts() == {"n1": 0, "n2": 1}, "the owner count")
