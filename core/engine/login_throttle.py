"""Failed logins slow down, per peer address: a growing delay before each refusal is sent.

A password guesser gets its "no" later and later (at once for a first typo,
then 0.1 s, doubling to 10 s from the ninth failure), so one connection tries a handful
of passwords a minute instead of thousands a second; a right password is
answered at once whatever came before. A host's count is forgotten after
five minutes without a failure. A success does not reset it, or a guesser
who knows one account could clear its count between guesses.
"""

from __future__ import annotations

import time
from collections.abc import Callable

FIRST_DELAY = 0.1
MAX_DELAY = 10.0
FORGET_AFTER = 300.0
MAX_HOSTS = 100_000


class LoginThrottle:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._failures: dict[str, tuple[int, float]] = {}  # host -> (failures, last failure)

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
