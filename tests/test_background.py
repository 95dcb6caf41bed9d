"""leveret/node/background.py: the store poll the node's watchers share."""

from __future__ import annotations

import logging

import pytest

from core.ports.store import StoreError
from leveret.node.background import poll_store


async def test_poll_store_yields_none_while_the_store_fails_and_warns_once_per_outage(
        caplog: pytest.LogCaptureFixture) -> None:
    answers: list[int | Exception] = [1, StoreError("down"), StoreError("down"), 2, StoreError("down again"), 3]

    async def read() -> int:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    log = logging.getLogger("test.poll")
    got: list[int | None] = []
    with caplog.at_level(logging.WARNING, logger="test.poll"):
        async for value in poll_store(read, 0, log, "things unavailable; retrying"):
            got.append(value)
            if not answers:
                break
    assert got == [1, None, None, 2, None, 3]
    warnings = [r for r in caplog.records if r.getMessage() == "things unavailable; retrying"]
    assert [r.error for r in warnings] == ["down", "down again"]  # type: ignore[attr-defined]


async def test_spawn_holds_the_task_until_it_ends() -> None:
    import asyncio
    import gc

    from core.model.tasks import spawn

    loop = asyncio.get_running_loop()
    gate = loop.create_future()
    done: list[str] = []

    async def waits(on: asyncio.Future[None]) -> None:
        await on
        done.append("ran")

    tasks: set[asyncio.Task[object]] = set()
    spawn(waits(gate), tasks)
    await asyncio.sleep(0)
    gc.collect()  # a task nothing holds could go here; this one is in ``tasks``
    assert len(tasks) == 1
    gate.set_result(None)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert done == ["ran"] and not tasks
