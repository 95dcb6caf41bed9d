"""RabbitMQ's ``message_stats`` counters of a queue or exchange, read at request time.

The engine keeps plain integer attributes on the objects the hot path
already touches (``Queue.published``; ``QueueChannel.delivered``, ``redelivered``, ``acked``;
``Exchange.published_in``), one ``+= 1`` each, no allocation.
Reading them here is the slow side: sums over a queue's channels. Rates are
kept by the management API (leveret/http/rates.py), from two samples.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from core.engine.exchange import Exchange
    from core.engine.queue import Queue

QUEUE_FIELDS = ("publish", "deliver_get", "ack", "redeliver")


def queue_counters(q: Queue) -> tuple[int, int, int, int]:
    """(publish, deliver_get, ack, redeliver) since the queue was made on this node."""
    delivered = acked = redelivered = 0
    for ch in q.channels:
        delivered += ch.delivered
        acked += ch.acked
        redelivered += ch.redelivered
    return q.published, delivered, acked, redelivered


def exchange_counters(x: Exchange) -> tuple[int]:
    """(publish_in,)"""
    return (x.published_in,)
