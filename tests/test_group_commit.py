"""The group committer against a real SQLite store: settled-before-written appends are never written."""

from __future__ import annotations

from pathlib import Path

from core.durable.durability import QueueStorage
from core.durable.group_commit import GroupCommitter
from core.model.message import Message, QueuedMessage
from core.ports.store import QueueRecord
from persistence.sqlite import SQLiteStore


async def _setup(tmp_path: Path) -> tuple[SQLiteStore, GroupCommitter, QueueStorage]:
    store = SQLiteStore(str(tmp_path / "s.sqlite3"))
    await store.open()
    await store.save_queue(QueueRecord("/", "q"))
    committer = GroupCommitter(store)
    storage = QueueStorage("/", "q", committer, await store.claim("/", "q"))
    return store, committer, storage


def _qm(offset: int) -> QueuedMessage:
    return QueuedMessage(Message("", "q", b"\x00\x00", b"x" * 100_000), offset)


async def test_removal_before_the_commit_cancels_the_write(tmp_path: Path) -> None:
    store, committer, storage = await _setup(tmp_path)
    try:
        outcomes: list[BaseException | None] = []
        for off in range(3):
            storage.append(_qm(off))
        committer.when_committed(outcomes.append)
        storage.remove(_qm(1))  # acked before the flush task ran: never written
        await committer.drain()
        assert outcomes == [None]
        assert committer.cancelled == 1
        assert [m.offset for m in await store.load_messages("/", "q")] == [0, 2]
        # Once written, a removal is a delete like any other.
        storage.remove(_qm(0))
        await committer.drain()
        assert committer.cancelled == 1
        assert [m.offset for m in await store.load_messages("/", "q")] == [2]
    finally:
        await store.close()


async def test_batch_of_only_cancelled_appends_still_confirms(tmp_path: Path) -> None:
    store, committer, storage = await _setup(tmp_path)
    try:
        outcomes: list[BaseException | None] = []
        storage.append(_qm(0))
        committer.when_committed(outcomes.append)
        storage.remove(_qm(0))
        await committer.drain()
        assert outcomes == [None]
        assert await store.load_messages("/", "q") == []
    finally:
        await store.close()


async def test_committed_waits_for_the_commit_and_reports_a_fence(tmp_path: Path) -> None:
    store, committer, storage = await _setup(tmp_path)
    try:
        storage.append(_qm(0))
        assert await committer.committed() is None
        assert [m.offset for m in await store.load_messages("/", "q")] == [0]
        assert await committer.committed() is None  # nothing pending: at once
        await store.claim("/", "q", storage.epoch + 1)  # another owner now: our next write is refused
        storage.append(_qm(1))
        error = await committer.committed()
        assert error is not None
        assert [m.offset for m in await store.load_messages("/", "q")] == [0]
    finally:
        await store.close()
