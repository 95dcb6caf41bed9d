"""Shared pieces of the fuzzers (tests/test_fuzz.py, bench/fuzz.py): seed frames, mutations, checks.

The seeds are well-formed client frames covering the methods clients use;
the mutations are the ones the issue's outside fuzzer used (flipped bytes,
bad type tags, truncation, huge sizes, wrong channels, nesting). Frames are
mutated inside their payload and re-framed most of the time, because a
broken frame header only ever reaches the framing check.
"""

from __future__ import annotations

import datetime
import random
import struct
from collections.abc import Iterator

from pamqp import commands, frame
from pamqp.base import Frame as Method
from pamqp.body import ContentBody
from pamqp.common import FieldTable, FieldValue
from pamqp.header import ContentHeader

from core.engine.broker import Broker
from core.model import properties
from core.model.errors import BrokerError
from harness.brokers import local_broker

FRAME_HEAD = struct.Struct(">BHI")
PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"

# Reply codes a close may carry: AMQP's own, never 541 INTERNAL_ERROR.
PROTOCOL_CODES = frozenset({200, 311, 312, 313, 320, 402, 403, 404, 405, 406,
                            501, 502, 503, 504, 505, 506, 530, 540})

# Field tables and message properties are decoded in core/model (the
# "publish" work makes them raise 502 there). Until that is merged their raw
# exceptions surface as 541 when a mutated content header is routed; the
# fuzzers count those apart instead of failing on them.
PUBLISH_DECODERS_HARDENED = issubclass(properties.PropertiesError, BrokerError)
PUBLISH_OWNED_FILES = ("core/model/fieldtable.py", "core/model/properties.py")

STAMP = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)


def fresh_broker() -> Broker:
    """A broker as the front-end tests build it, with the local coordinator."""
    broker: Broker = local_broker()
    return broker


def _m(method: Method, channel: int = 1) -> bytes:
    return frame.marshal(method, channel)


def publish(channel: int, body: bytes, exchange: str = "", routing_key: str = "q",
            props: commands.Basic.Properties | None = None) -> bytes:
    return (
        _m(commands.Basic.Publish(exchange=exchange, routing_key=routing_key), channel)
        + frame.marshal(ContentHeader(0, len(body), props or commands.Basic.Properties()), channel)
        + (frame.marshal(ContentBody(body), channel) if body else b"")
    )


RICH_PROPS = commands.Basic.Properties(
    content_type="text/plain", delivery_mode=2, priority=3, message_id="m-1", expiration="60000",
    timestamp=STAMP, headers={"a": 1, "s": "text", "l": [1, "x", 2.5], "t": {"d": STAMP, "n": None}},
)

SETUP = [  # run once per connection before the fuzzed frames (all on channel 1)
    commands.Queue.Declare(queue="q", arguments={"x-max-length": 50}),
    commands.Exchange.Declare(exchange="h", exchange_type="headers"),
    commands.Queue.Bind(queue="q", exchange="h", arguments={"x-match": "any", "a": 1}),
    commands.Queue.Declare(queue="ttl", arguments={"x-message-ttl": 0, "x-dead-letter-exchange": "h"}),
]


def seeds() -> list[bytes]:
    """Well-formed frames (or whole publishes) a client sends, on channels 0-2."""
    methods: list[tuple[int, Method]] = [
        (1, commands.Queue.Declare(queue="q2", durable=False, arguments={"x-max-priority": 5, "x-expires": 60000})),
        (1, commands.Queue.Declare(queue="", exclusive=True)),
        (1, commands.Queue.Declare(queue="q", passive=True)),
        (1, commands.Queue.Bind(queue="q", exchange="amq.topic", routing_key="a.*.#")),
        (1, commands.Queue.Bind(queue="q", exchange="h", arguments={"x-match": "all-with-x", "x-k": "v"})),
        (1, commands.Queue.Unbind(queue="q", exchange="amq.topic", routing_key="a.*.#")),
        (1, commands.Queue.Purge(queue="q")),
        (1, commands.Queue.Delete(queue="q2", if_unused=True)),
        (1, commands.Exchange.Declare(exchange="x", exchange_type="topic", arguments={"alternate-exchange": "h"})),
        (1, commands.Exchange.Bind(destination="h", source="amq.fanout")),
        (1, commands.Exchange.Unbind(destination="h", source="amq.fanout")),
        (1, commands.Exchange.Delete(exchange="x")),
        (1, commands.Basic.Qos(prefetch_count=2)),
        (1, commands.Basic.Consume(queue="q", consumer_tag="c1", arguments={"x-priority": 2})),
        (1, commands.Basic.Cancel(consumer_tag="c1")),
        (1, commands.Basic.Get(queue="q")),
        (1, commands.Basic.Ack(delivery_tag=1, multiple=True)),
        (1, commands.Basic.Nack(delivery_tag=1, requeue=True)),
        (1, commands.Basic.Reject(delivery_tag=2, requeue=False)),
        (1, commands.Basic.Recover(requeue=True)),
        (1, commands.Confirm.Select()),
        (1, commands.Tx.Select()),
        (1, commands.Tx.Commit()),
        (1, commands.Tx.Rollback()),
        (1, commands.Channel.Flow(active=True)),
        (1, commands.Channel.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0)),
        (1, commands.Channel.CloseOk()),
        (2, commands.Channel.Open()),
        (2, commands.Basic.Get(queue="q", no_ack=True)),
        (0, commands.Connection.UpdateSecret(new_secret="s", reason="r")),
    ]
    out = [_m(m, ch) for ch, m in methods]
    out += [
        publish(1, b"hello", exchange="h", props=RICH_PROPS),
        publish(1, b"", routing_key="ttl"),
        publish(1, b"x" * 300, exchange="amq.topic", routing_key="a.b.c"),
        publish(2, b"two", props=commands.Basic.Properties(headers={"x-match": "any", "deep": {"a": [{"b": 1}]}})),
        b"\x08\x00\x00\x00\x00\x00\x00\xce",  # heartbeat
    ]
    return out


def split_frames(data: bytes) -> list[bytes]:
    """``data`` cut at its frame boundaries (as far as they parse)."""
    out = []
    pos = 0
    while len(data) - pos >= 8:
        _t, _c, size = FRAME_HEAD.unpack_from(data, pos)
        out.append(data[pos : pos + size + 8])
        pos += size + 8
    return out


def reframe(ftype: int, channel: int, payload: bytes) -> bytes:
    return FRAME_HEAD.pack(ftype, channel, len(payload)) + payload + b"\xce"


def nested_table(depth: int) -> bytes:
    inner = struct.pack(">I", 0)
    for _ in range(depth - 1):
        entry = b"\x01a" + b"F" + inner
        inner = struct.pack(">I", len(entry)) + entry
    return inner


def mutate(rnd: random.Random, data: bytes) -> bytes:
    """One frame (or publish) mutated the way a hostile or broken client would."""
    frames = split_frames(data) or [data]
    i = rnd.randrange(len(frames))
    f = frames[i]
    if len(f) < 8:
        return data
    ftype, channel, _size = FRAME_HEAD.unpack_from(f, 0)
    payload = bytearray(f[7:-1])
    op = rnd.randrange(12)
    if op == 0 and payload:  # random byte
        payload[rnd.randrange(len(payload))] = rnd.randrange(256)
    elif op == 1 and payload:  # bit flip
        payload[rnd.randrange(len(payload))] ^= 1 << rnd.randrange(8)
    elif op == 2 and payload:  # truncate
        del payload[rnd.randrange(len(payload)):]
    elif op == 3:  # insert
        at = rnd.randrange(len(payload) + 1)
        payload[at:at] = rnd.randbytes(rnd.randint(1, 16))
    elif op == 4:  # field type tags: replace a tag-looking byte
        tags = [j for j, b in enumerate(payload) if chr(b) in "tbBsuIilLfdDSTVFAx"]
        if tags:
            payload[rnd.choice(tags)] = rnd.randrange(256)
    elif op == 5:  # a huge length somewhere
        if len(payload) >= 8:
            at = rnd.randrange(len(payload) - 4)
            payload[at : at + 4] = rnd.choice([b"\xff\xff\xff\xff", b"\x7f\xff\xff\xff", b"\x00\x01\x00\x00"])
    elif op == 6:  # deep nesting at the end (where table arguments sit)
        if len(payload) >= 4:
            payload[-4:] = nested_table(rnd.choice([65, 200, 3000]))
    elif op == 7:  # another frame type
        ftype = rnd.choice([1, 2, 3, 4, 8, 0, 255])
    elif op == 8:  # another channel
        channel = rnd.choice([0, 1, 2, 3, 65535])
    elif op == 9:  # timestamp out of range
        stamp = struct.pack(">Q", int(STAMP.timestamp()))
        payload = bytearray(bytes(payload).replace(stamp, b"\xff" * 8))
    elif op == 10:  # raw damage to framing: no re-frame
        raw = bytearray(f)
        raw[rnd.randrange(len(raw))] = rnd.randrange(256)
        frames[i] = bytes(raw)
        return b"".join(frames)
    else:  # drop the frame entirely (content out of order)
        del frames[i]
        return b"".join(frames)
    frames[i] = reframe(ftype, channel, bytes(payload))
    return b"".join(frames)


def server_frames(data: bytes) -> Iterator[tuple[int, int, bytes]]:
    """The node's output as (type, channel, payload); raises on broken framing."""
    pos = 0
    while pos < len(data):
        ftype, channel, size = FRAME_HEAD.unpack_from(data, pos)
        end = pos + 7 + size
        if data[end] != 0xCE:
            raise AssertionError(f"node wrote a bad frame end at {end}")
        yield ftype, channel, data[pos + 7 : end]
        pos = end + 1


def close_codes(data: bytes) -> list[tuple[int, int]]:
    """(channel, reply code) of every connection.close / channel.close the node wrote."""
    out = []
    for ftype, channel, payload in server_frames(data):
        if ftype == 1 and payload[:4] in (b"\x00\x0a\x00\x32", b"\x00\x14\x00\x28"):
            out.append((channel, struct.unpack_from(">H", payload, 4)[0]))
    return out


# -- hostile but well-formed input ---------------------------------------------------------
# A byte fuzzer breaks frames; it did not find that a valid topic binding such as
# "#.*.#.*.…z" made routing exponential (issue #26, item 11). These frames are all valid
# AMQP: what is hostile is their content (patterns, sizes, nesting, names).

def _words(rnd: random.Random, count: int) -> str:
    return ".".join(rnd.choice(("a", "b", "z", "#", "*", "ab", "")) for _ in range(count))


def nasty_topic_pattern(rnd: random.Random, scale: int = 14) -> str:
    """Binding keys a backtracking matcher pays for: runs of '#' and '*', at most 255 bytes."""
    shape = rnd.randrange(5)
    if shape == 0:
        key = "#.*." * rnd.randint(1, scale) + "z"
    elif shape == 1:
        key = ".".join(["#"] * rnd.randint(2, scale * 2) + ["z"])
    elif shape == 2:
        key = "*." * rnd.randint(1, scale * 2) + "#"
    elif shape == 3:
        key = _words(rnd, rnd.randint(1, scale * 3))
    else:
        key = "#." + ".".join("*" if rnd.random() < 0.5 else "#" for _ in range(rnd.randint(1, scale))) + ".z"
    return key[:255]


def long_routing_key(rnd: random.Random, words: int = 128) -> str:
    """Up to 255 bytes of short words (the most words a key can have), never ending in 'z'."""
    count = words if rnd.random() < 0.5 else rnd.randint(1, words)  # often the longest: the worst case
    return ".".join(rnd.choice("abcdxy") for _ in range(count))[:255].rstrip(".") or "a"


def big_table(rnd: random.Random, entries: int = 200, depth: int = 0) -> FieldTable:
    """A table with many entries, or nested up to ``depth`` (within the 64-level limit)."""
    values: tuple[FieldValue, ...]
    table: FieldTable = {}
    for i in range(entries):
        values = (i, "v" * rnd.randint(0, 200), [i, "x"], None, True, 2.5)
        table[f"k{i}"] = rnd.choice(values)
    for _ in range(depth):
        table = {"n": table, "x-match": "any"}
    return table


def odd_name(rnd: random.Random) -> str:
    """Queue and exchange names at the edges: 255 bytes, multi-byte UTF-8, amq.-like, dots."""
    return rnd.choice(("q" * 255, "é" * 127, "amq.gen-" + "x" * 20, "....", "очередь", " ", "a\x00b",
                       "h-" + "#.*" * 20))


def _named(method: Method, name: str) -> bytes:
    """``method`` (built with the name "PLACEHOLDER") with ``name`` put in its place: pamqp refuses to
    build names outside the spec's domain, which RabbitMQ (and Leveret) accept."""
    raw = _m(method)
    encoded = name.encode("utf-8")[:255]
    payload = raw[7:-1].replace(b"\x0bPLACEHOLDER", bytes((len(encoded),)) + encoded, 1)
    return reframe(1, 1, payload)


def hostile(rnd: random.Random, scale: int = 14, partial: bool = True) -> bytes:
    """Well-formed frames for channel 1 that stress routing, decoding and memory, not framing.

    ``scale`` bounds the topic patterns (14: the issue's 14 times "#.*."); the in-process test uses
    less, bench/fuzz.py the full size, where a second client measures the node's stalls. With
    ``partial`` the frames may end inside a message body (a method frame after it is then 505).
    """
    kind = rnd.randrange(9 if partial else 8)
    if kind == 0:  # a nasty binding, then a publish with a long key that matches nothing
        return (_m(commands.Queue.Bind(queue="q", exchange="amq.topic", routing_key=nasty_topic_pattern(rnd, scale)))
                + publish(1, b"t", exchange="amq.topic", routing_key=long_routing_key(rnd, scale * 2)))
    if kind == 1:  # headers bindings with large and deep argument tables
        args = big_table(rnd, rnd.choice((1, 50, 500)), rnd.choice((0, 5, 60)))
        args["x-match"] = rnd.choice(("any", "all", "any-with-x", "all-with-x"))
        return _m(commands.Queue.Bind(queue="q", exchange="h", arguments=args))
    if kind == 2:  # a publish with huge headers to the headers exchange
        headers = big_table(rnd, rnd.choice((10, 300, 2000)), rnd.choice((0, 20, 60)))
        return publish(1, b"h", exchange="h", props=commands.Basic.Properties(headers=headers))
    if kind == 3:  # declarations with large argument tables and odd names
        args = big_table(rnd, rnd.choice((5, 500)), rnd.choice((0, 60)))
        return _named(commands.Queue.Declare(queue="PLACEHOLDER", arguments=args, auto_delete=True), odd_name(rnd))
    if kind == 4:  # exchange-to-exchange bindings in a ring, then a publish into it
        return (_m(commands.Exchange.Declare(exchange="r1", exchange_type="topic"))
                + _m(commands.Exchange.Declare(exchange="r2", exchange_type="topic"))
                + _m(commands.Exchange.Bind(destination="r2", source="r1", routing_key="#"))
                + _m(commands.Exchange.Bind(destination="r1", source="r2", routing_key="#"))
                + _m(commands.Exchange.Bind(destination="amq.topic", source="r1",
                                            routing_key=nasty_topic_pattern(rnd, scale)))
                + publish(1, b"r", exchange="r1", routing_key=long_routing_key(rnd, scale * 2)))
    if kind == 5:  # a consumer with a big argument table, a long tag
        return _m(commands.Basic.Consume(queue="q", consumer_tag=f"{rnd.getrandbits(64):016x}" + "c" * 239,
                                         no_ack=True,
                                         arguments=big_table(rnd, rnd.choice((1, 300)), 0)))
    if kind == 6:  # many small bindings with patterns on one queue
        return b"".join(_m(commands.Queue.Bind(queue="q", exchange="amq.topic",
                                               routing_key=nasty_topic_pattern(rnd, scale // 2 or 1)))
                        for _ in range(rnd.randint(5, 40)))
    if kind == 7:  # get + reject(requeue) pairs: replies the client may never read
        return b"".join(_m(commands.Basic.Get(queue="q")) + _m(commands.Basic.Reject(delivery_tag=i + 1,
                                                                                     requeue=True))
                        for i in range(rnd.randint(1, 20)))
    # a body announced larger than what follows: a partial body the node must account for
    body = b"p" * rnd.choice((10, 4096, 100_000))
    return (_m(commands.Basic.Publish(exchange="", routing_key="q"))
            + frame.marshal(ContentHeader(0, len(body) * 4, commands.Basic.Properties()), 1)
            + frame.marshal(ContentBody(body), 1))
