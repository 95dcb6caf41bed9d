"""The harness's hand-written fast path must agree byte-for-byte with pamqp."""

from __future__ import annotations

import pytest
from pamqp import body as pbody
from pamqp import commands, frame, header, heartbeat

from bench.codec import FrameError, FrameScanner, encode_basic_ack, encode_publish
from bench.scenarios.routing import topic_matches

FRAME_MAX = 131072


def unmarshal_all(data: bytes) -> list[tuple[int, frame.FrameTypes]]:
    out: list[tuple[int, frame.FrameTypes]] = []
    while data:
        used, channel, value = frame.unmarshal(data)
        out.append((channel, value))
        data = data[used:]
    return out


@pytest.mark.parametrize("delivery_mode", [None, 1, 2])
@pytest.mark.parametrize("size", [0, 1, 256, FRAME_MAX - 8, FRAME_MAX - 7, (1 << 20) + 3])
def test_encode_publish_round_trips_through_pamqp(delivery_mode: int | None, size: int) -> None:
    body = bytes(i % 251 for i in range(size))
    raw = encode_publish(3, "bench.x", "a.b.c", body, delivery_mode=delivery_mode, frame_max=FRAME_MAX)
    frames = unmarshal_all(raw)
    assert all(channel == 3 for channel, _ in frames)
    method, content = frames[0][1], frames[1][1]
    assert isinstance(method, commands.Basic.Publish)
    assert (method.exchange, method.routing_key) == ("bench.x", "a.b.c")
    assert not method.mandatory and not method.immediate
    assert isinstance(content, header.ContentHeader)
    assert content.body_size == size
    assert content.properties.delivery_mode == delivery_mode
    bodies = [v for _, v in frames[2:] if isinstance(v, pbody.ContentBody)]
    assert len(bodies) == len(frames) - 2
    assert all(len(b.value) <= FRAME_MAX - 8 for b in bodies)
    assert b"".join(b.value for b in bodies) == body
    assert len(bodies) == -(-size // (FRAME_MAX - 8))


def test_encode_publish_matches_pamqp_bytes() -> None:
    body = b"x" * 256
    ours = encode_publish(1, "", "q", body, delivery_mode=2)
    theirs = (
        frame.marshal(commands.Basic.Publish(exchange="", routing_key="q"), 1)
        + frame.marshal(header.ContentHeader(0, len(body), commands.Basic.Properties(delivery_mode=2)), 1)
        + frame.marshal(pbody.ContentBody(body), 1)
    )
    assert ours == theirs


def test_encode_basic_ack() -> None:
    [(channel, ack)] = unmarshal_all(encode_basic_ack(7, 2**40 + 5, multiple=True))
    assert channel == 7
    assert isinstance(ack, commands.Basic.Ack)
    assert (ack.delivery_tag, ack.multiple) == (2**40 + 5, True)


def deliveries(count: int, body_size: int, *, channel: int = 1, first_tag: int = 1) -> tuple[bytes, list[bytes]]:
    """pamqp-marshalled Basic.Deliver + header + body frames, and the bodies."""
    parts, bodies = [], []
    for tag in range(first_tag, first_tag + count):
        body = bytes((tag + i) % 256 for i in range(body_size))
        bodies.append(body)
        parts.append(frame.marshal(commands.Basic.Deliver(
            consumer_tag="bench-ctag", delivery_tag=tag, exchange="bench.x", routing_key="a.b.c"), channel))
        parts.append(frame.marshal(
            header.ContentHeader(0, body_size, commands.Basic.Properties(delivery_mode=1)), channel))
        for start in range(0, body_size, FRAME_MAX - 8):
            parts.append(frame.marshal(pbody.ContentBody(body[start : start + FRAME_MAX - 8]), channel))
    return b"".join(parts), bodies


# Tiny chunks split every header field; large bodies span several body frames.
CHUNKINGS = [(chunk, size) for chunk in (1, 7, 8, 13, 4096, 1 << 30) for size in (0, 256, 300_000)
             if not (chunk < 13 and size > 1000)]  # byte-at-a-time over 1 MiB is slow and adds nothing


@pytest.mark.parametrize(("chunk", "body_size"), CHUNKINGS)
def test_scanner_parses_pamqp_deliveries_in_any_chunking(chunk: int, body_size: int) -> None:
    stream, bodies = deliveries(5, body_size, first_tag=41)
    scanner = FrameScanner(capture_bodies=True)
    tags = []
    for i in range(0, len(stream), chunk):
        assert scanner.feed(stream[i : i + chunk]) == []
        tags.append(scanner.last_delivery_tag)
    assert scanner.deliveries == 5
    assert scanner.last_delivery_tag == 45
    assert tags == sorted(tags)
    assert scanner.bodies == bodies


@pytest.mark.parametrize("chunk", [5, 1000, 65536])
def test_scanner_counts_without_capturing_large_bodies(chunk: int) -> None:
    # Non-capturing mode skips partial body frames unbuffered; it must stay in sync.
    stream, _ = deliveries(3, 1 << 20)
    stream += deliveries(2, 10, first_tag=4)[0]
    scanner = FrameScanner()
    for i in range(0, len(stream), chunk):
        scanner.feed(stream[i : i + chunk])
    assert (scanner.deliveries, scanner.last_delivery_tag, scanner.bodies) == (5, 5, [])


def test_scanner_returns_other_methods_raw_for_pamqp() -> None:
    consume_ok = frame.marshal(commands.Basic.ConsumeOk(consumer_tag="bench-ctag"), 1)
    close = frame.marshal(commands.Channel.Close(reply_code=404, reply_text="NOT_FOUND", class_id=50, method_id=10), 2)
    stream = consume_ok + deliveries(2, 16)[0] + close
    scanner = FrameScanner()
    slow = scanner.feed(stream[:10]) + scanner.feed(stream[10:])
    assert slow == [consume_ok, close]
    assert isinstance(frame.unmarshal(slow[1])[2], commands.Channel.Close)
    assert scanner.deliveries == 2


def test_scanner_tracks_publisher_confirms() -> None:
    stream = b"".join([
        frame.marshal(commands.Basic.Ack(delivery_tag=1), 1),
        frame.marshal(commands.Basic.Ack(delivery_tag=3), 1),  # single: 2 still outstanding
        frame.marshal(commands.Basic.Nack(delivery_tag=5, multiple=True), 1),
        frame.marshal(commands.Basic.Ack(delivery_tag=7), 1),
    ])
    scanner = FrameScanner()
    scanner.feed(stream[:30])  # first ack (21 bytes) and part of the second
    assert scanner.confirms.confirmed == 1
    scanner.feed(stream[30:])
    assert scanner.confirms.confirmed == 6
    assert scanner.confirms.nacked == 1


def test_scanner_heartbeat_and_bad_frame_end() -> None:
    scanner = FrameScanner()
    scanner.feed(heartbeat.Heartbeat().marshal())
    assert scanner.heartbeats == 1
    bad = bytearray(frame.marshal(commands.Basic.ConsumeOk(consumer_tag="x"), 1))
    bad[-1] = 0
    with pytest.raises(FrameError):
        scanner.feed(bytes(bad))


@pytest.mark.parametrize(
    ("pattern", "key", "expected"),
    [
        ("a.*.c", "a.b.c", True),
        ("a.*.c", "a.b.b.c", False),
        ("a.#", "a", True),
        ("a.#", "a.b.c.d", True),
        ("#.c", "c", True),
        ("#.d", "a.b.c", False),
        ("*.*.z", "x.y.z", True),
        ("#", "", True),
        ("a.b.c", "a.b.c", True),
    ],
)
def test_topic_matches(pattern: str, key: str, expected: bool) -> None:
    assert topic_matches(pattern, key) is expected


def test_queue_bind_and_unbind_decode_with_pamqp() -> None:
    from pamqp import commands, frame

    from bench.codec import encode_queue_bind

    for unbind, cls in ((False, commands.Queue.Bind), (True, commands.Queue.Unbind)):
        raw = encode_queue_bind(3, "q", "x", "dev.1.*", unbind=unbind)
        consumed, channel, method = frame.unmarshal(raw)
        assert (consumed, channel) == (len(raw), 3)
        assert isinstance(method, cls)
        assert (method.queue, method.exchange, method.routing_key, method.arguments) == ("q", "x", "dev.1.*", {})
