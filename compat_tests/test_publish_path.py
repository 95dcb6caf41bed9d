"""The publish path end to end (core/engine/publish.py, docs/notes/publish.md).

1. A durable stream confirms after its commit for every delivery mode: publishers
   with confirms send delivery_mode 1 and 2, the node is SIGKILLed right after
   a confirm arrives, restarted on the same data, and every confirmed message
   is read back.
2. A message whose headers do not decode is refused at the door (AMQP 502 and
   only that connection closes; gRPC INVALID_ARGUMENT), so the messages around
   it in a queue with a TTL and a dead-letter exchange all reach the DLX's queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import struct
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pika
import pika.exceptions
import pytest
from pamqp import commands

from compat_tests.raw_amqp import RawAMQP, raw_frame
from compat_tests.test_durability import (  # noqa: F401  (fixtures: a node on each store)
    durability_postgres,
    fresh_database,
    store_args,
)
from harness.node import ConfirmingPublisher, ConnectionLost, NodeProcess
from leveret.client import Client, LeveretError
from leveret.streams_client import StreamsClient

pytestmark = pytest.mark.timeout(120)

STREAM = {"x-queue-type": "stream"}


def _name(prefix: str) -> str:
    return f"{prefix}.{uuid.uuid4().hex[:8]}"


@pytest.fixture
def stream_node(tmp_path: Path, store_args: list[str]) -> Iterator[NodeProcess]:  # noqa: F811
    n = NodeProcess(tmp_path / "data", tmp_path / "logs", store_args)
    try:
        yield n
    finally:
        n.cleanup()


# -- 1. a stream's confirms survive kill -9 -------------------------------------------------------


async def _publish(pub: ConfirmingPublisher, kind: str, queue: str, stop: asyncio.Event) -> None:
    """Publish as fast as a window allows until ``stop`` or the connection drops; kind T, P or M(ixed)."""
    window, chunk = 2000, 100
    while not stop.is_set() and not pub.closed.is_set():
        if pub.published - pub.settled >= window:
            await pub.wait_progress(0.05)
            continue
        for _ in range(chunk):
            seq = pub.published + 1
            mode = 1 if kind == "T" or (kind == "M" and seq % 2) else 2
            pub.publish("", queue, f"{kind}:{seq}:{mode}".encode(), mode)
        try:
            await pub.flush()
        except ConnectionLost:
            return
        await asyncio.sleep(0)


async def _run_until_killed(node: NodeProcess, queue: str) -> dict[str, set[int]]:
    pubs = {kind: ConfirmingPublisher() for kind in "TPM"}
    for pub in pubs.values():
        await pub.open("127.0.0.1", node.amqp_port)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(_publish(pub, kind, queue, stop)) for kind, pub in pubs.items()]
    started = time.monotonic()
    transient = pubs["T"]
    try:
        while True:
            # Woken right after the transient publisher read a confirm: the bug this
            # guards against acked a delivery_mode=1 publish to a stream before its commit.
            await transient.wait_progress(1.0)
            enough = all(len(p.acked()) >= 300 for p in pubs.values()) and time.monotonic() - started > 1.0
            if enough or time.monotonic() - started > 30:
                node.send_kill()
                break
        confirmed = {kind: set(pub.acked()) for kind, pub in pubs.items()}
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for pub in pubs.values():
            with contextlib.suppress(Exception):
                await pub.close()
    for kind, pub in pubs.items():
        assert not pub.anomalies, pub.anomalies
        assert not pub.nacked(), f"{kind}: nacked {sorted(pub.nacked())[:10]}"
    return confirmed


def _read_stream(node: NodeProcess, queue: str, wanted: set[bytes], timeout: float = 30.0) -> set[bytes]:
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    got: set[bytes] = set()
    try:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=2000)

        def on_message(c: object, m: object, p: object, body: bytes) -> None:
            got.add(body)
            ch.basic_ack(m.delivery_tag)  # type: ignore[attr-defined]

        ch.basic_consume(queue, on_message, arguments={"x-stream-offset": "first"})
        deadline = time.monotonic() + timeout
        while not wanted <= got and time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.1)
    finally:
        with contextlib.suppress(pika.exceptions.AMQPError):
            conn.close()
    return got


def test_stream_confirms_of_both_delivery_modes_survive_kill9(stream_node: NodeProcess) -> None:
    node = stream_node
    node.start()
    queue = _name("stream")
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    conn.channel().queue_declare(queue, durable=True, arguments=STREAM)
    conn.close()

    confirmed = asyncio.run(_run_until_killed(node, queue))
    node.kill()
    wanted = {
        f"{kind}:{seq}:{1 if kind == 'T' or (kind == 'M' and seq % 2) else 2}".encode()
        for kind, seqs in confirmed.items() for seq in seqs
    }
    transient = sum(1 for w in wanted if w.endswith(b":1"))
    assert transient >= 300 and len(wanted) - transient >= 300, (transient, len(wanted))

    node.start()
    got = _read_stream(node, queue, wanted)
    missing = sorted(wanted - got)
    assert not missing, f"{len(missing)} of {len(wanted)} confirmed messages lost, e.g. {missing[:10]}"


# -- 2. malformed headers are refused at the door --------------------------------------------------


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    base = tmp_path_factory.mktemp("publish-path")
    n = NodeProcess(base / "data", base / "logs")
    n.start()
    deadline = time.monotonic() + 15
    while True:  # the gRPC port opens a moment after AMQP's
        try:
            socket.create_connection(("127.0.0.1", n.grpc_port), timeout=0.5).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "gRPC port never opened"
            time.sleep(0.05)
    try:
        yield n
    finally:
        n.terminate()


def _table(*entries: tuple[bytes, bytes]) -> bytes:
    body = b"".join(bytes([len(k)]) + k + v for k, v in entries)
    return struct.pack(">I", len(body)) + body


def _deep(depth: int) -> bytes:
    data = b"\x00\x00\x00\x00"
    for _ in range(depth - 1):
        data = _table((b"k", b"F" + data))
    return data


MALFORMED = {
    "unknown-tag": _table((b"kind", b"S\x00\x00\x00\x04good"), (b"bad", b"Z\x00\x00")),
    "3000-deep": _table((b"kind", b"S\x00\x00\x00\x04good"), (b"deep", b"F" + _deep(3000))),
    "string-past-end": _table((b"kind", b"S\x00\x00\x00\x04good"),
                              (b"s", b"S" + struct.pack(">I", 500) + b"short")),
}


def _publish_malformed(node: NodeProcess, exchange: str, headers: bytes) -> commands.Connection.Close:
    raw = RawAMQP("127.0.0.1", node.amqp_port)
    try:
        raw.handshake()
        raw.open_channel(1)
        body = b"malformed"
        # flags: headers (bit 13) + delivery-mode (bit 12); delivery mode 2
        header = struct.pack(">HHQ", 60, 0, len(body)) + struct.pack(">H", 0x2000 | 0x1000) + headers + b"\x02"
        raw.send(commands.Basic.Publish(exchange=exchange, routing_key="work"), 1)
        raw.send_raw(raw_frame(2, 1, header) + raw_frame(3, 1, body))
        close = raw.expect(commands.Connection.Close)
        raw.send(commands.Connection.CloseOk())
        assert raw.wait_closed(timeout=5)
        return close
    finally:
        raw.close_socket()


def test_malformed_headers_are_refused_and_their_neighbours_dead_lettered(node: NodeProcess) -> None:
    work, dlq, dlx, hx = _name("work"), _name("dlq"), _name("dlx"), _name("hx")
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.exchange_declare(dlx, "fanout", durable=True)
    ch.queue_declare(dlq, durable=True)
    ch.queue_bind(dlq, dlx)
    ch.exchange_declare(hx, "headers", durable=True)
    ch.queue_declare(work, durable=True, arguments={"x-message-ttl": 300, "x-dead-letter-exchange": dlx})
    ch.queue_bind(work, hx, arguments={"x-match": "any", "kind": "good"})

    sent: list[bytes] = []

    def good(n: int) -> None:
        for _ in range(n):
            body = f"good-{len(sent)}".encode()
            props = pika.BasicProperties(delivery_mode=2, headers={"kind": "good", "n": {"a": [1, {"b": 2}]}})
            ch.basic_publish(hx, "work", body, props, mandatory=True)
            sent.append(body)

    good(5)
    for case, headers in MALFORMED.items():
        close = _publish_malformed(node, hx, headers)
        assert close.reply_code == 502, (case, close)
        assert close.reply_text.startswith("SYNTAX_ERROR"), (case, close.reply_text)
        good(5)  # the other connection is unaffected
        # The same through the default exchange, straight into the queue.
        assert _publish_malformed(node, "", headers).reply_code == 502, case

    stream = _name("stream")
    ch.queue_declare(stream, durable=True, arguments=STREAM)
    bad_properties = ({"x" * 300: "key longer than 255 bytes"}, {"timestamp": "9" * 30})
    with Client(f"127.0.0.1:{node.grpc_port}") as client, \
            StreamsClient(f"127.0.0.1:{node.grpc_port}") as streams:
        for props in bad_properties:
            calls = (functools.partial(client.push, work, b"refused", properties=props),
                     functools.partial(client.push_many, work, [b"refused"], properties=props),
                     functools.partial(streams.publish, stream, b"refused", properties=props))
            for call in calls:
                with pytest.raises(LeveretError) as info:
                    call()
                assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT, info.value
                assert "properties do not encode" in info.value.details
        client.push(work, b"good-grpc", properties={"kind": "good"}, persistent=True)
        sent.append(b"good-grpc")
    assert ch.queue_declare(stream, passive=True).method.message_count == 0

    # Every good message expires after 300 ms and is dead-lettered to dlq.
    got: list[tuple[bytes, dict[str, object]]] = []
    deadline = time.monotonic() + 20
    while len(got) < len(sent) and time.monotonic() < deadline:
        method, props, body = ch.basic_get(dlq, auto_ack=True)
        if method is None:
            conn.process_data_events(time_limit=0.1)
            continue
        got.append((body, props.headers or {}))
    assert sorted(b for b, _ in got) == sorted(sent)
    assert all(h.get("x-first-death-reason") == "expired" for _, h in got)
    assert ch.queue_declare(work, passive=True).method.message_count == 0
    conn.close()

    log = "".join(p.read_text(errors="replace") for p in node.log_dir.glob("node-*.std*"))
    assert "Traceback" not in log
    assert "RecursionError" not in log
    assert log.count("SYNTAX_ERROR") + log.count('"code": 502') >= 6
