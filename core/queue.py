"""Core queues, their channels and consumers: delivery, credit, acks, requeue.

A queue is an ordered sequence of messages; every message gets the next
offset. Messages are read through a queue's channels: each channel sees every
message (that passes its filter) and has its own ready list, consumers and
unacknowledged set. AMQP uses one default channel per queue that all of the
queue's AMQP consumers share.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from core.errors import AccessRefused
from core.message import Message, QueuedMessage


class ConsumerSink(Protocol):
    """What receives deliveries: the AMQP channel, or a native subscription."""

    def has_credit(self, consumer: Consumer) -> bool:
        """May ``consumer`` take one more message now (prefetch, back-pressure)?"""
        ...

    def deliver(self, consumer: Consumer, qm: QueuedMessage) -> None: ...

    def consumer_cancelled(self, consumer: Consumer) -> None:
        """The broker ended the consumer (its queue went away)."""
        ...


class Consumer:
    __slots__ = ("tag", "channel", "sink", "no_ack", "exclusive", "arguments", "unacked", "prefetch")

    def __init__(
        self,
        tag: str,
        channel: QueueChannel,
        sink: ConsumerSink,
        no_ack: bool,
        exclusive: bool = False,
        arguments: dict[str, Any] | None = None,
        prefetch: int = 0,
    ) -> None:
        self.tag = tag
        self.channel = channel
        self.sink = sink
        self.no_ack = no_ack
        self.exclusive = exclusive
        self.arguments = arguments or {}
        self.unacked = 0
        self.prefetch = prefetch

    @property
    def queue(self) -> Queue:
        return self.channel.queue


class QueueChannel:
    """A receiver end of a queue: ready messages, competing consumers, unacked."""

    def __init__(self, queue: Queue, name: str, topic_filter: Callable[[str], bool] | None = None) -> None:
        self.queue = queue
        self.name = name
        self.accepts = topic_filter
        self.ready: deque[QueuedMessage] = deque()
        self.consumers: list[Consumer] = []
        self._next = 0  # round-robin position
        self.unacked = 0
        self.ready_bytes = 0
        self._dispatching = False

    # -- arrival ---------------------------------------------------------------
    def push(self, qm: QueuedMessage) -> None:
        self.ready.append(qm)
        self.ready_bytes += len(qm.message.body)
        if self.consumers and not self._dispatching:
            self.dispatch()

    # -- delivery --------------------------------------------------------------
    def _pick(self) -> Consumer | None:
        consumers = self.consumers
        n = len(consumers)
        if n == 1:
            c = consumers[0]
            return c if c.sink.has_credit(c) else None
        start = self._next
        for i in range(n):
            c = consumers[(start + i) % n]
            if c.sink.has_credit(c):
                self._next = (start + i + 1) % n
                return c
        return None

    def dispatch(self) -> None:
        """Hand ready messages to consumers that have credit, round robin."""
        if self._dispatching:
            return
        self._dispatching = True
        try:
            ready = self.ready
            while ready and self.consumers:
                c = self._pick()
                if c is None:
                    break
                qm = ready.popleft()
                self.ready_bytes -= len(qm.message.body)
                qm.delivery_count += 1
                if not c.no_ack:
                    self.unacked += 1
                    c.unacked += 1
                c.sink.deliver(c, qm)
        finally:
            self._dispatching = False

    def get(self, no_ack: bool) -> QueuedMessage | None:
        """basic.get: the next ready message, or None."""
        if not self.ready:
            return None
        qm = self.ready.popleft()
        self.ready_bytes -= len(qm.message.body)
        qm.delivery_count += 1
        if not no_ack:
            self.unacked += 1
        return qm

    # -- settlement ------------------------------------------------------------
    def settle(self, qm: QueuedMessage, consumer: Consumer | None) -> None:
        """An unacked delivery is done with (acked, or rejected without requeue)."""
        self.unacked -= 1
        if consumer is not None:
            consumer.unacked -= 1

    def requeue(self, items: Iterable[tuple[QueuedMessage, Consumer | None]]) -> None:
        """Put unacked deliveries back in their original order, marked redelivered."""
        back: list[QueuedMessage] = []
        for qm, consumer in items:
            self.unacked -= 1
            if consumer is not None:
                consumer.unacked -= 1
            if self.queue.deleted:
                continue
            qm.redelivered = True
            back.append(qm)
            self.ready_bytes += len(qm.message.body)
        if not back:
            return
        back.sort(key=_offset)
        ready = self.ready
        if not ready or back[-1].offset < ready[0].offset:
            ready.extendleft(reversed(back))
        else:
            merged = list(heapq.merge(back, ready, key=_offset))
            ready.clear()
            ready.extend(merged)
        self.dispatch()

    # -- consumers -------------------------------------------------------------
    def add_consumer(self, consumer: Consumer, dispatch: bool = True) -> None:
        if any(c.exclusive for c in self.consumers):
            raise AccessRefused(
                f"queue '{self.queue.name}' in vhost '{self.queue.vhost}' in exclusive use"
            )
        if consumer.exclusive and self.consumers:
            raise AccessRefused(
                f"queue '{self.queue.name}' in vhost '{self.queue.vhost}' in exclusive use"
            )
        self.consumers.append(consumer)
        self.queue.had_consumers = True
        if dispatch:
            self.dispatch()

    def remove_consumer(self, consumer: Consumer) -> None:
        try:
            self.consumers.remove(consumer)
        except ValueError:
            return
        if self._next >= len(self.consumers):
            self._next = 0
        self.queue.consumer_removed()

    def purge(self) -> int:
        n = len(self.ready)
        self.ready.clear()
        self.ready_bytes = 0
        return n


def _offset(qm: QueuedMessage) -> int:
    return qm.offset


class Queue:
    """A named queue in a vhost: offsets, its channels and its lifecycle flags."""

    def __init__(
        self,
        name: str,
        vhost: str,
        durable: bool = False,
        exclusive_owner: object | None = None,
        auto_delete: bool = False,
        arguments: dict[str, Any] | None = None,
        on_unused: Callable[[Queue], None] | None = None,
    ) -> None:
        self.name = name
        self.vhost = vhost
        self.durable = durable
        self.exclusive_owner = exclusive_owner
        self.auto_delete = auto_delete
        self.arguments = dict(arguments or {})
        self.next_offset = 0
        self.default = QueueChannel(self, "")
        self.channels: list[QueueChannel] = [self.default]
        self.had_consumers = False
        self.deleted = False
        self._on_unused = on_unused

    @property
    def exclusive(self) -> bool:
        return self.exclusive_owner is not None

    def enqueue(self, message: Message) -> None:
        offset = self.next_offset
        self.next_offset = offset + 1
        channels = self.channels
        if len(channels) == 1:
            channels[0].push(QueuedMessage(message, offset))
            return
        for ch in channels:
            if ch.accepts is None or ch.accepts(message.routing_key):
                ch.push(QueuedMessage(message, offset))

    @property
    def message_count(self) -> int:
        return len(self.default.ready)

    @property
    def consumer_count(self) -> int:
        return len(self.default.consumers)

    def consumer_removed(self) -> None:
        if self.auto_delete and self.had_consumers and not any(ch.consumers for ch in self.channels):
            if self._on_unused is not None:
                self._on_unused(self)

    def purge(self) -> int:
        return sum(ch.purge() for ch in self.channels) if len(self.channels) > 1 else self.default.purge()

    def delete(self) -> int:
        """Mark deleted, cancel every consumer; return the ready count dropped."""
        self.deleted = True
        count = self.message_count
        for ch in self.channels:
            consumers = list(ch.consumers)
            ch.consumers.clear()
            ch.purge()
            for c in consumers:
                c.sink.consumer_cancelled(c)
        return count
