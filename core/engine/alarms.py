"""Resource alarms (memory, disk free space): what blocks publishers, as RabbitMQ's alarms.

The node's monitors (leveret/node/resources.py) raise and clear them; every way in
respects them: AMQP connections stop reading from publishers
(``connection.blocked``), gRPC ``Push``/``PushBatch`` and batches forwarded
by other nodes wait here until every alarm is clear.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

MEMORY = "memory"
DISK = "disk"


class Alarms:
    """Which alarms are raised, and a wait for all of them to clear."""

    def __init__(self) -> None:
        self.raised: set[str] = set()
        self._clear: asyncio.Event | None = None  # made on first wait, inside the running loop
        self.listeners: list[Callable[[bool], None]] = []  # told "publishers blocked?" on every change

    @property
    def blocking(self) -> bool:
        return bool(self.raised)

    def set(self, kind: str, active: bool) -> bool:
        """Raise or clear ``kind``; True when whether publishers are blocked changed."""
        before = bool(self.raised)
        if active:
            self.raised.add(kind)
        else:
            self.raised.discard(kind)
        after = bool(self.raised)
        if after != before:
            if not after and self._clear is not None:
                self._clear.set()
            elif after and self._clear is not None:
                self._clear.clear()
            for listener in list(self.listeners):
                listener(after)
            return True
        return False

    async def wait_clear(self) -> None:
        """Return once no alarm is raised (at once when none is: one set check)."""
        if not self.raised:
            return
        if self._clear is None:
            self._clear = asyncio.Event()
        while self.raised:
            self._clear.clear()
            await self._clear.wait()
