"""Clients that try to stall the node or exhaust its memory, against a real node (issue #26).

Each attack runs while a bystander on another connection measures its round trips, and the
node's RSS is read from /proc. The sans-IO halves are tests/test_bounded_input.py (items 13, 14)
and tests/test_user_patterns.py (item 10).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pamqp import commands

from bench.hostile import (
    Bystander,
    amqp_client,
    get_reject_without_reading,
    mqtt_connect,
    rss,
    run_for,
    send_partial,
    wrong_logins,
)
from compat_tests.raw_amqp import RawAMQP
from harness.node import NodeProcess

MiB = 1024 * 1024


def start_node(*flags: str, mqtt: bool = False) -> Iterator[NodeProcess]:
    root = Path(tempfile.mkdtemp(prefix="leveret-hostile-"))
    node = NodeProcess(root / "data", root / "logs", list(flags), mqtt=mqtt)
    node.start()
    try:
        yield node
    finally:
        node.terminate()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def node() -> Iterator[NodeProcess]:
    yield from start_node()


# -- item 13: output is bounded for every method ----------------------------------------------
def test_a_client_that_never_reads_cannot_make_the_node_hold_its_output(node: NodeProcess) -> None:
    """150 basic.get + basic.reject(requeue) pairs for a 4 MiB message from a client with a 4 KiB
    receive buffer that never reads: 600 MiB of output on a node that read them all at once."""
    before = rss(node.pid)
    attacker = get_reject_without_reading(node.amqp_port)  # 6,000 bytes of requests
    time.sleep(3.0)
    grown = rss(node.pid) - before
    attacker.close_socket()
    assert grown < 64 * MiB, f"RSS grew {grown / MiB:.0f} MiB for one 4 MiB message"


# -- item 14: unfinished bodies count and are bounded -----------------------------------------
def test_unfinished_bodies_are_bounded_per_connection(node: NodeProcess) -> None:
    """Six channels each announcing a 120 MiB body and sending 100 MiB of it: the node took 680 MiB.
    Now the connection is closed with 506 once its unfinished bodies pass max_message_size."""
    attacker = amqp_client(node.amqp_port)
    for ch in range(2, 8):
        attacker.open_channel(ch)
    before = rss(node.pid)
    for ch in range(2, 8):
        send_partial(attacker.sock, ch, 120 * MiB, 100 * MiB)
    grown = rss(node.pid) - before
    codes = []
    try:
        while True:
            _ch, value = attacker.read_frame(timeout=5)
            if isinstance(value, commands.Connection.Close):
                codes.append((value.reply_code, value.reply_text))
                break
    except (OSError, TimeoutError, Exception):  # noqa: BLE001 - the close may come with a reset
        pass
    attacker.close_socket()
    assert grown < 200 * MiB, f"RSS grew {grown / MiB:.0f} MiB"
    assert codes and codes[0][0] == 506 and "unfinished message bodies" in codes[0][1], codes


@pytest.fixture
def low_watermark_node() -> Iterator[NodeProcess]:
    yield from start_node("--memory-high-watermark", str(24 * MiB))


def test_the_memory_alarm_stops_reading_a_connection_with_an_unfinished_body(
        low_watermark_node: NodeProcess) -> None:
    """The alarm counts a body as it arrives; the connection that sends it is a publisher from its
    basic.publish on, so the alarm blocks it (it was not, and kept being read)."""
    attacker = amqp_client(low_watermark_node.amqp_port)
    attacker.sock.settimeout(3.0)  # a node that stopped reading makes sendall time out
    sent = send_partial(attacker.sock, 1, 120 * MiB, 100 * MiB, pace=0.01)  # ~12 MiB/s
    attacker.close_socket()
    assert "memory high watermark reached" in low_watermark_node.stderr_tail(20000)
    assert sent < 60 * MiB, f"the node kept reading: {sent / MiB:.0f} MiB of an unfinished body"


# -- item 12: password checks do not run on the event loop -----------------------------------
def _wrong_login(node: NodeProcess, password: str) -> str:
    """One AMQP login with ``password`` for guest: 'ok', 'refused' or how it ended."""
    try:
        c = RawAMQP("127.0.0.1", node.amqp_port, timeout=30)
    except OSError as exc:
        return type(exc).__name__
    try:
        c.handshake(password=password)
        return "ok"
    except Exception as exc:  # noqa: BLE001 - the node's close (403), or its refusal to talk at all
        return "refused" if "403" in repr(exc) or "Close" in repr(exc) else type(exc).__name__
    finally:
        c.close_socket()


def _assert_bystander_unstalled(node: NodeProcess, attack: subprocess.Popen[bytes], seconds: float) -> None:
    """Run ``attack`` for up to ``seconds`` while a bystander on its own AMQP connection makes round
    trips: more than 20 of them, and none over 100 ms."""
    bystander = Bystander(node.amqp_port)
    bystander.start()
    time.sleep(0.3)
    run_for(attack, seconds)
    time.sleep(0.2)
    worst = bystander.finish()
    print(f"bystander: {len(bystander.times)} round trips, worst {worst * 1000:.0f} ms")
    assert len(bystander.times) > 20, len(bystander.times)
    assert worst < 0.1, f"the bystander's worst round trip was {worst * 1000:.0f} ms"


def test_a_hundred_parallel_wrong_logins_do_not_stall_another_tenant(node: NodeProcess) -> None:
    """100 parallel wrong logins stalled another tenant for 2.3 s (~25 ms of argon2 each on the loop)."""
    _assert_bystander_unstalled(node, wrong_logins("amqp", node.amqp_port, 100), 60)


@pytest.fixture
def mqtt_node() -> Iterator[NodeProcess]:
    yield from start_node(mqtt=True)


def _mqtt_login(node: NodeProcess, password: str) -> int:
    """One MQTT CONNECT for guest: the CONNACK's return code (0 accepted, 4 bad credentials)."""
    with socket.create_connection(("127.0.0.1", node.mqtt_port), timeout=30) as s:
        s.sendall(mqtt_connect(password))
        connack = s.recv(4)
        assert connack[:2] == b"\x20\x02", connack
        return connack[3]


def test_parallel_wrong_mqtt_logins_do_not_stall_another_tenant(mqtt_node: NodeProcess) -> None:
    """MQTT checked passwords on the event loop: 50 parallel wrong CONNECTs stalled everyone."""
    assert _mqtt_login(mqtt_node, "guest") == 0  # the right password (Broker.login's path)
    assert _mqtt_login(mqtt_node, "wrong") == 4
    _assert_bystander_unstalled(mqtt_node, wrong_logins("mqtt", mqtt_node.mqtt_port, 50), 6)


def test_parallel_wrong_grpc_logins_do_not_stall_another_tenant(node: NodeProcess) -> None:
    """gRPC checked passwords on the event loop: 50 parallel wrong logins stalled everyone."""
    import grpc

    from leveret_client.proto import leveret_pb2 as pb
    from leveret_client.proto import leveret_pb2_grpc as pb_grpc

    def list_queues(password: str) -> str:
        with grpc.insecure_channel(f"127.0.0.1:{node.grpc_port}") as channel:
            try:
                pb_grpc.BrokerStub(channel).ListQueues(
                    pb.ListQueuesRequest(), metadata=(("username", "guest"), ("password", password)), timeout=30)
                return "OK"
            except grpc.RpcError as exc:
                return str(exc.code().name)  # type: ignore[attr-defined]

    assert list_queues("guest") == "OK"  # the right password (Broker.login's path)
    assert list_queues("wrong") == "UNAUTHENTICATED"
    _assert_bystander_unstalled(node, wrong_logins("grpc", node.grpc_port, 50), 6)


def _pika_login(node: NodeProcess, password: str) -> str:
    import pika
    import pika.exceptions

    params = pika.ConnectionParameters("127.0.0.1", node.amqp_port,
                                       credentials=pika.PlainCredentials("guest", password),
                                       connection_attempts=1, socket_timeout=30, stack_timeout=60)
    try:
        pika.BlockingConnection(params).close()
        return "ok"
    except pika.exceptions.ProbableAuthenticationError:
        return "refused"
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return type(exc).__name__


def test_after_parallel_guesses_the_right_password_is_not_answered_at_once(node: NodeProcess) -> None:
    """Eight guesses in parallel, then the right password: it was answered at once (only the refusals
    waited), so a parallel guesser found it in 1.8 s. Now its check waits the address's delay (6.4 s
    after eight failures); tests/test_login_checks.py shows parallel guesses taking turns."""
    results: list[str] = []
    threads = [threading.Thread(target=lambda i=i: results.append(_pika_login(node, f"guess {i}")), daemon=True)
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results.count("refused") == 8, results
    started = time.monotonic()
    assert _pika_login(node, "guest") == "ok"
    assert time.monotonic() - started > 3.0, "the right password was checked at once"


def test_http_basic_auth_is_throttled_like_amqp(node: NodeProcess) -> None:
    """35 guesses/s against argon2 users and 6,763/s against an imported RabbitMQ record, unthrottled."""
    import base64
    import urllib.error
    import urllib.request

    def status(password: str) -> int:
        token = base64.b64encode(f"guest:{password}".encode()).decode()
        req = urllib.request.Request(f"http://127.0.0.1:{node.management_port}/api/whoami",
                                     headers={"Authorization": f"Basic {token}"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    for _ in range(100):  # the HTTP listener starts a moment after the AMQP one
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{node.management_port}/api/overview", timeout=5)
        except urllib.error.HTTPError:
            break  # it answers (401 without credentials)
        except OSError:
            time.sleep(0.1)
    deadline = time.monotonic() + 3.0
    guesses = 0
    while time.monotonic() < deadline:
        assert status(f"guess {guesses}") == 401
        guesses += 1
    assert guesses <= 10, f"{guesses} HTTP guesses answered in 3 s"
    started = time.monotonic()
    assert status("guest") == 200
    assert time.monotonic() - started > 1.0  # the check itself waited, the right password's too
