"""Message rates from samples of the engine's counters (core/engine/stats.py, core/engine/node_stats.py).

Every ``INTERVAL`` seconds the sampler copies each queue's and exchange's
counters, the queues' depths, the node's counters and each AMQP connection's
and channel's; a rate is the difference between the last two samples over
their time apart, so it lags by at most one interval, as RabbitMQ's default
``rates_mode = basic`` does (5 s there too). A sample of 10,000 queues is a
few tuples each: the engine itself keeps only the counters.

The node-wide part of each sample is also kept for ``HISTORY`` samples (10
minutes, as RabbitMQ's ``basic`` retention keeps 600 s), so the console can
chart the last minutes after a reload (/api/leveret/samples).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from core.engine.broker import Broker
from core.engine.node_stats import NodeStats
from core.engine.stats import QUEUE_FIELDS, exchange_counters, queue_counters
from core.model.tasks import stop_task

if TYPE_CHECKING:
    from amqp_frontend.server import AMQPServer

INTERVAL = 5.0
HISTORY = 120
# Queues and connections whose own history is kept, from when the console (or anyone) first asks for it:
# keeping every one of 10,000 queues' last 10 minutes would hold over a million samples.
WATCHED = 64
EXCHANGE_FIELDS = ("publish_in",)
# RabbitMQ's overview (and channel) message_stats, from NodeStats in this order.
NODE_FIELDS = ("publish", "confirm", "return_unroutable", "drop_unroutable", "deliver_get", "get", "get_no_ack",
               "deliver", "deliver_no_ack", "redeliver", "ack", "get_empty")
CHURN_FIELDS = ("connection_created", "connection_closed", "channel_created", "channel_closed",
                "queue_declared", "queue_created", "queue_deleted")
DEPTH_FIELDS = ("messages", "messages_ready", "messages_unacknowledged")
OCTET_FIELDS = ("recv_oct", "send_oct")

Key = tuple[Any, ...]


def node_counters(s: NodeStats) -> tuple[int, ...]:
    return (s.received, s.confirmed, s.unroutable_returned, s.unroutable_dropped, s.delivered,
            s.delivered_get_manual_ack, s.delivered_get_auto_ack, s.delivered_consume_manual_ack,
            s.delivered_consume_auto_ack, s.redelivered, s.acknowledged, s.get_empty)


def churn_counters(s: NodeStats) -> tuple[int, ...]:
    return (s.connections_opened, s.connections_closed, s.channels_opened, s.channels_closed,
            s.queues_declared, s.queues_created, s.queues_deleted)


def depth(q: Any) -> tuple[int, int, int]:
    ch = q.default
    ready = len(ch.ready)
    return ready + ch.unacked, ready, ch.unacked


class RateSampler:
    def __init__(self, broker: Broker, interval: float = INTERVAL, amqp: AMQPServer | None = None) -> None:
        self.broker = broker
        self.interval = interval
        self.amqp = amqp  # its connections' and channels' counters are sampled too
        self._prev: tuple[float, dict[Key, tuple[int, ...]]] = (time.monotonic(), {})
        self._last: tuple[float, dict[Key, tuple[int, ...]]] = self._prev
        self._task: asyncio.Task[None] | None = None
        # (unix time, {field: value}) of the node's totals, oldest first: the console's charts.
        self.history: deque[tuple[float, dict[str, float]]] = deque(maxlen=HISTORY)
        # The node's gauges each sample adds to the history (memory against the alarm, disk, fds, sockets).
        self.gauges: Callable[[], dict[str, float]] | None = None
        # ("queue", vhost, name) or ("connection", name) -> its samples, least recently asked for first.
        self.watched: OrderedDict[Key, deque[tuple[float, dict[str, float]]]] = OrderedDict()

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
        totals = [0, 0, 0]
        for vh in self.broker.vhosts.values():
            for q in vh.queues.values():
                snap[("q", vh.name, q.name)] = queue_counters(q)
                d = snap[("d", vh.name, q.name)] = depth(q)
                totals[0] += d[0]
                totals[1] += d[1]
                totals[2] += d[2]
            for x in vh.exchanges.values():
                snap[("x", vh.name, x.name)] = exchange_counters(x)
            snap[("x", vh.name, "")] = (vh.default_published_in,)
        stats = self.broker.stats
        snap[("n",)] = node_counters(stats)
        snap[("churn",)] = churn_counters(stats)
        snap[("totals",)] = tuple(totals)
        if self.amqp is not None:
            for proto in self.amqp.connections:
                snap[("c", id(proto))] = (proto.recv_oct, proto.send_oct)
                conn = proto.conn
                if conn is not None:
                    for ch in conn.channels.values():
                        snap[("ch", id(ch))] = node_counters(ch.own)
        self._prev, self._last = self._last, (time.monotonic(), snap)
        self._remember()

    def _remember(self) -> None:
        point: dict[str, float] = dict(zip(DEPTH_FIELDS, self._last[1][("totals",)], strict=True))
        for field, rate in zip(NODE_FIELDS, self.rates(("n",), len(NODE_FIELDS)), strict=True):
            point[field + "_rate"] = rate
        if self.gauges is not None:
            point.update(self.gauges())
        now = time.time()
        self.history.append((now, point))
        if self.watched:
            octets = {}
            if self.amqp is not None and any(k[0] == "connection" for k in self.watched):
                from leveret.http.views import connection_name

                octets = {connection_name(p): p for p in self.amqp.connections if p.conn is not None}
            for key, hist in self.watched.items():
                one = self._point(key, octets)
                if one is not None:
                    hist.append((now, one))

    def _point(self, key: Key, connections: dict[str, Any]) -> dict[str, float] | None:
        last = self._last[1]
        if key[0] == "queue":
            d = last.get(("d", key[1], key[2]))
            if d is None:
                return None  # not (or no longer) here
            point: dict[str, float] = dict(zip(DEPTH_FIELDS, d, strict=True))
            rates = self.rates(("q", key[1], key[2]), len(QUEUE_FIELDS))
            point.update({f + "_rate": r for f, r in zip(QUEUE_FIELDS, rates, strict=True)})
            return point
        proto = connections.get(key[1])
        if proto is None:
            return None
        rates = self.rates(("c", id(proto)), 2)
        point = {"recv_oct_rate": rates[0], "send_oct_rate": rates[1], "channels": len(proto.conn.channels)}
        # Its channels' message rates summed (RabbitMQ's connection page charts them the same way); a
        # channel closed since the last sample no longer counts.
        total = [0.0] * len(NODE_FIELDS)
        for ch in proto.conn.channels.values():
            add_stats(total, self.rates(("ch", id(ch)), len(NODE_FIELDS)))
        point.update({f + "_rate": round(r, 1) for f, r in zip(NODE_FIELDS, total, strict=True)})
        return point

    def watch(self, key: Key) -> list[tuple[float, dict[str, float]]]:
        """This object's samples so far; from now on each sample keeps one more (for WATCHED objects)."""
        hist = self.watched.get(key)
        if hist is None:
            hist = self.watched[key] = deque(maxlen=HISTORY)
            while len(self.watched) > WATCHED:
                self.watched.popitem(last=False)
        self.watched.move_to_end(key)
        return list(hist)

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

    def depth_details(self, vhost: str, name: str) -> dict[str, Any]:
        """messages_details, messages_ready_details, messages_unacknowledged_details of one queue."""
        rates = self.rates(("d", vhost, name), len(DEPTH_FIELDS))
        return {f + "_details": {"rate": r} for f, r in zip(DEPTH_FIELDS, rates, strict=True)}

    def node_stats(self, stats: NodeStats) -> dict[str, Any]:
        return stats_json(NODE_FIELDS, node_counters(stats), self.rates(("n",), len(NODE_FIELDS)))

    def churn_rates(self, stats: NodeStats) -> dict[str, Any]:
        return stats_json(CHURN_FIELDS, churn_counters(stats), self.rates(("churn",), len(CHURN_FIELDS)))

    def totals_details(self) -> dict[str, Any]:
        rates = self.rates(("totals",), len(DEPTH_FIELDS))
        return {f + "_details": {"rate": r} for f, r in zip(DEPTH_FIELDS, rates, strict=True)}

    def connection_octets(self, proto: Any) -> dict[str, Any]:
        rates = self.rates(("c", id(proto)), 2)
        return stats_json(OCTET_FIELDS, (proto.recv_oct, proto.send_oct), rates)

    def channel_stats(self, ch: Any) -> dict[str, Any]:
        return stats_json(NODE_FIELDS, node_counters(ch.own), self.rates(("ch", id(ch)), len(NODE_FIELDS)))


def stats_json(fields: tuple[str, ...], counters: tuple[int, ...], rates: tuple[float, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field, count, rate in zip(fields, counters, rates, strict=True):
        out[field] = count
        out[field + "_details"] = {"rate": rate}
    return out


def add_stats(total: list[float], part: tuple[float, ...]) -> None:
    for i, v in enumerate(part):
        total[i] += v
