"""Tasks that run beside the caller: how one is started so it is not lost, and how one is stopped.

Every layer starts background work (the engine's page reads, the transport's forwarded calls, the
coordinators' watches, the node's loops), so the helpers live at the bottom, in the model.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

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


def run_then(op: Awaitable[T], done: Callable[[T | None, BaseException | None], None],
             tasks: set[asyncio.Task[Any]]) -> None:
    """Await ``op`` in a task held in ``tasks``, then hand ``done`` its result or the exception it raised.

    How a sans-IO state machine's asynchronous step (a durable declaration, a login) comes back to
    it: the front ends' asyncio layers pass this, and the machine never awaits.
    """

    async def run() -> None:
        try:
            result = await op
        except Exception as exc:  # noqa: BLE001 - handed to the state machine
            done(None, exc)
            return
        done(result, None)

    spawn(run(), tasks)


async def stop_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and wait until it has ended (its own clean-up included); None does nothing."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
