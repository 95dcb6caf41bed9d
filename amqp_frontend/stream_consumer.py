"""AMQP consumers of stream queues (``x-queue-type: stream``), as RabbitMQ serves them.

``basic.consume`` on a stream needs a per-consumer prefetch (406 without),
refuses no-ack (540) and global qos (406), and starts where the
``x-stream-offset`` argument says. ``x-stream-consumer-group`` (a Leveret
extension) joins a named consumer group: its committed offset is where it
starts, members share it one active at a time, and acks advance it.

Every delivery carries the header ``x-stream-offset`` (long), so the message's
properties are re-encoded per delivery; that happens here, for stream
consumers only, and the classic delivery path (``Channel.deliver``) is
untouched.

In a cluster, a consumer of a stream another node owns reads through a
``RemoteStreamReader`` (core/cluster/stream_proxy.py, opened through the
queue's ``remote`` port): same checks, same sink, the
reader itself runs on the owner.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

from pamqp import commands

from amqp_frontend import codec
from core.engine.queue import Consumer, Queue
from core.engine.stream import StreamQueue, reachable, until_reachable
from core.engine.stream_args import GROUP_ARGUMENT, parse_consumer
from core.model.errors import NotImplementedFeature, NotOwner, PreconditionFailed
from core.model.message import QueuedMessage
from core.model.properties import PropertySummary

if TYPE_CHECKING:
    from amqp_frontend.channel import Channel

_u32 = struct.Struct(">I")
_i64 = struct.Struct(">q")
# Field-table entry: shortstr key "x-stream-offset", type 'l' (signed 64-bit), then the value.
_ENTRY_HEAD = b"\x0fx-stream-offsetl"
_ENTRY_LEN = len(_ENTRY_HEAD) + 8
_HEADERS_FLAG = 0x2000


def with_stream_offset(props: bytes, summary: PropertySummary, offset: int) -> bytes:
    """``props`` with ``x-stream-offset: offset`` added at the end of the headers table.

    Spliced into the publisher's bytes rather than decoded and re-encoded. Put
    last so that it wins in a client's dict over a publisher's own header of
    the same name.
    """
    entry = _ENTRY_HEAD + _i64.pack(offset)
    at = summary.headers_at
    if at >= 0:
        (n,) = _u32.unpack_from(props, at)
        end = at + 4 + n
        return b"".join((props[:at], _u32.pack(n + _ENTRY_LEN), props[at + 4 : end], entry, props[end:]))
    flags = (props[0] << 8) | props[1]
    pos = 2
    # content-type and content-encoding come before headers on the wire.
    if flags & 0x8000:
        pos += 1 + props[pos]
    if flags & 0x4000:
        pos += 1 + props[pos]
    flags |= _HEADERS_FLAG
    return b"".join((bytes((flags >> 8, flags & 0xFF)), props[2:pos], _u32.pack(_ENTRY_LEN), entry, props[pos:]))


class StreamSink:
    """The ConsumerSink of one AMQP stream consumer: the channel's credit, deliveries with the offset header."""

    __slots__ = ("ch",)

    def __init__(self, ch: Channel) -> None:
        self.ch = ch

    def has_credit(self, consumer: Consumer) -> bool:
        return self.ch.has_credit(consumer)

    def consumer_cancelled(self, consumer: Consumer) -> None:
        self.ch.consumer_cancelled(consumer)

    def deliver(self, consumer: Consumer, qm: QueuedMessage) -> None:
        ch = self.ch
        tag = ch.next_tag
        ch.next_tag = tag + 1
        ch.unacked[tag] = (qm, consumer, consumer.channel)
        m = qm.message
        props = with_stream_offset(m.props, m.summary, qm.offset)
        conn = ch.conn
        tag_raw = ch._consumer_tag_raw[consumer.tag]
        if len(m.body) > codec.LARGE_BODY:
            conn.write(codec.deliver_frame(ch.number, tag_raw, tag, False, m.exchange, m.routing_key))
            conn.write_content(ch.number, props, m.body)
            return
        route_raw = _route_raw(m.exchange, m.routing_key)
        content = b"".join(codec.content_frames(ch.number, props, m.body, conn.frame_max))
        conn.write(codec.delivery(ch.number, tag_raw, tag, False, route_raw, content))


_routes: dict[tuple[str, str], bytes] = {}


def _route_raw(exchange: str, routing_key: str) -> bytes:
    """Exchange and routing key as shortstrs; a stream has few distinct ones, so they are cached."""
    key = (exchange, routing_key)
    raw = _routes.get(key)
    if raw is None:
        if len(_routes) > 4096:
            _routes.clear()
        raw = _routes[key] = codec.shortstr(exchange) + codec.shortstr(routing_key)
    return raw


def _name(q: Queue) -> str:
    return f"queue '{q.name}' in vhost '{q.vhost}'"


def refuse_get(q: Queue) -> None:
    if isinstance(q, StreamQueue):
        raise NotImplementedFeature(f"basic.get not supported by stream queues {_name(q)}")


def consume(ch: Channel, q: StreamQueue, tag: str, m: commands.Basic.Consume) -> None:
    """basic.consume on a stream: check the consumer, open its reader, start delivering."""
    if ch.prefetch_per_consumer == 0:
        raise PreconditionFailed(f"consumer prefetch count is not set for stream queue {_name(q)}")
    if m.no_ack:
        raise NotImplementedFeature(f"automatic acknowledgement not supported by stream queues {_name(q)}")
    if ch.prefetch_global:
        raise PreconditionFailed(f"global qos is not supported by stream queues {_name(q)}; use basic.qos "
                                 "with global=false")
    args = dict(m.arguments or {})
    spec, group = parse_consumer(args)
    if not reachable(q):
        # Being loaded here (a take-over) or between owners (a failover): wait for it, as a
        # classic consumer would, then consume again from the start (the queue object may be new).
        ch.conn.suspend(ch, 60, 20, _until_served(ch, m.queue), lambda _: ch._basic_consume(m))
        return
    if q.remote is not None:
        _consume_remote(ch, q, tag, m, args)
        return
    reader = q.open_reader(spec, name=tag, group=group)
    consumer = Consumer(tag, reader, StreamSink(ch), no_ack=False, arguments=args, prefetch=ch.prefetch_per_consumer)
    reader.add_consumer(consumer, dispatch=False)
    ch.consumers[tag] = consumer
    ch._consumer_tag_raw[tag] = codec.shortstr(tag)
    if not m.nowait:
        ch.conn.send_method(ch.number, commands.Basic.ConsumeOk(consumer_tag=tag))
    reader.dispatch()


# How long a stream consume waits for the stream to be served (a take-over or a failover).
SERVED_WAIT = 10.0


async def _until_served(ch: Channel, name: str) -> None:
    vhost = ch.vhost
    assert vhost is not None
    try:
        await until_reachable(lambda: vhost.queues.get(name), SERVED_WAIT)
    except TimeoutError:
        raise NotOwner(f"home node of stream queue '{name}' in vhost '{vhost.name}' is down or being replaced; "
                       "retry shortly") from None


def _consume_remote(ch: Channel, q: StreamQueue, tag: str, m: commands.Basic.Consume, args: dict[str, Any]) -> None:
    """A stream another node owns (cluster): the reader runs there, this consumer reads through it."""
    assert q.remote is not None
    reader_args: dict[str, object] = {k: v for k, v in args.items() if k in ("x-stream-offset", GROUP_ARGUMENT)}
    reader = q.remote.open_stream_reader(tag, reader_args)
    consumer = Consumer(tag, reader, StreamSink(ch), no_ack=False, arguments=args, prefetch=ch.prefetch_per_consumer)
    ch.consumers[tag] = consumer
    ch._consumer_tag_raw[tag] = codec.shortstr(tag)
    if not m.nowait:
        ch.conn.send_method(ch.number, commands.Basic.ConsumeOk(consumer_tag=tag))
    reader.add_consumer(consumer)
