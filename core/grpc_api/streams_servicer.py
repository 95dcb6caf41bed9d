"""``leveret.v1.Streams``: the geo seed's Publish / Subscribe(map<topic, offset>) over stream queues.

A topic is a stream queue or a partitioned stream (core/partition.py).
Publish picks the partition (key hash, or round robin) and returns the
message's id, stream and offset once the store holds it. Subscribe opens one
reader per stream behind each topic (so a partitioned stream is read as one
subscription) and sends batches of messages, each with its stream and offset,
so a client can resume from exactly where it stopped. Credit: at most
``prefetch`` messages wait to be sent; a message sent counts as settled.

With a ``group`` the readers are the group's: members of the group share
each stream (one active at a time, partition ``p`` active on member
``p mod n``), a stream where the group has a committed offset resumes after
it, and offsets are committed by CommitOffset, or as messages are sent with
``auto_commit``.

In a cluster any node serves all of it: a stream another node owns is
written through forwarding (Publish answers after the owner committed; the
offset is the owner's to give, so it is 0 there), read through a reader the
owner runs for this subscription (``Queue.remote.open_stream_reader``, as AMQP), and a group's
commit goes to the owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import grpc

from core.engine import access, entry, partition, publish
from core.engine.queue import Consumer, Queue, QueueChannel, Remote
from core.engine.stream import StreamQueue, reachable, until_reachable
from core.engine.stream_args import FIRST, LAST, NEXT, OffsetSpec, parse_age, reader_arguments
from core.engine.stream_reader import LogChannel
from core.engine.vhost import VirtualHost
from core.grpc_api.servicer import (
    DEFAULT_BATCH,
    DEFAULT_PREFETCH,
    ApiError,
    BrokerServicer,
    LiveCall,
    _errors,
    decode_properties,
    message_properties,
)
from core.model import properties
from core.model.errors import NotOwner
from core.model.message import Message, QueuedMessage
from leveret_client.proto import leveret_pb2 as pb
from leveret_client.proto import leveret_pb2_grpc as pb_grpc

_SPECS: dict[int, OffsetSpec] = {int(pb.OFFSET_NEXT): NEXT, int(pb.OFFSET_FIRST): FIRST, int(pb.OFFSET_LAST): LAST}


def offset_spec(value: int, from_timestamp_ms: int) -> OffsetSpec:
    """A Subscribe offset: >= 0 an offset; OFFSET_NEXT / FIRST / LAST; 0 means 0 (the first offset)."""
    if value >= 0:
        if value == 0 and from_timestamp_ms > 0:
            return OffsetSpec("timestamp", from_timestamp_ms / 1000.0)
        return OffsetSpec("offset", value)
    spec = _SPECS.get(value)
    if spec is None:
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT,
                       f"offset {value}: use >= 0, OFFSET_NEXT (-1), OFFSET_FIRST (-2) or OFFSET_LAST (-3)")
    return spec


class StreamSubscription:
    """One Subscribe call: a consumer on each stream it reads, and the ConsumerSink of them all."""

    def __init__(self, prefetch: int, max_batch: int) -> None:
        self.prefetch = prefetch
        self.max_batch = max_batch
        self.pending: deque[tuple[Consumer, QueuedMessage]] = deque()
        self.topics: dict[int, str] = {}  # id(consumer) -> topic as subscribed
        self.remote: set[int] = set()  # id(consumer) of those reading through another node
        self.consumers: list[Consumer] = []
        self.wakeup = asyncio.Event()
        self.cancelled = False
        self.moved = False  # a stream read through another node lost its owner or moved
        self.closed = False

    def add(self, topic: str, reader: LogChannel, tag: str, remote: bool = False) -> None:
        c = Consumer(tag, reader, self, no_ack=False, prefetch=self.prefetch)
        self.topics[id(c)] = topic
        if remote:
            self.remote.add(id(c))
        self.consumers.append(c)
        reader.add_consumer(c, dispatch=False)

    # ConsumerSink
    def has_credit(self, consumer: Consumer) -> bool:
        return not self.closed and len(self.pending) < self.prefetch

    def deliver(self, consumer: Consumer, qm: QueuedMessage) -> None:
        self.pending.append((consumer, qm))
        self.wakeup.set()

    def consumer_cancelled(self, consumer: Consumer) -> None:
        self.cancelled = True
        if id(consumer) in self.remote and not consumer.channel.queue.deleted:
            self.moved = True
        self.wakeup.set()

    def dispatch(self) -> None:
        for c in self.consumers:
            c.channel.dispatch()

    def take_batch(self) -> tuple[pb.StreamMessages, list[tuple[Consumer, QueuedMessage]]]:
        response = pb.StreamMessages()
        add = response.messages.add
        taken = []
        pending = self.pending
        empty = properties.EMPTY
        for _ in range(min(len(pending), self.max_batch)):
            c, qm = pending.popleft()
            taken.append((c, qm))
            m = qm.message
            sm = add(
                id=m.id, timestamp_ms=int(m.timestamp * 1000), topic=self.topics[id(c)],
                body=m.body if type(m.body) is bytes else bytes(m.body), stream=c.channel.queue.name,
                offset=qm.offset, key=m.routing_key,
            )
            if m.props != empty:
                sm.properties.update(decode_properties(m.props))
        return response, taken

    @staticmethod
    def sent(taken: list[tuple[Consumer, QueuedMessage]]) -> None:
        """A batch went out: its messages are settled (credit back; a group with auto_commit commits)."""
        readers: dict[int, QueueChannel] = {}
        for c, qm in taken:
            c.channel.settle(qm, c)
            readers[id(c.channel)] = c.channel
        for r in readers.values():
            r.dispatch()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        # Consumers first: what was never sent must not count as processed by a group.
        for c in self.consumers:
            c.channel.remove_consumer(c)
        for c, qm in self.pending:
            c.channel.settle(qm, c)
        self.pending.clear()


# How long a call waits for the owner of a stream to be known here (just declared, or a failover).
OWNER_WAIT = 5.0


async def _owner(q: StreamQueue) -> Remote | None:
    """The stand-in for the node that owns ``q`` (core/ports/remote.py), or None when this node owns it."""
    with contextlib.suppress(TimeoutError):
        await until_reachable(lambda: None if q.deleted else q, OWNER_WAIT)
    remote = q.remote
    if remote is None:
        return None
    if q.deleted or not reachable(q):
        raise ApiError(grpc.StatusCode.UNAVAILABLE, f"the owner of stream '{q.name}' is being replaced; retry shortly")
    return remote


class StreamsServicer(pb_grpc.StreamsServicer):
    def __init__(self, api: BrokerServicer) -> None:
        self.api = api  # logins, the store-commit wait
        self._tags = itertools.count(1)

    def _stream(self, vh: VirtualHost, name: str) -> StreamQueue:
        if not name:
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, "a stream name is required")
        queues = partition.resolve(vh, name)
        if len(queues) != 1 or partition.exchange_of(vh, name) is not None:
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"'{name}' is a partitioned stream; name one partition ({name}-0, ...)")
        return queues[0]

    @staticmethod
    async def _info(vh: VirtualHost, name: str) -> pb.StreamInfo:
        info = pb.StreamInfo(name=name, partitioned=partition.exchange_of(vh, name) is not None)
        for q in partition.resolve(vh, name):
            remote = await _owner(q)
            if remote is None:
                first, next_, messages, size, committed = (q.first_offset, q.next_offset, q.message_count,
                                                           q.log_bytes, q.committed)
            else:  # another node owns it: its figures are there
                try:
                    s = await remote.stream_figures()
                except NotOwner as exc:
                    raise ApiError(grpc.StatusCode.UNAVAILABLE,
                                   f"the owner of stream '{q.name}' did not answer: {exc.text}") from exc
                first, next_, messages, size, committed = (s.first_offset, s.next_offset, s.messages, s.bytes,
                                                           s.committed)
            p = info.partitions.add(stream=q.name, first_offset=first, next_offset=next_, messages=messages,
                                    bytes=size)
            p.committed.update(committed)
        return info

    async def CreateStream(self, request: pb.CreateStreamRequest, context: Any) -> pb.StreamInfo:
        async with _errors(context):
            user, vh = await self.api.login(context)
            name = request.name
            if not name:
                raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, "a stream name is required")
            # A stream is a queue; a partitioned one an exchange too: configure on what is made.
            grants = self.api.grants(user, vh)
            access.check(grants, "configure", "exchange" if request.partitions else "queue", name)
            if request.max_age and parse_age(request.max_age) is None:
                raise ApiError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"max_age {request.max_age!r}: use a number and a unit Y, M, D, h, m or s, e.g. '7D'")
            exists = name in vh.queues or name in vh.exchanges
            if exists and not request.exist_ok:
                raise ApiError(grpc.StatusCode.ALREADY_EXISTS, f"'{name}' already exists in vhost '{vh.name}'")
            arguments = partition.stream_arguments(request.max_age or None, request.max_bytes or None)
            coordinator = self.api.broker.coordinator
            if request.partitions:
                await partition.declare(coordinator, vh, name, request.partitions, arguments)
            else:
                await coordinator.declare_queue(vh, name, None, True, False, False, arguments)
                self._stream(vh, name)  # an existing classic queue of that name is an error
            return await self._info(vh, name)
        raise AssertionError("unreachable")

    async def GetStream(self, request: pb.GetStreamRequest, context: Any) -> pb.StreamInfo:
        async with _errors(context):
            _, vh = await self.api.login(context)
            return await self._info(vh, request.name)
        raise AssertionError("unreachable")

    async def DeleteStream(self, request: pb.DeleteStreamRequest, context: Any) -> pb.DeleteStreamResponse:
        async with _errors(context):
            user, vh = await self.api.login(context)
            kind = "exchange" if partition.exchange_of(vh, request.name) is not None else "queue"
            access.check(self.api.grants(user, vh), "configure", kind, request.name)
            dropped = await partition.remove(self.api.broker.coordinator, vh, request.name)
            return pb.DeleteStreamResponse(messages_dropped=dropped)
        raise AssertionError("unreachable")

    async def Publish(self, request: pb.PublishRequest, context: Any) -> pb.PublishResponse:
        async with _errors(context):
            user, vh = await self.api.login(context)
            topic = request.topic
            props, summary = message_properties(user, request.properties, True)
            x = partition.exchange_of(vh, topic)
            # As AMQP: a partitioned stream is a publish to its exchange, a plain one to the default exchange.
            entry.target(vh, self.api.grants(user, vh), topic if x is not None else "", request.key)
            node = self.api.broker.node_id
            q: Queue
            if x is not None:
                if not x.partitions:
                    raise ApiError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"partitioned stream '{topic}' has no partitions")
                dest = x.partitions[x.partition_of(request.key)]
                if not isinstance(dest, Queue):
                    raise ApiError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"partitioned stream '{topic}' is bound to exchange '{dest.name}', not a stream")
                q = dest
                message = Message(topic, request.key, props, request.body, summary, node)
            else:
                q = self._stream(vh, topic)
                message = Message("", request.key or topic, props, request.body, summary, node)
            message.id  # noqa: B018 - fixed now (ids are lazy): the reply names it, and a forward carries it
            await self.api.broker.alarms.wait_clear()  # a resource alarm holds publishes (core/engine/alarms.py)
            # Another node owns the stream: it gives the offset (0 here) and answers after its commit.
            offset = q.next_offset if q.remote is None else 0
            # A stream confirms after its commit whatever the delivery mode (core/engine/publish.py).
            await self.api.settled([publish.publish_to(q, message, self.api.broker.committer)])
            return pb.PublishResponse(id=message.id, stream=q.name, offset=offset)
        raise AssertionError("unreachable")

    async def CommitOffset(self, request: pb.CommitOffsetRequest, context: Any) -> pb.CommitOffsetResponse:
        async with _errors(context):
            user, vh = await self.api.login(context)
            if not request.group:
                raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, "a group name is required")
            access.read_queue(self.api.grants(user, vh), request.stream)
            q = self._stream(vh, request.stream)
            remote = await _owner(q)
            if remote is not None:
                try:
                    await remote.commit_offset(request.group, request.offset)
                except NotOwner as exc:
                    raise ApiError(grpc.StatusCode.UNAVAILABLE,
                                   f"the owner of stream '{q.name}' did not commit the offset: {exc.text}") from exc
                return pb.CommitOffsetResponse()
            q.set_committed(request.group, request.offset)
            if q.storage is not None:
                await self.api.committed()
            return pb.CommitOffsetResponse()
        raise AssertionError("unreachable")

    async def Subscribe(self, request: pb.StreamSubscribeRequest, context: Any) -> AsyncIterator[pb.StreamMessages]:
        sub: StreamSubscription | None = None
        live: LiveCall | None = None
        try:
            async with _errors(context):
                user, vh = await self.api.login(context)
                grants = self.api.grants(user, vh)
                if not request.offsets:
                    raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, "name at least one topic in offsets")
                sub = StreamSubscription(request.prefetch or DEFAULT_PREFETCH, request.max_batch or DEFAULT_BATCH)
                group = request.group or None
                tag = f"grpc-stream-{next(self._tags)}"
                read: list[str] = []
                for topic, value in sorted(request.offsets.items()):
                    spec = offset_spec(value, request.from_timestamp_ms)
                    if partition.exchange_of(vh, topic) is None:
                        # The permission before the lookup: a refused caller learns nothing of what exists.
                        access.read_queue(grants, topic)
                    for q in partition.resolve(vh, topic):
                        read.append(q.name)
                        access.read_queue(grants, q.name)
                        reader: LogChannel
                        remote = await _owner(q)
                        if remote is not None:  # another node owns it: its reader runs there
                            reader = remote.open_stream_reader(tag, reader_arguments(spec, group,
                                                                                    request.auto_commit))
                        else:
                            reader = q.open_reader(spec, name=tag, group=group,
                                                   commit_on_settle=request.auto_commit)
                        sub.add(topic, reader, tag, remote=remote is not None)
            assert sub is not None
            live = LiveCall(user.name, vh.name, tuple(read), sub.wakeup.set)
            self.api.live.add(live)
            await context.send_initial_metadata(())
            sub.dispatch()
            while live.ended is None:
                if not sub.pending:
                    if sub.cancelled:
                        break
                    sub.wakeup.clear()
                    await sub.wakeup.wait()
                    continue
                batch, taken = sub.take_batch()
                yield batch
                sub.sent(taken)
            if live.ended is not None:  # the user was deleted or lost read permission
                await context.abort(live.status, live.ended)
            if sub.moved:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "a stream of this subscription moved to another "
                                    "node or lost its owner; subscribe again to resume")
            await context.abort(grpc.StatusCode.NOT_FOUND, "a stream of this subscription was deleted")
        finally:
            if live is not None:
                self.api.live.discard(live)
            if sub is not None:
                sub.close()
