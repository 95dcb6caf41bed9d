"""The native gRPC API (``leveret.v1.Broker``) on top of the core.

It mirrors amqp_frontend/channel.py: a push is a publish to the default
exchange with the topic as routing key, straight into one queue; a
subscription is a ``Consumer`` on one ``QueueChannel`` and implements
``core.engine.queue.ConsumerSink`` (credit = prefetch, deliveries gathered and sent
several per stream response). A native channel is an extra ``QueueChannel``
on the queue with a topic filter; the queue's default channel (id
``"<queue>/"``) is the one AMQP consumers share.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from core.engine import access, entry, flow, limits, publish
from core.engine.broker import Broker, User
from core.engine.publish import Outcome
from core.engine.queue import Consumer, Queue, QueueChannel
from core.engine.stream import StreamQueue
from core.engine.topic import topic_matches
from core.engine.vhost import VirtualHost
from core.model import properties
from core.model.errors import AccessRefused, BrokerError
from core.model.message import Message, QueuedMessage
from leveret_client.proto import leveret_pb2 as pb
from leveret_client.proto import leveret_pb2_grpc as pb_grpc

log = logging.getLogger("leveret.grpc")

DEFAULT_PREFETCH = 1000
DEFAULT_BATCH = 512
# PushBatch handles this many messages per loop turn (~2-3 ms here), so a big batch
# cannot keep the loop from other clients' acks and heartbeats (docs/notes/flow.md).
PUSH_SLICE = 256
# A publisher-chosen message id (PushRequest.id) at most this long, as an AMQP shortstr.
MAX_ID = 255
# Auto-ack subscriptions stop taking messages while this many wait to be sent.
AUTO_ACK_BUFFER = 4096

# The owner of queues declared through the native API (never exclusive).
GRPC_OWNER = object()

_STATUS = {
    404: grpc.StatusCode.NOT_FOUND,
    403: grpc.StatusCode.PERMISSION_DENIED,
    405: grpc.StatusCode.FAILED_PRECONDITION,
    406: grpc.StatusCode.FAILED_PRECONDITION,
    530: grpc.StatusCode.PERMISSION_DENIED,
    540: grpc.StatusCode.UNIMPLEMENTED,
    502: grpc.StatusCode.INVALID_ARGUMENT,  # properties or headers that do not decode
}

_TRANSIENT = (properties.EMPTY, properties.scan(properties.EMPTY))
_PERSISTENT_RAW = properties.encode({"delivery_mode": 2})
_PERSISTENT = (_PERSISTENT_RAW, properties.scan(_PERSISTENT_RAW))

_PROPERTY_NAMES = {name for _bit, name, _kind in properties.FIELDS} - {"headers"}
_INT_PROPERTIES = {"delivery_mode", "priority", "timestamp"}


def status_of(exc: BrokerError) -> grpc.StatusCode:
    return _STATUS.get(exc.code, grpc.StatusCode.INTERNAL)


class ApiError(Exception):
    """A refusal with its gRPC status (raised inside handlers, turned into an abort)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


# -- properties ---------------------------------------------------------------
def message_properties(
    user: User, given: Any, persistent: bool
) -> tuple[bytes, properties.PropertySummary]:
    """A pushed message's property bytes and summary, past the entry checks every front end makes
    (core/engine/entry.py: no other user's id, an expiration in milliseconds)."""
    if not len(given):
        return _PERSISTENT if persistent else _TRANSIENT
    props = encode_properties(dict(given), persistent)
    summary = properties.scan(props)
    entry.check_properties(summary, user.name)
    return props, summary


def encode_properties(props: dict[str, str], persistent: bool) -> bytes:
    """A Push's string map as AMQP basic properties (unknown names become headers)."""
    out: dict[str, Any] = {}
    headers: dict[str, Any] = {}
    for key, value in props.items():
        if key in _PROPERTY_NAMES:
            if key in _INT_PROPERTIES:
                try:
                    out[key] = int(value)
                except ValueError:
                    raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, f"property {key} must be an integer") from None
            else:
                out[key] = value
        else:
            headers[key] = value
    if headers:
        out["headers"] = headers
    out["delivery_mode"] = 2 if persistent else out.get("delivery_mode", 1)
    try:
        return properties.encode(out)
    except (properties.PropertiesError, ValueError, TypeError) as exc:
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, f"properties do not encode: {exc}") from None


def _text(value: Any) -> str:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


_decoded: dict[bytes, dict[str, str]] = {}


def decode_properties(raw: bytes) -> dict[str, str]:
    """AMQP properties as the string map of a Delivery (cached: few distinct encodings occur)."""
    cached = _decoded.get(raw)
    if cached is not None:
        return cached
    out: dict[str, str] = {}
    try:
        decoded = properties.decode(raw)
    except properties.PropertiesError:
        decoded = {}
    for key, value in decoded.items():
        if key == "headers":
            for hk, hv in value.items():
                out.setdefault(hk, _text(hv))
        else:
            out[key] = _text(value)
    if len(_decoded) > 1024:
        _decoded.clear()
    _decoded[raw] = out
    return out


# -- filters ------------------------------------------------------------------
def make_filter(kind: int, topic: str) -> tuple[int, Callable[[str], bool] | None]:
    if kind == pb.FILTER_AUTO:
        if not topic:
            kind = pb.FILTER_NONE
        elif "*" in topic or "#" in topic:
            kind = pb.FILTER_PATTERN
        else:
            kind = pb.FILTER_EXACT
    if kind == pb.FILTER_NONE:
        return kind, None
    if kind == pb.FILTER_EXACT:
        return kind, topic.__eq__
    if kind == pb.FILTER_PREFIX:
        return kind, lambda rk: rk.startswith(topic)
    if kind == pb.FILTER_PATTERN:
        return kind, lambda rk: topic_matches(topic, rk)
    raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, f"unknown filter kind {kind}")


# -- subscriptions ------------------------------------------------------------
class Subscription:
    """One Subscribe stream: a consumer on a queue channel, and its ConsumerSink."""

    def __init__(self, api: BrokerServicer, qch: QueueChannel, prefetch: int, auto_ack: bool, max_batch: int,
                 owner: tuple[str, str] = ("", "")) -> None:
        self.api = api
        self.qch = qch
        # (user, vhost) that subscribed: only the same login may settle these deliveries.
        self.owner = owner
        self.prefetch = prefetch
        self.auto_ack = auto_ack
        self.max_batch = max_batch
        self.pending: deque[tuple[int, QueuedMessage]] = deque()
        self.unacked: dict[int, QueuedMessage] = {}
        self.wakeup = asyncio.Event()
        self.cancelled = False
        self.closed = False
        tag = f"grpc-{os.urandom(6).hex()}"
        self.consumer = Consumer(tag, qch, self, no_ack=auto_ack, prefetch=prefetch)

    # ConsumerSink
    def has_credit(self, consumer: Consumer) -> bool:
        if self.closed:
            return False
        if self.auto_ack:
            return len(self.pending) < AUTO_ACK_BUFFER
        return consumer.unacked < self.prefetch

    def deliver(self, consumer: Consumer, qm: QueuedMessage) -> None:
        did = next(self.api.delivery_ids)
        if not self.auto_ack:
            self.unacked[did] = qm
            self.api.deliveries[did] = self
            self.api.broker.stats.delivered_consume_manual_ack += 1
        else:
            self.api.broker.stats.delivered_consume_auto_ack += 1
        self.pending.append((did, qm))
        self.wakeup.set()

    def consumer_cancelled(self, consumer: Consumer) -> None:
        self.cancelled = True
        self.wakeup.set()

    # settlement
    def settle(self, did: int) -> None:
        qm = self.unacked.pop(did)
        self.qch.settle(qm, self.consumer)
        self.api.broker.stats.acknowledged += 1

    def take_batch(self) -> pb.SubscribeResponse:
        response = pb.SubscribeResponse()
        add = response.messages.add  # add() in place: ~2.5x cheaper than building a list of Delivery
        pending = self.pending
        empty = properties.EMPTY
        for _ in range(min(len(pending), self.max_batch)):
            did, qm = pending.popleft()
            m = qm.message
            d = add(
                delivery_id=did,
                id=m.id,
                topic=m.routing_key,
                content=m.body if type(m.body) is bytes else bytes(m.body),
                offset=qm.offset,
                timestamp_ms=int(m.timestamp * 1000),
                redelivered=qm.redelivered,
                delivery_count=qm.delivery_count,
            )
            if m.props != empty:
                d.properties.update(decode_properties(m.props))
        return response

    def close(self) -> None:
        """The stream ended: the consumer goes, what it held unacked is requeued."""
        if self.closed:
            return
        self.closed = True
        self.qch.remove_consumer(self.consumer)
        for did in self.unacked:
            self.api.deliveries.pop(did, None)
        if self.unacked and not self.qch.queue.deleted:
            items = [(qm, self.consumer) for qm in self.unacked.values()]
            self.unacked.clear()
            self.qch.requeue(items)
        self.pending.clear()


# -- the servicer -------------------------------------------------------------
class BrokerServicer(pb_grpc.BrokerServicer):
    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.delivery_ids = itertools.count(1)
        self.deliveries: dict[int, Subscription] = {}
        self.watchers: list[Watcher] = []
        # Live streams (Subscribe, WatchCluster, Streams.Subscribe): each checks again, when its
        # user changes, that the user may still read; one that may not ends (docs/SECURITY.md).
        self.live: set[LiveCall] = set()
        broker.on_user_changed.append(self._user_changed)
        self._channel_names = itertools.count(1)
        # (username, password, peer host) -> user: one PBKDF2 check per client, not per call.
        self._logins: dict[tuple[str, bytes, str | None], User] = {}
        # This node's --region and, in a cluster, the live members (set by the
        # node's wiring: core cannot ask the coordinator's mirror itself).
        self.region = ""
        # Each member: NodeEntry's fields (id, region, grpc, amqp, queues, draining).
        self.members: Callable[[], list[dict[str, Any]]] | None = None
        self._observed: dict[str, VirtualHost] = {}
        self._observe_all()

    # -- plumbing ----------------------------------------------------------------
    def _observe_all(self) -> None:
        """Queue events of every vhost, those added since the last call too (a new watch calls it)."""
        for vh in self.broker.vhosts.values():
            if self._observed.get(vh.name) is not vh:  # new, or deleted and declared again
                self._observed[vh.name] = vh
                self._observe(vh)

    def _observe(self, vh: VirtualHost) -> None:
        vh.on_queue_declared.append(lambda q: self._event(pb.ClusterEvent.QUEUE_CREATED, q))
        vh.on_queue_deleted.append(lambda q: self._event(pb.ClusterEvent.QUEUE_DELETED, q))

    def _event(self, kind: int, q: Queue) -> None:
        if not self.watchers:
            return
        ev = pb.ClusterEvent(
            kind=kind,  # type: ignore[arg-type]
            node=self.broker.node_id,
            vhost=q.vhost,
            queue=q.name,
            timestamp_ms=int(time.time() * 1000),
        )
        self._tell_watchers(ev)

    def _tell_watchers(self, ev: pb.ClusterEvent) -> None:
        """Each watcher sees node events, and queue events of the vhosts its user may use (no names
        of other tenants' queues)."""
        users = self.broker.users
        for w in self.watchers:
            if ev.vhost:
                user = users.get(w.user)
                if user is None or ev.vhost not in user.vhosts:
                    continue
            w.events.put_nowait(ev)

    def _user_changed(self, name: str) -> None:
        for live in [c for c in self.live if c.user == name]:
            reason = revoked(self.broker, live.user, live.vhost, live.queues)
            if reason is not None:
                live.end(reason, deleted=live.user not in self.broker.users)

    _CLUSTER_KINDS = {
        "node-added": pb.ClusterEvent.NODE_ADDED,
        "node-lost": pb.ClusterEvent.NODE_LOST,
        "queue-moved": pb.ClusterEvent.QUEUE_MOVED,
    }

    def cluster_event(self, kind: str, node: str, vhost: str = "", queue: str = "") -> None:
        """Membership and ownership changes seen by the cluster coordinator."""
        code = self._CLUSTER_KINDS.get(kind)
        if code is None or not self.watchers:
            return
        ev = pb.ClusterEvent(kind=code, node=node, vhost=vhost, queue=queue,  # type: ignore[arg-type]
                             timestamp_ms=int(time.time() * 1000))
        self._tell_watchers(ev)

    def close(self) -> None:
        """Server stopping: end every watch stream."""
        for w in self.watchers:
            w.events.put_nowait(pb.ClusterEvent(kind=pb.ClusterEvent.KIND_UNSPECIFIED))

    async def login(self, context: grpc.aio.ServicerContext) -> tuple[User, VirtualHost]:
        """The caller's user and vhost. Credentials that already logged in here (and whose user has
        not changed since) answer at once; others go through ``Broker.login``: the address's turn
        and delay, then the KDF off the event loop, so guessers never stall other clients."""
        md = {k: v for k, v in (context.invocation_metadata() or ())}
        username, password = md.get("username"), md.get("password")
        if not isinstance(username, str) or not isinstance(password, str):
            raise ApiError(grpc.StatusCode.UNAUTHENTICATED, "send the metadata 'username' and 'password'")
        host = _peer_host(context.peer())
        key = (username, hashlib.sha256(password.encode()).digest(), host)
        user = self._logins.get(key)
        if user is None or self.broker.users.get(username) is not user:
            try:
                user = await self.broker.login(username, password, host)
            except BrokerError as exc:
                # Broker.login has already waited the address's delay (core/engine/login_throttle.py).
                raise ApiError(grpc.StatusCode.UNAUTHENTICATED, exc.text) from None
            if len(self._logins) > 1024:
                self._logins.clear()
            self._logins[key] = user
        vhost = md.get("vhost") or "/"
        vh = self.broker.open_vhost(user, str(vhost))
        return user, vh

    def grants(self, user: User, vh: VirtualHost) -> access.Grants:
        """The AMQP permission checks (core/engine/access.py), mapped: CreateQueue, DeleteQueue,
        CreateChannel and DeleteChannel are configure on the queue; Push and PushBatch are a
        publish to the default exchange (write on ``amq.default``); Subscribe is read on the queue."""
        return self.broker.access.grants(user.name, vh.name)

    @staticmethod
    def _queue(vh: VirtualHost, name: str) -> Queue:
        if not name:
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, "a queue name is required")
        return vh.get_queue(name, GRPC_OWNER)

    def _channel(self, vh: VirtualHost, channel_id: str) -> QueueChannel:
        queue, sep, name = channel_id.rpartition("/")
        if not sep or not queue:
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, f"channel id {channel_id!r} is not '<queue>/<name>'")
        q = self._not_stream(self._queue(vh, queue))
        for ch in q.channels:
            if ch.name == name:
                return ch
        raise ApiError(grpc.StatusCode.NOT_FOUND, f"no channel '{name}' on queue '{queue}' in vhost '{vh.name}'")

    @staticmethod
    def _owned_here(q: Queue, what: str) -> None:
        """Extra channels are the owner's (publishes are filtered there); the default channel works anywhere."""
        if q.remote is not None:
            owner = q.remote.owner or "(being replaced)"
            raise ApiError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"queue '{q.name}' is owned by node {owner}: in a cluster, {what} on the owner "
                           "(`leveret cluster status` names it); the default channel is served by any node")

    @staticmethod
    def _not_stream(q: Queue) -> Queue:
        if isinstance(q, StreamQueue):
            raise ApiError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"'{q.name}' is a stream: read it with leveret.v1.Streams/Subscribe (docs/STREAMS.md)")
        return q

    @staticmethod
    def _queue_info(q: Queue) -> pb.QueueInfo:
        return pb.QueueInfo(
            name=q.name, durable=q.durable, messages=q.message_count, consumers=q.consumer_count,
            channels=len(q.channels), auto_delete=q.auto_delete, exclusive=q.exclusive,
        )

    @staticmethod
    def _channel_info(ch: QueueChannel) -> pb.ChannelInfo:
        kind, topic = getattr(ch, "grpc_filter", (pb.FILTER_NONE, ""))
        return pb.ChannelInfo(
            id=f"{ch.queue.name}/{ch.name}", queue=ch.queue.name, name=ch.name, topic=topic, kind=kind,
            ready=len(ch.ready), unacked=ch.unacked, consumers=len(ch.consumers),
        )

    # -- queues ------------------------------------------------------------------
    async def CreateQueue(self, request: pb.CreateQueueRequest, context: Any) -> pb.QueueInfo:
        async with _errors(context):
            user, vh = await self.login(context)
            if not request.name:
                raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, "a queue name is required")
            access.check(self.grants(user, vh), "configure", "queue", request.name)
            limits.check_queue(vh.name, self.broker.vhost_limits.get(vh.name, {}), vh.queues, request.name)
            if request.name in vh.queues and not request.exist_ok:
                raise ApiError(grpc.StatusCode.ALREADY_EXISTS,
                               f"queue '{request.name}' already exists in vhost '{vh.name}'")
            arguments: dict[str, Any] = {}
            if request.max_length:
                arguments["x-max-length"] = request.max_length
            if request.message_ttl_ms:
                arguments["x-message-ttl"] = request.message_ttl_ms
            q = await self.broker.coordinator.declare_queue(vh, request.name, GRPC_OWNER, request.durable, False,
                                                        request.auto_delete, arguments)
            return self._queue_info(q)
        raise AssertionError("unreachable")

    async def DeleteQueue(self, request: pb.DeleteQueueRequest, context: Any) -> pb.DeleteQueueResponse:
        async with _errors(context):
            user, vh = await self.login(context)
            access.check(self.grants(user, vh), "configure", "queue", request.name)
            self._queue(vh, request.name)  # NOT_FOUND for a missing queue, unlike AMQP
            n = await self.broker.coordinator.delete_queue(vh, request.name, GRPC_OWNER, request.if_unused,
                                                       request.if_empty)
            return pb.DeleteQueueResponse(messages_dropped=n)
        raise AssertionError("unreachable")

    async def ListQueues(self, request: pb.ListQueuesRequest, context: Any) -> pb.ListQueuesResponse:
        async with _errors(context):
            _, vh = await self.login(context)
            return pb.ListQueuesResponse(queues=[self._queue_info(q) for q in vh.queues.values()])
        raise AssertionError("unreachable")

    # -- channels ----------------------------------------------------------------
    async def CreateChannel(self, request: pb.CreateChannelRequest, context: Any) -> pb.ChannelInfo:
        async with _errors(context):
            user, vh = await self.login(context)
            access.check(self.grants(user, vh), "configure", "queue", request.queue)
            q = self._not_stream(self._queue(vh, request.queue))
            name = request.name or f"ch-{next(self._channel_names)}-{os.urandom(3).hex()}"
            if "/" in name:
                raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, "a channel name cannot contain '/'")
            if any(ch.name == name for ch in q.channels):
                raise ApiError(grpc.StatusCode.ALREADY_EXISTS, f"channel '{name}' already exists on '{q.name}'")
            self._owned_here(q, "create channels other than the default one")
            kind, accepts = make_filter(request.kind, request.topic)
            ch = q.add_channel(name, accepts)
            ch.grpc_filter = (kind, request.topic)  # type: ignore[attr-defined]
            return self._channel_info(ch)
        raise AssertionError("unreachable")

    async def DeleteChannel(self, request: pb.DeleteChannelRequest, context: Any) -> pb.DeleteChannelResponse:
        async with _errors(context):
            user, vh = await self.login(context)
            # The permission first: a refused caller learns nothing of what exists (no 404/403 oracle).
            access.check(self.grants(user, vh), "configure", "queue", request.id.rpartition("/")[0])
            ch = self._channel(vh, request.id)
            if ch is ch.queue.default:
                raise ApiError(grpc.StatusCode.FAILED_PRECONDITION,
                               "the default channel goes with its queue (DeleteQueue)")
            n = ch.queue.remove_channel(ch)
            return pb.DeleteChannelResponse(messages_dropped=n)
        raise AssertionError("unreachable")

    async def ListChannels(self, request: pb.ListChannelsRequest, context: Any) -> pb.ListChannelsResponse:
        async with _errors(context):
            _, vh = await self.login(context)
            queues = [self._queue(vh, request.queue)] if request.queue else list(vh.queues.values())
            return pb.ListChannelsResponse(
                channels=[self._channel_info(ch) for q in queues for ch in q.channels]
            )
        raise AssertionError("unreachable")

    # -- push --------------------------------------------------------------------
    def _push(self, user: User, q: Queue, req: pb.PushRequest) -> tuple[Message, int, Outcome]:
        """Enqueue one pushed message through the publish path: (message, offset, its outcome)."""
        persistent = req.persistent if req.HasField("persistent") else q.durable
        props, summary = message_properties(user, req.properties, persistent)
        message = Message("", req.topic, props, req.content, summary, self.broker.node_id)
        if req.id:
            # The publisher's id: a push it retries after a restart carries the same one (docs/GRPC.md).
            if len(req.id) > MAX_ID:
                raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, f"message id longer than {MAX_ID} characters")
            message.id = req.id
        message.id  # noqa: B018 - fixed now (ids are lazy): the reply names it, and a forward carries it
        # Cluster: another node owns the queue and gives the offset: 0 here (docs/CLUSTER.md).
        offset = q.next_offset if q.remote is None else 0
        self.broker.stats.received += 1
        outcome = publish.publish_to(q, message, self.broker.committer)
        if not outcome.accepted:
            raise ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"queue '{q.name}' is full (x-overflow)")
        return message, offset, outcome

    async def committed(self) -> None:
        """Wait for the group commit of everything so far (a committed stream offset)."""
        committer = self.broker.committer
        assert committer is not None
        error = await committer.committed()
        if error is not None:
            raise ApiError(grpc.StatusCode.UNAVAILABLE, f"the store did not commit: {error}")

    @staticmethod
    async def settled(outcomes: list[Outcome]) -> None:
        """Answer once every outcome is settled (committed here, answered by the owners); UNAVAILABLE if one failed."""
        for outcome in outcomes:
            if not await outcome.wait():
                raise ApiError(grpc.StatusCode.UNAVAILABLE, outcome.error or "the message was not taken; retry")

    async def Push(self, request: pb.PushRequest, context: Any) -> pb.PushResponse:
        async with _errors(context):
            user, vh = await self.login(context)
            entry.target(vh, self.grants(user, vh), "", request.queue)  # a publish to the default exchange
            q = self._queue(vh, request.queue)
            # A resource alarm (memory, disk) holds pushes as it blocks AMQP publishers.
            await self.broker.alarms.wait_clear()
            call = flow.HeldCall()
            previous = flow.swap(call)
            try:
                message, offset, outcome = self._push(user, q, request)
            finally:
                flow.swap(previous)
            # Flow control: while the queue is behind its consumers the answer waits.
            await flow.released(call)
            await self.settled([outcome])
            return pb.PushResponse(id=message.id, offset=offset)
        raise AssertionError("unreachable")

    async def PushBatch(self, request: pb.PushBatchRequest, context: Any) -> pb.PushBatchResponse:
        async with _errors(context):
            user, vh = await self.login(context)
            entry.target(vh, self.grants(user, vh), "", request.queue)  # a publish to the default exchange
            q = self._queue(vh, request.queue)
            response = pb.PushBatchResponse()
            add = response.results.add
            outcomes: list[Outcome] = []
            push = self._push
            call = flow.HeldCall()
            for i, req in enumerate(request.messages):
                if not i % PUSH_SLICE:
                    # Each slice waits while a resource alarm is raised (as AMQP publishers are blocked).
                    await self.broker.alarms.wait_clear()
                if i and not i % PUSH_SLICE:
                    # A loop turn between slices for everyone else; wait while flow control holds.
                    await asyncio.sleep(0)
                    await flow.released(call)
                    if q.deleted:
                        raise ApiError(grpc.StatusCode.NOT_FOUND,
                                       f"queue '{q.name}' was deleted during the batch; the {i} before it were pushed")
                previous = flow.swap(call)
                try:
                    message, offset, outcome = push(user, q, req)
                except ApiError as exc:
                    exc.details += f" (message {i} of the batch; the {i} before it were pushed)"
                    raise
                finally:
                    flow.swap(previous)
                add(id=message.id, offset=offset)
                if not outcome.settled:
                    outcomes.append(outcome)
            await flow.released(call)
            await self.settled(outcomes)
            return response
        raise AssertionError("unreachable")

    # -- subscribe ---------------------------------------------------------------
    async def Subscribe(self, request: pb.SubscribeRequest, context: Any) -> AsyncIterator[pb.SubscribeResponse]:
        sub: Subscription | None = None
        live: LiveCall | None = None
        try:
            async with _errors(context):
                user, vh = await self.login(context)
                access.read_queue(self.grants(user, vh), request.channel_id.rpartition("/")[0])
                qch = self._channel(vh, request.channel_id)
                if qch is not qch.queue.default:
                    self._owned_here(qch.queue, "subscribe to channels other than the default one")
                sub = Subscription(
                    self, qch, request.prefetch or DEFAULT_PREFETCH, request.auto_ack,
                    request.max_batch or DEFAULT_BATCH, owner=(user.name, vh.name),
                )
                qch.add_consumer(sub.consumer, dispatch=False)
            assert sub is not None
            live = LiveCall(user.name, vh.name, (sub.qch.queue.name,), sub.wakeup.set)
            self.live.add(live)
            # Headers first: the client knows the subscription is in place before any message.
            await context.send_initial_metadata(())
            sub.qch.dispatch()
            while live.ended is None:
                if not sub.pending:
                    if sub.cancelled:
                        break
                    sub.wakeup.clear()
                    await sub.wakeup.wait()
                    continue
                yield sub.take_batch()
                if sub.auto_ack and not sub.cancelled:
                    sub.qch.dispatch()  # buffer space freed
            if live.ended is not None:
                await context.abort(live.status, live.ended)
            await context.abort(grpc.StatusCode.NOT_FOUND, f"queue '{sub.qch.queue.name}' or its channel was deleted")
        finally:
            if live is not None:
                self.live.discard(live)
            if sub is not None:
                sub.close()

    def _settle(self, ids: Any, requeue: bool | None, caller: tuple[str, str]) -> pb.AckResponse:
        """requeue None: ack; True/False: nack. Only deliveries to ``caller``'s (user, vhost) subscriptions.

        Another login's delivery ids are answered exactly as ids that do not
        exist (in ``unknown``, nothing changed): delivery ids are sequential,
        and a distinct answer would tell a prober which ids are live elsewhere.
        """
        unknown = []
        groups: dict[int, tuple[Subscription, list[int]]] = {}
        deliveries = self.deliveries
        for did in ids:
            sub = deliveries.get(did)
            if sub is None or did not in sub.unacked or sub.owner != caller:
                unknown.append(did)
                continue
            del deliveries[did]
            groups.setdefault(id(sub), (sub, []))[1].append(did)
        settled = 0
        for sub, dids in groups.values():
            settled += len(dids)
            if requeue is None:
                for did in dids:
                    sub.settle(did)
                sub.qch.dispatch()
            else:
                items = [(sub.unacked.pop(did), sub.consumer) for did in dids]
                if requeue:
                    sub.qch.requeue(items)
                else:
                    sub.qch.discard(items)
        return pb.AckResponse(settled=settled, unknown=unknown)

    async def Ack(self, request: pb.AckRequest, context: Any) -> pb.AckResponse:
        async with _errors(context):
            user, vh = await self.login(context)
            return self._settle(request.delivery_ids, None, (user.name, vh.name))
        raise AssertionError("unreachable")

    async def Nack(self, request: pb.NackRequest, context: Any) -> pb.AckResponse:
        async with _errors(context):
            user, vh = await self.login(context)
            return self._settle(request.delivery_ids, request.requeue, (user.name, vh.name))
        raise AssertionError("unreachable")

    # -- cluster -----------------------------------------------------------------
    async def WatchCluster(self, request: pb.WatchClusterRequest, context: Any) -> AsyncIterator[pb.ClusterEvent]:
        async with _errors(context):
            user, vh = await self.login(context)
        self._observe_all()
        watcher = Watcher(user.name)
        # Ended (user deleted, vhost access gone): the empty event wakes the loop, which then aborts.
        live = LiveCall(user.name, vh.name, (), lambda: watcher.events.put_nowait(pb.ClusterEvent()))
        self.watchers.append(watcher)
        self.live.add(live)
        try:
            yield pb.ClusterEvent(kind=pb.ClusterEvent.NODE_UP, node=self.broker.node_id,
                                  timestamp_ms=int(time.time() * 1000))
            while True:
                ev = await watcher.events.get()
                if live.ended is not None:
                    await context.abort(live.status, live.ended)
                if ev.kind == pb.ClusterEvent.KIND_UNSPECIFIED:
                    return
                yield ev
        finally:
            self.live.discard(live)
            self.watchers.remove(watcher)

    async def Nodes(self, request: pb.NodesRequest, context: Any) -> pb.NodesResponse:
        async with _errors(context):
            await self.login(context)
            members = (self.members() if self.members is not None
                       else [{"id": self.broker.node_id, "region": self.region}])
            return pb.NodesResponse(node=self.broker.node_id, region=self.region,
                                    nodes=[pb.NodeEntry(**m) for m in members])
        raise AssertionError("unreachable")


class Watcher:
    """One WatchCluster stream: its user (events are filtered by what it may see) and its queue."""

    def __init__(self, user: str) -> None:
        self.user = user
        self.events: asyncio.Queue[pb.ClusterEvent] = asyncio.Queue()


class LiveCall:
    """A stream running on a user's behalf; ``end`` stops it with the reason (its loop aborts)."""

    def __init__(self, user: str, vhost: str, queues: tuple[str, ...], wake: Callable[[], None]) -> None:
        self.user = user
        self.vhost = vhost
        self.queues = queues  # what it reads: read permission on each is needed to go on
        self.wake = wake
        self.ended: str | None = None
        self.status = grpc.StatusCode.PERMISSION_DENIED

    def end(self, reason: str, deleted: bool = False) -> None:
        if self.ended is None:
            self.ended = reason
            if deleted:
                self.status = grpc.StatusCode.UNAUTHENTICATED
            self.wake()


def revoked(broker: Broker, username: str, vhost: str, queues: tuple[str, ...]) -> str | None:
    """Why ``username`` may no longer read ``queues`` of ``vhost`` (None: it still may)."""
    user = broker.users.get(username)
    if user is None:
        return f"user '{username}' was deleted"
    if vhost not in user.vhosts:
        return f"access to vhost '{vhost}' refused for user '{username}'"
    grants = broker.access.grants(username, vhost)
    for queue in queues:
        try:
            access.read_queue(grants, queue)
        except AccessRefused as exc:
            return exc.text
    return None


def _peer_host(peer: str) -> str | None:
    """gRPC's peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:...") as a host."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]")
    if kind in ("unix", "unix-abstract"):
        return "127.0.0.1"
    return rest or None


class _errors:
    """``async with _errors(context)``: ApiError and BrokerError become gRPC aborts."""

    def __init__(self, context: Any) -> None:
        self.context = context

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if isinstance(exc, ApiError):
            await self.context.abort(exc.code, exc.details)
        if isinstance(exc, BrokerError):
            await self.context.abort(status_of(exc), exc.reply_text)
        return False
