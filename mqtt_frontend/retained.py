"""Retained messages, kept durably as the persistent messages of one durable queue per vhost.

The queue (``mqtt-retained``) is bound to nothing and has no consumer: the
engine stores, restores and pages it like any durable queue, so a retained
message survives a restart with no store change. This module keeps the index
(topic -> the message and its offset in that queue); replacing or clearing a
topic's retained message drops the old offset from the queue
(``Queue.drop_offsets``, which removes it from the store like an ack).

A retained message is written through the one publish path (``publish_to``),
so a QoS 1 PUBACK for a retained publish still waits for whatever the
routed copy waits for; the retained copy's own commit rides in the same
group commit.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.engine import publish
from core.model import properties
from core.model.message import Message
from core.ports.coordinator import Immediate
from mqtt_frontend import topics

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from core.engine.broker import Broker
    from core.engine.queue import Queue
    from core.engine.vhost import VirtualHost

log = logging.getLogger("leveret.mqtt")

QUEUE = "mqtt-retained"
# A QoS 0 retained message is stored too (as RabbitMQ keeps every retained message): its copy is
# persistent and says its QoS in this header, so a subscriber still gets it at QoS 0.
QOS_HEADER = "x-mqtt-publish-qos"


def qos_of(message: Message) -> int:
    """The QoS a retained message was published with."""
    if message.summary.headers_at >= 0 and message.headers.get(QOS_HEADER) == 0:
        return 0
    return 1 if message.persistent else 0


@dataclass
class RetainedMessage:
    topic: str
    message: Message
    offset: int
    expires_at: float | None  # wall clock (v5 message expiry), None never


class Retained:
    """The retained messages of one vhost."""

    def __init__(self, broker: Broker, vhost: VirtualHost) -> None:
        self.broker = broker
        self.vhost = vhost
        self.queue: Queue | None = None
        self.by_topic: dict[str, RetainedMessage] = {}
        # While the queue's declaration waits for the store: what a connection waits on.
        self.opening: Awaitable[None] | None = None

    def open(self) -> Awaitable[Queue]:
        """Declare the queue (durable) and read back what it holds; the index is built when it answers."""
        op = self.broker.coordinator.declare_queue(self.vhost, QUEUE, None, True, False, False, {})
        if isinstance(op, Immediate):
            self._loaded(op.value)
            return op
        return self._await(op)

    async def _await(self, op: Awaitable[Queue]) -> Queue:
        q = await op
        self._loaded(q)
        return q

    def _loaded(self, q: Queue) -> None:
        self.queue = q
        ready = list(q.default.ready)  # restored in offset order: a later one for a topic wins
        stale = []
        for qm in ready:
            topic = topics.to_topic(qm.message.routing_key)
            old = self.by_topic.get(topic)
            if old is not None:
                stale.append(old.offset)
            self.by_topic[topic] = RetainedMessage(topic, qm.message, qm.offset, qm.expires_at)
        if stale:
            q.drop_offsets(stale)
        if self.by_topic:
            log.info("retained messages restored", extra={"vhost": self.vhost.name, "count": len(self.by_topic)})

    def put(self, topic: str, message: Message) -> publish.Outcome:
        """Retain ``message`` for ``topic`` (an empty body clears it)."""
        q = self.queue
        old = self.by_topic.pop(topic, None)
        if q is None:
            return publish.ROUTED  # not open (no store answer yet): kept nowhere, as without retain
        if old is not None:
            q.drop_offsets([old.offset])
        if not message.body:
            return publish.ROUTED
        if not message.persistent:
            props = properties.decode(message.props)
            props["delivery_mode"] = 2
            props["headers"] = {**(props.get("headers") or {}), QOS_HEADER: 0}
            message = Message(message.exchange, message.routing_key, properties.encode(props), message.body,
                              None, message.node)
        offset = q.next_offset
        outcome = publish.publish_to(q, message, self.broker.committer)
        if outcome.accepted:
            expires_at = None
            if message.summary.expiration is not None:
                expires_at = time.time() + int(message.summary.expiration) / 1000.0
            self.by_topic[topic] = RetainedMessage(topic, message, offset, expires_at)
        return outcome

    def matching(self, topic_filter: str) -> list[RetainedMessage]:
        now = time.time()
        found = []
        for topic, rm in list(self.by_topic.items()):
            if rm.expires_at is not None and rm.expires_at <= now:
                self.by_topic.pop(topic, None)
                if self.queue is not None:
                    self.queue.drop_offsets([rm.offset])
                continue
            if topics.matches(topic_filter, topic):
                found.append(rm)
        return found
