"""A tiny sans-IO AMQP 0-9-1 test client driving ``amqp_frontend.connection.Connection``.

Frames are built with pamqp (``frame.marshal``) exactly as a real client would
send them and the connection's output is parsed back with ``frame.unmarshal``,
so the tests read like a wire transcript without opening a socket.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pamqp import commands, frame
from pamqp.base import Frame as Method
from pamqp.body import ContentBody
from pamqp.header import ContentHeader, ProtocolHeader
from pamqp.heartbeat import Heartbeat

from amqp_frontend.connection import Connection, ServerSettings
from core.engine.broker import Broker
from harness.brokers import local_broker

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
LOOPBACK = ("127.0.0.1", 1234)
DEFAULT_CAPABILITIES = {
    "authentication_failure_close": True,
    "consumer_cancel_notify": True,
    "publisher_confirms": True,
    "basic.nack": True,
}

AnyFrame = Method | ContentHeader | ContentBody | Heartbeat | ProtocolHeader
Received = list[tuple[int, AnyFrame]]


def parse_frames(data: bytes) -> Received:
    """Every complete frame in ``data`` as (channel, frame); trailing bytes are an error."""
    out: Received = []
    pos = 0
    view = bytes(data)
    while pos < len(view):
        consumed, channel, value = frame.unmarshal(view[pos:])
        assert consumed > 0
        out.append((channel, value))
        pos += consumed
    return out


def plain(user: str = "guest", password: str = "guest") -> str:
    return f"\0{user}\0{password}"


def content_frames(channel: int, body: bytes, properties: commands.Basic.Properties | None = None,
                   chunk: int | None = None) -> bytes:
    """Content header plus body frames, the body split in ``chunk``-sized pieces when given."""
    props = properties or commands.Basic.Properties()
    out = [frame.marshal(ContentHeader(0, len(body), props), channel)]
    step = chunk or max(len(body), 1)
    for start in range(0, len(body), step):
        out.append(frame.marshal(ContentBody(body[start : start + step]), channel))
    return b"".join(out)


@dataclass
class Delivery:
    """A method that carries content (Deliver, GetOk, Return) with its header and body."""

    channel: int
    method: Any
    header: Any = None  # ContentHeader once it arrived
    body: bytes = b""
    body_frames: int = 0

    @property
    def properties(self) -> commands.Basic.Properties:
        return self.header.properties


def assemble(frames: Received) -> tuple[list[Delivery], Received]:
    """Split ``frames`` into content-carrying deliveries and the other frames (in order)."""
    deliveries: list[Delivery] = []
    others: Received = []
    pending: dict[int, Delivery] = {}
    for channel, value in frames:
        if isinstance(value, (commands.Basic.Deliver, commands.Basic.GetOk, commands.Basic.Return)):
            assert channel not in pending, f"new content method while content pending on channel {channel}"
            d = Delivery(channel, value)
            pending[channel] = d
            deliveries.append(d)
        elif isinstance(value, ContentHeader):
            d = pending[channel]
            d.header = value
            if value.body_size == 0:
                del pending[channel]
        elif isinstance(value, ContentBody):
            d = pending[channel]
            d.body += value.value
            d.body_frames += 1
            if len(d.body) >= d.header.body_size:
                assert len(d.body) == d.header.body_size
                del pending[channel]
        else:
            others.append((channel, value))
    assert not pending, f"incomplete content on channels {sorted(pending)}"
    return deliveries, others


@dataclass
class Client:
    """One client connection: sends pamqp frames in, reads parsed frames out."""

    broker: Broker = field(default_factory=local_broker)
    settings: ServerSettings | None = None
    peer: tuple[str, int] | None = LOOPBACK
    now: float | None = None
    conn: Connection = field(init=False)

    def __post_init__(self) -> None:
        self.conn = Connection(self.broker, self.settings, peer=self.peer, now=self.now)

    # ----------------------------------------------------------------- input
    def send_raw(self, data: bytes, now: float | None = None) -> None:
        """Feed bytes; under an injected clock (``now`` given at creation) they arrive at ``self.now``."""
        self.conn.receive_data(data, now=self.now if now is None else now)

    def tick(self, now: float) -> None:
        """Advance the injected clock to ``now`` and let the connection run its timers."""
        self.now = now
        self.conn.tick(now)

    def send(self, channel: int, *values: AnyFrame, now: float | None = None) -> None:
        """Marshal ``values`` on ``channel`` and feed them in one receive_data call."""
        self.send_raw(b"".join(frame.marshal(v, channel) for v in values), now=now)

    # ---------------------------------------------------------------- output
    def read(self) -> Received:
        return parse_frames(self.conn.data_to_send())

    def call(self, channel: int, method: Method) -> Received:
        self.send(channel, method)
        return self.read()

    def expect(self, channel: int, method: Method, reply: type) -> Any:
        """Send ``method`` and return the single reply frame, asserting its type and channel."""
        frames = self.call(channel, method)
        assert len(frames) == 1, frames
        ch, value = frames[0]
        assert ch == channel and isinstance(value, reply), frames
        return value

    # ------------------------------------------------------------- handshake
    def handshake(
        self,
        vhost: str = "/",
        user: str = "guest",
        password: str = "guest",
        heartbeat: int = 0,
        frame_max: int | None = None,
        channel_max: int | None = None,
        capabilities: dict[str, Any] | None = None,
    ) -> tuple[commands.Connection.Start, commands.Connection.Tune]:
        """Protocol header -> Start -> StartOk -> Tune -> TuneOk -> Open -> OpenOk."""
        self.send_raw(PROTOCOL_HEADER)
        frames = self.read()
        assert len(frames) == 1 and isinstance(frames[0][1], commands.Connection.Start), frames
        start = frames[0][1]
        caps = DEFAULT_CAPABILITIES if capabilities is None else capabilities
        tune = self.expect(
            0,
            commands.Connection.StartOk(
                client_properties={"product": "leveret-tests", "capabilities": caps},
                mechanism="PLAIN",
                response=plain(user, password),
            ),
            commands.Connection.Tune,
        )
        self.send(
            0,
            commands.Connection.TuneOk(
                channel_max=tune.channel_max if channel_max is None else channel_max,
                frame_max=tune.frame_max if frame_max is None else frame_max,
                heartbeat=heartbeat,
            ),
        )
        assert self.read() == []
        self.expect(0, commands.Connection.Open(virtual_host=vhost), commands.Connection.OpenOk)
        return start, tune

    def open_channel(self, number: int = 1) -> None:
        self.expect(number, commands.Channel.Open(), commands.Channel.OpenOk)

    # ------------------------------------------------------------ messaging
    def publish(
        self,
        channel: int,
        body: bytes,
        exchange: str = "",
        routing_key: str = "",
        properties: commands.Basic.Properties | None = None,
        mandatory: bool = False,
        immediate: bool = False,
        chunk: int | None = None,
    ) -> None:
        self.send_raw(
            publish_bytes(channel, body, exchange, routing_key, properties, mandatory, immediate, chunk)
        )

    def declare_queue(self, channel: int, name: str = "", **kwargs: Any) -> commands.Queue.DeclareOk:
        return self.expect(channel, commands.Queue.Declare(queue=name, **kwargs), commands.Queue.DeclareOk)

    def consume(self, channel: int, queue: str, tag: str = "", **kwargs: Any) -> Received:
        """Basic.Consume; returns every frame produced (ConsumeOk first, then deliveries)."""
        frames = self.call(channel, commands.Basic.Consume(queue=queue, consumer_tag=tag, **kwargs))
        assert frames and isinstance(frames[0][1], commands.Basic.ConsumeOk), frames
        return frames


def publish_bytes(
    channel: int,
    body: bytes,
    exchange: str = "",
    routing_key: str = "",
    properties: commands.Basic.Properties | None = None,
    mandatory: bool = False,
    immediate: bool = False,
    chunk: int | None = None,
) -> bytes:
    method = commands.Basic.Publish(
        exchange=exchange, routing_key=routing_key, mandatory=mandatory, immediate=immediate
    )
    return frame.marshal(method, channel) + content_frames(channel, body, properties, chunk)


def connected(broker: Broker | None = None, channels: tuple[int, ...] = (1,), **kwargs: Any) -> Client:
    """A client on ``broker`` (a new one by default) past the handshake with ``channels`` open."""
    client = Client(broker or local_broker())
    client.handshake(**kwargs)
    for n in channels:
        client.open_channel(n)
    return client
