"""Message counters of queues and exchanges, read by the management API at request time.

Plain integer attributes on a slotted object created once per queue/exchange:
the hot path only does ``stats.x += 1`` (no allocation, no lock, no call).
Rates are not kept here: the HTTP layer samples these counters
(leveret/http/rates.py) and derives ``*_details.rate`` from two samples.
"""

from __future__ import annotations


class QueueStats:
    """RabbitMQ's queue ``message_stats`` counters (totals since the queue was created)."""

    __slots__ = ("publish", "deliver_get", "ack", "redeliver")

    def __init__(self) -> None:
        self.publish = 0  # messages enqueued (routed here and accepted)
        self.deliver_get = 0  # deliveries to consumers plus basic.get answers
        self.ack = 0  # deliveries settled (acked, or rejected without requeue)
        self.redeliver = 0  # deliveries of a message that had been delivered before


class ExchangeStats:
    __slots__ = ("publish_in",)

    def __init__(self) -> None:
        self.publish_in = 0  # messages published to this exchange
