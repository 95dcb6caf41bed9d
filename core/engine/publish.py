"""The one publish path: accept a message, route and enqueue it, and say when it may be confirmed.

Every front end goes through here (AMQP's channel, the gRPC Push / PushBatch
and Streams.Publish, the owner's side of a forwarded batch, the held publishes
a queue's new owner flushes), so the confirm rule is written once:

- a classic queue with a store confirms a persistent message (delivery mode 2)
  after the group commit that wrote it, a transient one at once;
- a stream with a store confirms every message after its commit, whatever its
  delivery mode: a stream stores everything (``StreamQueue.stores``);
- a queue another node owns (``Queue.remote``) confirms when the owner
  answers, which it does after its own commit by the same rule;
- a queue that refused the message (x-overflow reject-publish) makes the
  publish a failure at once (AMQP: basic.nack);
- without a store (a node with no durability), at once.

Sender-selected distribution (RabbitMQ's extension): a message whose headers
carry ``CC`` or ``BCC`` (arrays of strings) is routed by its routing key and
by each of those keys; ``BCC`` is taken out of the headers before any queue
sees the message (``CC`` stays). Only a message with a headers table that
mentions them pays for it: the property scan knows where the table is.

A publish routed to several queues is settled when all of them are: one
``Outcome`` with one settled signal, read by a callback (the sans-IO AMQP
channel, which must not await) or awaited (the asyncio layers). See
docs/notes/publish.md.

This module must not import core.cluster: a remote queue is reached through
its ``remote`` port (core/ports/remote.py: forward on enqueue, ``when_forwarded``
for the answer).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from core.engine import direct_reply
from core.model import properties
from core.model.message import Message

if TYPE_CHECKING:
    from core.engine.broker import Broker
    from core.engine.exchange import Exchange
    from core.engine.queue import Queue, Remote
    from core.engine.vhost import VirtualHost
    from core.ports.storage import Committer

Settled = Callable[[bool], None]


# Refuse a message whose properties do not decode (502 SYNTAX_ERROR).
# ``properties.scan`` (which made the summary) checked the property list; this
# walks the headers table, nesting and bounds included, without building it.
# Called once when a front end accepts a message, so routing, the headers
# exchange, dead-lettering, expiry, the stores and consumers never meet
# malformed bytes. Callers test ``summary.headers_at >= 0`` first, so a
# message without headers costs one comparison. An alias, not a wrapper: one
# call less per message with headers.
check: Callable[[bytes, properties.PropertySummary], None] = properties.check


class Outcome:
    """What became of one publish (or one forwarded batch) and when it is settled.

    ``routed``: some queue (or a direct reply-to consumer) took it; ``accepted``:
    no queue refused it. ``settled`` becomes True once the local commit and
    every remote owner answered; ``ok`` says whether all of them succeeded,
    ``error`` why not. Read it with ``on_settled`` (called at once if already
    settled) or ``await outcome.wait()``.
    """

    __slots__ = ("routed", "accepted", "ok", "error", "settled", "needs_commit", "_pending", "_callbacks")

    def __init__(self, routed: bool = True, accepted: bool = True, settled: bool = False) -> None:
        self.routed = routed
        self.accepted = accepted
        self.ok = accepted
        self.error: str | None = None if accepted else "a queue refused the message (x-overflow)"
        self.settled = settled
        self.needs_commit = False
        # Answers still awaited, plus one for the publish itself until ``seal``.
        self._pending = 1
        self._callbacks: list[Settled] | None = None

    # -- reading it ----------------------------------------------------------------
    def on_settled(self, done: Settled) -> None:
        """``done(ok)`` once settled (now, if it is)."""
        if self.settled:
            done(self.ok)
        elif self._callbacks is None:
            self._callbacks = [done]
        else:
            self._callbacks.append(done)

    async def wait(self) -> bool:
        """Wait until settled; whether it succeeded."""
        if not self.settled:
            fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

            def done(ok: bool) -> None:
                if not fut.done():
                    fut.set_result(ok)

            self.on_settled(done)
            await fut
        return self.ok

    # -- building it (this module and the owner side of forwarding) ----------------
    def wait_for_owner(self, remote: Remote) -> None:
        """The message just forwarded through ``remote``: settled also by its owner's answer."""
        self._pending += 1
        remote.when_forwarded(self._owner_answer)

    def seal(self, committer: Committer | None) -> Outcome:
        """Everything is enqueued: wait for the commit if a store took the message, then settle."""
        if self.needs_commit:
            assert committer is not None, "a queue with a store on a broker without a committer"
            self._pending += 1
            committer.when_committed(self._store_answer)
        self._answer(True, None)
        return self

    def _owner_answer(self, ok: bool) -> None:
        self._answer(ok, None if ok else "the queue's owner did not accept the message; retry")

    def _store_answer(self, error: BaseException | None) -> None:
        self._answer(error is None, None if error is None else f"the store did not commit the message: {error}")

    def _answer(self, ok: bool, error: str | None) -> None:
        if not ok and self.ok:
            self.ok = False
            self.error = error
        self._pending -= 1
        if self._pending == 0 and not self.settled:
            self.settled = True
            callbacks, self._callbacks = self._callbacks, None
            if callbacks is not None:
                for done in callbacks:
                    done(self.ok)


# Settled outcomes shared by every publish that needs no answer (the hot path
# allocates nothing for them).
ROUTED = Outcome(settled=True)
UNROUTED = Outcome(routed=False, settled=True)
REFUSED = Outcome(accepted=False, settled=True)


def _enqueue(queues: list[Queue] | tuple[Queue, ...], message: Message, committer: Committer | None,
             track: bool) -> Outcome:
    if not track:
        # Nobody waits for the answer (no confirms, no tx): enqueue and say what happened.
        refused = False
        for q in queues:
            if not q.enqueue(message):
                refused = True
        return REFUSED if refused else ROUTED
    outcome: Outcome | None = None
    refused = False
    needs_commit = False
    for q in queues:
        if not q.enqueue(message):
            refused = True
        elif q.remote is not None:
            if outcome is None:
                outcome = Outcome()
            outcome.wait_for_owner(q.remote)
        elif q.storage is not None and q.stores(message):
            needs_commit = True
    if refused:
        # Nacked at once, whatever else is pending (as before: a refusal is final).
        return REFUSED
    if outcome is None:
        if not needs_commit:
            return ROUTED
        outcome = Outcome()
    outcome.needs_commit = needs_commit
    return outcome.seal(committer)


def publish(broker: Broker, vhost: VirtualHost, exchange: Exchange | None, message: Message,
            track: bool = True) -> Outcome:
    """Route ``message`` through ``exchange`` (None: the default exchange) and enqueue it.

    ``track`` False (a publisher that waits for nothing) skips registering for
    the answers and returns a settled outcome.
    """
    if message.summary.headers_at >= 0 and b"CC" in message.props:
        keys, message = sender_selected(message)
        if len(keys) > 1:
            queues = vhost.route_keys(exchange, message, keys)
            return _enqueue(queues, message, broker.committer, track) if queues else UNROUTED
    routing_key = message.routing_key
    if exchange is None:
        # The default exchange: the routing key names the queue.
        q = vhost.queues.get(routing_key)
        if q is not None:
            if not track:  # the commonest publish, kept to one call (bench.inprocess)
                return ROUTED if q.enqueue(message) else REFUSED
            return _enqueue((q,), message, broker.committer, track)
        if routing_key.startswith(direct_reply.PREFIX):
            return ROUTED if broker.reply_to.deliver(routing_key, message) else UNROUTED
        return UNROUTED
    queues = vhost.route(exchange, message)
    if not queues:
        return UNROUTED
    return _enqueue(queues, message, broker.committer, track)


def _keys(value: object) -> list[str]:
    """The routing keys of a CC or BCC header: an array of strings (anything else is no key, as RabbitMQ)."""
    if not isinstance(value, list):
        return []
    keys = []
    for item in value:
        if isinstance(item, bytes | bytearray):
            item = bytes(item).decode("utf-8", "replace")
        if isinstance(item, str):
            keys.append(item)
    return keys


def sender_selected(message: Message) -> tuple[tuple[str, ...], Message]:
    """The keys ``message`` is routed by (its routing key, then CC's, then BCC's) and the message to
    enqueue: ``message`` itself, or without ``BCC`` in its headers when it had one.

    A direct reply-to is routed by its own key only (the reply goes to one requester).
    """
    headers = message.headers
    if "CC" not in headers and "BCC" not in headers:
        return (message.routing_key,), message
    keys = (message.routing_key, *_keys(headers.get("CC")), *_keys(headers.get("BCC")))
    if message.exchange == "" and message.routing_key.startswith(direct_reply.PREFIX):
        keys = (message.routing_key,)
    if "BCC" in headers:
        rest = {name: value for name, value in headers.items() if name != "BCC"}
        props = properties.with_headers(message.props, rest)
        message = Message(message.exchange, message.routing_key, props, message.body, None, message.node,
                          message.timestamp)
    return keys, message


def publish_to(queue: Queue, message: Message, committer: Committer | None, track: bool = True) -> Outcome:
    """Enqueue ``message`` into ``queue`` itself (gRPC Push, Streams.Publish, held publishes)."""
    return _enqueue((queue,), message, committer, track)


def enqueue_batch(queue: Queue, messages: list[Message], outcome: Outcome) -> list[bool]:
    """A batch another node forwarded to this owner: which were accepted; ``outcome`` learns of the commit.

    Refusals are answered per message (the list), so they do not fail ``outcome``.
    """
    oks = queue.enqueue_many(messages)
    if queue.storage is not None and not outcome.needs_commit:
        stores = queue.stores
        outcome.needs_commit = any(ok and stores(m) for ok, m in zip(oks, messages, strict=True))
    return oks
