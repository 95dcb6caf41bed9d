"""Where a queue (or stream) lives: the one placement rule of a cluster (docs/notes/region.md).

Declare (``balanced``, the default locator), failover (an owner's lease went)
and drain (a graceful hand-over) all ask ``place``; only ``client-local``
bypasses it, and that already keeps a queue in its declaring node's region.

The rule, in order:

1. Only candidates: a live node (it holds a lease), not draining, not excluded.
2. Of those, the ones in the queue's region when that region has any: a queue
   declared through a node of region R stays in R while R has a live node, so
   its clients there never pay an inter-region round trip. ``None`` (a queue
   recorded before regions were kept, or a caller with no preference) skips
   this step; nodes without ``--region`` form the ``""`` region, so a cluster
   with no regions at all places exactly as before.
3. The least loaded of those (fewest owned queues), ties by node id, so every
   node computes the same answer from the same mirror and only the chosen
   node tries to acquire (etcd's transaction settles any race anyway).

It is a pure function of what etcd says (no I/O), so every rule is unit-tested
in tests/test_placement.py without a cluster.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """What placement needs of a node: its id, region, whether it may take queues."""

    id: str
    region: str = ""
    live: bool = True  # holds a lease
    draining: bool = False


def place(nodes: Iterable[Candidate], load: Mapping[str, int], region: str | None,
          exclude: str | None = None) -> Candidate | None:
    """The node a queue of ``region`` goes to, or None when no node may take it."""
    candidates = [n for n in nodes if n.live and not n.draining and n.id != exclude]
    if region is not None:
        local = [n for n in candidates if n.region == region]
        if local:
            candidates = local
    if not candidates:
        return None
    return min(candidates, key=lambda n: (load.get(n.id, 0), n.id))


def queue_region(meta: Mapping[str, object] | None) -> str | None:
    """The region a queue's metadata records (``region`` in meta/queues/...); None when it predates regions."""
    if meta is None:
        return None
    value = meta.get("region")
    return value if isinstance(value, str) else None
