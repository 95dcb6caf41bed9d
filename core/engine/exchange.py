"""Exchanges: the routing table. They store nothing; they name destinations."""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Union

from core.engine.topic import TopicTrie
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
        self._to: dict[int, dict[tuple[Any, ...], Binding]] = {}  # id(destination) -> its bindings here
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
        self._to.setdefault(id(binding.destination), {})[binding.key] = binding
        self._added(binding)
        self.bindings_changed()
        return True

    def remove_binding(self, key: tuple[Any, ...]) -> Binding | None:
        binding = self.bindings.pop(key, None)
        if binding is not None:
            to = self._to[id(binding.destination)]
            del to[key]
            if not to:
                del self._to[id(binding.destination)]
            self._removed(binding)
            self.bindings_changed()
        return binding

    def clear_bindings(self) -> None:
        """Drop every binding (the exchange is being deleted)."""
        self.bindings.clear()
        self._to.clear()
        self._rebuild()
        self.bindings_changed()

    def bindings_changed(self) -> None:
        for watcher in tuple(self.binding_watchers):
            watcher()

    def bindings_to(self, destination: Destination) -> list[Binding]:
        # Indexed: deleting a queue must not scan every binding of every exchange.
        return list(self._to.get(id(destination), {}).values())

    # A type keeps its lookup structure in step with the bindings through these. The default
    # recomputes it from all bindings, which suits the types whose bindings are few (a hash
    # ring, partitions); direct, fanout, topic and headers edit theirs per binding, so a bind
    # or unbind costs the same with 10 bindings as with 100,000.
    def _added(self, binding: Binding) -> None:
        self._rebuild()

    def _removed(self, binding: Binding) -> None:
        self._rebuild()

    def _rebuild(self) -> None:
        """Recompute the lookup structures from ``self.bindings``."""

    def route(self, routing_key: str, message: Message) -> tuple[Destination, ...] | list[Destination]:
        raise NotImplementedError


def _unique(bindings: Iterable[Binding]) -> tuple[Destination, ...]:
    """The bindings' destinations, each once, in binding order."""
    seen: dict[int, Destination] = {}
    for b in bindings:
        seen.setdefault(id(b.destination), b.destination)
    return tuple(seen.values())


class DirectExchange(Exchange):
    type = "direct"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._bound: dict[str, dict[tuple[Any, ...], Binding]] = {}  # routing key -> its bindings
        self._by_key: dict[str, tuple[Destination, ...]] = {}
        super().__init__(*args, **kwargs)

    def _added(self, binding: Binding) -> None:
        bound = self._bound.setdefault(binding.routing_key, {})
        bound[binding.key] = binding
        self._by_key[binding.routing_key] = _unique(bound.values())

    def _removed(self, binding: Binding) -> None:
        rk = binding.routing_key
        bound = self._bound[rk]
        del bound[binding.key]
        if bound:
            self._by_key[rk] = _unique(bound.values())
        else:
            del self._bound[rk]
            del self._by_key[rk]

    def _rebuild(self) -> None:
        self._bound = {}
        self._by_key = {}
        for b in self.bindings.values():
            self._added(b)

    def route(self, routing_key: str, message: Message) -> tuple[Destination, ...]:
        return self._by_key.get(routing_key, ())


class FanoutExchange(Exchange):
    type = "fanout"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._all: tuple[Destination, ...] | None = ()  # None: recompute at the next publish
        super().__init__(*args, **kwargs)

    def _added(self, binding: Binding) -> None:
        self._all = None

    def _removed(self, binding: Binding) -> None:
        self._all = None

    def _rebuild(self) -> None:
        self._all = None

    def route(self, routing_key: str, message: Message) -> tuple[Destination, ...]:
        dests = self._all
        if dests is None:
            # Once per change of bindings, and only when a publish follows: a burst of binds costs O(1) each.
            dests = self._all = tuple(next(iter(bs.values())).destination for bs in self._to.values())
        return dests


class TopicExchange(Exchange):
    """Routed through a trie of the binding patterns' words (core/engine/topic.py).

    A publish costs the branches its key's words select, not a match per
    binding; a bind or unbind edits one path of the trie. Keys whose walk is
    long are answered from a cache when they come again (measured: a walk
    over the ten patterns of bench's ``topic`` scenario takes 4.3 us, a cache
    hit 0.03 us; a short walk such as ``dev.N.*``'s four steps, 1 us, is not
    cached: filing it would cost as much). A binding change drops only the
    cached keys it can affect: the key itself for a pattern without
    wildcards, else the keys sharing the pattern's literal first one or two
    words (everything only when it starts with a wildcard).
    """

    type = "topic"
    _CACHE_MAX = 10_000
    # A walk this short costs about what filing its answer in the cache does (1 us): not worth it.
    _CACHE_FROM_STEPS = 6

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._trie: TopicTrie[Destination] = TopicTrie()
        self._cache: dict[str, tuple[Destination, ...]] = {}
        # Cached keys by their first word (a str) and first two words (a tuple), for narrow invalidation.
        self._prefixed: dict[object, list[str]] = {}
        self._indexed = 0  # entries put in _prefixed since it was last emptied (stale ones included)
        super().__init__(*args, **kwargs)

    def _added(self, binding: Binding) -> None:
        self._trie.add(binding.routing_key, binding.key, binding.destination)
        self._invalidate(binding.routing_key)

    def _removed(self, binding: Binding) -> None:
        self._trie.remove(binding.routing_key, binding.key)
        self._invalidate(binding.routing_key)

    def _rebuild(self) -> None:
        self._trie.clear()
        for b in self.bindings.values():
            self._trie.add(b.routing_key, b.key, b.destination)
        self._forget_all()

    def _forget_all(self) -> None:
        self._cache.clear()
        self._prefixed.clear()
        self._indexed = 0

    def _invalidate(self, pattern: str) -> None:
        if not self._cache:
            return
        if "*" not in pattern and "#" not in pattern:
            self._cache.pop(pattern, None)  # only that very key routes differently now
            return
        words = pattern.split(".")
        first = words[0]
        if first in ("*", "#"):
            self._forget_all()
            return
        bucket: object = first
        if len(words) > 1 and words[1] not in ("*", "#"):
            bucket = (first, words[1])
        for key in self._prefixed.pop(bucket, ()):
            self._cache.pop(key, None)

    def route(self, routing_key: str, message: Message) -> tuple[Destination, ...]:
        hit = self._cache.get(routing_key)
        if hit is not None:
            return hit
        found, steps = self._trie.walk(routing_key)
        result = tuple(found)
        if steps <= self._CACHE_FROM_STEPS:
            return result
        if len(self._cache) >= self._CACHE_MAX or self._indexed >= 3 * self._CACHE_MAX:
            self._forget_all()
        self._cache[routing_key] = result
        first, dot, rest = routing_key.partition(".")
        self._prefixed.setdefault(first, []).append(routing_key)
        self._indexed += 1
        if dot:
            self._prefixed.setdefault((first, rest.partition(".")[0]), []).append(routing_key)
            self._indexed += 1
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


_Criteria = tuple[bool, tuple[tuple[str, Any], ...]]  # (x-match is all, the (header, value) pairs to compare)


def _criteria(args: dict[str, Any]) -> _Criteria:
    """What a binding compares, read once at bind time (add_binding validated x-match)."""
    mode = _x_match(args)
    assert isinstance(mode, str)
    with_x = mode.endswith("-with-x")
    # x- arguments are binding options, except in the -with-x modes (RabbitMQ 3.10+),
    # where everything but x-match itself is matched.
    wanted = tuple((k, v) for k, v in args.items() if k != "x-match" and (with_x or not k.startswith("x-")))
    return not mode.startswith("any"), wanted


def _criteria_met(criteria: _Criteria, headers: dict[str, Any]) -> bool:
    match_all, wanted = criteria
    if match_all:
        return all(k in headers and _same_value(v, headers[k]) for k, v in wanted)
    return any(k in headers and _same_value(v, headers[k]) for k, v in wanted)


class HeadersExchange(Exchange):
    """Bindings are indexed by what they compare, so a message is checked only
    against bindings one of its headers can satisfy: a header compared with a
    value under (name, value), one compared for presence only (a void value)
    under its name. An ``all`` binding needs every pair, so one entry serves
    (a valued pair where it has one: more selective); an ``any`` binding has
    an entry per pair. An ``all`` binding with nothing to compare takes every
    message; an ``any`` binding with nothing to compare takes none."""

    type = "headers"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._criteria: dict[tuple[Any, ...], _Criteria] = {}  # binding key -> what it compares
        self._by_pair: dict[tuple[str, Any], dict[tuple[Any, ...], Binding]] = {}  # (name, frozen value)
        self._by_name: dict[str, dict[tuple[Any, ...], Binding]] = {}  # presence only
        self._names: dict[str, int] = {}  # header names in either index, with how many entries name each
        self._everything: dict[tuple[Any, ...], Binding] = {}
        super().__init__(*args, **kwargs)

    def add_binding(self, binding: Binding) -> bool:
        mode = _x_match(binding.arguments)
        if not isinstance(mode, str) or mode not in ("all", "any", "all-with-x", "any-with-x"):
            raise PreconditionFailed(
                f"Invalid x-match field value {mode!r}; expected all, any, all-with-x, or any-with-x"
            )
        return super().add_binding(binding)

    @staticmethod
    def _entries(criteria: _Criteria) -> list[tuple[str, Any]]:
        """(name, frozen value) pairs the binding is filed under; value None: presence only."""
        match_all, wanted = criteria
        if match_all:
            valued = [(k, v) for k, v in wanted if v is not None]
            pairs = [(valued or list(wanted))[0]] if wanted else []
        else:
            pairs = list(wanted)
        return list({(k, _freeze(v)): None for k, v in pairs})

    def _file(self, binding: Binding, criteria: _Criteria, add: bool) -> None:
        for name, value in self._entries(criteria):
            index: dict[Any, dict[tuple[Any, ...], Binding]] = self._by_name if value is None else self._by_pair
            slot: Any = name if value is None else (name, value)
            if add:
                index.setdefault(slot, {})[binding.key] = binding
                self._names[name] = self._names.get(name, 0) + 1
            else:
                filed = index[slot]
                del filed[binding.key]
                if not filed:
                    del index[slot]
                self._names[name] -= 1
                if not self._names[name]:
                    del self._names[name]

    def _added(self, binding: Binding) -> None:
        criteria = self._criteria[binding.key] = _criteria(binding.arguments)
        if criteria[0] and not criteria[1]:
            self._everything[binding.key] = binding
        else:
            self._file(binding, criteria, add=True)

    def _removed(self, binding: Binding) -> None:
        criteria = self._criteria.pop(binding.key)
        if self._everything.pop(binding.key, None) is None:
            self._file(binding, criteria, add=False)

    def _rebuild(self) -> None:
        self._criteria.clear()
        self._by_pair.clear()
        self._by_name.clear()
        self._names.clear()
        self._everything.clear()
        for b in self.bindings.values():
            self._added(b)

    def route(self, routing_key: str, message: Message) -> list[Destination]:
        found: dict[int, Destination] = {}
        for b in self._everything.values():
            found.setdefault(id(b.destination), b.destination)
        if not self._names:
            return list(found.values())
        headers = message.headers
        # Walk the shorter side: the message's headers or the names bindings compare.
        if len(headers) <= len(self._names):
            names = [n for n in headers if n in self._names]
        else:
            names = [n for n in self._names if n in headers]
        for name in names:
            candidates = [self._by_name.get(name)]
            try:
                candidates.append(self._by_pair.get((name, _freeze(headers[name]))))
            except TypeError:
                pass  # a value that cannot be a dict key cannot equal a binding's (they are all frozen)
            for filed in candidates:
                for key, b in (filed or {}).items():
                    if id(b.destination) not in found and _criteria_met(self._criteria[key], headers):
                        found[id(b.destination)] = b.destination
        return list(found.values())


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
