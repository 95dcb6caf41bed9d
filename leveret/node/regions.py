"""Nodes grouped by region, as `leveret cluster status` and the management API's overview show them."""

from __future__ import annotations

from typing import Any


def regions_of(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per region (\"\" for nodes without one), by name: its nodes, how many take queues, the queues they own.

    ``nodes``: dicts with ``id``, ``region``, ``queues`` (owned) and ``draining``, as ``snapshot`` lists them.
    """
    out: dict[str, dict[str, Any]] = {}
    for n in nodes:
        r = out.setdefault(n["region"], {"region": n["region"], "nodes": [], "live": 0, "queues": 0})
        r["nodes"].append(n["id"])
        r["live"] += 0 if n["draining"] else 1
        r["queues"] += n["queues"]
    return [out[k] for k in sorted(out)]
