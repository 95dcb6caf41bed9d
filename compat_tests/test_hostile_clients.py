"""Clients that try to stall the node or exhaust its memory, against a real node (issue #26).

Each attack runs while a bystander on another connection measures its round trips, and the
node's RSS is read from /proc. The sans-IO halves are tests/test_bounded_input.py (items 13, 14)
and tests/test_user_patterns.py (item 10).
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pamqp import commands, frame, header
from pamqp.body import ContentBody

from compat_tests.raw_amqp import RawAMQP
from harness.node import NodeProcess

MiB = 1024 * 1024


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def start_node(*flags: str) -> Iterator[NodeProcess]:
    root = Path(tempfile.mkdtemp(prefix="leveret-hostile-"))
    node = NodeProcess(root / "data", root / "logs", list(flags))
    node.start()
    try:
        yield node
    finally:
        node.terminate()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def node() -> Iterator[NodeProcess]:
    yield from start_node()


def client(node: NodeProcess, rcvbuf: int = 0) -> RawAMQP:
    c = RawAMQP("127.0.0.1", node.amqp_port)
    if rcvbuf:
        # Set before connect, so the window the node may fill is this small.
        c.sock.close()
        c.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        c.sock.settimeout(5)
        c.sock.connect(("127.0.0.1", node.amqp_port))
    c.handshake()
    c.open_channel(1)
    return c


class Bystander(threading.Thread):
    """Another tenant: basic.get round trips on its own queue, all along; ``worst`` in seconds."""

    def __init__(self, node: NodeProcess) -> None:
        super().__init__(daemon=True)
        self.c = client(node)
        self.c.rpc(commands.Queue.Declare(queue="bystander"))
        self.stop = threading.Event()
        self.times: list[float] = []

    def run(self) -> None:
        while not self.stop.is_set():
            t = time.monotonic()
            reply = self.c.rpc(commands.Basic.Get(queue="bystander", no_ack=True), timeout=30)
            assert isinstance(reply, commands.Basic.GetEmpty), reply
            self.times.append(time.monotonic() - t)
            time.sleep(0.01)

    @property
    def worst(self) -> float:
        return max(self.times, default=float("inf"))

    def finish(self) -> float:
        self.stop.set()
        self.join(35)
        self.c.close()
        return self.worst


# -- item 13: output is bounded for every method ----------------------------------------------
def test_a_client_that_never_reads_cannot_make_the_node_hold_its_output(node: NodeProcess) -> None:
    """150 basic.get + basic.reject(requeue) pairs for a 4 MiB message from a client with a 4 KiB
    receive buffer that never reads: 600 MiB of output on a node that read them all at once."""
    publisher = client(node)
    publisher.rpc(commands.Queue.Declare(queue="big"))
    publisher.publish(1, b"m" * (4 * MiB), routing_key="big")
    publisher.close()
    time.sleep(0.5)
    before = rss(node.pid)
    attacker = client(node, rcvbuf=4096)
    pairs = b"".join(frame.marshal(commands.Basic.Get(queue="big"), 1)
                     + frame.marshal(commands.Basic.Reject(delivery_tag=i + 1, requeue=True), 1)
                     for i in range(150))
    attacker.send_raw(pairs)  # 6,000 bytes
    time.sleep(3.0)
    grown = rss(node.pid) - before
    attacker.close_socket()
    assert grown < 64 * MiB, f"RSS grew {grown / MiB:.0f} MiB for one 4 MiB message"


# -- item 14: unfinished bodies count and are bounded -----------------------------------------
def _send_partial(sock: socket.socket, channel: int, announced: int, send: int, pace: float = 0.0) -> int:
    """basic.publish + a header announcing ``announced`` bytes, then ``send`` bytes of body (never
    all of it); the bytes sent before the node stopped reading or closed."""
    sock.sendall(frame.marshal(commands.Basic.Publish(exchange="", routing_key="sink"), channel)
                 + frame.marshal(header.ContentHeader(0, announced, commands.Basic.Properties()), channel))
    piece = frame.marshal(ContentBody(b"b" * (128 * 1024 - 8)), channel)
    sent = 0
    try:
        while sent < send:
            sock.sendall(piece)
            sent += len(piece)
            if pace:
                time.sleep(pace)
    except OSError:  # the node closed the connection (506), or stopped reading (timeout)
        pass
    return sent


def test_unfinished_bodies_are_bounded_per_connection(node: NodeProcess) -> None:
    """Six channels each announcing a 120 MiB body and sending 100 MiB of it: the node took 680 MiB.
    Now the connection is closed with 506 once its unfinished bodies pass max_message_size."""
    attacker = client(node)
    for ch in range(2, 8):
        attacker.open_channel(ch)
    before = rss(node.pid)
    for ch in range(2, 8):
        _send_partial(attacker.sock, ch, 120 * MiB, 100 * MiB)
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
    attacker = client(low_watermark_node)
    attacker.sock.settimeout(3.0)  # a node that stopped reading makes sendall time out
    sent = _send_partial(attacker.sock, 1, 120 * MiB, 100 * MiB, pace=0.01)  # ~12 MiB/s
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


# 100 connections that each send a wrong PLAIN login at once and wait for the answer: in a process of
# its own, so that the bystander's round trips measure the node, not this process's threads.
_ATTACK = """
import selectors, socket, sys, time
from pamqp import commands, frame
port, count = int(sys.argv[1]), int(sys.argv[2])
socks = []
for i in range(count):  # every connection first, then every login at once: they arrive together
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"AMQP\\x00\\x00\\x09\\x01")
    socks.append(s)
time.sleep(0.5)
sel = selectors.DefaultSelector()
for i, s in enumerate(socks):
    ok = commands.Connection.StartOk(client_properties={"capabilities": {"authentication_failure_close": True}},
                                     mechanism="PLAIN", response=f"\\0guest\\0guess {i}")
    try:
        s.sendall(frame.marshal(ok, 0))
    except OSError:
        s.close()
        continue
    s.setblocking(False)
    sel.register(s, selectors.EVENT_READ)
open_ = len(sel.get_map())
while open_:
    for key, _ in sel.select(timeout=30) or [(None, None)]:
        if key is None:
            sys.exit("no answer in 30 s")
        try:
            data = key.fileobj.recv(65536)
        except OSError:
            data = b""
        if not data:
            sel.unregister(key.fileobj)
            key.fileobj.close()
            open_ -= 1
"""


def test_a_hundred_parallel_wrong_logins_do_not_stall_another_tenant(node: NodeProcess) -> None:
    """100 parallel wrong logins stalled another tenant for 2.3 s (~25 ms of argon2 each on the loop)."""
    import subprocess
    import sys

    bystander = Bystander(node)
    bystander.start()
    time.sleep(0.3)
    attack = subprocess.Popen([sys.executable, "-c", _ATTACK, str(node.amqp_port), "100"])
    try:
        attack.wait(60)
    finally:
        attack.kill()
    time.sleep(0.2)
    worst = bystander.finish()
    print(f"bystander: {len(bystander.times)} round trips, worst {worst * 1000:.0f} ms")
    assert len(bystander.times) > 20, len(bystander.times)
    assert worst < 0.1, f"the bystander's worst round trip was {worst * 1000:.0f} ms"


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
