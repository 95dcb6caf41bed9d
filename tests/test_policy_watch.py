"""The policy watch (leveret/node/policy_watch.py) tells the coordinator what it saw change in the store.

Only a command writing the store straight (``leveret policies``) changes policies behind every
node's back; the watch applies it here and tells ``on_store_change``, which in a cluster brings
etcd's copy in line (coordination/etcd.py ``policy_stored``).
"""

from __future__ import annotations

from pathlib import Path

from core.engine.broker import Broker
from core.model.policy import Policy
from leveret.node.policy_watch import Key, PolicyWatch
from persistence.sqlite import SQLiteStore


async def test_each_change_between_two_reads_is_told_once(tmp_path: Path) -> None:
    store = SQLiteStore(str(tmp_path / "leveret.sqlite3"))
    await store.open()
    try:
        broker = Broker(default_user=None)
        watch = PolicyWatch(broker, store)
        told: list[tuple[Key, Policy | None]] = []
        watch.on_store_change.append(lambda key, policy: told.append((key, policy)))
        cap = Policy.create("/", "cap", "^a", {"max-length": 1})
        elsewhere = Policy.create("gone", "p", ".*", {"max-length": 2})  # a vhost this node does not have
        watch.apply_changes({("/", False, "cap"): cap, ("gone", False, "p"): elsewhere})
        assert told == [(("/", False, "cap"), cap), (("gone", False, "p"), elsewhere)]
        assert broker.vhosts["/"].policies == {"cap": cap}
        told.clear()
        watch.apply_changes({("/", False, "cap"): cap, ("gone", False, "p"): elsewhere})  # nothing changed here
        assert told == []  # the store did not change (the policy of "gone" is retried until its vhost exists)
        told.clear()
        watch.apply_changes({})
        assert sorted(told) == [(("/", False, "cap"), None), (("gone", False, "p"), None)]
        assert broker.vhosts["/"].policies == {}
    finally:
        await store.close()
