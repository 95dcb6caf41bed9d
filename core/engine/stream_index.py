"""The part of a stream's retained log that is only in the store: offset, size and time of each message.

24 bytes a message in three arrays, oldest first, so retention by size or
age and a reader's start by timestamp work without the bodies in memory.
"""

from __future__ import annotations

import bisect
from array import array

_COMPACT_AT = 65536


class StoredIndex:
    def __init__(self) -> None:
        self.offsets = array("q")
        self.sizes = array("q")
        self.stamps = array("d")
        self.head = 0  # entries before it are no longer retained

    def __len__(self) -> int:
        return len(self.offsets) - self.head

    def add(self, offset: int, size: int, stamp: float) -> None:
        self.offsets.append(offset)
        self.sizes.append(size)
        self.stamps.append(stamp)

    @property
    def first(self) -> int:
        return self.offsets[self.head]

    @property
    def last(self) -> int:
        return self.offsets[-1]

    @property
    def oldest_stamp(self) -> float:
        return self.stamps[self.head]

    @property
    def newest_stamp(self) -> float:
        return self.stamps[-1]

    def pop_oldest(self) -> int:
        """Forget the oldest message; its size."""
        size = self.sizes[self.head]
        self.head += 1
        if self.head >= _COMPACT_AT and self.head * 2 >= len(self.offsets):
            for a in (self.offsets, self.sizes, self.stamps):
                del a[: self.head]
            self.head = 0
        return size

    def at_time(self, stamp: float) -> int | None:
        """Offset of the first message at or after ``stamp``; None when all are older."""
        pos = bisect.bisect_left(self.stamps, stamp, self.head)
        return self.offsets[pos] if pos < len(self.offsets) else None

    def clear(self) -> None:
        self.__init__()  # type: ignore[misc]
