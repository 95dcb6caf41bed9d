"""The seam where durable storage plugs into the core (implemented in persistence/).

Only persistent messages (delivery_mode 2) on durable queues, and durable
topology, reach a store. Every message write names the queue's epoch, the
fencing token of DESIGN.md: a store refuses a batch for a queue whose epoch has
moved on (``Fenced``), and the caller then stops serving that queue.

All methods are coroutines; the group committer (core/group_commit.py) is the
only caller on the hot path and hands the store whole batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from core.model.policy import Policy


class StoreError(Exception):
    """The store failed (unreachable, I/O error): the batch was not committed."""


class Fenced(StoreError):
    """A newer owner holds these queues: (vhost, queue) pairs."""

    def __init__(self, queues: Sequence[tuple[str, str]]) -> None:
        super().__init__(f"fenced out of {len(queues)} queue(s): " + ", ".join(f"{v}/{q}" for v, q in queues))
        self.queues = list(queues)


@dataclass
class ExchangeRecord:
    vhost: str
    name: str
    type: str
    auto_delete: bool = False
    internal: bool = False
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class QueueRecord:
    vhost: str
    name: str
    auto_delete: bool = False
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class BindingRecord:
    vhost: str
    source: str
    destination_kind: str  # "queue" or "exchange"
    destination: str
    routing_key: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class Topology:
    exchanges: list[ExchangeRecord] = field(default_factory=list)
    queues: list[QueueRecord] = field(default_factory=list)
    bindings: list[BindingRecord] = field(default_factory=list)


@dataclass
class UserRecord:
    name: str
    salt: bytes
    password_hash: bytes
    tags: list[str] = field(default_factory=list)
    vhosts: list[str] = field(default_factory=list)  # the vhosts the user may open
    loopback_only: bool = False
    # The permission regexes: {"vhosts": {vhost: [configure, write, read]},
    # "topics": {vhost: {exchange: [write, read]}}} (core.engine.broker.User.grants_record).
    permissions: dict[str, Any] = field(default_factory=dict)


@dataclass
class StoredMessage:
    """One persistent message in one durable queue, as the store keeps it."""

    vhost: str
    queue: str
    offset: int
    message_id: str
    exchange: str
    routing_key: str
    properties: bytes
    body: bytes
    enqueued_at: float
    expires_at: float | None
    delivery_count: int = 0


@dataclass(frozen=True)
class TopologyWrite:
    """One durable declaration (``delete`` False) or deletion, as the single-method calls above do it.

    A deleted exchange or queue is named by its record's vhost and name (the
    other fields are ignored); deleting one also deletes what the single
    method deletes with it (bindings, messages, epoch row, group offsets).
    """

    record: ExchangeRecord | QueueRecord | BindingRecord
    delete: bool = False


@dataclass
class Batch:
    """One group commit: what to add, remove and update, per fenced queue.

    In one transaction, in this order: the topology writes (in list order),
    the claims, the epoch check, then the message writes. A queue claimed in
    the batch needs no entry in ``epochs``: the batch fences it itself.
    """

    epochs: dict[tuple[str, str], int] = field(default_factory=dict)  # (vhost, queue) -> writer's epoch
    appends: list[StoredMessage] = field(default_factory=list)
    removals: list[tuple[str, str, int]] = field(default_factory=list)  # (vhost, queue, offset)
    delivery_counts: list[tuple[str, str, int, int]] = field(default_factory=list)  # (vhost, queue, offset, n)
    purges: list[tuple[str, str]] = field(default_factory=list)  # (vhost, queue): drop every message
    # Stream retention: (vhost, queue, first offset kept): drop every message below it.
    truncations: list[tuple[str, str, int]] = field(default_factory=list)
    # Consumer-group committed offsets: (vhost, queue, group) -> offset (latest wins).
    offsets: dict[tuple[str, str, str], int] = field(default_factory=dict)
    # Durable topology changes, and queues claimed for this node as ``claim(vhost, queue)``
    # without an epoch does it (single node: the stored epoch plus one).
    topology: list[TopologyWrite] = field(default_factory=list)
    claims: list[tuple[str, str]] = field(default_factory=list)
    # Filled by the store when the commit succeeds: the epoch each claim moved to.
    claimed: dict[tuple[str, str], int] = field(default_factory=dict)

    def __len__(self) -> int:
        return (len(self.appends) + len(self.removals) + len(self.delivery_counts) + len(self.purges)
                + len(self.truncations) + len(self.offsets) + len(self.topology) + len(self.claims))


class MessageStore(Protocol):
    description: str  # for logs and errors: backend and location, never a password

    async def open(self) -> None:
        """Connect and apply migrations; raise StoreError naming the location when unreachable."""
        ...

    async def close(self) -> None: ...

    # -- topology (rare, small) ------------------------------------------------
    async def load_topology(self) -> Topology: ...

    async def save_exchange(self, record: ExchangeRecord) -> None: ...

    async def delete_exchange(self, vhost: str, name: str) -> None:
        """Also deletes bindings from and to it."""
        ...

    async def save_queue(self, record: QueueRecord) -> None: ...

    async def delete_queue(self, vhost: str, name: str) -> None:
        """Also deletes its messages, bindings to it, its epoch row and its group offsets."""
        ...

    async def save_binding(self, record: BindingRecord) -> None: ...

    async def delete_binding(self, record: BindingRecord) -> None: ...

    # -- users and vhosts (rare; written by ``leveret users|vhosts``, read at start) --------
    async def load_users(self) -> list[UserRecord]: ...

    async def save_user(self, record: UserRecord) -> None: ...

    async def delete_user(self, name: str) -> bool: ...

    async def load_vhosts(self) -> list[str]: ...

    async def save_vhost(self, name: str) -> None: ...

    async def delete_vhost(self, name: str) -> bool:
        """Also deletes everything in it: exchanges, queues, bindings, messages, epochs."""
        ...

    async def load_vhost_limits(self) -> dict[str, dict[str, int]]:
        """RabbitMQ's vhost limits (max-connections, max-queues) of every vhost that has some."""
        ...

    async def save_vhost_limits(self, name: str, limits: dict[str, int]) -> None:
        """Replace a vhost's limits ({} removes them)."""
        ...

    # -- policies (set through the vhost, by the management API or ``leveret retention policy``) --
    async def load_policies(self) -> list[Policy]:
        """Every stored policy, user and operator, of every vhost (polled by a node each second)."""
        ...

    async def save_policy(self, policy: Policy) -> None: ...

    async def delete_policy(self, vhost: str, name: str, operator: bool) -> bool: ...

    # -- runtime parameters (/api/parameters: shovels) ------------------------------
    async def load_parameters(self) -> list[tuple[str, str, str, Any]]:
        """Every stored runtime parameter as (vhost, component, name, value), the value as JSON gave it."""
        ...

    async def save_parameter(self, vhost: str, component: str, name: str, value: Any) -> None: ...

    async def delete_parameter(self, vhost: str, component: str, name: str) -> bool: ...

    # -- ownership and messages --------------------------------------------------
    async def claim(self, vhost: str, queue: str, epoch: int | None = None) -> int:
        """Fence the queue for a new owner and return its epoch.

        With ``epoch`` (cluster mode: the etcd create revision) the row moves to
        it only if it is newer (``Fenced`` otherwise); without (single node)
        the stored epoch is bumped by one.
        """
        ...

    async def load_messages(self, vhost: str, queue: str) -> list[StoredMessage]:
        """The queue's backlog in offset order."""
        ...

    async def commit(self, batch: Batch) -> None:
        """Apply a batch atomically; Fenced if any queue's epoch moved on."""
        ...

    async def load_range(self, vhost: str, queue: str, start: int, below: int | None, limit: int
                         ) -> list[StoredMessage]:
        """Up to ``limit`` messages with ``start <= offset < below`` (no upper bound for None), in offset order.

        Streams read their older part back with it, and restore in pages.
        """
        ...

    async def load_offsets(self, vhost: str, queue: str) -> dict[str, int]:
        """A stream's consumer groups and their committed offsets."""
        ...
