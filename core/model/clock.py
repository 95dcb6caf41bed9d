"""Time for the queue engine: a clock and timers, injectable for tests.

The core must stay sans-IO, yet TTLs and x-expires need timers. Production
uses the running asyncio loop; tests use ``ManualScheduler`` and advance time
themselves.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("leveret.core")

# Exceptions raised by timer callbacks and contained, by callback
# (e.g. "QueueChannel._on_expiry_timer"). Read by tests and operators.
callback_failures: Counter[str] = Counter()


def contained(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` such that an exception it raises stays with it.

    A timer belongs to one queue; before this, a message whose headers could
    not be decoded raised inside a queue's expiry timer and the exception
    reached the event loop. Now the failure is counted and logged (the node's
    log filter keeps one traceback per kind per interval) and every other
    queue, and this queue's next timer, run as before.
    """

    def run() -> None:
        call_contained(fn)

    return run


def call_contained(fn: Callable[..., None], *args: object) -> None:
    """Call ``fn(*args)``; an exception is counted in ``callback_failures`` and logged, not raised.

    For loops over other parties' callbacks (a commit's confirm callbacks):
    one that fails must not keep the others from running.
    """
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - contained by design, see contained()
        name = getattr(fn, "__qualname__", type(fn).__name__)
        callback_failures[name] += 1
        log.error("callback failed; contained", exc_info=True,
                  extra={"callback": name, "failures": callback_failures[name]})


# One anchor for the process, so every queue's scheduler agrees (see AsyncioScheduler).
_WALL0 = time.time()
_MONO0 = time.monotonic()


def steady_wall_time() -> float:
    """Wall-clock seconds that a step of the system clock after start-up does not move."""
    return _WALL0 + (time.monotonic() - _MONO0)


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
    """Timers on the running loop; without one (plain unit tests) timers never fire.

    ``now()`` is the wall clock read once, when the process started, moved on by the
    monotonic clock since: wall-clock seconds (what the store keeps as a
    message's expiry, so a restarted node or a queue's next owner compares it
    with its own wall clock, as RabbitMQ does) that an NTP step or an operator's
    ``date -s`` does not move. RabbitMQ reads the OS wall clock for every expiry
    check, so a step of +1 h expires every message with a TTL under an hour at
    once and a step of -1 h holds expired messages an hour longer; the chaos
    suite's clock fault (bench/chaos_clock.py) showed Leveret doing the same
    before this. CLOCK_MONOTONIC is slewed by NTP like the wall clock, only never
    stepped, so the two agree but for steps taken while the node runs.
    """

    def now(self) -> float:
        return steady_wall_time()

    def call_later(self, delay: float, fn: Callable[[], None]) -> TimerHandle:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return _NoTimer()
        return loop.call_later(max(0.0, delay), contained(fn))


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
                contained(fn)()
        self._now = target
