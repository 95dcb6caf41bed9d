"""Ready lists: messages waiting for a consumer, in delivery order."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from core.model.message import QueuedMessage


def _offset(qm: QueuedMessage) -> int:
    return qm.offset


def requeue_into(ready: deque[QueuedMessage], back: list[QueuedMessage]) -> None:
    """Merge ``back`` (sorted by offset) into ``ready`` so offsets stay in order."""
    if not ready or back[-1].offset < ready[0].offset:
        ready.extendleft(reversed(back))  # the usual case: all older than what waits
        return
    merged = list(heapq.merge(back, ready, key=_offset))
    ready.clear()
    ready.extend(merged)


def take_offsets(ready: deque[QueuedMessage], offsets: set[int]) -> list[QueuedMessage]:
    """Remove and return the messages of ``ready`` whose offset is in ``offsets`` (order kept)."""
    taken = [qm for qm in ready if qm.offset in offsets]
    if taken:
        kept = [qm for qm in ready if qm.offset not in offsets]
        ready.clear()
        ready.extend(kept)
    return taken


class PriorityReady:
    """``x-max-priority`` queues: highest priority first, FIFO (by offset) within one.

    Offers the subset of deque's interface that QueueChannel uses.
    """

    def __init__(self, max_priority: int) -> None:
        self.max_priority = max_priority
        self.levels: list[deque[QueuedMessage]] = [deque() for _ in range(max_priority + 1)]
        self._len = 0

    def _level(self, qm: QueuedMessage) -> deque[QueuedMessage]:
        return self.levels[min(qm.message.summary.priority, self.max_priority)]

    def append(self, qm: QueuedMessage) -> None:
        self._level(qm).append(qm)
        self._len += 1

    def popleft(self) -> QueuedMessage:
        for level in reversed(self.levels):
            if level:
                self._len -= 1
                return level.popleft()
        raise IndexError("pop from an empty ready list")

    def __getitem__(self, index: int) -> QueuedMessage:
        if index != 0:
            raise IndexError("only the head of a priority ready list is addressable")
        for level in reversed(self.levels):
            if level:
                return level[0]
        raise IndexError("empty ready list")

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[QueuedMessage]:
        for level in reversed(self.levels):
            yield from level

    def clear(self) -> None:
        for level in self.levels:
            level.clear()
        self._len = 0

    def take_offsets(self, offsets: set[int]) -> list[QueuedMessage]:
        taken = []
        for level in self.levels:
            taken.extend(take_offsets(level, offsets))
        self._len -= len(taken)
        return taken

    def requeue(self, back: list[QueuedMessage]) -> None:
        by_level: dict[int, list[QueuedMessage]] = {}
        for qm in back:
            by_level.setdefault(min(qm.message.summary.priority, self.max_priority), []).append(qm)
        for p, items in by_level.items():
            requeue_into(self.levels[p], items)
        self._len += len(back)
