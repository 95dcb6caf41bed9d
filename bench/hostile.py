"""The attacks of issue #26 and what measures them, shared by the tests and ``python -m bench.attack``.

A ``Bystander`` is another tenant doing basic.get round trips on its own
connection all along; ``rss`` reads a local node's memory from /proc. The
attacks that must not share this process's interpreter with the bystander
(parallel logins) run in a subprocess of their own.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

from pamqp import commands, frame, header
from pamqp.body import ContentBody

from compat_tests.raw_amqp import RawAMQP

MiB = 1024 * 1024
HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parent.parent  # the attack scripts import bench


def rss(pid: int, field: str = "VmRSS") -> int:
    """A field of /proc/PID/status in bytes (VmRSS now, VmHWM the peak so far)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def amqp_client(port: int, rcvbuf: int = 0, host: str = HOST) -> RawAMQP:
    """A logged-in raw AMQP connection with channel 1 open; ``rcvbuf`` set before connecting."""
    c = RawAMQP(host, port)
    if rcvbuf:
        # Set before connect, so the window the node may fill is this small.
        c.sock.close()
        c.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        c.sock.settimeout(5)
        c.sock.connect((host, port))
    c.handshake()
    c.open_channel(1)
    return c


class Bystander(threading.Thread):
    """Another tenant: basic.get round trips on its own queue, all along; ``worst`` in seconds."""

    def __init__(self, port: int, host: str = HOST) -> None:
        super().__init__(daemon=True)
        self.c = amqp_client(port, host=host)
        self.c.rpc(commands.Queue.Declare(queue="bystander"))
        self.stop = threading.Event()
        self.times: list[float] = []
        self.in_flight: float | None = None  # when the round trip under way began

    def run(self) -> None:
        while not self.stop.is_set():
            t = self.in_flight = time.monotonic()
            reply = self.c.rpc(commands.Basic.Get(queue="bystander", no_ack=True), timeout=30)
            assert isinstance(reply, commands.Basic.GetEmpty), reply
            self.in_flight = None
            self.times.append(time.monotonic() - t)
            time.sleep(0.01)

    @property
    def worst(self) -> float:
        return max(self.times, default=float("inf"))

    def worst_since(self, mark: int) -> float:
        """The worst round trip since ``len(self.times)`` was ``mark``, one under way included."""
        times = self.times[mark:]
        began = self.in_flight
        if began is not None:
            times.append(time.monotonic() - began)
        return max(times, default=float("inf"))

    def finish(self) -> float:
        self.stop.set()
        self.join(35)
        self.c.close()
        return self.worst


# -- item 12: parallel wrong logins, each front end ------------------------------------------------
# ``count`` connections that each send a wrong login at once and wait for the answer, in a process of
# its own so that the bystander's round trips measure the node, not this process's threads.
_SOCKETS = """
import selectors, socket, sys, time
port, count = int(sys.argv[1]), int(sys.argv[2])
socks = []
for i in range(count):  # every connection first, then every login at once: they arrive together
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(greeting())
    socks.append(s)
time.sleep(0.5)
sel = selectors.DefaultSelector()
for i, s in enumerate(socks):
    try:
        s.sendall(login(i))
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

_AMQP_LOGIN = """
from pamqp import commands, frame
def greeting():
    return b"AMQP\\x00\\x00\\x09\\x01"
def login(i):
    ok = commands.Connection.StartOk(client_properties={"capabilities": {"authentication_failure_close": True}},
                                     mechanism="PLAIN", response=f"\\0guest\\0guess {i}")
    return frame.marshal(ok, 0)
"""

_MQTT_LOGIN = """
from bench.hostile import mqtt_connect
def greeting():
    return b""
def login(i):
    return mqtt_connect(f"guess {i}", f"guesser-{i}")
"""


def mqtt_connect(password: str, client_id: str = "right") -> bytes:
    """An MQTT 3.1.1 CONNECT packet for guest (clean session, keep-alive 60 s)."""
    def s(b: bytes) -> bytes:
        return len(b).to_bytes(2, "big") + b

    body = s(b"MQTT") + b"\x04\xc2\x00\x3c" + s(client_id.encode()) + s(b"guest") + s(password.encode())
    assert len(body) < 128, "one byte of remaining length"
    return b"\x10" + bytes([len(body)]) + body


_GRPC_LOGINS = """
import asyncio, sys
import grpc
from leveret_client.proto import leveret_pb2 as pb
from leveret_client.proto import leveret_pb2_grpc as pb_grpc
port, count = int(sys.argv[1]), int(sys.argv[2])
async def guess(stub, i):
    try:
        await stub.ListQueues(pb.ListQueuesRequest(), metadata=(("username", "guest"), ("password", f"guess {i}")),
                              timeout=120)
    except grpc.aio.AioRpcError:
        pass
async def main():
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.BrokerStub(channel)
        await channel.channel_ready()
        await asyncio.gather(*(guess(stub, i) for i in range(count)))
asyncio.run(main())
"""

LOGIN_SCRIPTS = {"amqp": _AMQP_LOGIN + _SOCKETS, "mqtt": _MQTT_LOGIN + _SOCKETS, "grpc": _GRPC_LOGINS}


def wrong_logins(protocol: str, port: int, count: int) -> subprocess.Popen[bytes]:
    """Start ``count`` parallel wrong logins for guest over ``protocol`` (amqp, mqtt or grpc)."""
    return subprocess.Popen([sys.executable, "-c", LOGIN_SCRIPTS[protocol], str(port), str(count)], cwd=ROOT)


def run_for(proc: subprocess.Popen[bytes], seconds: float) -> None:
    """Let an attack process run ``seconds`` (or until it ends), then end it."""
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        pass
    finally:
        proc.kill()
        proc.wait()


# -- item 13: a client that never reads --------------------------------------------------------------
def get_reject_without_reading(port: int, pairs: int = 150, size: int = 4 * MiB) -> RawAMQP:
    """One ``size`` message, then ``pairs`` basic.get + basic.reject(requeue) from a client with a
    4 KiB receive buffer that never reads. The attacker's connection, for the caller to close."""
    publisher = amqp_client(port)
    publisher.rpc(commands.Queue.Declare(queue="big"))
    publisher.publish(1, b"m" * size, routing_key="big")
    publisher.close()
    attacker = amqp_client(port, rcvbuf=4096)
    attacker.send_raw(b"".join(frame.marshal(commands.Basic.Get(queue="big"), 1)
                               + frame.marshal(commands.Basic.Reject(delivery_tag=i + 1, requeue=True), 1)
                               for i in range(pairs)))
    return attacker


# -- item 14: unfinished bodies -----------------------------------------------------------------------
def send_partial(sock: socket.socket, channel: int, announced: int, send: int, pace: float = 0.0,
                 until: float = float("inf")) -> int:
    """basic.publish + a header announcing ``announced`` bytes, then ``send`` bytes of body (never
    all of it, and nothing after the monotonic time ``until``); the bytes sent before the node
    stopped reading or closed."""
    sock.sendall(frame.marshal(commands.Basic.Publish(exchange="", routing_key="sink"), channel)
                 + frame.marshal(header.ContentHeader(0, announced, commands.Basic.Properties()), channel))
    piece = frame.marshal(ContentBody(b"b" * (128 * 1024 - 8)), channel)
    sent = 0
    try:
        while sent < send and time.monotonic() < until:
            sock.sendall(piece)
            sent += len(piece)
            if pace:
                time.sleep(pace)
    except OSError:  # the node closed the connection (506), or stopped reading (timeout)
        pass
    return sent


# -- item 11: an exponential topic pattern --------------------------------------------------------------
HOSTILE_BINDING = "#.*." * 14 + "z"
LONG_KEY = ".".join(["a"] * 127) + "x"  # 255 characters, 128 words, no "z": every path fails


def topic_binding(port: int, publishes: int, until: float = float("inf")) -> int:
    """Bind ``HOSTILE_BINDING`` on amq.topic and publish with a 255-character key; publishes sent."""
    c = amqp_client(port)
    try:
        q = c.rpc(commands.Queue.Declare(queue="", exclusive=True)).queue
        c.rpc(commands.Queue.Bind(queue=q, exchange="amq.topic", routing_key=HOSTILE_BINDING))
        sent = 0
        while sent < publishes and time.monotonic() < until:
            c.publish(1, b"x", exchange="amq.topic", routing_key=LONG_KEY)
            sent += 1
        c.rpc(commands.Queue.Declare(queue=q, passive=True), timeout=30)  # every publish was routed
        return sent
    finally:
        c.close()


# -- item 10: a catastrophic regular expression ----------------------------------------------------------
EVIL_NAME = "a" * 27 + "!"
EVIL_REGEX = "^(a+)+$"


def regex_filter(http_port: int, requests: int, until: float = float("inf")) -> int:
    """GET /api/queues?name=^(a+)+$&use_regex=true over a queue named 27 a's and '!'; requests made."""
    base = f"http://{HOST}:{http_port}/api/queues/%2F"
    auth = {"Authorization": "Basic Z3Vlc3Q6Z3Vlc3Q="}  # guest:guest
    declare = urllib.request.Request(f"{base}/{urllib.parse.quote(EVIL_NAME)}", data=b"{}", method="PUT",
                                     headers={**auth, "Content-Type": "application/json"})
    with urllib.request.urlopen(declare, timeout=30) as resp:  # a name pamqp would not send
        resp.read()
    url = f"{base}?" + urllib.parse.urlencode({"name": EVIL_REGEX, "use_regex": "true"})
    made = 0
    while made < requests and time.monotonic() < until:
        with urllib.request.urlopen(urllib.request.Request(url, headers=auth), timeout=30) as resp:
            resp.read()
        made += 1
    return made


# -- item 15: unauthenticated large gRPC pushes ----------------------------------------------------------
GRPC_OPTIONS = [("grpc.max_send_message_length", 256 * MiB), ("grpc.max_receive_message_length", 256 * MiB)]


def unauthenticated_pushes(grpc_port: int, count: int = 4, size: int = 120 * MiB) -> list[str]:
    """``count`` parallel ``size``-byte Push calls without valid credentials; their status codes."""
    import grpc

    from leveret_client.proto import leveret_pb2 as pb
    from leveret_client.proto import leveret_pb2_grpc as pb_grpc

    body = b"\x00" * size
    codes: list[str] = []

    def one(metadata: tuple[tuple[str, str], ...]) -> None:
        with grpc.insecure_channel(f"{HOST}:{grpc_port}", options=GRPC_OPTIONS) as channel:
            try:
                pb_grpc.BrokerStub(channel).Push(pb.PushRequest(queue="big", content=body), metadata=metadata,
                                                 timeout=60)
                codes.append("OK")
            except grpc.RpcError as exc:
                codes.append(exc.code().name)  # type: ignore[attr-defined]

    mds: list[tuple[tuple[str, str], ...]] = [(), (("username", "guest"),),
                                              (("username", "guest"), ("password", "wrong"))]
    threads = [threading.Thread(target=one, args=(mds[i % len(mds)],)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return codes

