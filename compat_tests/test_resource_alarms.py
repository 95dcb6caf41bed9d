"""Resource alarms (issue #17): what the memory alarm counts, every way in respecting it, the disk alarm.

Each test starts its own node (its thresholds are the test's), so they are
Leveret-only.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pytest
from pamqp import commands, frame, header
from pamqp.body import ContentBody

from compat_tests.raw_amqp import RawAMQP
from compat_tests.util import drain, wait_until
from harness.node import NodeProcess
from leveret.client import Client, LeveretError

pytestmark = pytest.mark.timeout(60)

WATERMARK = 8_000_000


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[Any]:
    nodes: list[NodeProcess] = []

    def start(*args: str) -> NodeProcess:
        n = NodeProcess(tmp_path / f"data{len(nodes)}", tmp_path / f"logs{len(nodes)}", list(args))
        nodes.append(n)
        n.start()
        return n

    yield start
    for n in nodes:
        n.cleanup()


def _api(node: NodeProcess, path: str) -> tuple[int, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{node.management_port}{path}")
    req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def _node_info(node: NodeProcess) -> dict[str, Any]:
    _status, nodes = _api(node, "/api/nodes")
    return nodes[0]  # type: ignore[no-any-return]


def _until(check: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return True
        except urllib.error.URLError:
            pass  # the management listener starts after the AMQP one
        time.sleep(0.05)
    return False


def test_a_partly_received_body_raises_the_memory_alarm(make_node: Any) -> None:
    """A channel announcing a 64 MiB body and sending 16 MiB of it: held, so counted (watermark 8 MB)."""
    node = make_node("--memory-high-watermark", str(WATERMARK))
    with RawAMQP("127.0.0.1", node.amqp_port) as raw:
        raw.handshake()
        raw.open_channel(1)
        announced = 64 * 1024 * 1024
        raw.sock.sendall(frame.marshal(commands.Basic.Publish(exchange="", routing_key="nowhere"), 1)
                         + frame.marshal(header.ContentHeader(0, announced, commands.Basic.Properties()), 1))
        chunk = frame.marshal(ContentBody(bytes(raw.frame_max - 8)), 1)
        sent = 0
        raw.sock.settimeout(2.0)
        try:
            while sent < 16 * 1024 * 1024:
                raw.sock.sendall(chunk)
                sent += len(chunk)
        except TimeoutError:
            pass  # the node stopped reading: the alarm blocked this connection first
        assert sent > WATERMARK
        assert _until(lambda: _node_info(node)["mem_alarm"] is True), "no alarm for 16 MiB held in a partial body"
        status, body = _api(node, "/api/health/checks/alarms")
        assert status == 503 and body["alarms"][0]["resource"] == "memory"
    # The connection went away with its partial body: the alarm clears.
    assert _until(lambda: _node_info(node)["mem_alarm"] is False)


def test_grpc_push_waits_while_the_memory_alarm_is_raised(make_node: Any) -> None:
    node = make_node("--memory-high-watermark", str(WATERMARK))
    client = Client(f"127.0.0.1:{node.grpc_port}", username="guest", password="guest")
    try:
        client.create_queue("fill")
        body = bytes(100_000)
        for _ in range(10):  # 10 MB past the 8 MB watermark, in batches
            client.push_many("fill", [body] * 10)
        assert _until(lambda: _node_info(node)["mem_alarm"] is True)
        done = threading.Event()
        batch_done = threading.Event()

        def push() -> None:
            client.push("fill", b"held")
            done.set()

        def push_batch() -> None:
            client.push_many("fill", [b"held 1", b"held 2"])
            batch_done.set()

        threading.Thread(target=push, daemon=True).start()
        threading.Thread(target=push_batch, daemon=True).start()
        assert not done.wait(1.5), "a gRPC Push was taken while the memory alarm was raised"
        assert not batch_done.is_set(), "a gRPC PushBatch was taken while the memory alarm was raised"
        conn = pika.BlockingConnection(pika.URLParameters(node.url))
        assert conn.channel().queue_declare("fill", passive=True).method.message_count == 100
        conn.channel().queue_purge("fill")  # a consumer-side action frees the memory
        assert done.wait(5) and batch_done.wait(5), "the held pushes did not go through once the alarm cleared"
        assert conn.channel().queue_declare("fill", passive=True).method.message_count == 3
        conn.close()
    finally:
        client.close()


def test_disk_free_limit_above_the_free_space_blocks_publishers(make_node: Any) -> None:
    """A limit larger than any disk's free space: the disk alarm is raised at once and blocks publishers."""
    node = make_node("--disk-free-limit", "1000000TB")
    assert _until(lambda: _node_info(node)["disk_free_alarm"] is True)
    assert _node_info(node)["mem_alarm"] is False
    status, body = _api(node, "/api/health/checks/alarms")
    assert status == 503 and [a["resource"] for a in body["alarms"]] == ["disk"]
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    events: list[str] = []
    conn.add_on_connection_blocked_callback(lambda c, f: events.append("blocked"))
    ch = conn.channel()
    ch.queue_declare("d")
    ch.basic_publish("", "d", b"first")
    assert wait_until(conn, lambda: events == ["blocked"], timeout=5), events
    ch.basic_publish("", "d", b"held back")
    drain(conn, 0.5)
    other = pika.BlockingConnection(pika.URLParameters(node.url))
    assert other.channel().queue_declare("d", passive=True).method.message_count <= 1
    other.close()
    client = Client(f"127.0.0.1:{node.grpc_port}", username="guest", password="guest")
    try:
        done = threading.Event()

        def push() -> None:
            try:
                client.push("d", b"grpc")
                done.set()
            except LeveretError:
                pass  # cancelled when the test closes the client: it was still held

        threading.Thread(target=push, daemon=True).start()
        assert not done.wait(1.0), "a gRPC push was taken while the disk alarm was raised"
    finally:
        client.close()


def test_a_reachable_disk_free_limit_raises_no_alarm(make_node: Any) -> None:
    node = make_node("--disk-free-limit", "1kB")
    assert _until(lambda: _node_info(node) is not None)
    time.sleep(1.0)  # two checks of the free space
    info = _node_info(node)
    assert info["disk_free_alarm"] is False and info["mem_alarm"] is False


def test_a_bad_disk_free_limit_is_refused_at_start(tmp_path: Path) -> None:
    n = NodeProcess(tmp_path / "data", tmp_path / "logs", ["--disk-free-limit", "plenty"])
    try:
        with pytest.raises(AssertionError, match="disk-free-limit"):
            n.start()
    finally:
        n.cleanup()
