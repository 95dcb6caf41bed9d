"""An exception inside a core timer stays with its queue: counted, logged, and the queue keeps working."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from core.durable import group_commit
from core.durable.durability import QueueStorage
from core.durable.group_commit import GroupCommitter
from core.engine.queue import QueuedMessage
from core.engine.vhost import VirtualHost
from core.model import clock as clock_module
from core.model.clock import AsyncioScheduler, ManualScheduler
from core.model.message import Message
from core.ports.store import QueueRecord
from persistence.sqlite import SQLiteStore
from tests.test_queue import FakeSink, ready_bodies
from tests.test_queue_args import OWNER, publish, subscribe


@pytest.fixture
def clock() -> ManualScheduler:
    return ManualScheduler()


@pytest.fixture
def vh(clock: ManualScheduler) -> VirtualHost:
    return VirtualHost("/", clock)


def test_failing_drop_in_expiry_timer_is_contained_and_ttl_keeps_working(
    vh: VirtualHost, clock: ManualScheduler, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    dlq = vh.declare_queue("dlq", OWNER)
    q = vh.declare_queue("q", OWNER, arguments={"x-message-ttl": 1000, "x-dead-letter-exchange": "",
                                                 "x-dead-letter-routing-key": "dlq"})
    real_drop = q.drop
    calls: list[list[bytes]] = []

    def failing_once(messages: list[QueuedMessage], reason: str) -> None:
        calls.append([qm.message.body for qm in messages])
        if len(calls) == 1:
            raise RuntimeError("injected failure in a core callback")
        real_drop(messages, reason)

    monkeypatch.setattr(q, "drop", failing_once)
    before = clock_module.callback_failures["QueueChannel._on_expiry_timer"]
    publish(vh, "q", b"poison")
    clock.advance(0.5)
    publish(vh, "q", b"next")
    with caplog.at_level(logging.ERROR, logger="leveret.core"):
        clock.advance(0.6)  # poison's timer fires and fails: nothing escapes advance()
    assert calls == [[b"poison"]]
    assert clock_module.callback_failures["QueueChannel._on_expiry_timer"] == before + 1
    failed = [r for r in caplog.records if r.getMessage() == "callback failed; contained"]
    assert len(failed) == 1 and failed[0].exc_info is not None
    # The timer was re-armed for the next head despite the failure: it expires on time.
    clock.advance(0.5)
    assert calls[1:] == [[b"next"]]
    assert ready_bodies(dlq.default) == [b"next"]
    # And the queue keeps serving: a consumer gets what comes next.
    sink = FakeSink()
    subscribe(q, sink, "c")
    publish(vh, "q", b"after")
    assert [qm.message.body for _, qm in sink.delivered] == [b"after"]


def test_asyncio_scheduler_contains_a_failing_callback() -> None:
    seen: list[dict[str, Any]] = []
    ran: list[str] = []

    def bad() -> None:
        raise ValueError("injected")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, context: seen.append(context))
        scheduler = AsyncioScheduler()
        scheduler.call_later(0, bad)
        scheduler.call_later(0, lambda: ran.append("ok"))
        await asyncio.sleep(0.05)

    before = clock_module.callback_failures["test_asyncio_scheduler_contains_a_failing_callback.<locals>.bad"]
    asyncio.run(main())
    assert ran == ["ok"]
    assert seen == []  # nothing reached the loop's exception handler
    after = clock_module.callback_failures["test_asyncio_scheduler_contains_a_failing_callback.<locals>.bad"]
    assert after == before + 1


def test_cancelled_timer_is_still_cancellable_through_the_wrapper() -> None:
    ran: list[int] = []

    async def main() -> None:
        handle = AsyncioScheduler().call_later(0.01, lambda: ran.append(1))
        handle.cancel()
        await asyncio.sleep(0.05)

    asyncio.run(main())
    assert ran == []


async def test_a_failing_commit_callback_does_not_stop_the_others_or_the_flusher(tmp_path: Path) -> None:
    """A real SQLite store; one confirm callback raises (an injected bug behind one connection)."""
    store = SQLiteStore(str(tmp_path / "s.sqlite3"))
    await store.open()
    try:
        await store.save_queue(QueueRecord("/", "q"))
        committer = GroupCommitter(store)
        storage = QueueStorage("/", "q", committer, await store.claim("/", "q"))
        outcomes: list[str] = []

        def broken(_error: BaseException | None) -> None:
            raise RuntimeError("injected failure in a commit callback")

        storage.append(QueuedMessage(Message("", "q", b"\x00\x00", b"a"), 0))
        committer.when_committed(broken)
        committer.when_committed(lambda error: outcomes.append(f"first {error}"))
        before = group_commit.callback_failures
        await committer.drain()
        assert outcomes == ["first None"]
        assert group_commit.callback_failures == before + 1
        # The flusher still runs: the next batch commits and confirms.
        storage.append(QueuedMessage(Message("", "q", b"\x00\x00", b"b"), 1))
        committer.when_committed(lambda error: outcomes.append(f"second {error}"))
        await committer.drain()
        assert outcomes == ["first None", "second None"]
        assert [m.offset for m in await store.load_messages("/", "q")] == [0, 1]
    finally:
        await store.close()
