"""Message rates from samples of the engine's counters (core/engine/stats.py).

Every ``INTERVAL`` seconds the sampler copies each queue's and exchange's
counters; a rate is the difference between the last two samples over their
time apart, so it lags by at most one interval, as RabbitMQ's default
``rates_mode = basic`` does (5 s there too). A sample of 10,000 queues is one
tuple each: the engine itself keeps only the counters.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from core.engine.broker import Broker
from core.engine.stats import QUEUE_FIELDS, exchange_counters, queue_counters
from core.model.tasks import stop_task

INTERVAL = 5.0
EXCHANGE_FIELDS = ("publish_in",)

Key = tuple[str, ...]


class RateSampler:
    def __init__(self, broker: Broker, interval: float = INTERVAL) -> None:
        self.broker = broker
        self.interval = interval
        self._prev: tuple[float, dict[Key, tuple[int, ...]]] = (time.monotonic(), {})
        self._last: tuple[float, dict[Key, tuple[int, ...]]] = self._prev
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.sample()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        await stop_task(self._task)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.sample()

    def sample(self) -> None:
        snap: dict[Key, tuple[int, ...]] = {}
        for vh in self.broker.vhosts.values():
            for q in vh.queues.values():
                snap[("q", vh.name, q.name)] = queue_counters(q)
            for x in vh.exchanges.values():
                snap[("x", vh.name, x.name)] = exchange_counters(x)
        self._prev, self._last = self._last, (time.monotonic(), snap)

    def rates(self, key: Key, width: int) -> tuple[float, ...]:
        t0, before = self._prev
        t1, after = self._last
        dt = t1 - t0
        new, old = after.get(key), before.get(key)
        if new is None or old is None or dt <= 0:
            return (0.0,) * width
        return tuple(round((a - b) / dt, 1) for a, b in zip(new, old, strict=True))

    def queue_stats(self, vhost: str, name: str, counters: tuple[int, ...]) -> dict[str, Any]:
        return stats_json(QUEUE_FIELDS, counters, self.rates(("q", vhost, name), len(QUEUE_FIELDS)))

    def exchange_stats(self, vhost: str, name: str, counters: tuple[int, ...]) -> dict[str, Any]:
        return stats_json(EXCHANGE_FIELDS, counters, self.rates(("x", vhost, name), 1))


def stats_json(fields: tuple[str, ...], counters: tuple[int, ...], rates: tuple[float, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field, count, rate in zip(fields, counters, rates, strict=True):
        out[field] = count
        out[field + "_details"] = {"rate": rate}
    return out


def add_stats(total: list[float], part: tuple[float, ...]) -> None:
    for i, v in enumerate(part):
        total[i] += v
