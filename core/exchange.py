"""Exchanges: the routing table. They store nothing; they name destinations."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Union

from core.errors import CommandInvalid, PreconditionFailed
from core.topic import topic_matches

if TYPE_CHECKING:
    from core.message import Message
    from core.queue import Queue

Destination = Union["Queue", "Exchange"]

EXCHANGE_TYPES = ("direct", "fanout", "topic", "headers")


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

    def add_binding(self, binding: Binding) -> bool:
        """Add; False when an identical binding already exists."""
        if binding.key in self.bindings:
            return False
        self.bindings[binding.key] = binding
        self._rebuild()
        return True

    def remove_binding(self, key: tuple[Any, ...]) -> Binding | None:
        binding = self.bindings.pop(key, None)
        if binding is not None:
            self._rebuild()
        return binding

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


def _headers_match(args: dict[str, Any], headers: dict[str, Any]) -> bool:
    mode = args.get("x-match", "all")
    if isinstance(mode, bytes):
        mode = mode.decode()
    wanted = [(k, v) for k, v in args.items() if not k.startswith("x-")]
    if mode in ("any", "any-with-x"):
        if not wanted:
            return False
        return any(k in headers and (v is None or headers[k] == v) for k, v in wanted)
    # all: every non-x- argument present (a void value means "present, any value").
    return all(k in headers and (v is None or headers[k] == v) for k, v in wanted)


class HeadersExchange(Exchange):
    type = "headers"

    def add_binding(self, binding: Binding) -> bool:
        mode = binding.arguments.get("x-match", "all")
        if isinstance(mode, bytes):
            mode = mode.decode()
        if mode not in ("all", "any", "all-with-x", "any-with-x"):
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


_TYPES: dict[str, type[Exchange]] = {
    "direct": DirectExchange,
    "fanout": FanoutExchange,
    "topic": TopicExchange,
    "headers": HeadersExchange,
}


def make_exchange(type_: str, name: str, **kwargs: Any) -> Exchange:
    cls = _TYPES.get(type_)
    if cls is None:
        raise CommandInvalid(f"unknown exchange type '{type_}'")
    return cls(name, **kwargs)
