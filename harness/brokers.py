"""A broker as a single node builds it: with the in-process coordinator (coordination/local.py).

Core never builds a coordinator itself (it must not import coordination/), so
tests that drive the front ends build their broker here.
"""

from __future__ import annotations

from typing import Any

from coordination.local import LocalCoordinator
from core.engine.broker import Broker


def local_broker(node_id: str = "leveret", **kwargs: Any) -> Broker:
    return Broker(node_id=node_id, coordinator=LocalCoordinator(node_id), **kwargs)
