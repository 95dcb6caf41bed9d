"""The node-to-node wire format: the protocol version, the packed records, their codec.

Both ends of the internal gRPC streams (``leveret.internal.v1.Node``, see
internal.proto) read and write these bytes: the caller side (core/cluster/link.py)
packs forwarded publishes and unpacks deliveries, the owner side
(core/cluster/service.py) the other way round. Nothing here does I/O.
"""

from __future__ import annotations

import struct

from core.model import properties
from core.model.message import Message, QueuedMessage, SettleHook

# The node-to-node wire format (the packed records, the session's kinds). Every
# call names it; a peer that speaks another one is refused at the call, with the
# reason in the log, rather than having its bytes misread (a rolling upgrade
# across a change of this format is not supported: run one version everywhere).
INTERNAL_PROTOCOL = "2"
PROTOCOL_KEY = "leveret-internal-protocol"
PROTOCOL_MD = ((PROTOCOL_KEY, INTERNAL_PROTOCOL),)


class ProxiedMessage(QueuedMessage):
    """A message a non-owner node holds for its local consumers; the owner keeps it unacked."""

    __slots__ = ("link", "remote_id", "reject", "sub")

    link: SettleHook  # the peer link it came through (core/cluster/link.py), where settling it is reported

    def __init__(self, message: Message, offset: int, link: SettleHook, remote_id: int, sub: int,
                 redelivered: bool = False, delivery_count: int = 0) -> None:
        # QueuedMessage's fields set here rather than through its __init__: one
        # call less per proxied delivery (keep in step with QueuedMessage).
        self.message = message
        self.offset = offset
        self.redelivered = bool(redelivered)
        self.delivery_count = delivery_count
        self.expires_at = None
        self.persisted = False
        self.link = link
        self.remote_id = remote_id
        self.reject = False
        self.sub = sub


# Packed records (the hot path; see the proto's `packed` fields). All names
# are AMQP short strings (<= 255 bytes); message ids are our own (< 64 KiB).
#
# A record carries only what differs from the record before it in the same
# batch: a batch is mostly one queue's messages from one exchange and routing
# key with the same properties, so most records are a fixed head and a body.
# Both nodes then skip the per-message encode, decode and property scan of
# fields that repeat (py-spy: unpacking was 15 % of the forwarding node's time
# and 24 % of the owner's, a third of it property scans and name decodes).
# The first record of a batch carries every field.
NEW_QUEUE = 1  # vhost and queue follow (forwarded publishes)
NEW_ROUTE = 2  # exchange and routing key follow
NEW_PROPS = 4  # the properties follow
_FWD = struct.Struct(">BIHd")  # flags, body length, id length, timestamp
_DLV = struct.Struct(">QQBIdBIH")  # id, offset, redelivered, count, timestamp, flags, body length, id length
_DLV_FLAGS_AT = struct.calcsize(">QQBId")
_NAMES = struct.Struct(">BB")
_U32 = struct.Struct(">I")


class Packer:
    """One batch of packed records being built, and the fields its last record had."""

    __slots__ = ("parts", "_vhost", "_queue", "_exchange", "_routing_key", "_props")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self._vhost: bytes | None = None
        self._queue: bytes | None = None
        self._exchange: str | None = None
        self._routing_key: str | None = None
        self._props: bytes | None = None

    def _changed(self, m: Message, flags: int) -> tuple[int, list[bytes]]:
        """The flags and packed fields of what differs from the last record (rarely anything)."""
        extra: list[bytes] = []
        if m.exchange != self._exchange or m.routing_key != self._routing_key:
            self._exchange, self._routing_key = m.exchange, m.routing_key
            ex, rk = m.exchange.encode(), m.routing_key.encode()
            extra += (_NAMES.pack(len(ex), len(rk)), ex, rk)
            flags |= NEW_ROUTE
        if m.props != self._props:
            self._props = m.props
            extra += (_U32.pack(len(m.props)), m.props)
            flags |= NEW_PROPS
        return flags, extra

    def forwarded(self, vhost: bytes, queue: bytes, m: Message) -> None:
        body = m.body
        mid = m._id
        if (queue is self._queue and vhost is self._vhost and m.props == self._props
                and m.routing_key == self._routing_key and m.exchange == self._exchange):
            if mid is None:
                self.parts += (_FWD.pack(0, len(body), 0, m.timestamp), body)
            else:
                mid_b = mid.encode()
                self.parts += (_FWD.pack(0, len(body), len(mid_b), m.timestamp), body, mid_b)
            return
        flags = 0
        extra: list[bytes] = []
        if queue is not self._queue or vhost is not self._vhost:
            self._vhost, self._queue = vhost, queue
            extra += (_NAMES.pack(len(vhost), len(queue)), vhost, queue)
            flags = NEW_QUEUE
        flags, more = self._changed(m, flags)
        mid_b = mid.encode() if mid is not None else b""
        self.parts.append(_FWD.pack(flags, len(body), len(mid_b), m.timestamp))
        self.parts += extra
        self.parts += more
        self.parts += (body, mid_b)

    def delivery(self, did: int, qm: QueuedMessage) -> None:
        m = qm.message
        body = m.body
        # The owner fixes the id (it is made lazily): the proxy's consumers must see the id the owner
        # stores, or a redelivery after a failover could not be told from a new message.
        mid_b = m.id.encode()
        if m.props == self._props and m.routing_key == self._routing_key and m.exchange == self._exchange:
            self.parts += (_DLV.pack(did, qm.offset, qm.redelivered, qm.delivery_count, m.timestamp, 0,
                                     len(body), len(mid_b)), body, mid_b)  # fmt: skip
            return
        flags, extra = self._changed(m, 0)
        self.parts.append(_DLV.pack(did, qm.offset, qm.redelivered, qm.delivery_count, m.timestamp, flags,
                                    len(body), len(mid_b)))  # fmt: skip
        self.parts += extra
        self.parts += (body, mid_b)

    def take(self) -> bytes:
        """The batch so far, packed; the next record starts a new batch."""
        data = b"".join(self.parts)
        self.parts = []
        self._vhost = self._queue = self._props = None
        self._exchange = self._routing_key = None
        return data


def _new_fields(
    data: bytes, pos: int, flags: int, exchange: str, rk: str, props: bytes, summary: properties.PropertySummary | None
) -> tuple[int, str, str, bytes, properties.PropertySummary | None]:
    """Read the route and properties a record carries (NEW_ROUTE, NEW_PROPS); the others stay as they were.

    Only records whose fields changed come here, so the common record pays no call.
    """
    if flags & NEW_ROUTE:
        lx, lr = _NAMES.unpack_from(data, pos)
        pos += 2
        exchange = data[pos : pos + lx].decode()
        pos += lx
        rk = data[pos : pos + lr].decode()
        pos += lr
    if flags & NEW_PROPS:
        (lp,) = _U32.unpack_from(data, pos)
        pos += 4
        props = data[pos : pos + lp]
        pos += lp
        summary = properties.scan(props)
    return pos, exchange, rk, props, summary


def _malformed(what: str) -> ValueError:
    return ValueError(f"malformed packed {what}: a batch must begin with a record carrying every field")


def unpack_forwarded(data: bytes, node: str) -> list[tuple[str, str, list[Message]]]:
    """The forwarded messages of a batch, as runs of messages to one (vhost, queue)."""
    runs: list[tuple[str, str, list[Message]]] = []
    if not data:
        return runs
    if data[0] != NEW_QUEUE | NEW_ROUTE | NEW_PROPS:
        raise _malformed("forwards")
    messages: list[Message] = []
    exchange = rk = ""
    props = b""
    summary = None
    pos = 0
    end = len(data)
    unpack = _FWD.unpack_from
    size = _FWD.size
    while pos < end:
        flags, lb, li, ts = unpack(data, pos)
        pos += size
        if flags:
            if flags & NEW_QUEUE:
                lv, lq = _NAMES.unpack_from(data, pos)
                pos += 2
                vhost = data[pos : pos + lv].decode()
                pos += lv
                queue = data[pos : pos + lq].decode()
                pos += lq
                messages = []
                runs.append((vhost, queue, messages))
            pos, exchange, rk, props, summary = _new_fields(data, pos, flags, exchange, rk, props, summary)
        body = data[pos : pos + lb]
        pos += lb
        m = Message(exchange, rk, props, body, summary, node, ts)
        if li:
            m._id = data[pos : pos + li].decode()
            pos += li
        messages.append(m)
    return runs


def unpack_deliveries(data: bytes, link: SettleHook, node: str, sub: int) -> list[ProxiedMessage]:
    """The owner's packed deliveries as the messages this node holds for them (``sub`` 0: a basic.get).

    ``link`` is where their settlements go, ``node`` the owner's id.
    """
    out: list[ProxiedMessage] = []
    if not data:
        return out
    if data[_DLV_FLAGS_AT] != NEW_ROUTE | NEW_PROPS:
        raise _malformed("deliveries")
    exchange = rk = ""
    props = b""
    summary = None
    pos = 0
    end = len(data)
    unpack = _DLV.unpack_from
    size = _DLV.size
    append = out.append
    while pos < end:
        did, offset, redelivered, count, ts, flags, lb, li = unpack(data, pos)
        pos += size
        if flags:
            pos, exchange, rk, props, summary = _new_fields(data, pos, flags, exchange, rk, props, summary)
        body = data[pos : pos + lb]
        pos += lb
        m = Message(exchange, rk, props, body, summary, node, ts)
        if li:
            m._id = data[pos : pos + li].decode()
            pos += li
        append(ProxiedMessage(m, offset, link, did, sub, redelivered, count))
    return out
