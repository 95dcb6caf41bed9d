"""One log line per source per interval: a repeated refusal must not flood the log.

A port scanner, a misconfigured client retrying in a loop or a brute-force
attempt would otherwise write a line per attempt; the first is logged at
once, repeats within ``interval`` are counted and reported with the next line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

MAX_SOURCES = 10_000


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval = interval
        self._clock = clock
        self._last: dict[str, tuple[float, int]] = {}  # source -> (when logged, repeats not logged since)

    def warning(self, source: str, message: str, **extra: Any) -> bool:
        """Log ``message`` for ``source`` unless it was logged less than ``interval`` ago; True if logged."""
        now = self._clock()
        last = self._last.get(source)
        if last is not None and now - last[0] < self.interval:
            self._last[source] = (last[0], last[1] + 1)
            return False
        if len(self._last) >= MAX_SOURCES:
            self._last.clear()
        self._last[source] = (now, 0)
        if last is not None and last[1]:
            extra["repeats_not_logged"] = last[1]
        self.logger.warning(message, extra={"peer": source, **extra})
        return True
