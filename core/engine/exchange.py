"""Exchanges: the routing table. They store nothing; they name destinations."""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Union

from core.engine.topic import topic_matches
from core.model import properties
from core.model.errors import CommandInvalid, PreconditionFailed

if TYPE_CHECKING:
    from core.engine.queue import Queue
    from core.model.message import Message

Destination = Union["Queue", "Exchange"]



def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, bytearray):
        return bytes(value)
    return value


class Binding:
    """``source`` routes messages whose key (or headers) match to ``destination``."""

    __slots__ = ("source", "destination", "routing_key", "arguments", "key")

    def __init__(
        self,
        source: Exchange,
        destination: Destination,
        routing_key: str,
        arguments: dict[str, Any] | None,
    ) -> None:
        self.source = source
        self.destination = destination
        self.routing_key = routing_key
        self.arguments = dict(arguments or {})
        kind = "exchange" if isinstance(destination, Exchange) else "queue"
        self.key = (kind, destination.name, routing_key, _freeze(self.arguments))


class Exchange:
    """Base of all exchange types; subclasses decide ``route``."""

    type = ""

    def __init__(
        self,
        name: str,
        durable: bool = False,
        auto_delete: bool = False,
        internal: bool = False,
        arguments: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.durable = durable
        self.auto_delete = auto_delete
        self.internal = internal
        self.arguments = dict(arguments or {})
        self.bindings: dict[tuple[Any, ...], Binding] = {}
        self.deleted = False
        self.published_in = 0  # messages routed through it: read by the management API (core/engine/stats.py)
        # Called after every change of this exchange's bindings (and when it is dropped): a federation
        # link keeps its upstream bindings in step with them. Bindings change at declare speed, not per message.
        self.binding_watchers: list[Callable[[], None]] = []

    def add_binding(self, binding: Binding) -> bool:
        """Add; False when an identical binding already exists."""
        if binding.key in self.bindings:
            return False
        self.bindings[binding.key] = binding
        self._rebuild()
        self.bindings_changed()
        return True

    def remove_binding(self, key: tuple[Any, ...]) -> Binding | None:
        binding = self.bindings.pop(key, None)
        if binding is not None:
            self._rebuild()
            self.bindings_changed()
        return binding

    def bindings_changed(self) -> None:
        for watcher in tuple(self.binding_watchers):
            watcher()

    def bindings_to(self, destination: Destination) -> list[Binding]:
        return [b for b in self.bindings.values() if b.destination is destination]

    def _rebuild(self) -> None:
        """Recompute the lookup structures after a change of bindings."""

    def route(self, routing_key: str, message: Message) -> tuple[Destination, ...] | list[Destination]:
        raise NotImplementedError


class DirectExchange(Exchange):
    type = "direct"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._by_key: dict[str, tuple[Destination, ...]] = {}
        super().__init__(*args, **kwargs)

    def _rebuild(self) -> None:
        by_key: dict[str, list[Destination]] = {}
        for b in self.bindings.values():
            dests = by_key.setdefault(b.routing_key, [])
            if b.destination not in dests:
                dests.append(b.destination)
        self._by_key = {k: tuple(v) for k, v in by_key.items()}

    def route(self, routing_key: str, message: Message) -> tuple[Destination, ...]:
        return self._by_key.get(routing_key, ())


class FanoutExchange(Exchange):
    type = "fanout"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._all: tuple[Destination, ...] = ()
        super().__init__(*args, **kwargs)

    def _rebuild(self) -> None:
        seen: dict[int, Destination] = {}
        for b in self.bindings.values():
            seen.setdefault(id(b.destination), b.destination)
        self._all = tuple(seen.values())

    def route(self, routing_key: str, message: Message) -> tuple[Destination, ...]:
        return self._all


class TopicExchange(Exchange):
    type = "topic"
    _CACHE_MAX = 10_000

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Routing keys repeat a lot; remember each key's destinations until the
        # bindings change rather than matching every pattern per message.
        self._cache: dict[str, tuple[Destination, ...]] = {}
        super().__init__(*args, **kwargs)

    def _rebuild(self) -> None:
        self._cache = {}

    def route(self, routing_key: str, message: Message) -> tuple[Destination, ...]:
        hit = self._cache.get(routing_key)
        if hit is not None:
            return hit
        seen: dict[int, Destination] = {}
        for b in self.bindings.values():
            if topic_matches(b.routing_key, routing_key):
                seen.setdefault(id(b.destination), b.destination)
        result = tuple(seen.values())
        if len(self._cache) >= self._CACHE_MAX:
            self._cache.clear()
        self._cache[routing_key] = result
        return result


def _same_value(wanted: Any, got: Any) -> bool:
    """Header equality as RabbitMQ sees it: a void binding value matches any value,
    and booleans never equal numbers (Python's True == 1 does not apply)."""
    if wanted is None:
        return True
    if isinstance(wanted, bool) != isinstance(got, bool):
        return False
    return bool(wanted == got)


def _x_match(args: dict[str, Any]) -> object:
    """The binding's x-match value as text where it can be; validated by add_binding."""
    mode = args.get("x-match", "all")
    if isinstance(mode, (bytes, bytearray)):
        # A client's bytes: invalid UTF-8 is an invalid value, not a crash.
        return mode.decode("utf-8", "replace")
    return mode


def _headers_match(args: dict[str, Any], headers: dict[str, Any]) -> bool:
    mode = _x_match(args)
    if not isinstance(mode, str):
        return False  # add_binding refused it; nothing else can bind it
    with_x = mode.endswith("-with-x")
    # x- arguments are binding options, except in the -with-x modes (RabbitMQ 3.10+),
    # where everything but x-match itself is matched.
    wanted = [(k, v) for k, v in args.items() if k != "x-match" and (with_x or not k.startswith("x-"))]
    if mode.startswith("any"):
        return any(k in headers and _same_value(v, headers[k]) for k, v in wanted)
    return all(k in headers and _same_value(v, headers[k]) for k, v in wanted)


class HeadersExchange(Exchange):
    type = "headers"

    def add_binding(self, binding: Binding) -> bool:
        mode = _x_match(binding.arguments)
        if not isinstance(mode, str) or mode not in ("all", "any", "all-with-x", "any-with-x"):
            raise PreconditionFailed(
                f"Invalid x-match field value {mode!r}; expected all, any, all-with-x, or any-with-x"
            )
        return super().add_binding(binding)

    def route(self, routing_key: str, message: Message) -> list[Destination]:
        headers = message.headers
        out: list[Destination] = []
        for b in self.bindings.values():
            if b.destination not in out and _headers_match(b.arguments, headers):
                out.append(b.destination)
        return out


def _ring_hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class ConsistentHashExchange(Exchange):
    """``x-consistent-hash``: spreads routing keys over bound queues by weight.

    Each binding's routing key is its weight: that many times POINTS_PER_WEIGHT
    points on a hash ring (a single point per queue spreads keys very unevenly).
    A message goes to the owner of the first point at or after the hash of its
    routing key (or of the header / property named by the exchange's
    ``hash-header`` / ``hash-property`` argument), so one key always lands on
    the same queue while the bindings stay the same.
    """

    type = "x-consistent-hash"
    POINTS_PER_WEIGHT = 64
    _PROPERTIES = ("message_id", "correlation_id", "timestamp")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._ring: list[int] = []
        self._owners: list[Destination] = []
        super().__init__(*args, **kwargs)
        hp = self.arguments.get("hash-property")
        if hp is not None and hp not in self._PROPERTIES:
            raise PreconditionFailed(
                f"invalid hash-property {hp!r} for exchange '{self.name}'; use one of {', '.join(self._PROPERTIES)}"
            )

    def add_binding(self, binding: Binding) -> bool:
        try:
            weight = int(binding.routing_key or "0")
        except ValueError:
            weight = -1
        if weight <= 0:
            raise PreconditionFailed(
                f"binding key of a consistent-hash exchange is a positive weight, got '{binding.routing_key}'"
            )
        return super().add_binding(binding)

    def _rebuild(self) -> None:
        points: list[tuple[int, str, Destination]] = []
        for b in self.bindings.values():
            for i in range(int(b.routing_key) * self.POINTS_PER_WEIGHT):
                points.append((_ring_hash(f"{b.key[0]}:{b.destination.name}:{i}".encode()), b.destination.name,
                               b.destination))
        points.sort(key=lambda p: (p[0], p[1]))
        self._ring = [p[0] for p in points]
        self._owners = [p[2] for p in points]

    def _hash_input(self, routing_key: str, message: Message) -> bytes | None:
        header = self.arguments.get("hash-header")
        if header is not None:
            value = message.headers.get(header)
            return None if value is None else str(value).encode()
        prop = self.arguments.get("hash-property")
        if prop is not None:
            value = properties.decode(message.props).get(prop)
            return None if value is None else str(value).encode()
        return routing_key.encode()

    def route(self, routing_key: str, message: Message) -> tuple[Destination, ...]:
        if not self._ring:
            return ()
        data = self._hash_input(routing_key, message)
        if data is None:
            return ()
        i = bisect.bisect_left(self._ring, _ring_hash(data))
        return (self._owners[i % len(self._owners)],)


class PartitionExchange(Exchange):
    """``x-partition``: the partitions of a partitioned stream (core/partition.py).

    Each binding's key is its partition index. A message goes to exactly one
    partition: the hash of its routing key modulo the partition count (stable
    for a key, across restarts and nodes), or round robin when the key is empty.
    Unlike x-consistent-hash the partition count is fixed at creation, so a
    plain modulo keeps the spread even and the choice predictable.
    """

    type = "x-partition"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.partitions: list[Destination] = []
        self._next = 0
        super().__init__(*args, **kwargs)

    def add_binding(self, binding: Binding) -> bool:
        if not binding.routing_key.isdigit():
            raise PreconditionFailed(
                f"binding key of a partition exchange is the partition index (0, 1, ...), "
                f"got '{binding.routing_key}'"
            )
        return super().add_binding(binding)

    def _rebuild(self) -> None:
        ordered = sorted(self.bindings.values(), key=lambda b: (int(b.routing_key), b.destination.name))
        self.partitions = [b.destination for b in ordered]

    def partition_of(self, routing_key: str) -> int:
        """The partition index a message with ``routing_key`` goes to (round robin for an empty key)."""
        n = len(self.partitions)
        if routing_key:
            return _ring_hash(routing_key.encode()) % n
        i = self._next % n
        self._next = i + 1
        return i

    def route(self, routing_key: str, message: Message) -> tuple[Destination, ...]:
        if not self.partitions:
            return ()
        return (self.partitions[self.partition_of(routing_key)],)


_TYPES: dict[str, type[Exchange]] = {
    "direct": DirectExchange,
    "fanout": FanoutExchange,
    "topic": TopicExchange,
    "headers": HeadersExchange,
    "x-consistent-hash": ConsistentHashExchange,
    "x-partition": PartitionExchange,
}


def make_exchange(type_: str, name: str, **kwargs: Any) -> Exchange:
    cls = _TYPES.get(type_)
    if cls is None:
        raise CommandInvalid(f"unknown exchange type '{type_}'")
    return cls(name, **kwargs)
