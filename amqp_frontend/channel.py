"""One AMQP channel: maps its methods onto the core and receives deliveries.

It implements core.engine.queue.ConsumerSink for its consumers: prefetch credit
(per consumer, and per channel for ``global`` qos, as RabbitMQ reads it),
delivery tags, the unacked set, and publisher confirms.
"""

from __future__ import annotations

import base64
import os
from bisect import bisect_left
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from pamqp import commands
from pamqp.base import Frame as Method

from amqp_frontend import codec, stream_consumer
from core.engine import access, direct_reply, entry, limits, publish
from core.engine.exchange import Exchange
from core.engine.node_stats import SIZE_BUCKETS, NodeStats
from core.engine.queue import Consumer, Queue, QueueChannel
from core.engine.stream import StreamQueue
from core.engine.vhost import server_generated_name
from core.model import properties
from core.model.errors import (
    BrokerError,
    CommandInvalid,
    NotAllowed,
    NotFound,
    NotImplementedFeature,
    PreconditionFailed,
    ResourceError,
    UnexpectedFrame,
)
from core.model.message import Message, QueuedMessage
from core.ports.coordinator import Immediate

if TYPE_CHECKING:
    from amqp_frontend.connection import Connection

# delivery tag -> (message, consumer or None for basic.get, queue channel)
Unacked = tuple[QueuedMessage, Consumer | None, QueueChannel]

NO_ROUTE = 312
T = TypeVar("T")


class Channel:
    def __init__(self, conn: Connection, number: int) -> None:
        self.conn = conn
        self.number = number
        self.vhost = conn.vhost
        assert self.vhost is not None
        self.closing = False
        self.stats = conn.broker.stats
        # This channel's own message counts, RabbitMQ's channel message_stats (leveret/http/views.py):
        # each bump of the node's counter below is mirrored here, one attribute store more.
        self.own = NodeStats()
        # This login's permission answers in this vhost (core/engine/access.py): a publish pays a dict lookup.
        self.grants = conn.broker.access.grants(conn.username, self.vhost.name)
        # Content being assembled: (exchange, routing key, mandatory), props, body parts.
        self.publishing: tuple[str, str, bool] | None = None
        self.awaiting_header = False
        self._props = b""
        self._summary: properties.PropertySummary | None = None
        self._body_size = 0
        self._body_parts: list[bytes] = []
        self._body_received = 0
        # Publisher confirms.
        self.confirm = False
        self.publish_seq = 0
        self.confirmed_upto = 0
        # Publishes after the first one that waits for the store: [seq, outcome];
        # outcome None = not known yet, True = ack, False = nack.
        self._waiting: deque[list[Any]] = deque()
        # Deliveries.
        self.next_tag = 1
        self.unacked: OrderedDict[int, Unacked] = OrderedDict()
        self.consumers: dict[str, Consumer] = {}
        self.prefetch_per_consumer = 0
        self.prefetch_global = 0
        self.last_queue: str | None = None
        self._consumer_tag_raw: dict[str, bytes] = {}
        # The last exchange and routing key delivered here, and their shortstrs.
        self._last_route: tuple[str, str, bytes] = ("", "", b"\x00\x00")
        # Transactions (tx.select): None, or what waits for tx.commit.
        self.tx: Transaction | None = None
        self._tx_join: _Join | None = None  # while tx.commit replays its publishes
        # Direct reply-to: this channel's reply address token and consumer.
        self.reply_token: str | None = None
        self.reply_consumer_tag: str | None = None
        # While this channel deletes a queue: cancels of its own consumers wait for
        # delete-ok, which RabbitMQ sends first (kombu's integration suite relies on it).
        self._deferred_cancels: list[str] | None = None

    # ------------------------------------------------------------------ sink
    def has_credit(self, consumer: Consumer) -> bool:
        if self.conn.write_blocked or self.closing:
            return False
        if consumer.no_ack:
            return True
        if consumer.prefetch and consumer.unacked >= consumer.prefetch:
            return False
        if self.prefetch_global and len(self.unacked) >= self.prefetch_global:
            return False
        return True

    def deliver(self, consumer: Consumer, qm: QueuedMessage) -> None:
        tag = self.next_tag
        self.next_tag = tag + 1
        if not consumer.no_ack:
            self.unacked[tag] = (qm, consumer, consumer.channel)
            self.stats.delivered_consume_manual_ack += 1
            self.own.delivered_consume_manual_ack += 1
        else:
            self.stats.delivered_consume_auto_ack += 1
            self.own.delivered_consume_auto_ack += 1
        if qm.redelivered:
            self.stats.redelivered += 1
            self.own.redelivered += 1
        m = qm.message
        if len(m.body) > codec.LARGE_BODY:
            self.conn.write(
                codec.deliver_frame(
                    self.number, self._consumer_tag_raw[consumer.tag], tag, qm.redelivered, m.exchange, m.routing_key
                )
            )
            self.conn.write_content(self.number, m.props, m.body)
            return
        route_raw, content = self._wire(m)
        self.conn.write(
            codec.delivery(self.number, self._consumer_tag_raw[consumer.tag], tag, qm.redelivered, route_raw, content)
        )

    def _wire(self, m: Message) -> tuple[bytes, bytes]:
        """The message's routing shortstrs and content frames for this channel, cached on it."""
        cache = m.wire_cache
        number = self.number
        frame_max = self.conn.frame_max
        if cache is not None and cache[0] == number and cache[1] == frame_max:
            return cache[2], cache[3]
        if cache is not None:
            route_raw = cache[2]
        else:
            # Messages that arrived together share their name objects (a batch
            # from a queue's owner node: core/forwarding.py), so most need no
            # encoding of their own; names are immutable, so `is` is enough.
            ex, rk, route_raw = self._last_route
            if m.routing_key is not rk or m.exchange is not ex:
                route_raw = codec.shortstr(m.exchange) + codec.shortstr(m.routing_key)
                self._last_route = (m.exchange, m.routing_key, route_raw)
        content = b"".join(codec.content_frames(number, m.props, m.body, frame_max))
        m.wire_cache = (number, frame_max, route_raw, content)
        return route_raw, content

    def consumer_cancelled(self, consumer: Consumer) -> None:
        if self.consumers.pop(consumer.tag, None) is None:
            return
        self._consumer_tag_raw.pop(consumer.tag, None)
        if self.conn.client_capability("consumer_cancel_notify") and not self.closing:
            if self._deferred_cancels is not None:
                self._deferred_cancels.append(consumer.tag)
                return
            self.conn.send_method(self.number, commands.Basic.Cancel(consumer_tag=consumer.tag, nowait=True))

    # --------------------------------------------------------------- publish
    def begin_publish(self, exchange: str, routing_key: str, mandatory: bool, immediate: bool) -> None:
        if immediate:
            raise NotImplementedFeature("immediate=true")
        # A body may be large and arrive slowly: the memory alarm blocks this connection from
        # now on (the I/O layer reads has_published), and a publish without write permission is
        # refused before its body is read (one dict lookup; _route checks again, the same way).
        self.conn.has_published = True
        if not self.grants.write.get(exchange or access.DEFAULT_EXCHANGE, False):
            access.publish(self.grants, exchange)
        self.publishing = (exchange, routing_key, mandatory)
        self.awaiting_header = True

    def publish(
        self, exchange: str, routing_key: str, mandatory: bool, immediate: bool, props: bytes, body: bytes
    ) -> None:
        """A whole message at once (the connection's fast path)."""
        if immediate:
            raise NotImplementedFeature("immediate=true")
        # Properties that do not decode raise PropertiesError: 502, the connection closes.
        summary = properties.scan(props)
        if summary.headers_at >= 0:
            publish.check(props, summary)
        self._route(exchange, routing_key, mandatory, props, summary, body)

    def content_header(self, payload: bytes) -> None:
        if len(payload) < 14:
            raise UnexpectedFrame("content header frame too short")
        class_id = (payload[0] << 8) | payload[1]
        if class_id != 60:
            raise UnexpectedFrame(f"content header for class {class_id} where class 60 was expected")
        body_size = int.from_bytes(payload[4:12], "big")
        if body_size > self.conn.settings.max_message_size:
            self.publishing = None
            self.awaiting_header = False
            raise PreconditionFailed(
                f"message size {body_size} is larger than configured max size "
                f"{self.conn.settings.max_message_size}"
            )
        props = bytes(payload[12:])
        summary = properties.scan(props)  # 502 if it does not decode
        if summary.headers_at >= 0:
            publish.check(props, summary)  # refused before the body arrives
        self._summary = summary
        self._props = props
        self._body_size = body_size
        self.awaiting_header = False
        if body_size == 0:
            self._finish_publish(b"")
        else:
            self._body_parts = []
            self._body_received = 0

    @property
    def partial_body_bytes(self) -> int:
        """Bytes of a content body received so far and not yet complete (held until it is)."""
        return self._body_received if self._body_parts else 0

    def content_body(self, payload: bytes) -> None:
        n = self._body_received + len(payload)
        if n > self._body_size:
            raise UnexpectedFrame(
                f"content body of {n} bytes exceeds the {self._body_size} bytes declared in its header"
            )
        conn = self.conn
        if n == self._body_size:
            if self._body_parts:
                self._body_parts.append(payload)
                body = b"".join(self._body_parts)
                conn.partial_bytes -= self._body_received
                self._body_parts = []
            else:
                body = payload
            self._finish_publish(body)
        else:
            self._body_parts.append(payload)
            self._body_received = n
            conn.partial_bytes += len(payload)
            if conn.partial_bytes > conn.max_partial_bytes:
                # Six channels each announcing 128 MiB and sending 100 MiB took a node to
                # 680 MiB: a connection's unfinished bodies are bounded together.
                raise ResourceError(f"unfinished message bodies on this connection exceed "
                                    f"{conn.max_partial_bytes} bytes")

    def _drop_partial_body(self) -> None:
        if self._body_parts:
            self.conn.partial_bytes -= self._body_received
            self._body_parts = []
            self._body_received = 0

    def _finish_publish(self, body: bytes) -> None:
        assert self.publishing is not None and self._summary is not None
        exchange_name, routing_key, mandatory = self.publishing
        self.publishing = None
        self._route(exchange_name, routing_key, mandatory, self._props, self._summary, body)

    def _route(
        self,
        exchange_name: str,
        routing_key: str,
        mandatory: bool,
        props: bytes,
        summary: properties.PropertySummary,
        body: bytes,
    ) -> None:
        conn = self.conn
        conn.has_published = True
        vhost = self.vhost
        assert vhost is not None
        # The entry checks every front end makes (user-id, expiration, permissions, the exchange).
        exchange = entry.admit(vhost, self.grants, conn.username, exchange_name, routing_key, summary)
        if summary.reply_to_direct:
            props = self._direct_reply_props(props)
        message = Message(exchange_name, routing_key, props, body, summary, conn.node_id)
        if self.tx is not None:
            self.tx.publishes.append((exchange, message, mandatory))
            return
        self._deliver_published(exchange, message, mandatory)

    def _deliver_published(self, exchange: Exchange | None, message: Message, mandatory: bool) -> None:
        # The confirm rule lives in core.engine.publish; here only what AMQP makes of its outcome.
        vhost = self.vhost
        assert vhost is not None
        self.stats.received += 1
        self.own.received += 1
        size = len(message.body)
        self.stats.message_sizes[bisect_left(SIZE_BUCKETS, size)] += 1  # the size histogram's bucket
        self.stats.message_bytes += size
        tx_join = self._tx_join
        outcome = publish.publish(self.conn.broker, vhost, exchange, message, self.confirm or tx_join is not None)
        if not outcome.routed:
            if mandatory:
                self.stats.unroutable_returned += 1
                self.own.unroutable_returned += 1
            else:
                self.stats.unroutable_dropped += 1
                self.own.unroutable_dropped += 1
        if mandatory and not outcome.routed:
            # basic.return goes out before the message's ack (both are written in order).
            self.conn.send_method(
                self.number,
                commands.Basic.Return(
                    reply_code=NO_ROUTE, reply_text="NO_ROUTE", exchange=message.exchange,
                    routing_key=message.routing_key,
                ),
            )
            self.conn.write_content(self.number, message.props, message.body)
        if tx_join is not None:
            # tx.commit-ok waits for every publish of the transaction to settle.
            if not outcome.settled:
                outcome.on_settled(tx_join.one())
        elif self.confirm:
            self.stats.received_confirm += 1
            self.publish_seq += 1
            seq = self.publish_seq
            if not outcome.settled:
                # Acked once settled; later publishes wait behind it (flush_confirms).
                entry = [seq, None]
                self._waiting.append(entry)
                outcome.on_settled(lambda ok: self._store_outcome(entry, ok))
            elif self._waiting:
                self._waiting.append([seq, outcome.ok])
                self.conn.confirm_pending(self)
            elif outcome.ok:
                self.conn.confirm_pending(self)
            else:
                # x-overflow reject-publish: nack this one, after acking all before it.
                self._ack_upto(seq - 1)
                self._nack(seq)

    def _store_outcome(self, entry: list[Any], ok: bool) -> None:
        entry[1] = ok
        if not self.closing:
            self.conn.confirm_pending(self)

    def flush_confirms(self) -> None:
        """Acks (multiple=true) for every publish settled since the last flush, nacks where refused.

        Publishes that wait for the store hold back the acks of later ones, so a
        multiple ack never covers a message that is not committed yet.
        """
        if self.closing:
            return
        waiting = self._waiting
        while waiting and waiting[0][1] is not None:
            seq, ok = waiting.popleft()
            if not ok:
                self._ack_upto(seq - 1)
                self._nack(seq)
        self._ack_upto(waiting[0][0] - 1 if waiting else self.publish_seq)

    def _ack_upto(self, upto: int) -> None:
        if upto > self.confirmed_upto:
            multiple = upto - self.confirmed_upto > 1
            self.stats.confirmed += upto - self.confirmed_upto
            self.own.confirmed += upto - self.confirmed_upto
            self.confirmed_upto = upto
            self.conn.write(_basic_ack_frame(self.number, upto, multiple))

    def _nack(self, seq: int) -> None:
        self.conn.write(codec.encode_method(self.number, commands.Basic.Nack(delivery_tag=seq)))
        self.confirmed_upto = seq

    # ------------------------------------------------------- direct reply-to
    def _direct_reply_props(self, props: bytes) -> bytes:
        if self.reply_token is None:
            raise PreconditionFailed("fast reply consumer does not exist")
        decoded = properties.decode(props)
        decoded["reply_to"] = direct_reply.PREFIX + self.reply_token
        return properties.encode(decoded)

    def deliver_reply(self, message: Message) -> None:
        """A reply published to this channel's amq.rabbitmq.reply-to address."""
        if self.closing or self.reply_consumer_tag is None:
            return
        tag = self.next_tag
        self.next_tag = tag + 1
        route_raw, content = self._wire(message)
        self.conn.write(
            codec.delivery(self.number, codec.shortstr(self.reply_consumer_tag), tag, False, route_raw, content)
        )

    # ----------------------------------------------------------------- acks
    def _take(self, tag: int, multiple: bool) -> list[Unacked]:
        return [entry for _, entry in self._take_tagged(tag, multiple)]

    def _take_tagged(self, tag: int, multiple: bool) -> list[tuple[int, Unacked]]:
        """Remove and return the deliveries an ack/nack/reject names (406 for an unknown tag)."""
        unacked = self.unacked
        if multiple and tag == 0:
            taken = list(unacked.items())
            unacked.clear()
            return taken
        if tag not in unacked:
            raise PreconditionFailed(f"unknown delivery tag {tag}")
        if not multiple:
            return [(tag, unacked.pop(tag))]
        taken = []
        while unacked:
            first = next(iter(unacked))
            if first > tag:
                break
            taken.append(unacked.popitem(last=False))
        return taken

    def ack(self, tag: int, multiple: bool) -> None:
        if self.tx is not None:
            self.tx.settlements.append((self._take_tagged(tag, multiple), "ack"))
            return
        if not multiple:
            entry = self.unacked.pop(tag, None)
            if entry is None:
                raise PreconditionFailed(f"unknown delivery tag {tag}")
            qm, consumer, qch = entry
            qch.settle(qm, consumer)
            self.stats.acknowledged += 1
            self.own.acknowledged += 1
            if self.prefetch_global:
                self.resume()  # channel-wide credit: any of its consumers may go on
            qch.dispatch()
            return
        self._settle_entries(self._take(tag, multiple))

    def reject(self, tag: int, multiple: bool, requeue: bool) -> None:
        if self.tx is not None:
            self.tx.settlements.append((self._take_tagged(tag, multiple), "requeue" if requeue else "discard"))
            return
        self._return_entries(self._take(tag, multiple), requeue)

    def _settle_entries(self, entries: list[Unacked]) -> None:
        touched: dict[int, QueueChannel] = {}
        self.stats.acknowledged += len(entries)
        self.own.acknowledged += len(entries)
        for qm, consumer, qch in entries:
            qch.settle(qm, consumer)
            touched[id(qch)] = qch
        self._dispatch(touched.values())
        if self.prefetch_global:
            self.resume()

    def _return_entries(self, entries: list[Unacked], requeue: bool) -> None:
        groups: dict[int, tuple[QueueChannel, list[tuple[QueuedMessage, Consumer | None]]]] = {}
        for qm, consumer, qch in entries:
            groups.setdefault(id(qch), (qch, []))[1].append((qm, consumer))
        for qch, items in groups.values():
            if requeue:
                qch.requeue(items)
            else:
                qch.discard(items)
        if self.prefetch_global and not self.closing:
            self.resume()

    @staticmethod
    def _dispatch(qchannels: Any) -> None:
        for qch in qchannels:
            qch.dispatch()

    def resume(self) -> None:
        """Writes drained: let this channel's consumers take messages again."""
        seen: dict[int, QueueChannel] = {}
        for c in self.consumers.values():
            seen[id(c.channel)] = c.channel
        self._dispatch(seen.values())

    # ------------------------------------------------------------- lifecycle
    def release(self) -> None:
        """Channel is closing: cancel its consumers and requeue what it holds unacked."""
        self.closing = True
        self.publishing = None
        self._drop_partial_body()
        if self.tx is not None:
            self.tx.rollback(self)
        if self.reply_token is not None:
            self.conn.broker.reply_to.unregister(self.reply_token)
            self.reply_token = self.reply_consumer_tag = None
        for consumer in list(self.consumers.values()):
            consumer.channel.remove_consumer(consumer)
        self.consumers.clear()
        self._requeue_unacked()

    def _requeue_unacked(self) -> None:
        """Every delivery still unacked goes back to its queue, in order, redelivered."""
        entries = list(self.unacked.values())
        self.unacked.clear()
        if entries:
            self._return_entries(entries, requeue=True)

    # --------------------------------------------------------------- methods
    def handle(self, method: Method) -> None:
        handler = _HANDLERS.get(type(method))
        if handler is None:
            raise CommandInvalid(f"method {method.name} is not allowed from a client on a channel")
        handler(self, method)

    def _queue_name(self, name: str) -> str:
        if name:
            return name
        if self.last_queue is None:
            raise NotFound("no previously declared queue")
        return self.last_queue

    def _reply(self, method: Method) -> None:
        self.conn.send_method(self.number, method)

    # channel
    def _channel_flow(self, m: commands.Channel.Flow) -> None:
        if not m.active:
            raise NotImplementedFeature("active=false")
        self._reply(commands.Channel.FlowOk(active=True))

    # Every declaration, deletion, binding change, purge, get and count goes through the
    # coordinator (core/ports/coordinator.py), on one node as in a cluster. An answer it has at
    # once is handled at once; otherwise the connection suspends input until it comes.
    def _when(self, class_id: int, method_id: int, op: Awaitable[T], then: Callable[[T], None]) -> None:
        if isinstance(op, Immediate):
            then(op.value)
        else:
            self.conn.suspend(self, class_id, method_id, op, then)

    # exchange
    def _exchange_declare(self, m: commands.Exchange.Declare) -> None:
        vhost = self.vhost
        assert vhost is not None
        if m.passive:
            vhost.declare_exchange(m.exchange, m.exchange_type, passive=True)
            self._exchange_declared(m, None)
            return
        access.declare_exchange(self.grants, m.exchange, m.arguments or {})
        op = self.conn.broker.coordinator.declare_exchange(
            vhost, m.exchange, m.exchange_type, m.durable, m.auto_delete, m.internal, dict(m.arguments or {})
        )
        self._when(40, 10, op, lambda _: self._exchange_declared(m, None))

    def _exchange_declared(self, m: commands.Exchange.Declare, _: None) -> None:
        if not m.nowait:
            self._reply(commands.Exchange.DeclareOk())

    def _exchange_delete(self, m: commands.Exchange.Delete) -> None:
        assert self.vhost is not None
        access.delete_exchange(self.grants, m.exchange)
        op = self.conn.broker.coordinator.delete_exchange(self.vhost, m.exchange, m.if_unused)
        self._when(40, 20, op, lambda _: None if m.nowait else self._reply(commands.Exchange.DeleteOk()))

    def _bind(self, class_id: int, method_id: int, source: str, kind: str, dest: str, routing_key: str,
              arguments: dict[str, Any] | None, add: bool, reply: Method | None) -> None:
        assert self.vhost is not None
        # The callers checked write/read on the names before looking them up, as RabbitMQ.
        src = self.vhost.exchanges.get(source)
        if src is not None and src.type == "topic":
            access.check_topic(self.grants, "read", source, routing_key)
        op = self.conn.broker.coordinator.bind(self.vhost, source, kind, dest, routing_key, dict(arguments or {}), add)
        self._when(class_id, method_id, op, lambda _: None if reply is None else self._reply(reply))

    def _exchange_bind(self, m: commands.Exchange.Bind) -> None:
        assert self.vhost is not None
        access.bind(self.grants, m.source, "exchange", m.destination)  # before the lookups, as RabbitMQ
        dest = self.vhost.get_exchange(m.destination)
        self._bind(40, 30, m.source, "exchange", dest.name, m.routing_key, m.arguments, True,
                   None if m.nowait else commands.Exchange.BindOk())

    def _exchange_unbind(self, m: commands.Exchange.Unbind) -> None:
        assert self.vhost is not None
        access.bind(self.grants, m.source, "exchange", m.destination)
        # Unbinding from or to what is gone succeeds, as in RabbitMQ.
        self._bind(40, 40, m.source, "exchange", m.destination, m.routing_key, m.arguments, False,
                   None if m.nowait else commands.Exchange.UnbindOk())

    # queue
    def _queue_declare(self, m: commands.Queue.Declare) -> None:
        vhost = self.vhost
        assert vhost is not None
        name = m.queue
        if name == direct_reply.PSEUDO_QUEUE or name.startswith(direct_reply.PREFIX):
            # RPC servers declare a reply address to see whether the requester is still there.
            if name != direct_reply.PSEUDO_QUEUE and not self.conn.broker.reply_to.is_live(name):
                raise NotFound(f"no queue '{name}' in vhost '{vhost.name}'")
            if not m.nowait:
                self._reply(commands.Queue.DeclareOk(queue=name, message_count=0, consumer_count=1))
            return
        if m.passive:
            self._queue_declared(m, vhost.get_queue(self._queue_name(name), self.conn))
            return
        # As RabbitMQ, a server-named queue is checked under an amq.gen- name (the coordinator makes the
        # queue's own, and only it may: a client's amq.* name is refused).
        checked = name or server_generated_name()
        access.declare_queue(self.grants, checked, m.arguments or {})
        limits.check_queue(vhost.name, self.conn.broker.vhost_limits.get(vhost.name, {}), vhost.queues, checked)
        op = self.conn.broker.coordinator.declare_queue(vhost, name, self.conn, m.durable, m.exclusive, m.auto_delete,
                                                    dict(m.arguments or {}))
        self._when(50, 10, op, lambda q: self._queue_declared(m, q))

    def _queue_declared(self, m: commands.Queue.Declare, q: Queue) -> None:
        self.last_queue = q.name
        if m.nowait:
            return
        self._when(50, 10, self.conn.broker.coordinator.counts(q), lambda counts: self._reply(
            commands.Queue.DeclareOk(queue=q.name, message_count=counts[0], consumer_count=counts[1])))

    def _get_queue(self, name: str) -> Queue:
        assert self.vhost is not None
        return self.vhost.get_queue(self._queue_name(name), self.conn)

    def _queue_bind(self, m: commands.Queue.Bind) -> None:
        routing_key = m.routing_key
        if not m.queue and not routing_key:
            routing_key = self._queue_name("")
        access.bind(self.grants, m.exchange, "queue", self._queue_name(m.queue))
        q = self._get_queue(m.queue)
        self._bind(50, 20, m.exchange, "queue", q.name, routing_key, m.arguments, True,
                   None if m.nowait else commands.Queue.BindOk())

    def _queue_unbind(self, m: commands.Queue.Unbind) -> None:
        assert self.vhost is not None
        access.bind(self.grants, m.exchange, "queue", self._queue_name(m.queue))
        if self._queue_name(m.queue) not in self.vhost.queues:  # a missing queue unbinds fine, as in RabbitMQ
            self._reply(commands.Queue.UnbindOk())
            return
        q = self._get_queue(m.queue)
        self._bind(50, 50, m.exchange, "queue", q.name, m.routing_key, m.arguments, False, commands.Queue.UnbindOk())

    def _queue_purge(self, m: commands.Queue.Purge) -> None:
        access.read_queue(self.grants, self._queue_name(m.queue))
        q = self._get_queue(m.queue)
        self._when(50, 30, self.conn.broker.coordinator.purge(q), lambda count: None if m.nowait else self._reply(
            commands.Queue.PurgeOk(message_count=count)))

    def _queue_delete(self, m: commands.Queue.Delete) -> None:
        assert self.vhost is not None
        # Cancels of this channel's own consumers wait for delete-ok (see _deferred_cancels).
        access.delete_queue(self.grants, self._queue_name(m.queue))
        self._deferred_cancels = []
        try:
            op = self.conn.broker.coordinator.delete_queue(self.vhost, self._queue_name(m.queue), self.conn,
                                                       m.if_unused, m.if_empty)
        except BaseException:
            self._deferred_cancels = None
            raise
        if not isinstance(op, Immediate):
            op = self._forget_cancels_on_error(op)
        self._when(50, 40, op, lambda count: self._queue_deleted(m, count))

    async def _forget_cancels_on_error(self, op: Awaitable[int]) -> int:
        try:
            return await op
        except BaseException:
            self._deferred_cancels = None
            raise

    def _queue_deleted(self, m: commands.Queue.Delete, count: int) -> None:
        deferred, self._deferred_cancels = self._deferred_cancels or [], None
        if not m.nowait:
            self._reply(commands.Queue.DeleteOk(message_count=count))
        for tag in deferred:
            self.conn.send_method(self.number, commands.Basic.Cancel(consumer_tag=tag, nowait=True))

    # basic
    def _basic_qos(self, m: commands.Basic.Qos) -> None:
        if m.prefetch_size:
            raise NotImplementedFeature(f"prefetch_size!=0 ({m.prefetch_size})")
        if m.global_:
            self.prefetch_global = m.prefetch_count
        else:
            # RabbitMQ 3.x (measured with 3.10.8, compat_tests/test_basic.py): a
            # per-consumer qos after a global one lifts the channel-wide limit.
            self.prefetch_per_consumer = m.prefetch_count
            self.prefetch_global = 0
        self._reply(commands.Basic.QosOk())
        self.resume()

    def _basic_consume(self, m: commands.Basic.Consume) -> None:
        tag = m.consumer_tag or "amq.ctag-" + base64.urlsafe_b64encode(os.urandom(16)).decode().rstrip("=")
        if tag in self.consumers or tag == self.reply_consumer_tag:
            raise NotAllowed(f"attempt to reuse consumer tag '{tag}'")
        if m.queue == direct_reply.PSEUDO_QUEUE:
            self._consume_replies(tag, m)
            return
        access.read_queue(self.grants, self._queue_name(m.queue))
        q = self._get_queue(m.queue)
        if isinstance(q, StreamQueue):
            stream_consumer.consume(self, q, tag, m)
            return
        if self.prefetch_global and q.args.quorum:
            # RabbitMQ 3.10.8: "NOT_IMPLEMENTED - queue 'q' in vhost '/' does not support global qos" (540).
            raise NotImplementedFeature(f"queue '{q.name}' in vhost '{q.vhost}' does not support global qos")
        priority = (m.arguments or {}).get("x-priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise PreconditionFailed(f"invalid arg 'x-priority': expected an integer, got {priority!r}")
        consumer = Consumer(
            tag,
            q.default,
            self,
            no_ack=m.no_ack,
            exclusive=m.exclusive,
            arguments=m.arguments,
            prefetch=self.prefetch_per_consumer,
            priority=priority,
        )
        q.default.add_consumer(consumer, dispatch=False)
        self.consumers[tag] = consumer
        self._consumer_tag_raw[tag] = codec.shortstr(tag)
        if not m.nowait:
            self._reply(commands.Basic.ConsumeOk(consumer_tag=tag))
        q.default.dispatch()

    def _consume_replies(self, tag: str, m: commands.Basic.Consume) -> None:
        if not m.no_ack:
            raise PreconditionFailed("reply consumer cannot acknowledge")
        if self.reply_token is not None:
            raise PreconditionFailed("reply consumer already set")
        self.reply_token = self.conn.broker.reply_to.register(self.deliver_reply)
        self.reply_consumer_tag = tag
        if not m.nowait:
            self._reply(commands.Basic.ConsumeOk(consumer_tag=tag))

    def _basic_cancel(self, m: commands.Basic.Cancel) -> None:
        tag = m.consumer_tag or ""
        if tag == self.reply_consumer_tag and self.reply_token is not None:
            self.conn.broker.reply_to.unregister(self.reply_token)
            self.reply_token = self.reply_consumer_tag = None
        consumer = self.consumers.pop(tag, None)
        if consumer is not None:
            self._consumer_tag_raw.pop(tag, None)
            consumer.channel.remove_consumer(consumer)
        if not m.nowait:
            self._reply(commands.Basic.CancelOk(consumer_tag=m.consumer_tag))

    def _basic_get(self, m: commands.Basic.Get) -> None:
        access.read_queue(self.grants, self._queue_name(m.queue))
        q = self._get_queue(m.queue)
        stream_consumer.refuse_get(q)
        self._when(60, 70, self.conn.broker.coordinator.get(q, m.no_ack),
                   lambda result: self._got(m, q.default, result[0], result[1]))

    def _got(self, m: commands.Basic.Get, qch: QueueChannel, qm: QueuedMessage | None, remaining: int) -> None:
        if qm is None:
            self.stats.get_empty += 1
            self.own.get_empty += 1
            self._reply(commands.Basic.GetEmpty())
            return
        tag = self.next_tag
        self.next_tag = tag + 1
        if not m.no_ack:
            self.unacked[tag] = (qm, None, qch)
            self.stats.delivered_get_manual_ack += 1
            self.own.delivered_get_manual_ack += 1
        else:
            self.stats.delivered_get_auto_ack += 1
            self.own.delivered_get_auto_ack += 1
        if qm.redelivered:  # RabbitMQ counts a redelivery through basic.get too
            self.stats.redelivered += 1
            self.own.redelivered += 1
        msg = qm.message
        self.conn.write(
            codec.get_ok_frame(self.number, tag, qm.redelivered, msg.exchange, msg.routing_key, remaining)
        )
        self.conn.write_content(self.number, msg.props, msg.body)

    def _basic_ack(self, m: commands.Basic.Ack) -> None:
        self.ack(m.delivery_tag, m.multiple)

    def _basic_reject(self, m: commands.Basic.Reject) -> None:
        self.reject(m.delivery_tag or 0, False, m.requeue)

    def _basic_nack(self, m: commands.Basic.Nack) -> None:
        self.reject(m.delivery_tag, m.multiple, m.requeue)

    def _basic_recover(self, m: commands.Basic.Recover) -> None:
        if not m.requeue:
            raise NotImplementedFeature("requeue=false")
        self._requeue_unacked()
        self._reply(commands.Basic.RecoverOk())

    def _basic_recover_async(self, m: commands.Basic.RecoverAsync) -> None:
        if not m.requeue:
            raise NotImplementedFeature("requeue=false")
        self._requeue_unacked()

    # confirm / tx
    def _confirm_select(self, m: commands.Confirm.Select) -> None:
        if self.tx is not None:
            raise PreconditionFailed("cannot switch from tx to confirm mode")
        self.confirm = True
        if not m.nowait:
            self._reply(commands.Confirm.SelectOk())

    def _tx_select(self, m: commands.Tx.Select) -> None:
        if self.confirm:
            raise PreconditionFailed("cannot switch from confirm to tx mode")
        if self.tx is None:
            self.tx = Transaction()
        self._reply(commands.Tx.SelectOk())

    def _tx_commit(self, m: commands.Tx.Commit) -> None:
        if self.tx is None:
            raise PreconditionFailed("channel is not transactional")
        tx, self.tx = self.tx, Transaction()
        # Cluster: commit-ok also waits for the owners of remote queues to answer.
        joined = self._tx_join = _Join()
        try:
            for exchange, message, mandatory in tx.publishes:
                self._deliver_published(exchange, message, mandatory)
        finally:
            self._tx_join = None
        for tagged, outcome in tx.settlements:
            entries = [entry for _, entry in tagged]
            if outcome == "ack":
                self._settle_entries(entries)
            else:
                self._return_entries(entries, requeue=outcome == "requeue")
        committer = self.conn.broker.committer
        if committer is not None:
            local = joined.one()
            committer.when_committed(lambda error: local(error is None))

        def done(ok: bool) -> None:
            if self.closing:
                return
            if ok:
                self._reply(commands.Tx.CommitOk())
            else:
                self.conn.fail_channel(
                    self, PreconditionFailed("tx.commit failed: the store or a queue's owner did not take it"), 90, 20
                )

        joined.finish(done)

    def _tx_rollback(self, m: commands.Tx.Rollback) -> None:
        if self.tx is None:
            raise PreconditionFailed("channel is not transactional")
        self.tx.rollback(self)
        self.tx = Transaction()
        self._reply(commands.Tx.RollbackOk())


class Transaction:
    """What a tx channel published and settled since its last commit or rollback."""

    def __init__(self) -> None:
        self.publishes: list[tuple[Exchange | None, Message, bool]] = []
        self.settlements: list[tuple[list[tuple[int, Unacked]], str]] = []

    def rollback(self, channel: Channel) -> None:
        """Forget the publishes; the settled deliveries become unacked again, in tag order."""
        self.publishes.clear()
        restored = [item for tagged, _ in self.settlements for item in tagged]
        self.settlements.clear()
        if restored:
            merged = sorted(list(channel.unacked.items()) + restored, key=lambda kv: kv[0])
            channel.unacked.clear()
            channel.unacked.update(merged)


def _basic_ack_frame(channel: int, tag: int, multiple: bool) -> bytes:
    return codec.encode_method(channel, commands.Basic.Ack(delivery_tag=tag, multiple=multiple))


_HANDLERS: dict[type, Any] = {
    commands.Channel.Flow: Channel._channel_flow,
    commands.Exchange.Declare: Channel._exchange_declare,
    commands.Exchange.Delete: Channel._exchange_delete,
    commands.Exchange.Bind: Channel._exchange_bind,
    commands.Exchange.Unbind: Channel._exchange_unbind,
    commands.Queue.Declare: Channel._queue_declare,
    commands.Queue.Bind: Channel._queue_bind,
    commands.Queue.Unbind: Channel._queue_unbind,
    commands.Queue.Purge: Channel._queue_purge,
    commands.Queue.Delete: Channel._queue_delete,
    commands.Basic.Qos: Channel._basic_qos,
    commands.Basic.Consume: Channel._basic_consume,
    commands.Basic.Cancel: Channel._basic_cancel,
    commands.Basic.Get: Channel._basic_get,
    commands.Basic.Ack: Channel._basic_ack,
    commands.Basic.Reject: Channel._basic_reject,
    commands.Basic.Nack: Channel._basic_nack,
    commands.Basic.Recover: Channel._basic_recover,
    commands.Basic.RecoverAsync: Channel._basic_recover_async,
    commands.Confirm.Select: Channel._confirm_select,
    commands.Tx.Select: Channel._tx_select,
    commands.Tx.Commit: Channel._tx_commit,
    commands.Tx.Rollback: Channel._tx_rollback,
}

__all__ = ["Channel", "BrokerError"]




class _Join:
    """Waits for several answers (owners, the local store); ok only if all are."""

    __slots__ = ("pending", "ok", "done")

    def __init__(self) -> None:
        self.pending = 0
        self.ok = True
        self.done: Any = None

    def one(self) -> Any:
        self.pending += 1

        def answer(ok: bool) -> None:
            self.pending -= 1
            self.ok = self.ok and ok
            if self.pending == 0 and self.done is not None:
                done, self.done = self.done, None
                done(self.ok)

        return answer

    def finish(self, done: Any) -> None:
        if self.pending == 0:
            done(self.ok)
        else:
            self.done = done
