"""Partitioned streams: N stream queues ``NAME-0 .. NAME-N-1`` behind an ``x-partition`` exchange ``NAME``.

Publishing to the exchange picks one partition per message: a hash of the
routing key (so one key always lands in the same partition, and order holds
per key), or round robin without a key. Everything is ordinary topology
(a durable exchange, durable stream queues, bindings whose keys are the
partition indexes), so it is stored, restored and, in a cluster, owned queue
by queue like anything else: the partitions spread over the nodes as their
owners are chosen. The gRPC API and ``leveret streams`` use these helpers;
AMQP clients can publish to the exchange and consume ``NAME-i`` directly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from core.engine.exchange import PartitionExchange
from core.engine.stream import StreamQueue
from core.engine.vhost import VirtualHost
from core.model.errors import NotFound, PreconditionFailed

if TYPE_CHECKING:
    from core.ports.coordinator import Coordinator

MAX_PARTITIONS = 1024


def partition_name(stream: str, index: int) -> str:
    return f"{stream}-{index}"


def stream_arguments(max_age: str | None = None, max_bytes: int | None = None) -> dict[str, Any]:
    args: dict[str, Any] = {"x-queue-type": "stream"}
    if max_age:
        args["x-max-age"] = max_age
    if max_bytes:
        args["x-max-length-bytes"] = max_bytes
    return args


def _check_create(vh: VirtualHost, name: str, partitions: int) -> None:
    if not name:
        raise PreconditionFailed("a partitioned stream needs a name")
    if not 1 <= partitions <= MAX_PARTITIONS:
        raise PreconditionFailed(f"partitions must be between 1 and {MAX_PARTITIONS}, got {partitions}")
    existing = vh.exchanges.get(name)
    if existing is not None:
        current = existing.partitions if isinstance(existing, PartitionExchange) else None
        if current is None or len(current) != partitions:
            have = f"{len(current)} partitions" if current is not None else f"a '{existing.type}' exchange"
            raise PreconditionFailed(
                f"'{name}' in vhost '{vh.name}' already exists as {have}; cannot make it {partitions} partitions"
            )


def exchange_of(vh: VirtualHost, name: str) -> PartitionExchange | None:
    x = vh.exchanges.get(name)
    return x if isinstance(x, PartitionExchange) else None


def resolve(vh: VirtualHost, topic: str) -> list[StreamQueue]:
    """The streams behind a topic: the partitions of a partitioned stream, or one stream queue."""
    x = exchange_of(vh, topic)
    if x is not None:
        return [q for q in x.partitions if isinstance(q, StreamQueue)]
    q = vh.queues.get(topic)
    if q is None:
        raise NotFound(f"no stream '{topic}' in vhost '{vh.name}'")
    if not isinstance(q, StreamQueue):
        raise PreconditionFailed(f"queue '{topic}' in vhost '{vh.name}' is a {q.args.queue_type} queue, "
                                 "not a stream")
    return [q]


async def declare(coordinator: Coordinator, vh: VirtualHost, name: str, partitions: int,
                  arguments: dict[str, Any], owner: object = None) -> list[StreamQueue]:
    """Declare a partitioned stream through the coordinator (agreed in etcd in a cluster, placing the
    partitions on the nodes as their owners are chosen; stored before this returns).

    Every call is made before the first is awaited: a single node queues all the
    topology writes at once, so they share commits; etcd's coroutines still run
    one after another when awaited (each placement sees the previous one).
    """
    _check_create(vh, name, partitions)
    await coordinator.declare_exchange(vh, name, PartitionExchange.type, True, False, False, {})
    names = [partition_name(name, i) for i in range(partitions)]
    declared = [coordinator.declare_queue(vh, n, owner, True, False, False, arguments) for n in names]
    queues = [await op for op in declared]
    bound = [coordinator.bind(vh, name, "queue", n, str(i), {}, True) for i, n in enumerate(names)]
    for op in bound:
        await op
    out = []
    for q in queues:
        if not isinstance(q, StreamQueue):
            raise PreconditionFailed(f"queue '{q.name}' in vhost '{vh.name}' exists and is not a stream")
        out.append(q)
    return out


async def remove(coordinator: Coordinator, vh: VirtualHost, name: str, owner: object = None) -> int:
    """Delete a stream, or a partitioned stream with all its partitions, through the coordinator."""
    dropped = 0
    for q in resolve(vh, name):
        dropped += await coordinator.delete_queue(vh, q.name, owner, False, False)
    if exchange_of(vh, name) is not None:
        await coordinator.delete_exchange(vh, name, False)
    return dropped
