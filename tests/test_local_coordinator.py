"""The single-node coordinator (coordination/local.py) against a real SQLite store.

The same interface as the etcd coordinator, so the declaration paths of the
front ends are tested here without etcd: a durable declaration, binding or
deletion is answered only once stored, transient ones at once, and a burst of
declarations shares commits.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pamqp import commands

from coordination.local import LocalCoordinator, StoreUnavailable
from core.durable.durability import Durability
from core.durable.group_commit import GroupCommitter
from core.engine.broker import Broker
from core.engine.ownership import OwnershipState
from core.engine.vhost import VirtualHost
from core.model.errors import PreconditionFailed
from core.ports.coordinator import Immediate
from core.ports.store import Batch, StoreError
from persistence.sqlite import SQLiteStore
from tests.amqp_client import Client, publish_bytes


class FlakySQLiteStore(SQLiteStore):
    """The real SQLite store, with commits that fail while ``failing`` is set (the disk gone, say)."""

    failing = False

    async def commit(self, batch: Batch) -> None:
        if self.failing:
            raise StoreError(f"{self.description}: disk I/O error (injected)")
        await super().commit(batch)


@dataclass
class Node:
    broker: Broker
    store: FlakySQLiteStore
    committer: GroupCommitter
    coordinator: LocalCoordinator

    @property
    def vh(self) -> VirtualHost:
        return self.broker.vhosts["/"]


async def _node(path: Path) -> Node:
    store = FlakySQLiteStore(str(path))
    await store.open()
    coordinator = LocalCoordinator("t")
    broker = Broker(node_id="t", coordinator=coordinator)
    committer = GroupCommitter(store)
    broker.committer = committer
    durability = Durability(store, committer)
    queues = await durability.restore_topology(broker)
    await coordinator.take_over_stored_queues(durability, queues, broker.vhosts.values())
    return Node(broker, store, committer, coordinator)


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    n = await _node(tmp_path / "s.sqlite3")
    try:
        yield n
    finally:
        await n.committer.drain()
        await n.store.close()


async def _stored_queues(store: SQLiteStore) -> set[str]:
    return {q.name for q in (await store.load_topology()).queues}


async def test_a_durable_queue_is_answered_only_once_stored(node: Node) -> None:
    op = node.coordinator.declare_queue(node.vh, "dq", None, True, False, False, {})
    assert not isinstance(op, Immediate)
    assert "dq" in node.vh.queues  # applied at once: routing sees it
    assert await _stored_queues(node.store) == set()  # ... but not stored yet
    q = await op
    assert q.name == "dq" and q.storage is not None and q.storage.epoch == 1
    assert await _stored_queues(node.store) == {"dq"}


async def test_transient_declarations_are_immediate_and_never_stored(node: Node) -> None:
    c = node.coordinator
    op = c.declare_queue(node.vh, "tq", None, False, False, False, {})
    assert isinstance(op, Immediate) and op.value.name == "tq"
    assert isinstance(c.declare_queue(node.vh, "ex", object(), True, True, False, {}), Immediate)  # exclusive
    assert isinstance(c.declare_exchange(node.vh, "tx", "fanout", False, False, False, {}), Immediate)
    assert isinstance(c.bind(node.vh, "tx", "queue", "tq", "", {}, True), Immediate)
    await node.committer.drain()
    topo = await node.store.load_topology()
    assert topo.queues == [] and topo.exchanges == [] and topo.bindings == []


async def test_server_named_queue_and_equivalence_checks(node: Node) -> None:
    q = await node.coordinator.declare_queue(node.vh, "", None, True, False, False, {})
    assert q.name.startswith("amq.gen-")
    assert await _stored_queues(node.store) == {q.name}
    with pytest.raises(PreconditionFailed, match="inequivalent arg 'durable'"):
        node.coordinator.declare_queue(node.vh, q.name, None, False, False, False, {})


async def test_durable_bindings_and_deletes_are_stored_before_answered(node: Node) -> None:
    c, vh = node.coordinator, node.vh
    await c.declare_exchange(vh, "x", "direct", True, False, False, {})
    await c.declare_queue(vh, "q", None, True, False, False, {})
    await c.bind(vh, "x", "queue", "q", "rk", {}, True)
    topo = await node.store.load_topology()
    assert [(b.source, b.destination, b.routing_key) for b in topo.bindings] == [("x", "q", "rk")]
    await c.bind(vh, "x", "queue", "q", "rk", {}, False)
    assert (await node.store.load_topology()).bindings == []
    assert await c.delete_queue(vh, "q", None, False, False) == 0
    await c.delete_exchange(vh, "x", False)
    topo = await node.store.load_topology()
    assert topo.queues == [] and topo.exchanges == []


async def test_a_burst_of_declarations_shares_commits(node: Node) -> None:
    before = node.committer.commits
    ops = [node.coordinator.declare_queue(node.vh, f"q{i}", None, True, False, False, {}) for i in range(5000)]
    queues = [await op for op in ops]
    # One transaction per loop turn and per MAX_BATCH_OPS, not one (two fsyncs) per queue.
    assert node.committer.commits - before <= 3
    assert len(await _stored_queues(node.store)) == 5000
    assert {q.storage.epoch for q in queues if q.storage is not None} == {1}


async def test_messages_of_a_queue_declared_in_the_same_batch_pass_the_fence(node: Node) -> None:
    c = Client(node.broker)
    c.handshake()
    c.open_channel(1)
    c.conn.run_async = _run_async
    c.send(1, commands.Queue.Declare(queue="dq", durable=True, nowait=True))
    c.send_raw(publish_bytes(1, b"hello", routing_key="dq", properties=commands.Basic.Properties(delivery_mode=2)))
    await node.committer.drain()
    q = node.vh.queues["dq"]
    assert q.storage is not None and q.storage.epoch == 1
    assert [m.body for m in await node.store.load_messages("/", "dq")] == [b"hello"]
    assert node.committer.failures == 0


async def test_a_failed_topology_write_is_refused_then_retried_until_stored(node: Node) -> None:
    node.store.failing = True
    with pytest.raises(StoreUnavailable, match="disk I/O error"):
        await node.coordinator.declare_queue(node.vh, "dq", None, True, False, False, {})
    assert node.committer.failures >= 1
    # Declaring it again while the store is still down is refused too: nothing is promised.
    with pytest.raises(StoreUnavailable):
        await node.coordinator.declare_queue(node.vh, "dq", None, True, False, False, {})
    node.store.failing = False
    # The vhost has the queue, so the store must get it: the write is retried, and a declaration
    # now is answered once it is there.
    q = await asyncio.wait_for(node.coordinator.declare_queue(node.vh, "dq", None, True, False, False, {}), 15)
    assert await _stored_queues(node.store) == {"dq"}
    assert q.storage is not None and q.storage.epoch == 1


async def test_restart_claims_every_stored_queue_in_one_commit(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite3"
    first = await _node(path)
    for op in [first.coordinator.declare_queue(first.vh, f"q{i}", None, True, False, False, {}) for i in range(300)]:
        await op
    await first.committer.drain()
    await first.store.close()
    again = await _node(path)
    try:
        assert len(again.vh.queues) == 300
        assert {q.storage.epoch for q in again.vh.queues.values() if q.storage is not None} == {2}
    finally:
        await again.store.close()


async def test_ownership_is_the_engine_state_machine_with_a_lease_that_never_ends(tmp_path: Path) -> None:
    """The single node records what it owns as etcd's coordinator does: restored and new stored queues
    serve under their epoch; transient queues need no record; a deleted queue's record goes."""
    path = tmp_path / "s.sqlite3"
    first = await _node(path)
    await first.coordinator.declare_queue(first.vh, "kept", None, True, False, False, {})
    await first.committer.drain()
    await first.store.close()
    again = await _node(path)
    try:
        own = again.coordinator.ownership
        assert own.state(("/", "kept")) is OwnershipState.SERVING
        assert own.epoch(("/", "kept")) == again.vh.queues["kept"].storage.epoch  # type: ignore[union-attr]
        await again.coordinator.declare_queue(again.vh, "new", None, True, False, False, {})
        await again.coordinator.declare_queue(again.vh, "transient", None, False, False, False, {})
        assert own.serving(("/", "new")) and not own.owning(("/", "transient"))
        await again.coordinator.delete_queue(again.vh, "new", None, False, False)
        again.vh.delete_queue("kept", None)  # not through the coordinator (as x-expires does)
        assert len(own) == 0
    finally:
        await again.committer.drain()
        await again.store.close()


# -- through the AMQP channel: the reply waits for the store -------------------------------------------
def _run_async(op: Awaitable[Any], done: Callable[[Any, BaseException | None], None]) -> None:
    async def run() -> None:
        try:
            result = await op
        except Exception as exc:  # noqa: BLE001 - handed to the state machine, as amqp_frontend/server.py does
            done(None, exc)
            return
        done(result, None)

    asyncio.get_running_loop().create_task(run())


async def _replies(c: Client, want: int) -> list[Any]:
    got: list[Any] = []
    for _ in range(500):
        got.extend(value for _, value in c.read())
        if len(got) >= want:
            return got
        await asyncio.sleep(0.01)
    raise AssertionError(f"only {got} after 5 s")


async def test_amqp_declare_ok_goes_out_after_the_commit(node: Node) -> None:
    c = Client(node.broker)
    c.handshake()
    c.open_channel(1)
    c.conn.run_async = _run_async
    c.send(1, commands.Exchange.Declare(exchange="x", exchange_type="topic", durable=True),
           commands.Queue.Declare(queue="dq", durable=True),
           commands.Queue.Bind(queue="dq", exchange="x", routing_key="a.#"))
    assert c.read() == []  # suspended until the store has the exchange
    replies = await _replies(c, 3)
    assert [type(r) for r in replies] == [commands.Exchange.DeclareOk, commands.Queue.DeclareOk,
                                          commands.Queue.BindOk]
    topo = await node.store.load_topology()
    assert [x.name for x in topo.exchanges] == ["x"] and [q.name for q in topo.queues] == ["dq"]
    assert [b.routing_key for b in topo.bindings] == ["a.#"]
    # A transient declaration needs no loop turn: the reply is there at once.
    c.send(1, commands.Queue.Declare(queue="tq"))
    assert [type(v) for _, v in c.read()] == [commands.Queue.DeclareOk]
    c.send(1, commands.Queue.Delete(queue="dq"))
    assert c.read() == []
    assert [type(r) for r in await _replies(c, 1)] == [commands.Queue.DeleteOk]
    assert await _stored_queues(node.store) == set()
