"""Memory one watched object's sample history holds (leveret/http/rates.py: WATCHED, HISTORY).

``python -m bench.sample_history``: fills 64 histories of HISTORY points each, shaped as the
sampler's for a queue and for a connection, and prints the bytes tracemalloc counts per object.
"""

from __future__ import annotations

import time
import tracemalloc
from collections import deque
from collections.abc import Callable

from core.engine.stats import QUEUE_FIELDS
from leveret.http.rates import DEPTH_FIELDS, HISTORY, NODE_FIELDS, WATCHED


def bytes_per_object(point: Callable[[int], dict[str, float]]) -> float:
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = []
    for _ in range(WATCHED):
        hist: deque[tuple[float, dict[str, float]]] = deque(maxlen=HISTORY)
        for i in range(HISTORY):
            hist.append((time.time() + i, point(i)))
        kept.append(hist)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / len(kept)


def queue_point(i: int) -> dict[str, float]:
    return {**{f: float(i + 1000) for f in DEPTH_FIELDS}, **{f + "_rate": i + 0.5 for f in QUEUE_FIELDS}}


def connection_point(i: int) -> dict[str, float]:
    return {"recv_oct_rate": i + 0.5, "send_oct_rate": i + 0.7, "channels": 1,
            **{f + "_rate": round(i + 0.1, 1) for f in NODE_FIELDS}}


def main() -> None:
    for kind, point in (("queue", queue_point), ("connection", connection_point)):
        each = bytes_per_object(point)
        print(f"{kind}: {each / 1024:.0f} KiB per watched {kind} ({HISTORY} samples, {each / HISTORY:.0f} B each); "
              f"{WATCHED} of them: {each * WATCHED / 2**20:.1f} MiB; 10,000: {each * 10_000 / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
