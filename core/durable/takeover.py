"""The take-over of stored queues, written once for both coordinators: fence, attach storage, load, serve.

DESIGN.md's take-over steps, with the store as the judge of who owns a queue:

1. **Fence**: the store's epoch of the queue moves to the new one only if it is
   newer (``MessageStore.claim`` / ``Batch.claims``), so no write of an earlier
   owner can land from then on. ``fence`` is the coordinator's: a single node
   at start fences every stored queue in one transaction and learns each epoch
   from the store (``Durability.fence``); a cluster's epoch is the owner key's
   create revision, and it fences one queue (coordination/takeover.py).
2. **Attach storage**: the queue writes through the new epoch from now on.
3. **Load**: the backlog, marked redelivered (``Durability.load``).
4. **Serve**: publishes held while it loaded are enqueued (answered by the one
   confirm rule), consumers are served, the x-expires clock runs here.

Each queue moves through core/engine/ownership.py's states as it goes (taking
over, fenced, loading, serving) when the coordinator passes its ``Ownership``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from core.durable.durability import QueueStorage
from core.engine import publish
from core.engine.ownership import Ownership, OwnershipState

if TYPE_CHECKING:
    from core.durable.durability import Durability
    from core.durable.group_commit import GroupCommitter
    from core.engine.queue import Queue

VQ = tuple[str, str]
Fence = Callable[[Sequence["Queue"]], Awaitable[dict[VQ, int]]]


async def fence_and_load(queues: Sequence[Queue], fence: Fence, durability: Durability, node: str,
                         ownership: Ownership | None = None) -> int:
    """Steps 1-3 for ``queues``; the messages loaded. A queue not yet taken over in ``ownership``
    (a single node, whose epoch only the fence gives) is taken over under the fenced epoch."""
    epochs = await fence(queues)
    loaded = 0
    for q in queues:
        vq = (q.vhost, q.name)
        epoch = epochs[vq]
        if ownership is not None:
            if ownership.state(vq) is OwnershipState.NOT_OWNED:
                ownership.take_over(vq, epoch)
            ownership.fence(vq)
        q.reset_ready()  # what an earlier incarnation had here is stale: the store's copy is the backlog
        q.attach_storage(QueueStorage(vq[0], vq[1], durability.committer, epoch))
        if ownership is not None:
            ownership.load(vq)
        loaded += await durability.load(q, node)  # marked redelivered
    return loaded


def serve(q: Queue, ownership: Ownership | None, committer: GroupCommitter | None,
          held: Sequence[Any] = ()) -> None:
    """Step 4: the queue is served from now on; ``held``: (message, confirm callbacks) that waited."""
    if ownership is not None:
        ownership.serve((q.vhost, q.name))
    flush_held(q, held, committer)
    q.default.dispatch()
    q.touch()  # the x-expires clock runs on the owner


def flush_held(q: Queue, held: Sequence[Any], committer: GroupCommitter | None) -> None:
    """Publishes held while the queue loaded (or was handed over): enqueued now, answered by the one confirm rule."""
    for message, cbs in held:
        outcome = publish.publish_to(q, message, committer, track=bool(cbs))
        for cb in cbs:
            outcome.on_settled(cb)
