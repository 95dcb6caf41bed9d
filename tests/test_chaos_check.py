"""The chaos suite's checker (bench/chaos_check.py) finds each kind of violation, and only those."""

from __future__ import annotations

from bench.chaos_check import Interval, check, log_time, serving_intervals, worst_gap
from bench.chaos_load import Delivery, Record

ALL = [Interval("n1", "q", 0, 100)]  # n1 served the queue the whole time


def _d(at: float, seq: int, redelivered: bool = False, consumer: str = "c-n1#1", queue: str = "q",
       message_id: str | None = None) -> Delivery:
    return Delivery(at, consumer, "n1", queue, "p-n1", seq, message_id or f"p-n1-{seq}", redelivered)


def _record(confirmed: list[int], deliveries: list[Delivery]) -> Record:
    rec = Record()
    rec.confirmed = {("p-n1", s): ("q", 0.0) for s in confirmed}
    rec.deliveries = deliveries
    return rec


def test_a_clean_run_has_no_violation() -> None:
    rec = _record([1, 2, 3], [_d(1, 1), _d(2, 2), _d(3, 3), _d(4, 2, redelivered=True)])
    res = check(rec, ALL, [], [], grace=2)
    assert res.total == 0, res.violations
    assert res.figures["duplicates"] == 1 and res.figures["redelivered"] == 1


def test_a_confirmed_message_never_delivered_is_lost() -> None:
    res = check(_record([1, 2], [_d(1, 1)]), ALL, [], [], grace=2)
    assert list(res.violations) == ["lost"] and "seq 2" in res.violations["lost"][0]


def test_an_unconfirmed_message_may_be_missing() -> None:
    assert check(_record([1], [_d(1, 1)]), ALL, [], [], grace=2).total == 0


def test_a_second_delivery_without_redelivered_is_a_duplicate() -> None:
    res = check(_record([1], [_d(1, 1), _d(2, 1, consumer="c-n2#1")]), ALL, [], [], grace=2)
    assert list(res.violations) == ["duplicate"]


def test_a_changed_message_id_is_reported() -> None:
    res = check(_record([1], [_d(1, 1, message_id="other")]), ALL, [], [], grace=2)
    assert list(res.violations) == ["message id"]


def test_first_deliveries_out_of_publish_order_on_one_consumer() -> None:
    res = check(_record([1, 2], [_d(1, 2), _d(2, 1)]), ALL, [], [], grace=2)
    assert list(res.violations) == ["order"]
    # the same order across two consumers is not a violation (each sees its own share in order)
    assert check(_record([1, 2], [_d(1, 2), _d(2, 1, consumer="c-n2#1")]), ALL, [], [], grace=2).total == 0


def test_two_nodes_serving_a_queue_beyond_the_grace_and_their_pauses() -> None:
    ivs = [Interval("n1", "q", 0, 10), Interval("n2", "q", 5, 20)]
    res = check(_record([], []), ivs, [], [], grace=2)
    assert list(res.violations) == ["two owners"]
    # n1 was SIGSTOPped from 4 to 9.5: it could deliver nothing then, the overlap left is 0.5 s
    assert check(_record([], []), ivs, [("n1", 4, 9.5)], [], grace=2).total == 0


def test_a_delivery_while_no_node_served_the_queue() -> None:
    ivs = [Interval("n1", "q", 0, 10), Interval("n2", "q", 20, 30)]
    rec = _record([1, 2, 3], [_d(5, 1), _d(10.5, 2), _d(15, 3)])
    res = check(rec, ivs, [], [], grace=2, slack=1)
    assert list(res.violations) == ["unowned delivery"] and "seq 3" in res.violations["unowned delivery"][0]


def test_crashes_are_violations() -> None:
    assert list(check(_record([], []), [], [], ["n2 exited with 1"], grace=2).violations) == ["crash"]


def test_serving_intervals_from_log_lines_and_kills() -> None:
    t0 = log_time("2026-11-24T04:00:00.000Z")
    recs = {
        "n1": [
            {"ts": "2026-11-24T04:00:01.000Z", "msg": "serving queue", "queue": "q"},
            {"ts": "2026-11-24T04:00:01.500Z", "msg": "serving queue", "queue": "other"},
            # killed at t0+5; the next start serves q again
            {"ts": "2026-11-24T04:00:08.000Z", "msg": "serving queue", "queue": "q"},
            {"ts": "2026-11-24T04:00:09.000Z", "msg": "stopped serving queue", "queue": "q"},
        ],
        "n2": [
            {"ts": "2026-11-24T04:00:06.000Z", "msg": "serving queue", "queue": "q"},
            {"ts": "2026-11-24T04:00:07.000Z", "msg": "stopping serving owned queues: lease deadline passed"},
        ],
    }
    ivs = serving_intervals(recs, {"n1": [t0 + 5]}, {"q"}, t0 + 100)
    spans = sorted((i.node, i.start - t0, i.end - t0) for i in ivs)
    assert spans == [("n1", 1, 5), ("n1", 8, 9), ("n2", 6, 7)]


def test_worst_gap() -> None:
    rec = _record([], [_d(1, 1), _d(2, 2), _d(6, 3)])
    gap, queue, start = worst_gap(rec, ["q"], 0.5, 7)
    assert (gap, queue, start) == (4, "q", 2)
