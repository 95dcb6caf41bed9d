"""Restoring what an older version stored: a refused declaration must not stop the node."""

from __future__ import annotations

from pathlib import Path

from core.durable.durability import Durability
from core.durable.group_commit import GroupCommitter
from core.engine.broker import Broker
from core.model import properties
from core.ports.store import Batch, QueueRecord, StoredMessage
from persistence.sqlite import SQLiteStore


async def test_a_stored_queue_with_refused_arguments_is_skipped_and_kept(tmp_path: Path) -> None:
    path = str(tmp_path / "leveret.sqlite3")
    store = SQLiteStore(path)
    await store.open()
    await store.save_queue(QueueRecord("/", "bad", False, {"x-made-up-argument": 1}))
    await store.save_queue(QueueRecord("/", "good", False, {}))
    epoch = await store.claim("/", "good")
    props = properties.encode({"delivery_mode": 2})
    await store.commit(Batch(epochs={("/", "good"): epoch}, appends=[
        StoredMessage("/", "good", 0, "id-0", "", "good", props, b"kept", 1.0, None)]))
    await store.close()

    store = SQLiteStore(path)
    await store.open()
    try:
        broker = Broker(node_id="t")
        queues, messages = await Durability(store, GroupCommitter(store)).restore(broker)
        vh = broker.vhosts["/"]
        assert "bad" not in vh.queues and "good" in vh.queues
        assert [qm.message.body for qm in vh.queues["good"].default.ready] == [b"kept"]
        topology = await store.load_topology()
        assert {q.name for q in topology.queues} == {"bad", "good"}  # nothing deleted
    finally:
        await store.close()
