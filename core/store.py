"""The seam where durable storage plugs into the core (implemented in persistence/).

Only persistent messages on durable queues reach a store. Every write names
the queue's epoch, the fencing token of DESIGN.md: a store refuses a write
whose epoch is no longer the queue's, and the caller then stops serving it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from core.message import QueuedMessage


class StoredQueue(Protocol):
    vhost: str
    name: str
    epoch: int


class MessageStore(Protocol):
    async def fence(self, vhost: str, queue: str, epoch: int) -> bool:
        """Claim ``queue`` for ``epoch``; False when a newer epoch holds it."""
        ...

    async def append(self, queue: StoredQueue, messages: Sequence[QueuedMessage]) -> None:
        """Durably add messages (one group commit); raises when fenced out."""
        ...

    async def remove(self, queue: StoredQueue, offsets: Sequence[int]) -> None:
        """Durably drop settled messages (grouped like appends)."""
        ...

    async def load(self, queue: StoredQueue) -> Sequence[QueuedMessage]:
        """The backlog of a queue, in offset order, for a new owner."""
        ...
