"""Node-wide message counters, read by the Prometheus endpoint at scrape time.

Plain integer attributes bumped with ``+= 1`` by the front ends: no lock (one
event loop), no label lookup, no callback. A Prometheus client counter costs
a lock and a dict lookup per increment, measurable on the publish path
(bench/inprocess.py); these cost one attribute store. ``leveret/http/metrics.py``
turns them into RabbitMQ's ``rabbitmq_global_*_total`` series.
"""

from __future__ import annotations

# RabbitMQ 4.1's message size histogram's upper bounds in bytes (its dashboard asks for these le values).
SIZE_BUCKETS = (100, 1000, 10000, 100000, 1000000, 10000000, 50000000, 100000000)


class NodeStats:
    """Totals since the node started (counters only go up), as rabbit_global_counters."""

    __slots__ = (
        "received",
        "received_confirm",
        "routed",
        "unroutable_dropped",
        "unroutable_returned",
        "confirmed",
        "delivered_consume_manual_ack",
        "delivered_consume_auto_ack",
        "delivered_get_manual_ack",
        "delivered_get_auto_ack",
        "get_empty",
        "redelivered",
        "acknowledged",
        "connections_opened",
        "connections_closed",
        "channels_opened",
        "channels_closed",
        "queues_declared",
        "queues_created",
        "queues_deleted",
        "message_sizes",
        "message_bytes",
    )

    def __init__(self) -> None:
        self.received = 0  # messages received from publishers (AMQP and the native API)
        self.received_confirm = 0  # of which on a channel in confirm mode
        self.routed = 0  # reached at least one queue
        self.unroutable_dropped = 0  # no queue, not mandatory: dropped
        self.unroutable_returned = 0  # no queue, mandatory: basic.return
        self.confirmed = 0  # basic.ack'ed to publishers
        self.delivered_consume_manual_ack = 0
        self.delivered_consume_auto_ack = 0
        self.delivered_get_manual_ack = 0
        self.delivered_get_auto_ack = 0
        self.get_empty = 0
        self.redelivered = 0
        self.acknowledged = 0  # settled by consumers' acks
        self.connections_opened = 0
        self.connections_closed = 0
        self.channels_opened = 0
        self.channels_closed = 0
        self.queues_declared = 0  # queue.declare (and its HTTP and gRPC equivalents), new or not
        self.queues_created = 0
        self.queues_deleted = 0
        # Published body sizes per bucket of SIZE_BUCKETS (the last: larger), RabbitMQ 4's
        # rabbitmq_message_size_bytes histogram; a publish finds its bucket with bisect (C, no loop).
        self.message_sizes = [0] * (len(SIZE_BUCKETS) + 1)
        self.message_bytes = 0

    @property
    def delivered(self) -> int:
        """Every delivery to a consumer, consume or get, either ack mode (RabbitMQ's messages_delivered_total)."""
        return (self.delivered_consume_manual_ack + self.delivered_consume_auto_ack
                + self.delivered_get_manual_ack + self.delivered_get_auto_ack)

    def snapshot(self) -> dict[str, int]:
        out = {name: getattr(self, name) for name in self.__slots__ if name != "message_sizes"}
        out["delivered"] = self.delivered
        return out
