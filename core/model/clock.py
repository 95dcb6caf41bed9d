"""Time for the queue engine: a clock and timers, injectable for tests.

The core must stay sans-IO, yet TTLs and x-expires need timers. Production
uses the running asyncio loop; tests use ``ManualScheduler`` and advance time
themselves.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Protocol


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


class Scheduler(Protocol):
    def now(self) -> float:
        """Wall-clock seconds (message timestamps and expiry are wall-clock, as in RabbitMQ)."""
        ...

    def call_later(self, delay: float, fn: Callable[[], None]) -> TimerHandle: ...


class _NoTimer:
    def cancel(self) -> None:
        pass


class AsyncioScheduler:
    """Timers on the running loop; without one (plain unit tests) timers never fire."""

    def now(self) -> float:
        return time.time()

    def call_later(self, delay: float, fn: Callable[[], None]) -> TimerHandle:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return _NoTimer()
        return loop.call_later(max(0.0, delay), fn)


class _ManualTimer:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualScheduler:
    """A clock that moves only when told to (``advance``), firing due timers in order."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._timers: list[tuple[float, int, _ManualTimer, Callable[[], None]]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    def call_later(self, delay: float, fn: Callable[[], None]) -> TimerHandle:
        handle = _ManualTimer()
        heapq.heappush(self._timers, (self._now + max(0.0, delay), next(self._seq), handle, fn))
        return handle

    def advance(self, seconds: float) -> None:
        target = self._now + seconds
        while self._timers and self._timers[0][0] <= target:
            when, _, handle, fn = heapq.heappop(self._timers)
            self._now = max(self._now, when)
            if not handle.cancelled:
                fn()
        self._now = target
