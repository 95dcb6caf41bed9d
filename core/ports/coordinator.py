"""The coordinator: the one interface the front ends use for declarations and queue operations.

Every declaration, deletion, binding change, purge, ``basic.get`` and count
goes through it, on a single node and in a cluster alike (DESIGN.md: "one code
path, not two"). Two implementations:

- ``coordination.local.LocalCoordinator`` (a single node): applies the change
  to the local vhost at once; a durable one is answered once its topology
  write has committed in the store (group commit).
- ``coordination.etcd.EtcdCoordinator`` (a cluster): agrees the change in etcd
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

from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from core.engine.broker import User
    from core.engine.queue import Queue
    from core.engine.vhost import VirtualHost
    from core.model.message import QueuedMessage
    from core.model.policy import Policy

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


@dataclass(frozen=True)
class Member:
    """A node of the cluster as the coordinator knows it (a single node: itself)."""

    id: str
    region: str = ""
    amqp: str = ""
    grpc: str = ""
    queues: int = 0  # queues it owns
    draining: bool = False
    started: float = 0.0  # time.time() it joined

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "region": self.region, "grpc": self.grpc, "amqp": self.amqp, "queues": self.queues,
                "draining": self.draining}


GLOBAL = "global"  # the component of global parameters, kept under the vhost "" (RabbitMQ's cluster_name)
ParameterKey = tuple[str, str, str]  # (vhost, component, name)
# Told of every runtime parameter change, this node's and other nodes': (vhost, component, name, value or None).
ParameterListener = Callable[[str, str, str, Any], None]


class Metadata(Protocol):
    """The metadata and membership side of a coordinator: what every node shares besides the topology.

    Users (with their permissions, topic permissions and user limits: one record), vhosts and their
    limits, policies and operator policies, runtime and global parameters, named holds, members. A
    write applies here at once, is stored, and reaches every other node: on a single node the local
    coordinator delivers its own changes; in a cluster each node applies what the others write from
    its etcd watch (no polling). The CLI, the management API, the node and the links use only this.
    """

    node_id: str

    # -- users and vhosts ------------------------------------------------------------
    async def save_user(self, user: User) -> None:
        """Add or replace a user record (password, tags, vhosts, permissions, limits) everywhere."""
        ...

    async def delete_user(self, name: str) -> bool:
        """The user goes everywhere (its connections close, 320); False when it did not exist."""
        ...

    def add_vhost(self, name: str) -> VirtualHost:
        """The vhost on this node, made (and watched by the coordinator) if new; ``save_vhost`` stores it."""
        ...

    async def save_vhost(self, name: str) -> None:
        """The vhost exists on every node, and across restarts."""
        ...

    async def delete_vhost(self, name: str) -> bool:
        """Its stored record and limits go (other nodes keep theirs until restarted); False: none was stored."""
        ...

    async def set_vhost_limits(self, name: str, limits: dict[str, int]) -> None:
        """The vhost's max-connections/max-queues on every node ({}: none)."""
        ...

    # -- policies ---------------------------------------------------------------------
    async def set_policy(self, policy: Policy) -> bool:
        """Applied to the vhost's live queues and exchanges on every node; True when it replaced one."""
        ...

    async def clear_policy(self, vhost: str, name: str, operator: bool) -> bool:
        """False when there was no such policy here."""
        ...

    # -- runtime and global parameters (GLOBAL under the vhost "") ---------------------
    async def parameters(self) -> dict[ParameterKey, Any]:
        """Every runtime parameter as stored now."""
        ...

    async def set_parameter(self, vhost: str, component: str, name: str, value: Any) -> None:
        """Stored, then delivered to every ``on_parameter`` listener of every node."""
        ...

    async def clear_parameter(self, vhost: str, component: str, name: str) -> None: ...

    def on_parameter(self, listener: ParameterListener) -> None:
        """Call ``listener`` for each parameter change from now on (this node's included)."""
        ...

    # -- named holds: exactly one node runs a shovel or a federation link ---------------
    async def hold(self, kind: str, vhost: str, name: str) -> bool:
        """True when this node holds it now (it may run it); a hold goes with its node."""
        ...

    async def holding(self, kind: str, vhost: str, name: str) -> bool:
        """Still ours? (False once the lease is gone: stop at once.)"""
        ...

    async def release(self, kind: str, vhost: str, name: str) -> None: ...

    async def holder(self, kind: str, vhost: str, name: str) -> str | None:
        """The node holding it, if any."""
        ...

    def on_holds_changed(self, kind: str, listener: Callable[[], None]) -> None:
        """Call ``listener`` when a hold of ``kind`` may have moved (released, its node gone, our lease lost)."""
        ...

    # The last to ask wins (an MQTT client id: its newest connection stays, the older one on any node closes).
    async def take_hold(self, kind: str, vhost: str, name: str) -> int:
        """Hold it now, whoever held it before; the take's revision (0 on a single node), to compare with
        the revisions ``on_hold_taken`` reports: a take with a higher one came later."""
        ...

    def on_hold_taken(self, kind: str, listener: Callable[[str, str, str, int], None]) -> None:
        """Call ``listener(vhost, name, holder node, revision)`` for each hold of ``kind`` taken on any node."""
        ...

    # -- members ----------------------------------------------------------------------
    draining: bool

    def members(self) -> list[Member]:
        """The live nodes, in id order (a single node: itself)."""
        ...

    def owner_counts(self) -> dict[str, int]:
        """Queues each live node owns (every queue, transient ones included)."""
        ...


class Coordinator(Metadata, Protocol):
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
