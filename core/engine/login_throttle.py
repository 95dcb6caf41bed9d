"""Failed logins slow down, per peer address: a growing delay before each password check.

A password guesser waits longer and longer before its next guess is even
checked (at once after a first typo, then 0.1 s, doubling to 10 s from the
ninth failure), so an address tries a handful of passwords a minute instead
of thousands a second. The wait comes before the check, for a right password
too: when only the refusal waited, a guesser opening connections in parallel
saw the right password answered at once and found it in 1.8 s. Checks from
one address also run a few at a time (``turn``), so parallel guesses queue
behind each other's delays, and an address may hold only so many handshakes
that have not logged in yet (``handshake_started``). A host's count is
forgotten after five minutes without a failure. A success does not reset
it, or a guesser who knows one account could clear its count between guesses.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

FIRST_DELAY = 0.1
MAX_DELAY = 10.0
FORGET_AFTER = 300.0
MAX_HOSTS = 100_000
# Password checks of one address running at once (the rest wait their turn, then their delay).
CHECKS_PER_HOST = 4
# Connections of one address that have not logged in yet; more are closed at once.
HANDSHAKES_PER_HOST = 64


class LoginThrottle:
    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 handshakes_per_host: int = HANDSHAKES_PER_HOST) -> None:
        self._clock = clock
        self._failures: dict[str, tuple[int, float]] = {}  # host -> (failures, last failure)
        self._turns: dict[str, asyncio.Semaphore] = {}
        self._waiting: dict[str, int] = {}  # host -> checks holding or waiting for a turn
        self.handshakes_per_host = handshakes_per_host
        self._handshakes: dict[str, int] = {}  # host -> connections not logged in yet

    @asynccontextmanager
    async def turn(self, host: str | None) -> AsyncIterator[None]:
        """Wait for one of the address's CHECKS_PER_HOST turns, then for its delay; check inside."""
        if host is None:
            yield
            return
        gate = self._turns.get(host)
        if gate is None:
            gate = self._turns[host] = asyncio.Semaphore(CHECKS_PER_HOST)
        self._waiting[host] = self._waiting.get(host, 0) + 1
        try:
            async with gate:
                wait = self.delay(host)  # the failures known when this check's turn came
                if wait > 0:
                    await asyncio.sleep(wait)
                yield
        finally:
            left = self._waiting[host] - 1
            if left:
                self._waiting[host] = left
            else:  # nobody else of this address: forget its gate
                del self._waiting[host]
                self._turns.pop(host, None)

    def handshake_started(self, host: str | None) -> bool:
        """A connection from ``host`` begins its handshake; False when the address already has
        ``handshakes_per_host`` that have not logged in (the caller closes this one)."""
        if host is None:
            return True
        count = self._handshakes.get(host, 0)
        if count >= self.handshakes_per_host:
            return False
        self._handshakes[host] = count + 1
        return True

    def handshake_ended(self, host: str | None) -> None:
        """The connection logged in, or went away before it did."""
        if host is None:
            return
        count = self._handshakes.get(host, 0) - 1
        if count > 0:
            self._handshakes[host] = count
        else:
            self._handshakes.pop(host, None)

    def failed(self, host: str | None) -> float:
        """Count a failed login from ``host``; the seconds to wait before refusing it."""
        if host is None:
            return 0.0  # in-process callers (tests of the state machines)
        now = self._clock()
        count, last = self._failures.get(host, (0, now))
        if now - last > FORGET_AFTER:
            count = 0
        count += 1
        if len(self._failures) >= MAX_HOSTS:
            self._forget_old(now)
        self._failures[host] = (count, now)
        return _delay(count)

    def delay(self, host: str | None) -> float:
        """The wait before refusing ``host`` now (after ``failed`` counted its latest attempt)."""
        count = self.failures(host) if host is not None else 0
        return _delay(count)

    def failures(self, host: str) -> int:
        count, last = self._failures.get(host, (0, 0.0))
        return count if self._clock() - last <= FORGET_AFTER else 0

    def _forget_old(self, now: float) -> None:
        self._failures = {h: v for h, v in self._failures.items() if now - v[1] <= FORGET_AFTER}
        if len(self._failures) >= MAX_HOSTS:
            self._failures.clear()  # a flood from many addresses: start over rather than grow


def _delay(failures: int) -> float:
    return 0.0 if failures <= 1 else min(MAX_DELAY, FIRST_DELAY * 2 ** (failures - 2))
