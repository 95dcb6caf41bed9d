"""The coordinator: the one interface the front ends use for declarations and queue operations.

Every declaration, deletion, binding change, purge, ``basic.get`` and count
goes through it, on a single node and in a cluster alike (DESIGN.md: "one code
path, not two"). Two implementations:

- ``coordination.local.LocalCoordinator`` (a single node): applies the change
  to the local vhost at once; a durable one is answered once its topology
  write has committed in the store (group commit).
- ``coordination.etcd.EtcdCluster`` (a cluster): agrees the change in etcd
  first (so it races safely across nodes), then applies it to the local
  routing table; operations on a queue another node owns go to its owner.

When a method returns, the change is applied here and, for durable topology,
stored (in etcd for a cluster, in the store for a single node). A method may
return ``Immediate(value)`` when the answer is known at once (a transient
declaration on a single node): the AMQP front end then replies without a loop
turn, so the sans-IO state machine stays synchronous for it. Refusals (404,
403, 405, 406) are raised either by the call itself or by awaiting its result.
"""

from __future__ import annotations

from collections.abc import Awaitable, Generator
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from core.engine.queue import Queue
    from core.engine.vhost import VirtualHost
    from core.model.message import QueuedMessage

T = TypeVar("T")


class ClusterStartError(Exception):
    """The node cannot join its cluster (etcd unreachable at start-up)."""


class ClusterEvents(Protocol):
    def __call__(self, kind: str, node: str, vhost: str = "", queue: str = "") -> None: ...


class Immediate(Generic[T]):
    """An answer that is already known: awaitable like any other, or read at once through ``value``."""

    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        self.value = value

    def __await__(self) -> Generator[Any, None, T]:
        return self.value
        yield  # a generator that returns at once: awaiting it never suspends


class Coordinator(Protocol):
    node_id: str

    def declare_exchange(
        self, vhost: VirtualHost, name: str, type_: str, durable: bool, auto_delete: bool, internal: bool,
        arguments: dict[str, Any],
    ) -> Awaitable[None]:
        """The exchange exists with these properties (406 if it exists with others)."""
        ...

    def delete_exchange(self, vhost: VirtualHost, name: str, if_unused: bool) -> Awaitable[None]: ...

    def declare_queue(
        self, vhost: VirtualHost, name: str, owner: object, durable: bool, exclusive: bool, auto_delete: bool,
        arguments: dict[str, Any],
    ) -> Awaitable[Queue]:
        """The queue (``name`` "" for a server-named one) as declared here; 405/406 as for any declare."""
        ...

    def delete_queue(
        self, vhost: VirtualHost, name: str, owner: object, if_unused: bool, if_empty: bool
    ) -> Awaitable[int]:
        """Messages dropped; deleting a missing queue succeeds (0)."""
        ...

    def bind(
        self, vhost: VirtualHost, source: str, kind: str, destination: str, routing_key: str, arguments: dict[str, Any],
        add: bool,
    ) -> Awaitable[None]:
        """Add (``add``) or remove a binding from exchange ``source`` to a queue or exchange (``kind``)."""
        ...

    def counts(self, queue: Queue) -> Awaitable[tuple[int, int]]:
        """(messages ready, consumers) as the owner sees them."""
        ...

    def purge(self, queue: Queue) -> Awaitable[int]: ...

    def get(self, queue: Queue, no_ack: bool) -> Awaitable[tuple[QueuedMessage | None, int]]:
        """``basic.get``: a message (or None) and how many remain ready."""
        ...
