"""coordination.placement: the one rule for declare (balanced), failover and drain."""

from __future__ import annotations

from coordination.placement import Candidate, place, queue_region

A1, A2 = Candidate("a1", "A"), Candidate("a2", "A")
B1, B2 = Candidate("b1", "B"), Candidate("b2", "B")


def _id(c: Candidate | None) -> str | None:
    return c.id if c is not None else None


def test_declare_prefers_least_loaded_node_of_its_region() -> None:
    nodes = [A1, A2, B1, B2]
    # b1 is far more loaded than either A node: region still wins, then load.
    assert _id(place(nodes, {"a1": 0, "a2": 0, "b1": 9, "b2": 3}, "B")) == "b2"
    assert _id(place(nodes, {"a1": 5, "a2": 1, "b1": 0, "b2": 0}, "A")) == "a2"


def test_ties_break_by_node_id_so_every_node_agrees() -> None:
    assert _id(place([B2, B1, A1], {}, "B")) == "b1"
    assert _id(place(list(reversed([B2, B1, A1])), {}, "B")) == "b1"


def test_region_without_a_live_node_falls_back_to_least_loaded_of_any() -> None:
    dead_b = Candidate("b1", "B", live=False)
    draining_b = Candidate("b2", "B", draining=True)
    assert _id(place([A1, A2, dead_b, draining_b], {"a1": 2, "a2": 1}, "B")) == "a2"
    assert _id(place([A1, A2], {"a1": 0, "a2": 1}, "C")) == "a1"


def test_failover_excludes_the_dead_owner_and_stays_in_region() -> None:
    # The owner b1 is excluded (drain) or not live (its lease went): b2, not the idle A nodes.
    assert _id(place([A1, A2, B1, B2], {"b2": 7}, "B", exclude="b1")) == "b2"
    assert _id(place([A1, A2, Candidate("b1", "B", live=False), B2], {"b2": 7}, "B")) == "b2"


def test_no_preference_is_plain_least_loaded() -> None:
    nodes = [A1, A2, B1]
    assert _id(place(nodes, {"a1": 3, "a2": 2, "b1": 1}, None)) == "b1"


def test_nodes_without_region_form_the_empty_region() -> None:
    plain1, plain2 = Candidate("n1"), Candidate("n2")
    # A cluster with no regions places as before: least loaded, ties by id.
    assert _id(place([plain2, plain1], {"n1": 4, "n2": 4}, "")) == "n1"
    # A queue of the "" region prefers "" nodes over an emptier node of region A.
    assert _id(place([plain1, A1], {"n1": 5, "a1": 0}, "")) == "n1"


def test_nobody_to_place_on() -> None:
    assert place([], {}, "A") is None
    assert place([Candidate("a1", "A", live=False)], {}, "A") is None
    assert place([A1], {}, "A", exclude="a1") is None


def test_queue_region_reads_metadata() -> None:
    assert queue_region({"region": "B"}) == "B"
    assert queue_region({"region": ""}) == ""
    assert queue_region({"durable": True}) is None  # recorded before regions were kept
    assert queue_region(None) is None
    assert queue_region({"region": 3}) is None


# -- leveret.client's nearest-node ranking (the client side of the same note) -------------------
def test_client_ranks_own_region_then_round_trip_then_silent() -> None:
    import math

    from leveret.client import NodeChoice, rank

    a1 = NodeChoice("a1:1", "n1", "A", 0.001)
    a2 = NodeChoice("a2:1", "n2", "A", 0.0005)
    b1 = NodeChoice("b1:1", "n3", "B", 0.080)
    b2 = NodeChoice("b2:1", "n4", "B", 0.085)
    dead = NodeChoice("x:1", rtt=math.inf)
    older = NodeChoice("o:1", rtt=0.0001)  # answered without the Nodes call: region unknown
    assert [c.address for c in rank([dead, a1, b2, a2, b1], "B")] == ["b1:1", "b2:1", "a2:1", "a1:1", "x:1"]
    # No region, or one no node is in: round trip alone.
    assert [c.address for c in rank([dead, a1, b2, a2, b1], None)] == ["a2:1", "a1:1", "b1:1", "b2:1", "x:1"]
    assert [c.address for c in rank([b1, older, a1], "C")] == ["o:1", "a1:1", "b1:1"]
    assert [c.address for c in rank([b1, older, a1], "B")] == ["b1:1", "o:1", "a1:1"]
