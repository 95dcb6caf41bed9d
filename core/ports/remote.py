"""What the engine, the front ends and the coordinator ask of a queue another node owns.

A remote queue is still an engine ``Queue``: routing, bindings, consumers and
their credit are the same code on every node. Its ``remote`` attribute, of
the type ``RemoteQueue``, is the only branch on the hot path: publishes are
forwarded to the owner and consumers are served through a proxied
subscription. The engine and the front ends see only this Protocol, never the
transport behind it (core/cluster/remote.py ``QueueRemote`` implements it).

The Protocol is generic in the engine's channel types so that this layer,
below the engine, names none of them: the engine instantiates it as
``RemoteQueue[QueueChannel, LogChannel]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from core.model.message import Message

# The owner's answer for a forwarded publish: True when it accepted (and committed) the message.
Forwarded = Callable[[bool], None]
# Publishes waiting for an owner, with the callbacks that wait for their answers.
Held = list[tuple["Message", list[Forwarded]]]

ChannelT = TypeVar("ChannelT", contravariant=True)
ReaderT = TypeVar("ReaderT", covariant=True)


@dataclass
class StreamFigures:
    """A stream's figures as its owner has them."""

    first_offset: int
    next_offset: int
    messages: int
    bytes: int
    committed: dict[str, int] = field(default_factory=dict)


class OwnerLink(Protocol):
    """The transport's connection to the owner, as far as a coordinator needs to test it."""

    @property
    def closed(self) -> bool: ...


class RemoteQueue(Protocol[ChannelT, ReaderT]):
    # -- the engine and the front ends ----------------------------------------------------
    @property
    def owner(self) -> str | None:
        """The owner's node id (None: between owners)."""
        ...

    def forward(self, message: Message) -> None:
        """Send a publish to the owner (held while the owner is unknown or loading)."""
        ...

    def when_forwarded(self, done: Forwarded) -> None:
        """``done`` gets the owner's answer for the message forwarded last."""
        ...

    def consumers_changed(self, qch: ChannelT) -> None:
        """A local consumer came or went: adjust the proxied subscription."""
        ...

    def reachable(self) -> bool:
        """The owner is known and reachable now (not being taken over here, not between owners)."""
        ...

    def open_stream_reader(self, name: str, arguments: dict[str, object]) -> ReaderT:
        """A reader of this stream that runs on the owner (one per consumer)."""
        ...

    async def stream_figures(self) -> StreamFigures:
        """The owner's figures of this stream (raises ``NotOwner`` when it does not answer)."""
        ...

    async def commit_offset(self, group: str, offset: int) -> None:
        """Set a consumer group's committed offset on the owner; returns once its store has it."""
        ...

    # -- the coordinator, which makes the ownership moves ----------------------------------
    @property
    def link(self) -> OwnerLink | None:
        """The connection to the owner (None: no owner known)."""
        ...

    def set_owner(self, owner: str | None) -> None:
        """The owner changed (None: being taken over): move the proxy to it."""
        ...

    def adopt(self, held: Held) -> None:
        """Publishes an earlier stand-in held: send them on (or hold them here)."""
        ...

    def detach(self) -> Held:
        """This node takes the queue over: stop proxying, hand back what waits for an owner."""
        ...
