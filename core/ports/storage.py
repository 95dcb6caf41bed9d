"""What the engine asks of the durable layer: a queue's writes and the group commit's answer.

The engine writes a durable queue's changes through its ``Queue.storage`` and
learns when they are committed from the group committer; both are implemented
in core/durable/ (``durability.QueueStorage``, ``group_commit.GroupCommitter``),
which the engine, below it, does not import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from core.model.message import QueuedMessage
    from core.ports.store import MessageStore

# Called once what was added before it is committed: None, or why it was not.
Done = Callable[[BaseException | None], None]


class Committer(Protocol):
    """The group committer as the engine sees it (core/durable/group_commit.py)."""

    @property
    def store(self) -> MessageStore: ...

    def when_committed(self, done: Done) -> None:
        """Call ``done`` once everything added so far is committed (or failed)."""
        ...

    async def committed(self) -> BaseException | None:
        """Wait until everything added so far is committed; the error if that failed."""
        ...


class QueueStorage(Protocol):
    """One durable queue's writes (core/durable/durability.py); its epoch fences every one."""

    @property
    def vhost(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def epoch(self) -> int: ...

    @property
    def committer(self) -> Committer: ...

    def append(self, qm: QueuedMessage) -> None: ...

    def remove(self, qm: QueuedMessage) -> None: ...

    def remove_offset(self, offset: int) -> None:
        """Remove a message known by its offset only (one paged out to disk)."""
        ...

    def delivery_count(self, qm: QueuedMessage) -> None: ...

    def truncate(self, first_kept: int) -> None:
        """Stream retention: every message below ``first_kept`` goes."""
        ...

    def commit_offset(self, group: str, offset: int) -> None:
        """A consumer group's committed offset."""
        ...
