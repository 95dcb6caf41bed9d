"""The chaos suite's clock fault: a node's wall clock stepped (an NTP step, an operator's ``date -s``).

Moving the system clock needs root and moves every process's clock; instead each
node runs under Debian's libfaketime (package ``faketime``), preloaded, reading
its offset from a file of its own (``FAKETIME_TIMESTAMP_FILE``) that the suite
rewrites: ``+3600`` is an hour ahead of the real clock, ``-86400`` a day behind.
libfaketime caches the file's content for ``FAKETIME_CACHE_DURATION`` seconds;
one second keeps the node's cost per clock read low (with ``FAKETIME_NO_CACHE``
every ``time.time()`` opens the file) and a step takes effect within a second.

Only the wall clock moves (``FAKETIME_DONT_FAKE_MONOTONIC=1``): a real NTP step
(``clock_settime(CLOCK_REALTIME)``) never moves ``CLOCK_MONOTONIC``, which the
kernel only slews, so faking the monotonic clock too would test a fault no real
machine has, and would jump every asyncio timer, lease deadline and heartbeat
with it. uvloop's ``loop.time()`` reads ``CLOCK_MONOTONIC`` through libc, so it
stays real as well (checked: a +1 h step moves ``time.time()`` by 3600 s and
neither ``time.monotonic()`` nor ``loop.time()``).

The node's log lines carry its faked wall clock; ``real_times`` maps them back
to the real clock from the steps the suite made, so the checker's ownership
intervals stay true.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

# The synchronized build. The plain libfaketime.so.1 re-reads the offset file without a lock, from
# every thread of the node (gRPC's, asyncio.to_thread's); libfaketime's issues #151 and #547 report
# processes dying at random of that race, its MT build being the remedy. The first 100-cycle run with
# the plain build lost two nodes to SIGABRT with nothing logged, one of them nowhere near a fault of
# its store (the other right after a commit timeout: persistence/postgres.py::_shut_down).
LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1")
CACHE_S = 1  # FAKETIME_CACHE_DURATION: how late a step may take effect in the node
STEPS = (3600.0, -3600.0, 86400.0, -86400.0)  # +1 h, -1 h, +1 day, -1 day


def available() -> bool:
    return LIBFAKETIME.exists()


@dataclass
class FakeClock:
    """One node's wall-clock offset, in a file its libfaketime re-reads."""

    path: Path
    steps: list[tuple[float, float]] = field(default_factory=list)  # (real time of the step, offset from then)

    def __post_init__(self) -> None:
        self.path.write_text("+0\n")

    def env(self) -> dict[str, str]:
        return {
            "LD_PRELOAD": str(LIBFAKETIME),
            "FAKETIME_TIMESTAMP_FILE": str(self.path),
            "FAKETIME_CACHE_DURATION": str(CACHE_S),
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        }

    @property
    def offset(self) -> float:
        return self.steps[-1][1] if self.steps else 0.0

    def step(self, offset: float) -> None:
        """From now on the node's wall clock reads ``offset`` seconds from the real one."""
        self.path.write_text(f"{offset:+.0f}\n")
        self.steps.append((time.time(), offset))

    def real_times(self, logged: Sequence[float]) -> list[float]:
        """The real times of log lines stamped ``logged`` (in the order written) under this clock.

        A line stamped ``ts`` under offset ``o`` was written at ``ts - o``; which
        offset held is known from the steps, give or take the cache interval, so
        each line takes the reading that lies in the offset's span and comes
        closest after the line before it (lines are written in real-time order).
        """
        if not self.steps:
            return list(logged)
        spans = [(float("-inf"), 0.0)] + self.steps  # (from, offset)
        bounds = [(start - CACHE_S - 1, (spans[i + 1][0] if i + 1 < len(spans) else float("inf")) + CACHE_S + 1, o)
                  for i, (start, o) in enumerate(spans)]
        out: list[float] = []
        prev = float("-inf")
        for ts in logged:
            candidates = [ts - o for lo, hi, o in bounds if lo <= ts - o <= hi]
            if not candidates:
                candidates = [ts - self.offset]
            after = [c for c in candidates if c >= prev - CACHE_S]
            real = min(after) if after else max(candidates)
            out.append(real)
            prev = max(prev, real)
        return out
