"""The chaos suite's checker: what the clients and the nodes' logs saw, against what a broker promises.

* every confirmed message delivered at least once;
* a message delivered again only with ``redelivered`` set and the same message id;
* per consumer connection, per queue and publisher, first deliveries in publish order
  (redeliveries may come out of order);
* no two nodes serving one queue at once (from the nodes' ``serving queue`` and
  ``stopped serving`` log lines), beyond a grace of the lease (a node learns its
  lease is gone only when it checks) and the time a node was SIGSTOPped (it delivers
  nothing then);
* every delivery made while some node served its queue, give or take ``slack`` (log
  lines are written just after the state changes, forwarded deliveries arrive just after);
* no node exited that the suite did not kill (the suite reports those).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from bench.chaos_load import Record

MAX_LISTED = 20  # violations of one kind listed in full; the rest counted


@dataclass
class Interval:
    node: str
    queue: str
    start: float
    end: float


@dataclass
class Result:
    violations: dict[str, list[str]] = field(default_factory=dict)
    figures: dict[str, float] = field(default_factory=dict)

    def add(self, kind: str, what: str) -> None:
        self.violations.setdefault(kind, []).append(what)

    @property
    def total(self) -> int:
        return sum(len(v) for v in self.violations.values())


def log_time(ts: str) -> float:
    """A node log line's ``ts`` (2026-11-24T04:34:24.123Z) as a Unix time."""
    return datetime.strptime(ts.rstrip("Z") + "+0000", "%Y-%m-%dT%H:%M:%S.%f%z").timestamp()


def serving_intervals(records: Mapping[str, Sequence[Mapping[str, object]]], ends: dict[str, list[float]],
                      queues: set[str], run_end: float) -> list[Interval]:
    """Per node, when it served each queue: from ``serving queue`` to ``stopped serving queue`` /
    ``stopping serving owned queues`` / its process's end (``ends[node]``: each start's end time)."""
    out: list[Interval] = []
    for node, recs in records.items():
        open_: dict[str, float] = {}
        proc_ends = iter(sorted(ends.get(node, [])))
        next_end = next(proc_ends, run_end)
        for r in recs:
            # real_ts: the line's real time where the node's wall clock was faked (bench/chaos_clock.py)
            t = float(r["real_ts"]) if "real_ts" in r else log_time(str(r.get("ts", "")))  # type: ignore[arg-type]
            while t > next_end:  # the process ended (killed) before this line: close what it served
                for q, s in open_.items():
                    out.append(Interval(node, q, s, next_end))
                open_.clear()
                next_end = next(proc_ends, run_end)
            msg, q = r.get("msg") or r.get("message"), str(r.get("queue", ""))
            if msg == "serving queue" and q in queues:
                open_.setdefault(q, t)
            elif msg == "stopped serving queue" and q in open_:
                out.append(Interval(node, q, open_.pop(q), t))
            elif isinstance(msg, str) and msg.startswith("stopping serving owned queues"):
                for q2, s in open_.items():
                    out.append(Interval(node, q2, s, t))
                open_.clear()
        for q, s in open_.items():
            out.append(Interval(node, q, s, min(next_end, run_end)))
    return out


def _paused_within(pauses: list[tuple[str, float, float]], node: str, a: float, b: float) -> float:
    return sum(max(0.0, min(b, e) - max(a, s)) for n, s, e in pauses if n == node)


def check(record: Record, intervals: list[Interval], pauses: list[tuple[str, float, float]],
          crashes: list[str], grace: float, slack: float = 1.0) -> Result:
    res = Result()
    by_msg: dict[tuple[str, int], list] = defaultdict(list)
    for d in record.deliveries:
        by_msg[(d.publisher, d.seq)].append(d)
    # 1. every confirmed message delivered
    for key, (queue, t) in sorted(record.confirmed.items()):
        if key not in by_msg:
            res.add("lost", f"{key[0]} seq {key[1]} on {queue} (confirmed at {t:.3f}) never delivered")
    # 2. duplicates only as redeliveries with the same id
    dups = 0
    for key, ds in by_msg.items():
        ds.sort(key=lambda d: d.at)
        want_id = f"{key[0]}-{key[1]}"
        for i, d in enumerate(ds):
            if d.message_id != want_id:
                res.add("message id", f"{want_id} delivered with message id {d.message_id!r}")
            if i and not d.redelivered:
                res.add("duplicate", f"{want_id} on {d.queue} delivered again by {d.consumer} at {d.at:.3f} "
                        f"without redelivered (first by {ds[0].consumer} at {ds[0].at:.3f})")
        dups += len(ds) - 1
    # 3. per consumer connection, queue and publisher: first deliveries in publish order
    last: dict[tuple[str, str, str], int] = {}
    for d in record.deliveries:  # in arrival order
        if d.redelivered:
            continue
        k = (d.consumer, d.queue, d.publisher)
        if k in last and d.seq <= last[k]:
            res.add("order", f"{d.consumer} got {d.publisher} seq {d.seq} on {d.queue} after seq {last[k]}")
        last[k] = max(d.seq, last.get(k, 0))
    # 4. one server per queue at a time
    by_queue: dict[str, list[Interval]] = defaultdict(list)
    for iv in intervals:
        by_queue[iv.queue].append(iv)
    for q, ivs in by_queue.items():
        ivs.sort(key=lambda i: i.start)
        for i, a in enumerate(ivs):
            for b in ivs[i + 1 :]:
                if b.node == a.node or b.start >= a.end:
                    continue
                lo, hi = b.start, min(a.end, b.end)
                overlap = hi - lo - _paused_within(pauses, a.node, lo, hi) - _paused_within(pauses, b.node, lo, hi)
                if overlap > grace:
                    res.add("two owners", f"{q}: {a.node} and {b.node} both served it for {overlap:.1f}s "
                            f"(beyond pauses) from {lo:.3f}")
    # 5. every delivery while some node served its queue (else it came from a node that did not own it)
    for d in record.deliveries:
        if not any(iv.queue == d.queue and iv.start - slack <= d.at <= iv.end + slack for iv in by_queue[d.queue]):
            res.add("unowned delivery", f"{d.publisher} seq {d.seq} on {d.queue} delivered to {d.consumer} at "
                    f"{d.at:.3f} while no node served the queue (per the node logs)")
    # 6. crashes
    for c in crashes:
        res.add("crash", c)
    res.figures.update(
        confirmed=len(record.confirmed), delivered=len(record.deliveries), distinct_delivered=len(by_msg),
        duplicates=dups, redelivered=sum(1 for d in record.deliveries if d.redelivered),
        nacked=record.nacked, unconfirmed=record.failed, published=sum(record.published.values()),
    )
    return res


def worst_gap(record: Record, queues: list[str], since: float, until: float) -> tuple[float, str, float]:
    """The longest time any queue went without a delivery between since and until: (gap, queue, start)."""
    times: dict[str, list[float]] = defaultdict(list)
    for d in record.deliveries:
        if since <= d.at <= until:
            times[d.queue].append(d.at)
    best = (0.0, "", since)
    for q in queues:
        ts = [since, *sorted(times[q]), until]
        for a, b in zip(ts, ts[1:], strict=False):
            if b - a > best[0]:
                best = (b - a, q, a)
    return best
