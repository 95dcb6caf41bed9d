"""The message model: content shared by every queue, and a message's place in one queue."""

from __future__ import annotations

import itertools
import time
from typing import Any, Protocol

from core.model import properties

_ids = itertools.count(1)


class Message:
    """A published message; immutable once routed and shared between queues.

    ``props`` is the AMQP basic-properties encoding as the publisher sent it
    (see core.model.properties); ``summary`` holds the few fields the broker acts on.
    """

    __slots__ = (
        "seq",
        "node",
        "exchange",
        "routing_key",
        "props",
        "summary",
        "body",
        "timestamp",
        "_headers",
        "wire_cache",
        "_id",
    )

    def __init__(
        self,
        exchange: str,
        routing_key: str,
        props: bytes,
        body: bytes,
        summary: properties.PropertySummary | None = None,
        node: str = "",
        timestamp: float | None = None,
    ) -> None:
        self.seq = next(_ids)
        self.node = node
        self.exchange = exchange
        self.routing_key = routing_key
        self.props = props
        self.summary = summary if summary is not None else properties.scan(props)
        self.body = body
        # Given when the message was made elsewhere (another node forwarded it).
        self.timestamp = time.time() if timestamp is None else timestamp
        self._headers: dict[str, Any] | None = None
        # Owned by a front end: its encoding of this message, reused when the
        # message goes out more than once (fanout, redelivery).
        self.wire_cache: Any = None
        self._id: str | None = None

    @property
    def id(self) -> str:
        """Unique id; consumers use it to drop duplicates after a failover."""
        if self._id is None:
            self._id = f"{self.node}-{self.timestamp:.0f}-{self.seq}"
        return self._id

    @id.setter
    def id(self, value: str) -> None:
        self._id = value

    @property
    def persistent(self) -> bool:
        return self.summary.delivery_mode == 2

    @property
    def size(self) -> int:
        return len(self.body)

    @property
    def headers(self) -> dict[str, Any]:
        if self._headers is None:
            self._headers = properties.headers_of(self.props, self.summary)
        return self._headers


class SettleHook(Protocol):
    """Where settling a message is reported when the queue's owner is another node.

    A non-owner node holds copies of the owner's deliveries for its local
    consumers (core/cluster/wire.py ``ProxiedMessage``); the owner keeps them
    unacked until the hook (the peer link they came through) reports what
    became of them here.
    """

    def settle(self, qm: QueuedMessage) -> None:
        """Acked (or rejected, after ``reject_next``) here: the owner settles it too."""
        ...

    def reject_next(self, qm: QueuedMessage) -> None:
        """The coming ``settle`` of ``qm`` is a reject without requeue (the owner drops or dead-letters it)."""
        ...

    def keeps(self, qm: QueuedMessage) -> bool:
        """May a requeued ``qm`` wait in the local ready list (its subscription still runs)?"""
        ...

    def give_back(self, qm: QueuedMessage) -> None:
        """Requeued here, but its subscription ended: the owner requeues it."""
        ...


class QueuedMessage:
    """One message in one queue: its offset there, and how often it went out."""

    __slots__ = ("message", "offset", "redelivered", "delivery_count", "expires_at", "persisted")

    # Set on a message a non-owner node received from the queue's owner (core/cluster/wire.py
    # ProxiedMessage): settling it is reported back there. None: this node's own message.
    link: SettleHook | None = None

    def __init__(self, message: Message, offset: int) -> None:
        self.message = message
        self.offset = offset
        self.redelivered = False
        self.delivery_count = 0
        self.expires_at: float | None = None  # wall-clock seconds; None never expires
        self.persisted = False  # in the store: leaving the queue must remove it there

    def copy(self) -> QueuedMessage:
        """The same message at the same offset, for another channel of the queue."""
        other = QueuedMessage(self.message, self.offset)
        other.expires_at = self.expires_at
        return other
