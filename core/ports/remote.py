"""What the engine asks of a queue another node owns (implemented by core.cluster.forwarding).

A remote queue is still an engine ``Queue``: routing, bindings, consumers and
their credit are the same code on every node. Its ``remote`` attribute, of
this type, is the only branch on the hot path: publishes are forwarded to the
owner and consumers are served through a proxied subscription. The engine and
the front ends see only this Protocol, never the transport behind it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from core.engine.queue import QueueChannel
    from core.engine.stream_reader import LogChannel
    from core.model.message import Message

# The owner's answer for a forwarded publish: True when it accepted (and committed) the message.
Forwarded = Callable[[bool], None]


class RemoteQueue(Protocol):
    owner: str | None

    def forward(self, message: Message) -> None:
        """Send a publish to the owner (held while the owner is unknown or loading)."""
        ...

    def when_forwarded(self, done: Forwarded) -> None:
        """``done`` gets the owner's answer for the message forwarded last."""
        ...

    def consumers_changed(self, qch: QueueChannel) -> None:
        """A local consumer came or went: adjust the proxied subscription."""
        ...

    def reachable(self) -> bool:
        """The owner is known and reachable now (not being taken over here, not between owners)."""
        ...

    def open_stream_reader(self, name: str, arguments: dict[str, object]) -> LogChannel:
        """A reader of this stream that runs on the owner (one per consumer)."""
        ...
