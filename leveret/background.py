"""The node's background loops (polls of the store, rate sampling): how one polls, how one is stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from core.ports.store import StoreError

T = TypeVar("T")


def spawn(coro: Coroutine[Any, Any, Any], tasks: set[asyncio.Task[Any]]) -> asyncio.Task[Any]:
    """Run ``coro`` as a task held in ``tasks`` until it ends.

    The event loop keeps only weak references to tasks: one that nothing else holds can be
    garbage-collected while it waits ("Task was destroyed but it is pending!").
    """
    task = asyncio.get_running_loop().create_task(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task


async def stop_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and wait until it has ended (its own clean-up included); None does nothing."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def poll_store(read: Callable[[], Awaitable[T]], every: float, log: logging.Logger,
                     unavailable: str) -> AsyncIterator[T | None]:
    """Every ``every`` seconds, what ``read`` returns from the store, or None while it fails.

    A failure (StoreError) is logged once per outage, as ``unavailable``: a store that is down
    for minutes must not write a warning every poll. For the node's polls of what other nodes
    change in the store (policies, runtime parameters).
    """
    failing = False
    while True:
        await asyncio.sleep(every)
        try:
            value = await read()
        except StoreError as exc:
            if not failing:
                log.warning(unavailable, extra={"error": str(exc)})
                failing = True
            yield None
            continue
        failing = False
        yield value
