"""The node's polls of the store: how one polls, and logs an outage once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from core.ports.store import StoreError

T = TypeVar("T")


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
