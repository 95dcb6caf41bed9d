"""Flow control: the memory alarm (connection.blocked / unblocked) and channel.flow.

The memory alarm tests start their own Leveret node with a low
``--memory-high-watermark``; they are skipped when the suite runs against an
external broker (LEVERET_TEST_AMQP_URL), whose alarm thresholds we must not
touch.  The channel.flow tests run against any broker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pika
import pika.exceptions
import pytest
from pamqp import commands

from compat_tests.conftest import STARTUP_TIMEOUT, URL_ENV, _free_ports, _port_open, _python, _stop
from compat_tests.raw_amqp import RawAMQP
from compat_tests.util import drain, unique_name, wait_until

pytestmark = pytest.mark.timeout(30)

REPO_ROOT = Path(__file__).resolve().parent.parent
WATERMARK = 2_000_000  # bytes of message bodies waiting in queues
CHUNK = 100_000


@pytest.fixture(scope="module")
def alarm_node_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A separate Leveret node with a 2 MB memory high watermark."""
    if os.environ.get(URL_ENV):
        pytest.skip("memory alarm tests need their own Leveret node (LEVERET_TEST_AMQP_URL is set)")
    amqp_port, grpc_port = _free_ports(2)
    workdir = tmp_path_factory.mktemp("leveret-alarm-node")
    data_dir = workdir / "data"
    data_dir.mkdir()
    stderr_path = workdir / "stderr.log"
    cmd = [
        _python(), "-m", "leveret", "serve",
        "--bind", "127.0.0.1",
        "--amqp-port", str(amqp_port),
        "--grpc-port", str(grpc_port),
        "--data-dir", str(data_dir),
        "--memory-high-watermark", str(WATERMARK),
    ]
    with open(workdir / "stdout.log", "wb") as out, open(stderr_path, "wb") as err:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=out, stderr=err)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while not _port_open("127.0.0.1", amqp_port):
            if proc.poll() is not None:
                pytest.fail(f"alarm node exited with {proc.returncode}:\n{stderr_path.read_text(errors='replace')}",
                            pytrace=False)
            if time.monotonic() > deadline:
                pytest.fail(f"alarm node did not start:\n{stderr_path.read_text(errors='replace')}", pytrace=False)
            time.sleep(0.05)
        yield f"amqp://guest:guest@127.0.0.1:{amqp_port}/"
    finally:
        _stop(proc)
        if proc.returncode not in (0, -signal.SIGTERM):
            sys.stderr.write(f"\nalarm node exited with {proc.returncode}; stderr tail:\n"
                             f"{stderr_path.read_text(errors='replace')[-5000:]}\n")


@pytest.fixture
def alarm_connect(alarm_node_url: str) -> Iterator[Callable[..., pika.BlockingConnection]]:
    opened: list[pika.BlockingConnection] = []

    def factory(**params: object) -> pika.BlockingConnection:
        parameters = pika.URLParameters(alarm_node_url)
        for key, value in params.items():
            setattr(parameters, key, value)
        conn = pika.BlockingConnection(parameters)
        opened.append(conn)
        return conn

    yield factory
    for conn in opened:
        if conn.is_open:
            try:
                conn.close()
            except pika.exceptions.AMQPError:
                pass


def _message_count(conn: pika.BlockingConnection, queue: str) -> int:
    return conn.channel().queue_declare(queue, passive=True).method.message_count


def test_memory_alarm_blocks_and_unblocks_publishers(alarm_connect: Callable[..., pika.BlockingConnection]) -> None:
    publisher = alarm_connect(blocked_connection_timeout=25)
    events: list[str] = []
    publisher.add_on_connection_blocked_callback(lambda conn, frame: events.append(type(frame.method).__name__))
    publisher.add_on_connection_unblocked_callback(lambda conn, frame: events.append(type(frame.method).__name__))
    ch = publisher.channel()
    queue = unique_name("compat.alarm")
    ch.queue_declare(queue, auto_delete=False)
    admin = alarm_connect()
    try:
        body = b"x" * CHUNK
        for _ in range(30):  # 3 MB, above the 2 MB watermark
            ch.basic_publish("", queue, body)
        assert wait_until(publisher, lambda: events == ["Blocked"], timeout=5), events
        assert _message_count(admin, queue) == 30

        # while blocked the broker does not take in what the publisher sends
        ch.basic_publish("", queue, b"held back")
        drain(publisher, 0.7)
        assert _message_count(admin, queue) == 30
        assert events == ["Blocked"]

        # a consumer-side connection is not blocked: it frees the memory
        admin.channel().queue_purge(queue)
        assert wait_until(publisher, lambda: events == ["Blocked", "Unblocked"], timeout=5), events
        # the held publish goes through, and publishing works again
        ch.basic_publish("", queue, b"after")
        drain(publisher, 0.2)
        admin_ch = admin.channel()
        bodies = [admin_ch.basic_get(queue, auto_ack=True)[2] for _ in range(2)]
        assert bodies == [b"held back", b"after"]
    finally:
        admin.channel().queue_delete(queue)


def test_memory_alarm_spares_non_publishers(alarm_connect: Callable[..., pika.BlockingConnection]) -> None:
    """Connections that never published are not blocked and can consume during an alarm."""
    publisher = alarm_connect(blocked_connection_timeout=25)
    blocked: list[str] = []
    publisher.add_on_connection_blocked_callback(lambda conn, frame: blocked.append("publisher"))
    consumer = alarm_connect()
    consumer.add_on_connection_blocked_callback(lambda conn, frame: blocked.append("consumer"))
    queue = unique_name("compat.alarm")
    cch = consumer.channel()
    cch.queue_declare(queue)
    pch = publisher.channel()
    try:
        for _ in range(25):
            pch.basic_publish("", queue, b"y" * CHUNK)
        assert wait_until(publisher, lambda: "publisher" in blocked, timeout=5)
        drain(consumer, 0.2)
        assert blocked == ["publisher"]
        got = 0
        for _ in range(25):
            method, _props, _body = cch.basic_get(queue, auto_ack=True)
            assert method is not None
            got += 1
        assert got == 25
        unblocked: list[bool] = []
        publisher.add_on_connection_unblocked_callback(lambda conn, frame: unblocked.append(True))
        assert wait_until(publisher, lambda: unblocked == [True], timeout=5)
    finally:
        cch.queue_delete(queue)


# --------------------------------------------------------------- channel.flow
def test_channel_flow_active_true_is_answered(raw: Callable[[], RawAMQP]) -> None:
    client = raw()
    client.handshake()
    client.open_channel(1)
    reply = client.rpc(commands.Channel.Flow(active=True), 1)
    assert isinstance(reply, commands.Channel.FlowOk)
    assert reply.active is True
    # the channel keeps working
    declared = client.rpc(commands.Queue.Declare(queue="", exclusive=True), 1)
    assert isinstance(declared, commands.Queue.DeclareOk)
    closed = client.rpc(commands.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0), 0)
    assert isinstance(closed, commands.Connection.CloseOk)


def test_channel_flow_active_false_not_implemented(raw: Callable[[], RawAMQP]) -> None:
    """RabbitMQ answers channel.flow(active=false) with a 540 connection close."""
    client = raw()
    client.handshake()
    client.open_channel(1)
    client.send(commands.Channel.Flow(active=False), 1)
    channel, close = client.read_frame()
    assert channel == 0
    assert isinstance(close, commands.Connection.Close), close
    assert close.reply_code == 540
    assert "active=false" in close.reply_text
    assert (close.class_id, close.method_id) == (20, 20)
    client.send(commands.Connection.CloseOk())
    assert client.wait_closed(5)
