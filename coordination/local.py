"""The coordinator of a single node: the same interface as etcd's, in process (DESIGN.md, "local").

There is nobody to agree with, so every call applies its change to the local
vhost at once, with the checks of any declaration (403, 404, 405, 406 raised
by the call itself). What makes it a coordinator rather than a pass-through is
the promise every coordinator keeps: a durable declaration, binding or
deletion is answered only once it is stored. Here that is the store, through
the group committer: the change is queued there as the vhost makes it, and
the call returns a wait for its commit (grouped with every other write of the
same loop turn). A transient change, or a durable one when nothing is pending,
returns ``Immediate`` and the front end replies at once. When the commit
fails (the store is down) the change is refused with 541: the client was
promised nothing, and the write is retried until the store takes it, since
the vhost holds the change already.

Ownership is trivial: one node owns every queue, under a lease that never
ends. It is recorded in the engine's ownership state machine all the same
(core/engine/ownership.py, shared with etcd's coordinator): at start
``take_over_stored_queues`` runs the take-over both coordinators share
(core/durable/takeover.py): it fences every stored queue in one store
transaction (epoch + 1, the store as the only judge), attaches storage, loads
each backlog, moving each queue through take over, fence and load, and only
then serves; a queue declared later is claimed as it is made, and forgotten
when deleted.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from coordination.metadata import StoredMetadata
from core.durable.durability import binding_is_stored, is_stored
from core.durable.takeover import fence_and_load, serve
from core.engine.exchange import Exchange
from core.engine.ownership import Lease, Ownership
from core.engine.queue import Queue
from core.model.errors import InternalError
from core.ports.coordinator import Immediate, Member
from core.ports.store import StoreError

if TYPE_CHECKING:
    from core.durable.durability import Durability
    from core.engine.broker import Broker
    from core.engine.vhost import VirtualHost
    from core.model.message import QueuedMessage
    from core.ports.store import MessageStore

T = TypeVar("T")


class StoreUnavailable(InternalError):
    """A durable change could not be stored now: it is refused (541), never answered as stored."""


class LocalCoordinator(StoredMetadata):
    """core.ports.coordinator.Coordinator for one node with no etcd.

    Its metadata side (users, vhosts, policies, parameters: coordination/metadata.py) writes the
    store and delivers this node's own parameter changes; every hold is this node's; it is the
    only member and owns every queue.
    """

    def __init__(self, node_id: str = "leveret", broker: Broker | None = None,
                 store: MessageStore | None = None) -> None:
        super().__init__(broker, store)
        self.node_id = node_id
        self.region = ""  # what members() says of this node (the node sets them)
        self.amqp = ""
        self.grpc = ""
        self.started = time.time()
        self.draining = False
        # Stored queues only: a transient queue has no epoch to fence and nothing to load.
        self.ownership = Ownership(Lease.forever())
        self._watched: set[int] = set()  # vhosts whose deletions forget ownership (id of the vhost)

    # -- ownership ---------------------------------------------------------------------
    async def take_over_stored_queues(self, durability: Durability, queues: list[Queue],
                                      vhosts: Iterable[VirtualHost] = ()) -> int:
        """Own every queue restored from the store: fence them all (epoch + 1, one transaction), attach
        their storage, load their backlogs, serve them (core/durable/takeover.py, as a cluster does)."""
        for vhost in vhosts:
            self._watch(vhost)
        stored = [q for q in queues if q.storage is not None]
        messages = await fence_and_load(stored, durability.fence, durability, self.node_id, self.ownership)
        for q in stored:
            serve(q, self.ownership, durability.committer)
        return messages

    def _claim(self, q: Queue) -> None:
        vq = (q.vhost, q.name)
        if q.storage is not None and not self.ownership.owning(vq):
            self.ownership.claim(vq, q.storage.epoch)

    def _watch(self, vhost: VirtualHost) -> None:
        """However a queue of ``vhost`` goes (delete, auto-delete, x-expires), its record goes too."""
        if id(vhost) not in self._watched:
            self._watched.add(id(vhost))
            vhost.on_queue_deleted.append(lambda q: self.ownership.forget((q.vhost, q.name)))

    # -- stored before answered -------------------------------------------------------
    @staticmethod
    def _answer(vhost: VirtualHost, durable: bool, value: T) -> Awaitable[T]:
        """``value`` once every topology write so far is stored; at once for a transient change."""
        durability = vhost.durability
        if not durable or durability is None or not durability.committer.topology_pending():
            return Immediate(value)
        committer = durability.committer

        async def stored() -> T:
            try:
                await committer.topology_stored()
            except StoreError as exc:
                raise StoreUnavailable(
                    f"the store did not take this change ({exc}); it applies here and is written once the store "
                    "is back; declare it again to learn when it is stored"
                ) from None
            return value

        return stored()

    # -- declarations -------------------------------------------------------------------
    def declare_exchange(
        self, vhost: VirtualHost, name: str, type_: str, durable: bool, auto_delete: bool, internal: bool,
        arguments: dict[str, Any],
    ) -> Awaitable[None]:
        x = vhost.declare_exchange(name, type_, durable=durable, auto_delete=auto_delete, internal=internal,
                                   arguments=arguments)
        return self._answer(vhost, is_stored(x), None)

    def delete_exchange(self, vhost: VirtualHost, name: str, if_unused: bool) -> Awaitable[None]:
        x = vhost.exchanges.get(name)
        vhost.delete_exchange(name, if_unused=if_unused)
        return self._answer(vhost, x is not None and is_stored(x), None)

    def declare_queue(
        self, vhost: VirtualHost, name: str, owner: object, durable: bool, exclusive: bool, auto_delete: bool,
        arguments: dict[str, Any],
    ) -> Awaitable[Queue]:
        q = vhost.declare_queue(name, owner, durable=durable, exclusive=exclusive, auto_delete=auto_delete,
                                arguments=arguments)
        self._watch(vhost)
        self._claim(q)
        return self._answer(vhost, is_stored(q), q)

    def delete_queue(
        self, vhost: VirtualHost, name: str, owner: object, if_unused: bool, if_empty: bool
    ) -> Awaitable[int]:
        q = vhost.queues.get(name)
        count = vhost.delete_queue(name, owner, if_unused=if_unused, if_empty=if_empty)
        return self._answer(vhost, q is not None and is_stored(q), count)

    def bind(
        self, vhost: VirtualHost, source: str, kind: str, destination: str, routing_key: str, arguments: dict[str, Any],
        add: bool,
    ) -> Awaitable[None]:
        dest: Queue | Exchange | None = (
            vhost.queues.get(destination) if kind == "queue" else vhost.exchanges.get(destination)
        )
        if dest is None:
            if add:  # the front ends look the destination up first; this is a race with its deletion
                if kind == "queue":
                    vhost.get_queue(destination)
                vhost.get_exchange(destination)
            return Immediate(None)  # unbinding what is gone succeeds, as in RabbitMQ
        x = vhost.exchanges.get(source)  # before an unbind may auto-delete it
        if add:
            vhost.bind(source, dest, routing_key, arguments)
        else:
            vhost.unbind(source, dest, routing_key, arguments)
        return self._answer(vhost, x is not None and binding_is_stored(x, dest), None)

    # -- queue operations (the owner is this node) -------------------------------------------
    def counts(self, queue: Queue) -> Awaitable[tuple[int, int]]:
        return Immediate((queue.message_count, queue.consumer_count))

    def purge(self, queue: Queue) -> Awaitable[int]:
        return Immediate(queue.purge())

    def get(self, queue: Queue, no_ack: bool) -> Awaitable[tuple[QueuedMessage | None, int]]:
        queue.touch()  # basic.get counts as use for x-expires
        qm = queue.default.get(no_ack)
        if qm is None and queue.default.head_loading():
            return self._get_paged(queue, no_ack)  # the head is being read from the store: wait for it
        return Immediate((qm, len(queue.default.ready)))

    async def _get_paged(self, queue: Queue, no_ack: bool) -> tuple[QueuedMessage | None, int]:
        qm = await queue.default.get_loaded(no_ack)
        return qm, len(queue.default.ready)

    # -- holds: one node holds everything -------------------------------------------------
    async def hold(self, kind: str, vhost: str, name: str) -> bool:
        return True

    async def holding(self, kind: str, vhost: str, name: str) -> bool:
        return True

    async def release(self, kind: str, vhost: str, name: str) -> None:
        return None

    async def holder(self, kind: str, vhost: str, name: str) -> str | None:
        return self.node_id

    def on_holds_changed(self, kind: str, listener: Callable[[], None]) -> None:
        return None  # nothing ever moves away from the only node

    async def take_hold(self, kind: str, vhost: str, name: str) -> int:
        return 0

    def on_hold_taken(self, kind: str, listener: Callable[[str, str, str, int], None]) -> None:
        return None  # no other node takes anything

    # -- members --------------------------------------------------------------------------
    def owner_counts(self) -> dict[str, int]:
        """This node owns every queue (transient ones too, as a cluster's owner keys count them)."""
        broker = self._broker
        return {self.node_id: sum(len(vh.queues) for vh in broker.vhosts.values()) if broker is not None else 0}

    def members(self) -> list[Member]:
        return [Member(self.node_id, self.region, self.amqp, self.grpc, self.owner_counts()[self.node_id],
                       self.draining, self.started)]
