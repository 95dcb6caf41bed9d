"""The native Python client of Leveret's gRPC API (``leveret.v1.Broker``).

Synchronous::

    with Client("127.0.0.1:50051", username="guest", password="guest") as c:
        c.create_queue("news", exist_ok=True)
        ch = c.create_channel("news", topic="sport.#")
        c.push("news", b"goal", topic="sport.football")
        sub = c.subscribe(ch, prefetch=100)
        m = sub.get(timeout=5)
        sub.ack(m)

``Subscriber.fileno()`` is readable while a message is pending, for
``select``/``poll`` loops. ``AsyncClient`` has the same methods as coroutines,
``async for`` and ``async with`` over a subscription, and the same
``fileno()``. Queues and channels come back as plain dataclasses
(``QueueInfo``, ``ChannelInfo``), not protobuf objects.

A subscription whose node goes away (restart, failover) subscribes again
once the node answers, for up to ``resubscribe_for`` seconds (default 60;
0 turns it off): messages it had received and not acknowledged come back
from the broker marked redelivered (a ``Deduplicator`` drops the ones already
handled); the ones still waiting in the subscriber are dropped, and acks of
deliveries made before the restart raise ``LeveretError`` (NOT_FOUND): the
broker no longer knows those delivery ids. ``Subscriber.resubscribed`` counts
the times it happened. See docs/GRPC.md.

Several nodes: give ``target`` as a list (or "host:port,host:port") and,
optionally, the client's ``region``; the client connects to the nearest node
and fails over to the next nearest when that one goes away
(docs/notes/region.md). How "nearest" is found, once, when the client is made
(``Client``) or at its first call (``AsyncClient``; or ``await choose()``):

1. every address is dialled at once (up to ``probe_timeout`` seconds for the
   connections to be up, so a dead address costs no more than that);
2. each node that connected is asked ``Nodes`` (this node's id and region,
   and the cluster's node list) ``probes`` times in turn on its own, already
   open connection; its round trip is the fastest of those answers (the
   least-disturbed sample: the first answer carries no handshake, which
   happened in step 1, and a scheduling hiccup only ever adds time);
3. the ranking: nodes of the client's ``region`` (as each node reported it)
   first, then the rest, each group by measured round trip; addresses that
   did not answer last, in the order given. ``Client.nodes`` lists it.

On a call that finds its node gone (UNAVAILABLE) the client moves to the next
address of the ranking and repeats the call there once; subscriptions move
with it (the resubscription above, on the next node). A node that answers
again is not moved back to: the client stays where it works.

``push`` and ``push_many`` ride out a restart or a failover: each message gets
its id before the first attempt (``id=``, else a random one), and a push that
finds its node gone (UNAVAILABLE; CANCELLED: the node stopped during the
call) is sent again, with the same id, along the addresses given
until one takes it or ``push_retry_for`` seconds (default 30; 0: one failover
as other calls) have passed, pausing between rounds (0.05 s doubling to 1 s).
A push whose node stored it and died before answering is stored twice under
the one id: consumers drop the second with a ``Deduplicator`` (the broker does
not deduplicate).
"""

from __future__ import annotations

import asyncio
import math
import socket
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Self, TypeVar

import grpc
import grpc.aio

from leveret_client.proto import leveret_pb2 as pb
from leveret_client.proto import leveret_pb2_grpc as pb_grpc

__all__ = [
    "AsyncClient",
    "AsyncStatusSubscriber",
    "AsyncSubscriber",
    "ChannelInfo",
    "Client",
    "ClusterEvent",
    "Deduplicator",
    "LeveretError",
    "Message",
    "NodeChoice",
    "QueueInfo",
    "StatusSubscriber",
    "Subscriber",
]

_KINDS = {
    None: pb.FILTER_AUTO,
    "auto": pb.FILTER_AUTO,
    "exact": pb.FILTER_EXACT,
    "prefix": pb.FILTER_PREFIX,
    "pattern": pb.FILTER_PATTERN,
    "none": pb.FILTER_NONE,
}

_OPTIONS = [
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    # A restarted node is reached again within ~1 s rather than after gRPC's default backoff (up to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# How a subscription ends when its node goes away: connection lost, server shut down, stream reset.
_GONE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL})
RESUBSCRIBE_FOR = 60.0
_KIND_NAMES = {v: k for k, v in _KINDS.items() if k is not None}
# With several addresses: how long a resubscription waits for its node to
# answer before moving to the next one (a restart within it keeps the node).
FAILOVER_WAIT = 1.0
PROBES = 3
PROBE_TIMEOUT = 2.0
# How long push/push_many keep trying while the nodes are gone (a restart takes a few seconds).
PUSH_RETRY_FOR = 30.0
PUSH_PAUSE, PUSH_PAUSE_MAX = 0.05, 1.0
# A push answered so has met a node going away: not reachable, or stopping during the call (its server
# cancels the calls still running). Either way it may or may not be stored: send it again, same id.
_PUSH_AGAIN = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


T = TypeVar("T")


def _pem(value: str | bytes | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as f:
        return f.read()


def credentials(tls: bool = False, ca: str | bytes | None = None, cert: str | bytes | None = None,
                key: str | bytes | None = None) -> grpc.ChannelCredentials | None:
    """TLS to the node when ``tls`` or any file is given, else None (plaintext).

    ``ca``: the CA that signed the node's certificate (a path or PEM bytes; None:
    the system's roots). ``cert``/``key``: a client certificate, for a node started
    with --tls-verify peer --tls-fail-if-no-peer-cert.
    """
    if not (tls or ca or cert or key):
        return None
    if bool(cert) != bool(key):
        raise ValueError("a client certificate needs both cert and key")
    return grpc.ssl_channel_credentials(root_certificates=_pem(ca), private_key=_pem(key),
                                        certificate_chain=_pem(cert))


class LeveretError(Exception):
    """A call the broker refused: ``code`` is the grpc.StatusCode, ``details`` the broker's text."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def _wrap(exc: grpc.RpcError) -> LeveretError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return LeveretError(code, details or "")


class Message:
    """A received message (``delivery_id`` is what Ack/Nack name)."""

    __slots__ = ("id", "topic", "content", "properties", "offset", "redelivered", "timestamp", "delivery_id",
                 "delivery_count", "channel_id")

    def __init__(
        self, id: str, topic: str, content: bytes, properties: dict[str, str], offset: int, redelivered: bool,
        timestamp: float, delivery_id: int, delivery_count: int = 1, channel_id: str = "",
    ) -> None:
        self.id = id
        self.topic = topic
        self.content = content
        self.properties = properties
        self.offset = offset
        self.redelivered = redelivered
        self.timestamp = timestamp
        self.delivery_id = delivery_id
        self.delivery_count = delivery_count
        self.channel_id = channel_id

    def __repr__(self) -> str:
        return (f"Message(id={self.id!r}, topic={self.topic!r}, content={self.content[:64]!r}, "
                f"offset={self.offset}, redelivered={self.redelivered}, delivery_id={self.delivery_id})")

    @classmethod
    def _from(cls, d: pb.Delivery, channel_id: str) -> Message:
        props = d.properties
        return cls(
            d.id, d.topic, d.content, dict(props) if len(props) else {}, d.offset, d.redelivered,
            d.timestamp_ms / 1000.0, d.delivery_id, d.delivery_count, channel_id,
        )


@dataclass(frozen=True)
class QueueInfo:
    name: str
    durable: bool
    messages: int  # ready in the default (AMQP) channel
    consumers: int  # of the default channel
    channels: int  # the default one included
    auto_delete: bool
    exclusive: bool

    @classmethod
    def _from(cls, q: pb.QueueInfo) -> QueueInfo:
        return cls(q.name, q.durable, q.messages, q.consumers, q.channels, q.auto_delete, q.exclusive)


@dataclass(frozen=True)
class ChannelInfo:
    id: str  # "<queue>/<name>"; "<queue>/" is the default (AMQP) channel
    queue: str
    name: str
    topic: str
    kind: str  # auto, exact, prefix, pattern or none
    ready: int
    unacked: int
    consumers: int

    @classmethod
    def _from(cls, c: pb.ChannelInfo) -> ChannelInfo:
        return cls(c.id, c.queue, c.name, c.topic, _KIND_NAMES.get(c.kind, "auto"), c.ready, c.unacked, c.consumers)


@dataclass
class ClusterEvent:
    kind: str  # NODE_UP, QUEUE_CREATED, QUEUE_DELETED; cluster: NODE_ADDED, NODE_LOST, QUEUE_MOVED
    node: str
    vhost: str = ""
    queue: str = ""
    timestamp: float = 0.0

    @classmethod
    def _from(cls, ev: pb.ClusterEvent) -> ClusterEvent:
        return cls(pb.ClusterEvent.Kind.Name(ev.kind), ev.node, ev.vhost, ev.queue, ev.timestamp_ms / 1000.0)


@dataclass
class Deduplicator:
    """Remembers the last ``capacity`` message ids to drop duplicates after a failover.

    ``seen(message_or_id)`` is True for an id already seen (drop it), else records it.
    """

    capacity: int = 100_000
    _ids: OrderedDict[str, None] = field(default_factory=OrderedDict)

    def seen(self, message: Message | str) -> bool:
        key = message if isinstance(message, str) else message.id
        ids = self._ids
        if key in ids:
            ids.move_to_end(key)
            return True
        ids[key] = None
        if len(ids) > self.capacity:
            ids.popitem(last=False)
        return False

    def __contains__(self, message: object) -> bool:
        key = message.id if isinstance(message, Message) else message
        return key in self._ids

    def __len__(self) -> int:
        return len(self._ids)


def _metadata(username: str | None, password: str | None, vhost: str) -> tuple[tuple[str, str], ...]:
    md: list[tuple[str, str]] = []
    if username is not None:
        md.append(("username", username))
    if password is not None:
        md.append(("password", password))
    if vhost != "/":
        md.append(("vhost", vhost))
    return tuple(md)


def new_id() -> str:
    """A message id chosen by the publisher: what a retried push carries again."""
    return uuid.uuid4().hex


def _push_request(
    queue: str, content: bytes, topic: str | None, properties: dict[str, Any] | None, persistent: bool | None,
    id: str | None = None,
) -> pb.PushRequest:
    req = pb.PushRequest(
        queue=queue, topic=topic or "", content=content,
        properties={k: str(v) for k, v in (properties or {}).items()}, id=id or new_id(),
    )
    if persistent is not None:
        req.persistent = persistent
    return req


def _batch_request(
    queue: str, contents: Iterable[bytes], topic: str | None, properties: dict[str, Any] | None,
    persistent: bool | None,
) -> pb.PushBatchRequest:
    """Built in place with messages.add(): far cheaper than a list of PushRequest."""
    req = pb.PushBatchRequest(queue=queue)
    add = req.messages.add
    props = {k: str(v) for k, v in (properties or {}).items()}
    kwargs: dict[str, Any] = {}
    if topic:
        kwargs["topic"] = topic
    if persistent is not None:
        kwargs["persistent"] = persistent
    if props:
        kwargs["properties"] = props
    for content in contents:
        add(content=content, id=new_id(), **kwargs)
    return req


def _kind(kind: str | None) -> int:
    try:
        return _KINDS[kind]
    except KeyError:
        raise ValueError(f"kind must be one of auto, exact, prefix, pattern, none; got {kind!r}") from None


# ---------------------------------------------------------------------- sync
class _Doorbell:
    """A socketpair whose read end is readable while something is pending: a subscriber's ``fileno()``
    for select/poll or ``loop.add_reader`` (sync and async subscribers alike)."""

    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        self._rung = False

    def ring(self) -> None:
        if not self._rung:
            self._rung = True
            try:
                self._w.send(b"x")
            except OSError:
                pass

    def quiet(self) -> None:
        if self._rung:
            self._rung = False
            try:
                self._r.recv(64)
            except OSError:
                pass

    def fileno(self) -> int:
        return self._r.fileno()

    def close(self) -> None:
        self._r.close()
        self._w.close()


class _Pending:
    """Received items, a condition for get(), and a socketpair readable while any are pending."""

    def __init__(self) -> None:
        self.items: deque[Any] = deque()
        self.cond = threading.Condition()
        self.error: LeveretError | None = None
        self.ended = False
        self._bell = _Doorbell()

    def put_many(self, items: Iterable[Any]) -> None:
        with self.cond:
            self.items.extend(items)
            self._signal()
            self.cond.notify_all()

    def finish(self, error: LeveretError | None) -> None:
        with self.cond:
            self.ended = True
            self.error = error
            self._signal()
            self.cond.notify_all()

    def _signal(self) -> None:
        self._bell.ring()

    def _unsignal(self) -> None:
        # Called with the lock held once nothing is pending.
        if not self.items and not self.ended:
            self._bell.quiet()

    def get(self, timeout: float | None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while not self.items:
                if self.ended:
                    if self.error is not None:
                        raise self.error
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self.cond.wait(remaining)
            item = self.items.popleft()
            self._unsignal()
            return item

    def drop(self) -> None:
        with self.cond:
            self.items.clear()
            self._unsignal()

    def poll(self) -> list[Any]:
        with self.cond:
            out = list(self.items)
            self.items.clear()
            self._unsignal()
            if not out and self.ended and self.error is not None:
                raise self.error
            return out

    def fileno(self) -> int:
        return self._bell.fileno()

    def close(self) -> None:
        self._bell.close()


class _StreamReader:
    """A thread draining a server stream into a _Pending; it opens the stream again when the node went away."""

    def __init__(self, call: Any, convert: Any, reopen: Any = None, retry_for: float = 0.0,
                 drop_on_reopen: bool = False) -> None:
        self.call = call
        self.pending = _Pending()
        self.reopened = 0
        self._convert = convert
        self._reopen = reopen  # () -> a new call, or None: no resubscription
        self._retry_for = retry_for
        self._drop_on_reopen = drop_on_reopen
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="leveret-stream", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        error: LeveretError | None = None
        while True:
            try:
                for response in self.call:
                    self.pending.put_many(self._convert(response))
                break  # the broker ended the stream (the queue went away)
            except grpc.RpcError as exc:
                code = exc.code()  # type: ignore[attr-defined]
                if self._closed:
                    break
                if code in _GONE and self._reopen is not None and self._again():
                    continue
                if code != grpc.StatusCode.CANCELLED:
                    error = _wrap(exc)
                break
        self.pending.finish(error)

    def _again(self) -> bool:
        """Open the stream again once the node answers; False when it does not within ``retry_for``."""
        deadline = time.monotonic() + self._retry_for
        pause = 0.05
        while not self._closed and time.monotonic() < deadline:
            try:
                call = self._reopen(max(0.01, deadline - time.monotonic()))
                call.initial_metadata()  # in place (or refused) when this returns
                if call.done() and call.code() != grpc.StatusCode.OK:
                    if call.code() not in _GONE:
                        return False  # refused (the queue is gone, access denied): not a restart
                    raise _Retry
            except (grpc.RpcError, grpc.FutureTimeoutError, _Retry):
                time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                pause = min(pause * 2, 1.0)
                continue
            if self._closed:
                call.cancel()
                return False
            if self._drop_on_reopen:
                self.pending.drop()  # unacked: the broker redelivers them
            self.call = call
            self.reopened += 1
            return True
        return False

    def close(self) -> None:
        self._closed = True
        self.call.cancel()
        self._thread.join(timeout=5)
        self.pending.close()


class _Retry(Exception):
    pass


class _Received(Generic[T]):
    """What a thread receives from a server stream: ``get``, ``poll``, ``fileno``, iteration, ``with``."""

    _reader: _StreamReader

    def get(self, timeout: float | None = None) -> T | None:
        """The next item; None after ``timeout`` seconds (or when the stream ended cleanly)."""
        return self._reader.pending.get(timeout)  # type: ignore[no-any-return]

    def poll(self) -> list[T]:
        """Every item received so far, without waiting."""
        return self._reader.pending.poll()

    def fileno(self) -> int:
        """Readable while an item is pending (or the stream ended)."""
        return self._reader.pending.fileno()

    def close(self) -> None:
        self._reader.close()

    def __iter__(self) -> Iterator[T]:
        while True:
            m = self.get()
            if m is None:
                return
            yield m

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Subscriber(_Received[Message]):
    """A subscription to one channel (sync). Not thread safe except that a thread receives for it."""

    def __init__(self, client: Client, channel_id: str, call: Any, reopen: Any = None, retry_for: float = 0.0,
                 auto_ack: bool = False) -> None:
        self.client = client
        self.channel_id = channel_id
        self._reader = _StreamReader(call, lambda r: [Message._from(d, channel_id) for d in r.messages], reopen,
                                     retry_for, drop_on_reopen=not auto_ack)

    @property
    def resubscribed(self) -> int:
        """How many times the subscription was opened again after its node went away."""
        return self._reader.reopened

    def available(self) -> int:
        return len(self._reader.pending.items)

    def ack(self, message: Message | Iterable[Message]) -> int:
        return self.client.ack(message)

    def nack(self, message: Message | Iterable[Message], requeue: bool = True) -> int:
        return self.client.nack(message, requeue=requeue)

    def close(self) -> None:
        """End the subscription: the broker requeues what was not acked (redelivered=True)."""
        self._reader.close()


class StatusSubscriber(_Received[ClusterEvent]):
    """Cluster status events (WatchCluster), sync."""

    def __init__(self, call: Any) -> None:
        self._reader = _StreamReader(call, lambda ev: [ClusterEvent._from(ev)])


@dataclass(frozen=True)
class NodeChoice:
    """One address as the nearest-node probe found it (see the module's docstring)."""

    address: str
    node: str = ""  # the node's id, as it answered; "" when it did not
    region: str = ""  # its --region, as it answered
    rtt: float = math.inf  # seconds: the fastest of the probes; inf when it did not answer


def _addresses(target: str | Sequence[str]) -> list[str]:
    items = target.split(",") if isinstance(target, str) else list(target)
    out = [t.strip() for t in items if t.strip()]
    if not out:
        raise ValueError("no node address given")
    return out


def rank(choices: Sequence[NodeChoice], region: str | None) -> list[NodeChoice]:
    """Nearest first: the client's region (when given), then round trip; the silent last, in the order given."""
    order = {c.address: i for i, c in enumerate(choices)}
    return sorted(choices, key=lambda c: (c.rtt == math.inf, region is not None and c.region != region,
                                          c.rtt if c.rtt != math.inf else 0.0, order[c.address]))


def _answered(address: str, reply: Any, rtt: float) -> NodeChoice:
    if reply is None:  # a node without the Nodes call: its round trip counts, its region is unknown
        return NodeChoice(address, rtt=rtt)
    return NodeChoice(address, reply.node, reply.region, rtt)


def _make_channel(address: str, creds: grpc.ChannelCredentials | None) -> grpc.Channel:
    return (grpc.insecure_channel(address, options=_OPTIONS) if creds is None
            else grpc.secure_channel(address, creds, options=_OPTIONS))


def _make_aio_channel(address: str, creds: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
    return (grpc.aio.insecure_channel(address, options=_OPTIONS) if creds is None
            else grpc.aio.secure_channel(address, creds, options=_OPTIONS))


def _ids(message: Message | Iterable[Message]) -> list[int]:
    if isinstance(message, Message):
        return [message.delivery_id]
    return [m.delivery_id for m in message]


class Client:
    def __init__(
        self,
        target: str | Sequence[str] = "127.0.0.1:50051",
        username: str | None = "guest",
        password: str | None = "guest",
        vhost: str = "/",
        timeout: float | None = 30.0,
        *,
        tls: bool = False,
        ca: str | bytes | None = None,
        cert: str | bytes | None = None,
        key: str | bytes | None = None,
        region: str | None = None,
        probes: int = PROBES,
        probe_timeout: float = PROBE_TIMEOUT,
        push_retry_for: float = PUSH_RETRY_FOR,
    ) -> None:
        """``tls``/``ca``/``cert``/``key``: a node started with --grpc-tls (see :func:`credentials`).

        ``target``: one address, or several (a list or "a:1,b:2"): then the nearest node is chosen, in
        ``region`` if given (see the module's docstring), and ``nodes`` holds the ranking.
        """
        self._creds = credentials(tls, ca, cert, key)
        self._md = _metadata(username, password, vhost)
        self.timeout = timeout
        self.region = region
        self.probes, self.probe_timeout = probes, probe_timeout
        self.push_retry_for = push_retry_for
        self._subscribers: list[Subscriber | StatusSubscriber] = []
        self._lock = threading.Lock()
        self._generation = 0  # bumped at each move to another node
        addresses = _addresses(target)
        self.nodes = [NodeChoice(a) for a in addresses]
        self._index = 0
        if len(addresses) > 1:
            self.choose()
        else:
            self._channel = _make_channel(addresses[0], self._creds)
            self._stub = pb_grpc.BrokerStub(self._channel)

    @property
    def address(self) -> str:
        """The address of the node this client talks to now."""
        return self.nodes[self._index].address

    def choose(self) -> list[NodeChoice]:
        """Probe every address and connect to the nearest (the module's docstring says how); the ranking."""
        channels = {c.address: _make_channel(c.address, self._creds) for c in self.nodes}
        ready = {a: grpc.channel_ready_future(ch) for a, ch in channels.items()}
        deadline = time.monotonic() + self.probe_timeout
        found: list[NodeChoice] = []
        for address, future in ready.items():
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except grpc.FutureTimeoutError:
                future.cancel()
                found.append(NodeChoice(address))
                continue
            found.append(self._probe(address, pb_grpc.BrokerStub(channels[address])))
        ranked = rank(found, self.region)
        with self._lock:
            old = getattr(self, "_channel", None)
            self.nodes, self._index = ranked, 0
            self._channel = channels.pop(ranked[0].address)
            self._stub = pb_grpc.BrokerStub(self._channel)
            self._generation += 1
        for ch in channels.values():
            ch.close()
        if old is not None:
            old.close()
        return ranked

    def _probe(self, address: str, stub: pb_grpc.BrokerStub) -> NodeChoice:
        best, reply = math.inf, None
        for _ in range(max(1, self.probes)):
            sent = time.perf_counter()
            try:
                reply = stub.Nodes(pb.NodesRequest(), metadata=self._md, timeout=self.probe_timeout)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:  # type: ignore[attr-defined]
                    return NodeChoice(address)  # refused or gone: not a candidate to start on
            best = min(best, time.perf_counter() - sent)
        return _answered(address, reply, best)

    def _fail_over(self, generation: int) -> bool:
        """Move to the next node of the ranking, unless another thread moved since ``generation``."""
        with self._lock:
            if generation != self._generation:
                return True
            if len(self.nodes) < 2:
                return False
            old = self._channel
            self._index = (self._index + 1) % len(self.nodes)
            self._channel = _make_channel(self.nodes[self._index].address, self._creds)
            self._stub = pb_grpc.BrokerStub(self._channel)
            self._generation += 1
        old.close()  # its streams end CANCELLED and subscribe again on the new node
        return True

    def _ready(self, wait: float) -> None:
        """The current node answers within ``wait`` seconds, moving along the ranking if it does not."""
        deadline = time.monotonic() + wait
        while True:
            generation, channel = self._generation, self._channel
            step = max(0.01, deadline - time.monotonic())
            if len(self.nodes) > 1:
                step = min(step, FAILOVER_WAIT)
            try:
                grpc.channel_ready_future(channel).result(timeout=step)
                return
            except grpc.FutureTimeoutError:
                if time.monotonic() >= deadline or not self._fail_over(generation):
                    raise

    def _call(self, name: str, request: Any) -> Any:
        for attempt in range(len(self.nodes)):
            generation = self._generation
            try:
                return getattr(self._stub, name)(request, metadata=self._md, timeout=self.timeout)
            except grpc.RpcError as exc:
                gone = exc.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
                if not gone or attempt == len(self.nodes) - 1 or not self._fail_over(generation):
                    raise _wrap(exc) from None
        raise AssertionError("unreachable")

    def _call_retrying(self, name: str, request: Any) -> Any:
        """``_call`` for a push: on UNAVAILABLE or CANCELLED (its node going away), along the addresses again and
        again until ``push_retry_for``."""
        if self.push_retry_for <= 0:
            return self._call(name, request)
        deadline = time.monotonic() + self.push_retry_for
        pause, attempt = PUSH_PAUSE, 0
        while True:
            generation = self._generation
            try:
                return getattr(self._stub, name)(request, metadata=self._md, timeout=self.timeout)
            except grpc.RpcError as exc:
                if exc.code() not in _PUSH_AGAIN or time.monotonic() >= deadline:  # type: ignore[attr-defined]
                    raise _wrap(exc) from None
            attempt += 1
            self._fail_over(generation)
            if attempt % len(self.nodes) == 0:  # every address tried: wait before the next round
                time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                pause = min(pause * 2, PUSH_PAUSE_MAX)

    def list_nodes(self) -> tuple[str, list[NodeChoice]]:
        """(the id of the node this client talks to, the cluster's live nodes: id, region, grpc address)."""
        r = self._call("Nodes", pb.NodesRequest())
        return r.node, [NodeChoice(n.grpc, n.id, n.region) for n in r.nodes]

    # queues
    def create_queue(
        self, name: str, durable: bool = False, exist_ok: bool = False, auto_delete: bool = False,
        max_length: int = 0, message_ttl_ms: int = 0,
    ) -> QueueInfo:
        return QueueInfo._from(self._call("CreateQueue", pb.CreateQueueRequest(
            name=name, durable=durable, exist_ok=exist_ok, auto_delete=auto_delete, max_length=max_length,
            message_ttl_ms=message_ttl_ms)))

    def delete_queue(self, name: str, if_unused: bool = False, if_empty: bool = False) -> int:
        r = self._call("DeleteQueue", pb.DeleteQueueRequest(name=name, if_unused=if_unused, if_empty=if_empty))
        return int(r.messages_dropped)

    def list_queues(self) -> list[QueueInfo]:
        return [QueueInfo._from(q) for q in self._call("ListQueues", pb.ListQueuesRequest()).queues]

    # channels
    def create_channel(self, queue: str, topic: str | None = None, kind: str | None = None, name: str = "") -> str:
        """A channel on ``queue``; ``topic`` filters by exact topic, prefix (kind="prefix") or pattern (* #)."""
        r = self._call("CreateChannel",
                       pb.CreateChannelRequest(queue=queue, topic=topic or "", kind=_kind(kind), name=name))  # type: ignore[arg-type]
        return str(r.id)

    def delete_channel(self, channel_id: str) -> int:
        return int(self._call("DeleteChannel", pb.DeleteChannelRequest(id=channel_id)).messages_dropped)

    def list_channels(self, queue: str = "") -> list[ChannelInfo]:
        r = self._call("ListChannels", pb.ListChannelsRequest(queue=queue))
        return [ChannelInfo._from(c) for c in r.channels]

    # messages
    def push(
        self, queue: str, content: bytes, topic: str | None = None, properties: dict[str, Any] | None = None,
        persistent: bool | None = None, id: str | None = None,
    ) -> str:
        """Push one message; returns its id (``id``, else a new one) once the broker holds it (committed, if
        persistent). Sent again with that id while the nodes are gone, for up to ``push_retry_for`` seconds."""
        return str(self._call_retrying("Push", _push_request(queue, content, topic, properties, persistent, id)).id)

    def push_many(
        self, queue: str, contents: Iterable[bytes], topic: str | None = None,
        properties: dict[str, Any] | None = None, persistent: bool | None = None,
    ) -> list[str]:
        """Push several messages in one call (each with an id of its own), retried as ``push``."""
        r = self._call_retrying("PushBatch", _batch_request(queue, contents, topic, properties, persistent))
        return [x.id for x in r.results]

    def subscribe(self, channel_id: str, prefetch: int = 0, auto_ack: bool = False, max_batch: int = 0,
                  resubscribe_for: float = RESUBSCRIBE_FOR) -> Subscriber:
        """Subscribe to a channel (a queue's default channel is "<queue>/").

        If the node goes away, subscribe again for up to ``resubscribe_for`` seconds (0: never).
        """
        request = pb.SubscribeRequest(channel_id=channel_id, prefetch=prefetch, auto_ack=auto_ack,
                                      max_batch=max_batch)

        def reopen(wait: float) -> Any:
            self._ready(wait)  # grpc.FutureTimeoutError
            return self._stub.Subscribe(request, metadata=self._md)

        for attempt in range(len(self.nodes)):
            generation = self._generation
            call = self._stub.Subscribe(request, metadata=self._md)
            try:
                call.initial_metadata()  # the subscription is in place (or refused) when this returns
            except grpc.RpcError as exc:
                raise _wrap(exc) from None
            if not call.done() or call.code() == grpc.StatusCode.OK:
                break
            if call.code() != grpc.StatusCode.UNAVAILABLE or attempt == len(self.nodes) - 1 \
                    or not self._fail_over(generation):
                raise LeveretError(call.code(), call.details() or "")
        sub = Subscriber(self, channel_id, call, reopen if resubscribe_for > 0 else None, resubscribe_for, auto_ack)
        self._subscribers.append(sub)
        return sub

    def ack(self, message: Message | Iterable[Message]) -> int:
        return int(self._call("Ack", pb.AckRequest(delivery_ids=_ids(message))).settled)

    def nack(self, message: Message | Iterable[Message], requeue: bool = True) -> int:
        return int(self._call("Nack", pb.NackRequest(delivery_ids=_ids(message), requeue=requeue)).settled)

    def status_subscriber(self) -> StatusSubscriber:
        call = self._stub.WatchCluster(pb.WatchClusterRequest(), metadata=self._md)
        sub = StatusSubscriber(call)
        self._subscribers.append(sub)
        return sub

    def close(self) -> None:
        for s in self._subscribers:
            s.close()
        self._subscribers.clear()
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------- async
class AsyncSubscriber:
    """A subscription to one channel (asyncio): ``get``, ``poll``, ``available``, ``fileno``, ``async for``,
    ``async with``; it subscribes again when its node went away (see the module's docstring)."""

    def __init__(self, client: AsyncClient, channel_id: str, call: Any, reopen: Any = None,
                 retry_for: float = 0.0, auto_ack: bool = False) -> None:
        self.client = client
        self.channel_id = channel_id
        self._resubscribed = 0
        self._call = call
        self._reopen = reopen  # async (wait seconds) -> a new call, or None
        self._retry_for = retry_for
        self._auto_ack = auto_ack
        self._items: deque[Message] = deque()
        self._event = asyncio.Event()
        self._error: LeveretError | None = None
        self._ended = False
        self._closed = False
        self._bell = _Doorbell()  # readable while a message is pending (fileno)
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            while True:
                try:
                    async for response in self._call:
                        self._items.extend(Message._from(d, self.channel_id) for d in response.messages)
                        self._wake()
                    break
                except grpc.RpcError as exc:
                    code = exc.code()  # type: ignore[attr-defined]
                    if self._closed:
                        break
                    if code in _GONE and self._reopen is not None and await self._again():
                        continue
                    if code != grpc.StatusCode.CANCELLED:
                        self._error = _wrap(exc)
                    break
        except asyncio.CancelledError:
            pass
        self._ended = True
        self._wake()

    async def _again(self) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._retry_for
        pause = 0.05
        while not self._closed and loop.time() < deadline:
            try:
                call = await self._reopen(max(0.01, deadline - loop.time()))
                await call.initial_metadata()
                if call.done():
                    code = await call.code()
                    if code != grpc.StatusCode.OK:
                        if code not in _GONE:
                            return False
                        raise _Retry
            except (grpc.RpcError, TimeoutError, _Retry):
                await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
                pause = min(pause * 2, 1.0)
                continue
            if not self._auto_ack:
                self._items.clear()  # unacked: the broker redelivers them
                self._unsignal()
            self._call = call
            self._resubscribed += 1
            return True
        return False

    def _wake(self) -> None:
        self._event.set()
        self._bell.ring()

    def _unsignal(self) -> None:
        if not self._items and not self._ended:
            self._bell.quiet()

    @property
    def resubscribed(self) -> int:
        """How many times the subscription was opened again after its node went away."""
        return self._resubscribed

    def fileno(self) -> int:
        """Readable while a message is pending (or the subscription ended): for ``loop.add_reader`` or select."""
        return self._bell.fileno()

    async def get(self, timeout: float | None = None) -> Message | None:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not self._items:
            if self._ended:
                if self._error is not None:
                    raise self._error
                return None
            self._event.clear()
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return None
            try:
                await asyncio.wait_for(self._event.wait(), remaining)
            except TimeoutError:
                return None
        m = self._items.popleft()
        self._unsignal()
        return m

    def poll(self) -> list[Message]:
        out = list(self._items)
        self._items.clear()
        self._unsignal()
        return out

    def available(self) -> int:
        return len(self._items)

    async def ack(self, message: Message | Iterable[Message]) -> int:
        return await self.client.ack(message)

    async def nack(self, message: Message | Iterable[Message], requeue: bool = True) -> int:
        return await self.client.nack(message, requeue=requeue)

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Message]:
        while True:
            m = await self.get()
            if m is None:
                return
            yield m

    async def close(self) -> None:
        """End the subscription: the broker requeues what was not acked (redelivered=True)."""
        if self._closed:
            return
        self._closed = True
        self._call.cancel()
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._bell.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncStatusSubscriber:
    def __init__(self, call: Any) -> None:
        self._call = call

    async def get(self, timeout: float | None = None) -> ClusterEvent | None:
        try:
            ev = await asyncio.wait_for(self._call.read(), timeout)
        except TimeoutError:
            return None
        except grpc.RpcError as exc:
            raise _wrap(exc) from None
        if ev is grpc.aio.EOF:
            return None
        return ClusterEvent._from(ev)

    def close(self) -> None:
        self._call.cancel()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    def __init__(
        self,
        target: str | Sequence[str] = "127.0.0.1:50051",
        username: str | None = "guest",
        password: str | None = "guest",
        vhost: str = "/",
        timeout: float | None = 30.0,
        *,
        tls: bool = False,
        ca: str | bytes | None = None,
        cert: str | bytes | None = None,
        key: str | bytes | None = None,
        region: str | None = None,
        probes: int = PROBES,
        probe_timeout: float = PROBE_TIMEOUT,
        push_retry_for: float = PUSH_RETRY_FOR,
    ) -> None:
        """As ``Client``; with several addresses the nearest is chosen at the first call (or ``await choose()``)."""
        self._creds = credentials(tls, ca, cert, key)
        self._md = _metadata(username, password, vhost)
        self.timeout = timeout
        self.region = region
        self.probes, self.probe_timeout = probes, probe_timeout
        self.push_retry_for = push_retry_for
        self._subscribers: list[AsyncSubscriber] = []
        self._generation = 0
        addresses = _addresses(target)
        self.nodes = [NodeChoice(a) for a in addresses]
        self._index = 0
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._choosing: asyncio.Future[list[NodeChoice]] | None = None
        if len(addresses) == 1:
            self._channel = _make_aio_channel(addresses[0], self._creds)
            self._stub = pb_grpc.BrokerStub(self._channel)

    @property
    def address(self) -> str:
        return self.nodes[self._index].address

    async def choose(self) -> list[NodeChoice]:
        """As ``Client.choose`` (the addresses are dialled at once, then probed in turn)."""
        channels = {c.address: _make_aio_channel(c.address, self._creds) for c in self.nodes}

        async def up(ch: grpc.aio.Channel) -> bool:
            try:
                await asyncio.wait_for(ch.channel_ready(), self.probe_timeout)
            except TimeoutError:
                return False
            return True

        alive = await asyncio.gather(*(up(ch) for ch in channels.values()))
        found = [await self._probe(a, pb_grpc.BrokerStub(channels[a])) if ok else NodeChoice(a)
                 for a, ok in zip(channels, alive, strict=True)]
        ranked = rank(found, self.region)
        old = self._channel
        self.nodes, self._index = ranked, 0
        self._channel = channels.pop(ranked[0].address)
        self._stub = pb_grpc.BrokerStub(self._channel)
        self._generation += 1
        for ch in channels.values():
            await ch.close()
        if old is not None:
            await old.close()
        return ranked

    async def _probe(self, address: str, stub: pb_grpc.BrokerStub) -> NodeChoice:
        best, reply = math.inf, None
        for _ in range(max(1, self.probes)):
            sent = time.perf_counter()
            try:
                reply = await stub.Nodes(pb.NodesRequest(), metadata=self._md, timeout=self.probe_timeout)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:  # type: ignore[attr-defined]
                    return NodeChoice(address)
            best = min(best, time.perf_counter() - sent)
        return _answered(address, reply, best)

    async def _chosen(self) -> None:
        """Choose the node once (concurrent first calls share the one probe)."""
        if self._stub is not None:
            return
        if self._choosing is None:
            self._choosing = asyncio.ensure_future(self.choose())
        await asyncio.shield(self._choosing)

    async def _fail_over(self, generation: int) -> bool:
        if generation != self._generation:
            return True
        if len(self.nodes) < 2:
            return False
        old = self._channel
        self._index = (self._index + 1) % len(self.nodes)
        self._channel = _make_aio_channel(self.nodes[self._index].address, self._creds)
        self._stub = pb_grpc.BrokerStub(self._channel)
        self._generation += 1
        if old is not None:
            await old.close()  # its streams end CANCELLED and subscribe again on the new node
        return True

    async def _ready(self, wait: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            generation, channel = self._generation, self._channel
            assert channel is not None
            step = max(0.01, deadline - loop.time())
            if len(self.nodes) > 1:
                step = min(step, FAILOVER_WAIT)
            try:
                await asyncio.wait_for(channel.channel_ready(), step)
                return
            except TimeoutError:
                if loop.time() >= deadline or not await self._fail_over(generation):
                    raise

    async def _call(self, name: str, request: Any) -> Any:
        if self._stub is None:
            await self._chosen()
        for attempt in range(len(self.nodes)):
            generation = self._generation
            try:
                return await getattr(self._stub, name)(request, metadata=self._md, timeout=self.timeout)
            except grpc.RpcError as exc:
                gone = exc.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
                if not gone or attempt == len(self.nodes) - 1 or not await self._fail_over(generation):
                    raise _wrap(exc) from None
        raise AssertionError("unreachable")

    async def _call_retrying(self, name: str, request: Any) -> Any:
        """As ``Client._call_retrying``."""
        if self.push_retry_for <= 0:
            return await self._call(name, request)
        if self._stub is None:
            await self._chosen()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.push_retry_for
        pause, attempt = PUSH_PAUSE, 0
        while True:
            generation = self._generation
            try:
                return await getattr(self._stub, name)(request, metadata=self._md, timeout=self.timeout)
            except grpc.RpcError as exc:
                if exc.code() not in _PUSH_AGAIN or loop.time() >= deadline:  # type: ignore[attr-defined]
                    raise _wrap(exc) from None
            attempt += 1
            await self._fail_over(generation)
            if attempt % len(self.nodes) == 0:
                await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
                pause = min(pause * 2, PUSH_PAUSE_MAX)

    async def list_nodes(self) -> tuple[str, list[NodeChoice]]:
        """As ``Client.list_nodes``."""
        r = await self._call("Nodes", pb.NodesRequest())
        return r.node, [NodeChoice(n.grpc, n.id, n.region) for n in r.nodes]

    async def create_queue(
        self, name: str, durable: bool = False, exist_ok: bool = False, auto_delete: bool = False,
        max_length: int = 0, message_ttl_ms: int = 0,
    ) -> QueueInfo:
        return QueueInfo._from(await self._call("CreateQueue", pb.CreateQueueRequest(
            name=name, durable=durable, exist_ok=exist_ok, auto_delete=auto_delete, max_length=max_length,
            message_ttl_ms=message_ttl_ms)))

    async def delete_queue(self, name: str, if_unused: bool = False, if_empty: bool = False) -> int:
        r = await self._call("DeleteQueue",
                             pb.DeleteQueueRequest(name=name, if_unused=if_unused, if_empty=if_empty))
        return int(r.messages_dropped)

    async def list_queues(self) -> list[QueueInfo]:
        return [QueueInfo._from(q) for q in (await self._call("ListQueues", pb.ListQueuesRequest())).queues]

    async def create_channel(self, queue: str, topic: str | None = None, kind: str | None = None,
                             name: str = "") -> str:
        r = await self._call("CreateChannel",
                             pb.CreateChannelRequest(queue=queue, topic=topic or "", kind=_kind(kind), name=name))  # type: ignore[arg-type]
        return str(r.id)

    async def delete_channel(self, channel_id: str) -> int:
        r = await self._call("DeleteChannel", pb.DeleteChannelRequest(id=channel_id))
        return int(r.messages_dropped)

    async def list_channels(self, queue: str = "") -> list[ChannelInfo]:
        r = await self._call("ListChannels", pb.ListChannelsRequest(queue=queue))
        return [ChannelInfo._from(c) for c in r.channels]

    async def push(
        self, queue: str, content: bytes, topic: str | None = None, properties: dict[str, Any] | None = None,
        persistent: bool | None = None, id: str | None = None,
    ) -> str:
        """As ``Client.push``."""
        r = await self._call_retrying("Push", _push_request(queue, content, topic, properties, persistent, id))
        return str(r.id)

    async def push_many(
        self, queue: str, contents: Iterable[bytes], topic: str | None = None,
        properties: dict[str, Any] | None = None, persistent: bool | None = None,
    ) -> list[str]:
        r = await self._call_retrying("PushBatch", _batch_request(queue, contents, topic, properties, persistent))
        return [x.id for x in r.results]

    async def subscribe(self, channel_id: str, prefetch: int = 0, auto_ack: bool = False, max_batch: int = 0,
                        resubscribe_for: float = RESUBSCRIBE_FOR) -> AsyncSubscriber:
        """As ``Client.subscribe``."""
        request = pb.SubscribeRequest(channel_id=channel_id, prefetch=prefetch, auto_ack=auto_ack,
                                      max_batch=max_batch)

        async def reopen(wait: float) -> Any:
            await self._ready(wait)
            return self._stub.Subscribe(request, metadata=self._md)

        await self._chosen()
        for attempt in range(len(self.nodes)):
            generation = self._generation
            call = self._stub.Subscribe(request, metadata=self._md)
            try:
                await call.initial_metadata()
            except grpc.RpcError as exc:
                raise _wrap(exc) from None
            if not call.done():
                break
            code = await call.code()
            if code == grpc.StatusCode.OK:
                break
            if code != grpc.StatusCode.UNAVAILABLE or attempt == len(self.nodes) - 1 \
                    or not await self._fail_over(generation):
                raise LeveretError(code, await call.details() or "")
        sub = AsyncSubscriber(self, channel_id, call, reopen if resubscribe_for > 0 else None, resubscribe_for,
                              auto_ack)
        self._subscribers.append(sub)
        return sub

    async def ack(self, message: Message | Iterable[Message]) -> int:
        return int((await self._call("Ack", pb.AckRequest(delivery_ids=_ids(message)))).settled)

    async def nack(self, message: Message | Iterable[Message], requeue: bool = True) -> int:
        r = await self._call("Nack", pb.NackRequest(delivery_ids=_ids(message), requeue=requeue))
        return int(r.settled)

    async def status_subscriber(self) -> AsyncStatusSubscriber:
        await self._chosen()
        return AsyncStatusSubscriber(self._stub.WatchCluster(pb.WatchClusterRequest(), metadata=self._md))

    async def close(self) -> None:
        for s in self._subscribers:
            await s.close()
        self._subscribers.clear()
        if self._choosing is not None and not self._choosing.done():
            self._choosing.cancel()
        if self._channel is not None:
            await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
