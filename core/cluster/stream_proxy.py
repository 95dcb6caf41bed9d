"""A stream consumer on a node that does not own the stream: its reader runs on the owner.

Built on the caller side of the transport (core/cluster/link.py): one subscription per consumer.

A classic queue's proxy (``QueueRemote``) shares one subscription among all
local consumers, because they compete for the same messages. A stream is
read, not consumed: every consumer has its own cursor (or its group's), so
each one gets a subscription of its own on the owner, where a real
``StreamReader`` is opened with the consumer's arguments (``x-stream-offset``,
``x-stream-consumer-group``) and a window of the consumer's prefetch. Acks
return credit on the owner (and advance a group's committed offset there),
exactly as for a consumer connected to the owner.

When the subscription ends (the stream moved to another node, the owner
died, the stream was deleted) the consumer is cancelled with
``basic.cancel``: a client that re-subscribes resumes where its offset
specification or its group's committed offset says, on the new owner.
"""

from __future__ import annotations

from collections import deque

from core.cluster.link import PeerLink
from core.cluster.wire import ProxiedMessage
from core.engine.queue import Consumer
from core.engine.stream import StreamQueue
from core.engine.stream_reader import LogChannel
from core.model.fieldtable import encode_table
from core.model.message import QueuedMessage


class RemoteStreamReader(LogChannel):
    """One consumer of a stream owned by another node, served through ``link``."""

    queue: StreamQueue

    def __init__(self, queue: StreamQueue, link: PeerLink, name: str, arguments: dict[str, object]) -> None:
        super().__init__(queue, name)
        self.link = link
        self.arguments = encode_table(arguments)
        self.sub = 0
        self.group: str | None = None  # groups live on the owner
        self.cursor = -1  # never woken by local appends: the owner delivers
        self.closed = False
        # Deliveries that arrived while the local consumer had no credit (a
        # qos change); normally the owner's window keeps this empty.
        self._waiting: deque[ProxiedMessage] = deque()

    # -- the consumer ------------------------------------------------------------
    def add_consumer(self, consumer: Consumer, dispatch: bool = True) -> None:
        self.consumers.append(consumer)
        self.queue.readers.append(self)
        self.sub = self.link.subscribe(self, max(1, consumer.prefetch), self.arguments)

    def remove_consumer(self, consumer: Consumer) -> None:
        if consumer not in self.consumers:
            return
        self.consumers.remove(consumer)
        self._end()

    def cancel_all(self) -> None:
        """The stream went away here (deleted, or its local copy rebuilt for a new owner)."""
        consumers = list(self.consumers)
        self.consumers.clear()
        self._end()
        for c in consumers:
            c.sink.consumer_cancelled(c)

    def _end(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self in self.queue.readers:
            self.queue.readers.remove(self)
        link, sub = self.link, self.sub
        self.sub = 0
        if sub:
            link.unsubscribe(sub)
        waiting, self._waiting = self._waiting, deque()
        if waiting:
            link.requeue([qm.remote_id for qm in waiting])

    # -- from the owner ------------------------------------------------------------
    def deliveries(self, link: PeerLink, sub: int, messages: list[ProxiedMessage]) -> None:
        if link is not self.link or sub != self.sub or self.closed:
            link.requeue([qm.remote_id for qm in messages])
            return
        self._waiting.extend(messages)
        self.dispatch()

    def subscription_cancelled(self, link: PeerLink, sub: int, reason: str) -> None:
        if link is self.link and sub == self.sub:
            self.sub = 0
            self.cancel_all()

    def session_lost(self, link: PeerLink) -> None:
        if link is self.link:
            self.sub = 0
            self.cancel_all()

    # -- delivery and settlement ------------------------------------------------------
    def dispatch(self) -> None:
        if not self.consumers:
            return
        c = self.consumers[0]
        waiting = self._waiting
        while waiting and c.sink.has_credit(c):
            qm = waiting.popleft()
            self.unacked += 1
            c.unacked += 1
            c.sink.deliver(c, qm)

    def settle(self, qm: QueuedMessage, consumer: Consumer | None) -> None:
        """An ack, and (LogChannel) a reject or requeue: on the owner they all count as done."""
        self.unacked -= 1
        if consumer is not None:
            consumer.unacked -= 1
        self.link.settle(qm)
