"""MQTT 3.1.1 and 5.0 against a real node with real clients: paho-mqtt 2.x, aiomqtt, pika beside them."""

from __future__ import annotations

import queue
import socket
import struct
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as paho
import pika
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from harness import mqtt_client as mc
from harness.node import REPO_ROOT, NodeProcess, _python, node_env
from harness.ports import free_port
from mqtt_frontend import codec

V311, V5 = paho.MQTTv311, paho.MQTTv5
TIMEOUT = 10.0


def wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def start(node: NodeProcess) -> None:
    node.start()
    wait_port(node.mqtt_port)  # MQTT listens right after AMQP


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    d = tmp_path_factory.mktemp("mqtt")
    n = NodeProcess(d / "data", d / "logs", mqtt=True)
    start(n)
    yield n
    n.cleanup()


class Client:
    """A paho client with its received messages in a queue."""

    def __init__(self, port: int, client_id: str = "", protocol: int = V311, clean: bool = True,
                 username: str = "guest", password: str = "guest", session_expiry: int | None = None,
                 will: tuple[str, bytes] | None = None, transport: str = "tcp") -> None:
        self.protocol = protocol
        self.client = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id or f"t-{uuid.uuid4().hex[:8]}",
                                  protocol=paho.MQTTProtocolVersion(protocol),
                                  clean_session=clean if protocol != V5 else None,
                                  transport=transport)  # type: ignore[arg-type]
        if transport == "websockets":
            self.client.ws_set_options(path="/ws")
        self.client.username_pw_set(username, password)
        if will is not None:
            self.client.will_set(will[0], will[1], qos=1)
        self.messages: queue.Queue[paho.MQTTMessage] = queue.Queue()
        self.connected: queue.Queue[tuple[bool, object, object]] = queue.Queue()
        self.disconnected = threading.Event()
        self.disconnect_reason: object = None
        self.client.on_message = lambda _c, _u, m: self.messages.put(m)
        self.client.on_connect = lambda _c, _u, flags, rc, props: self.connected.put((flags.session_present, rc,
                                                                                      props))
        self.client.on_disconnect = self._on_disconnect
        props = None
        if protocol == V5:
            props = Properties(PacketTypes.CONNECT)
            if session_expiry is not None:
                props.SessionExpiryInterval = session_expiry
        kwargs = {"clean_start": clean, "properties": props} if protocol == V5 else {}
        self.client.connect("127.0.0.1", port, keepalive=30, **kwargs)  # type: ignore[arg-type]
        self.client.loop_start()
        present, rc, self.connack_props = self.connected.get(timeout=TIMEOUT)
        self.session_present = present
        self.rc = rc

    def _on_disconnect(self, _c: object, _u: object, _flags: object, rc: object, _props: object) -> None:
        self.disconnect_reason = rc
        self.disconnected.set()

    def subscribe(self, topic: str, qos: int = 1, **options: object) -> None:
        done = threading.Event()
        self.client.on_subscribe = lambda *_a: done.set()
        if self.protocol == V5:
            opts = paho.SubscribeOptions(qos=qos, **options)  # type: ignore[arg-type]
            props = options.pop("properties", None) if "properties" in options else None
            self.client.subscribe(topic, options=opts, properties=props)  # type: ignore[arg-type]
        else:
            self.client.subscribe(topic, qos)
        assert done.wait(TIMEOUT)

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                properties: Properties | None = None) -> None:
        info = self.client.publish(topic, payload, qos=qos, retain=retain, properties=properties)
        info.wait_for_publish(TIMEOUT)
        assert info.is_published()

    def get(self, timeout: float = TIMEOUT) -> paho.MQTTMessage:
        return self.messages.get(timeout=timeout)

    def nothing(self, wait: float = 0.5) -> bool:
        try:
            self.messages.get(timeout=wait)
        except queue.Empty:
            return True
        return False

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.mark.parametrize("protocol", [V311, V5], ids=["3.1.1", "5.0"])
def test_publish_subscribe_with_wildcards(node: NodeProcess, protocol: int) -> None:
    sub = Client(node.mqtt_port, protocol=protocol)
    pub = Client(node.mqtt_port, protocol=protocol)
    sub.subscribe("home/+/temp", qos=1)
    sub.subscribe("office/#", qos=0)
    pub.publish("home/kitchen/temp", b"21", qos=1)
    pub.publish("home/kitchen/humidity", b"40", qos=1)
    pub.publish("office/a/b", b"x", qos=0)
    got = sorted((m.topic, m.payload, m.qos) for m in (sub.get(), sub.get()))
    assert got == [("home/kitchen/temp", b"21", 1), ("office/a/b", b"x", 0)]
    assert sub.nothing()
    sub.close()
    pub.close()


def test_device_publish_reaches_pika_and_amqp_publish_reaches_device(node: NodeProcess) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    ch = conn.channel()
    q = ch.queue_declare("", exclusive=True).method.queue
    ch.queue_bind(q, "amq.topic", "sensors.#")
    dev = Client(node.mqtt_port)
    dev.subscribe("commands/dev1", qos=1)
    dev.publish("sensors/dev1/temp", b"22.5", qos=1)
    for _ in range(50):
        method, props, body = ch.basic_get(q, auto_ack=True)
        if method is not None:
            break
        time.sleep(0.05)
    assert method is not None and method.routing_key == "sensors.dev1.temp" and body == b"22.5"
    assert props.delivery_mode == 2  # QoS 1 is a persistent message
    ch.basic_publish("amq.topic", "commands.dev1", b"reboot", pika.BasicProperties(delivery_mode=2))
    m = dev.get()
    assert (m.topic, m.payload, m.qos) == ("commands/dev1", b"reboot", 1)
    dev.close()
    conn.close()


def test_retained_message_on_subscribe_and_cleared(node: NodeProcess) -> None:
    topic = f"retained/{uuid.uuid4().hex[:6]}"
    pub = Client(node.mqtt_port)
    pub.publish(topic, b"last", qos=1, retain=True)
    sub = Client(node.mqtt_port)
    sub.subscribe(topic, qos=1)
    m = sub.get()
    assert (m.payload, m.retain) == (b"last", True)
    pub.publish(topic, b"", qos=1, retain=True)
    sub2 = Client(node.mqtt_port)
    sub2.subscribe(topic, qos=1)
    assert sub2.nothing()
    for c in (pub, sub, sub2):
        c.close()


def test_will_published_when_the_client_vanishes(node: NodeProcess) -> None:
    watcher = Client(node.mqtt_port)
    watcher.subscribe("wills/#", qos=1)
    s = socket.create_connection(("127.0.0.1", node.mqtt_port))
    s.sendall(mc.connect("vanishing", will=codec.Will("wills/vanishing", b"gone", 1, False)))
    assert s.recv(4)[:1] == b"\x20"
    s.close()  # no DISCONNECT
    m = watcher.get()
    assert (m.topic, m.payload) == ("wills/vanishing", b"gone")
    watcher.close()


def test_second_connection_with_the_same_client_id_disconnects_the_first(node: NodeProcess) -> None:
    first = Client(node.mqtt_port, client_id="same-id", protocol=V5)
    first.client.reconnect_delay_set(60, 120)  # let it stay disconnected
    second = Client(node.mqtt_port, client_id="same-id", protocol=V5)
    assert first.disconnected.wait(TIMEOUT)
    assert first.disconnect_reason.value == codec.SESSION_TAKEN_OVER  # type: ignore[attr-defined]
    second.publish("x", b"still fine")
    first.client.loop_stop()
    second.close()


def test_bad_password_refused(node: NodeProcess) -> None:
    for protocol in (V311, V5):
        c = Client(node.mqtt_port, protocol=protocol, password="wrong")
        assert c.rc.is_failure  # type: ignore[attr-defined]
        assert c.rc.value == codec.BAD_CREDENTIALS  # type: ignore[attr-defined]  # 3.1.1's 4, as paho names it
        c.client.loop_stop()


def test_bad_input_closes_that_connection_only(node: NodeProcess) -> None:
    other = Client(node.mqtt_port, protocol=V5)
    other.subscribe("ok", qos=0)
    s = socket.create_connection(("127.0.0.1", node.mqtt_port))
    s.settimeout(TIMEOUT)
    s.sendall(mc.connect("bad", level=5))
    assert s.recv(1) == b"\x20"
    s.recv(1024)
    s.sendall(mc.publish("a/+/b", b"x", level=5))
    data = b""
    while chunk := s.recv(1024):
        data += chunk
    got = mc.read(data, 5)
    assert got[-1].kind == codec.DISCONNECT and got[-1].fields["reason"] == codec.TOPIC_NAME_INVALID
    s2 = socket.create_connection(("127.0.0.1", node.mqtt_port))
    s2.settimeout(TIMEOUT)
    s2.sendall(b"\x10\xff\xff\xff\xff\x7f")  # remaining length over the maximum, before CONNECT
    assert s2.recv(1024) == b""  # closed
    other.publish("ok", b"unaffected", qos=1)
    assert other.get().payload == b"unaffected"
    other.close()


def test_v5_properties_subscription_ids_no_local_and_aliases(node: NodeProcess) -> None:
    c = Client(node.mqtt_port, protocol=V5)
    assert c.connack_props.MaximumQoS == 1  # type: ignore[attr-defined]
    sub_props = Properties(PacketTypes.SUBSCRIBE)
    sub_props.SubscriptionIdentifier = 7
    done = threading.Event()
    c.client.on_subscribe = lambda *_a: done.set()
    c.client.subscribe("v5/#", options=paho.SubscribeOptions(qos=1, noLocal=True), properties=sub_props)
    assert done.wait(TIMEOUT)
    other = Client(node.mqtt_port, protocol=V5)
    other.subscribe("v5/#", qos=1)
    props = Properties(PacketTypes.PUBLISH)
    props.UserProperty = ("k", "v")
    props.ContentType = "text/plain"
    props.ResponseTopic = "replies/x"
    props.CorrelationData = b"\x01\x02"
    props.MessageExpiryInterval = 60
    c.publish("v5/a", b"hello", qos=1, properties=props)
    m = other.get()
    assert m.payload == b"hello"
    assert ("k", "v") in m.properties.UserProperty  # type: ignore[union-attr]
    assert m.properties.ContentType == "text/plain"  # type: ignore[union-attr]
    assert m.properties.ResponseTopic == "replies/x"  # type: ignore[union-attr]
    assert m.properties.CorrelationData == b"\x01\x02"  # type: ignore[union-attr]
    assert 50 <= m.properties.MessageExpiryInterval <= 60  # type: ignore[union-attr]
    assert c.nothing()  # no local: its own publish does not come back
    other.publish("v5/b", b"from other", qos=1)
    m = c.get()
    assert m.payload == b"from other" and m.properties.SubscriptionIdentifier == [7]  # type: ignore[union-attr]
    assert other.get().topic == "v5/b"  # other has no no-local: its own comes back
    alias = Properties(PacketTypes.PUBLISH)
    alias.TopicAlias = 3
    c.publish("v5/alias", b"one", qos=1, properties=alias)
    c.publish("", b"two", qos=1, properties=alias)
    assert [other.get().topic for _ in range(2)] == ["v5/alias", "v5/alias"]
    c.close()
    other.close()


def test_v5_shared_subscription(node: NodeProcess) -> None:
    members = [Client(node.mqtt_port, protocol=V5) for _ in range(2)]
    for m in members:
        m.subscribe("$share/workers/jobs/#", qos=1)
    pub = Client(node.mqtt_port, protocol=V5)
    for i in range(10):
        pub.publish("jobs/x", b"%d" % i, qos=1)
    time.sleep(0.5)
    counts = [m.messages.qsize() for m in members]
    assert sum(counts) == 10 and all(counts)
    for c in (*members, pub):
        c.close()


def test_qos1_confirmed_messages_survive_kill_9(tmp_path: Path) -> None:
    n = NodeProcess(tmp_path / "data", tmp_path / "logs", mqtt=True)
    start(n)
    try:
        dev = Client(n.mqtt_port, client_id="durable-dev", clean=False)
        dev.subscribe("fleet/#", qos=1)
        dev.close()
        v5 = Client(n.mqtt_port, client_id="durable-v5", protocol=V5, clean=False, session_expiry=3600)
        v5.subscribe("fleet/#", qos=1)
        v5.close()
        pub = Client(n.mqtt_port)
        for i in range(50):
            pub.publish(f"fleet/{i}", b"m%d" % i, qos=1)  # waits for the PUBACK
        n.kill()
        start(n)
        for client_id, protocol in (("durable-dev", V311), ("durable-v5", V5)):
            again = Client(n.mqtt_port, client_id=client_id, protocol=protocol, clean=False, session_expiry=3600)
            assert again.session_present
            got = sorted(again.get().payload for _ in range(50))
            assert got == sorted(b"m%d" % i for i in range(50))
            again.close()
    finally:
        n.cleanup()


def test_retained_message_survives_restart(tmp_path: Path) -> None:
    n = NodeProcess(tmp_path / "data", tmp_path / "logs", mqtt=True)
    start(n)
    try:
        Client(n.mqtt_port).publish("status/door", b"open", qos=1, retain=True)
        n.kill()
        start(n)
        sub = Client(n.mqtt_port)
        sub.subscribe("status/#", qos=1)
        m = sub.get()
        assert (m.topic, m.payload, m.retain) == ("status/door", b"open", True)
        sub.close()
    finally:
        n.cleanup()


def test_aiomqtt(node: NodeProcess) -> None:
    import asyncio

    import aiomqtt

    async def run() -> None:
        async with aiomqtt.Client("127.0.0.1", node.mqtt_port, username="guest", password="guest",
                                  protocol=aiomqtt.ProtocolVersion.V5) as client:
            await client.subscribe("aio/#", qos=1)
            await client.publish("aio/1", b"async", qos=1)
            async for message in client.messages:
                assert (str(message.topic), message.payload) == ("aio/1", b"async")
                return

    asyncio.run(asyncio.wait_for(run(), TIMEOUT))


def test_keep_alive_closes_a_silent_client(node: NodeProcess) -> None:
    s = socket.create_connection(("127.0.0.1", node.mqtt_port))
    s.settimeout(TIMEOUT)
    s.sendall(mc.connect("silent", keep_alive=1))
    assert s.recv(4)[:1] == b"\x20"
    started = time.monotonic()
    assert s.recv(1024) == b""  # closed after 1.5 s of silence (checked once a second)
    assert time.monotonic() - started < 4


def test_unknown_packet_before_connect_gets_no_answer(node: NodeProcess) -> None:
    s = socket.create_connection(("127.0.0.1", node.mqtt_port))
    s.settimeout(TIMEOUT)
    s.sendall(struct.pack(">BB", 0xC0, 0))  # PINGREQ before CONNECT
    assert s.recv(1024) == b""


class WebSocketNode(NodeProcess):
    """A node that also serves MQTT over WebSocket (/ws) on a free port."""

    ws_port = 0

    def command(self) -> list[str]:
        self.ws_port = free_port()
        return [*super().command(), "--mqtt-ws-port", str(self.ws_port)]  # the later flag wins


def test_mqtt_over_websocket(tmp_path: Path) -> None:
    n = WebSocketNode(tmp_path / "data", tmp_path / "logs", mqtt=True)
    start(n)
    try:
        wait_port(n.ws_port)
        ws = Client(n.ws_port, transport="websockets")
        tcp = Client(n.mqtt_port)
        ws.subscribe("browser/#", qos=1)
        tcp.publish("browser/news", b"over ws", qos=1)
        assert ws.get().payload == b"over ws"
        ws.publish("from/browser", b"x", qos=1)  # PUBACK over the WebSocket
        ws.close()
        tcp.close()
    finally:
        n.cleanup()


def test_disconnect_reason_is_not_lost_to_a_reset(node: NodeProcess) -> None:
    """Bytes the client sent after its bad packet are still unread when the node closes: without the
    linger, the reset they cause overtakes the DISCONNECT."""
    s = socket.create_connection(("127.0.0.1", node.mqtt_port))
    s.settimeout(TIMEOUT)
    s.sendall(mc.connect("burst", level=5))
    assert s.recv(1) == b"\x20"
    s.recv(1024)
    s.sendall(mc.publish("a/#", b"x", level=5) + mc.publish("ok", b"y" * 1000, level=5) * 200)
    time.sleep(0.5)
    data = b""
    while chunk := s.recv(1024):
        data += chunk
    got = mc.read(data, 5)
    assert got[-1].kind == codec.DISCONNECT and got[-1].fields["reason"] == codec.TOPIC_NAME_INVALID


def test_memory_alarm_stops_reading_mqtt_publishers_until_it_clears(tmp_path: Path) -> None:
    n = NodeProcess(tmp_path / "data", tmp_path / "logs", ["--memory-high-watermark", "8000000"], mqtt=True)
    start(n)
    try:
        away = Client(n.mqtt_port, client_id="alarm-sub", clean=False)
        away.subscribe("alarm/#", qos=1)
        away.close()
        pub = Client(n.mqtt_port)
        # Bodies under the embedded store's 32 KiB segment threshold (--body-store-threshold): with
        # 100 KB bodies the alarm went up in about one run of three here (not understood yet, see
        # the note of this change), with 20 KB ones in every run.
        body = b"x" * 20_000
        blocked = None
        for i in range(1000):  # 20 MB into a queue nobody reads: past the 8 MB watermark
            info = pub.client.publish("alarm/t", body, qos=1)
            info.wait_for_publish(3)
            if not info.is_published():
                blocked = i
                break
        assert blocked is not None and blocked >= 200, blocked  # ~8 MB went in first
        back = Client(n.mqtt_port, client_id="alarm-sub", clean=False)
        received = 0
        while received < blocked:  # draining the queue clears the alarm ...
            back.get()
            received += 1
        info.wait_for_publish(15)  # ... and the held publisher is read again
        assert info.is_published()
        back.close()
        pub.close()
    finally:
        n.cleanup()


def test_vhost_user_login_and_retained_messages_of_another_vhost(tmp_path: Path) -> None:
    data = tmp_path / "data"
    for cmd in (["vhosts", "add", "iot"], ["users", "add", "dev", "--password", "dev-pass-1", "--vhost", "iot"]):
        subprocess.run([_python(), "-m", "leveret", *cmd, "--data-dir", str(data)], cwd=REPO_ROOT, env=node_env(),
                       check=True, capture_output=True, timeout=60)
    n = NodeProcess(data, tmp_path / "logs", mqtt=True)
    start(n)
    try:
        # The first connection to "iot" declares its retained queue; the publish right after must find it.
        Client(n.mqtt_port, username="iot:dev", password="dev-pass-1").publish("cfg/a", b"v1", qos=1, retain=True)
        refused = Client(n.mqtt_port, username="dev", password="dev-pass-1")  # no access to "/"
        assert refused.rc.is_failure  # type: ignore[attr-defined]
        refused.client.loop_stop()
        n.kill()
        start(n)
        sub = Client(n.mqtt_port, username="iot:dev", password="dev-pass-1")
        sub.subscribe("cfg/#", qos=1)
        assert (sub.get().payload, sub.nothing()) == (b"v1", True)
        sub.close()
        guest = Client(n.mqtt_port)  # vhost "/": another vhost's retained messages are not its own
        guest.subscribe("cfg/#", qos=1)
        assert guest.nothing()
        guest.close()
    finally:
        n.cleanup()


def test_management_api_lists_and_closes_mqtt_connections(node: NodeProcess) -> None:
    """/api/connections shows MQTT connections as RabbitMQ's MQTT plugin does (checked against
    RabbitMQ 3.10.8: protocol "MQTT 3.1.1", client_properties {"client_id", "product": "MQTT client"}),
    and DELETE closes one: a v5 client reads reason 0x98 (administrative action)."""
    from compat_tests.mgmt_http import Mgmt, q, wait_http

    mgmt = Mgmt(f"http://127.0.0.1:{node.management_port}", "guest", "guest", node.url, leveret=True)
    wait_http(mgmt)
    old = Client(node.mqtt_port, client_id="mgmt-311", protocol=V311)
    new = Client(node.mqtt_port, client_id="mgmt-5", protocol=V5)
    try:
        rows = {c["client_properties"].get("client_id"): c for c in mgmt.get("/api/connections")
                if c["protocol"].startswith("MQTT")}
        assert rows.keys() >= {"mgmt-311", "mgmt-5"}
        a, b = rows["mgmt-311"], rows["mgmt-5"]
        assert a["protocol"] == "MQTT 3.1.1" and b["protocol"] == "MQTT 5.0"
        assert a["client_properties"] == {"client_id": "mgmt-311", "product": "MQTT client"}
        local = old.client.socket().getsockname()  # type: ignore[union-attr]
        assert (a["user"], a["vhost"], a["peer_host"], a["peer_port"]) == ("guest", "/", "127.0.0.1", local[1])
        assert a["port"] == node.mqtt_port and a["state"] == "running" and a["ssl"] is False
        assert a["name"] == f"127.0.0.1:{local[1]} -> 127.0.0.1:{node.mqtt_port}"
        assert [c["name"] for c in mgmt.get("/api/vhosts/%2F/connections")].count(a["name"]) == 1
        assert mgmt.get(f"/api/connections/{q(b['name'])}")["client_properties"]["client_id"] == "mgmt-5"
        assert mgmt.request("GET", f"/api/connections/{q(b['name'])}/channels").status == 404

        mgmt.ok("DELETE", f"/api/connections/{q(b['name'])}", headers={"X-Reason": "maintenance"})
        assert new.disconnected.wait(TIMEOUT)
        assert int(new.disconnect_reason.value) == 0x98  # type: ignore[attr-defined]
        mgmt.ok("DELETE", f"/api/connections/{q(a['name'])}")
        assert old.disconnected.wait(TIMEOUT)
        deadline = time.monotonic() + TIMEOUT
        while any(c["name"] in (a["name"], b["name"]) for c in mgmt.get("/api/connections")):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert mgmt.request("GET", f"/api/connections/{q(a['name'])}").status == 404
    finally:
        old.close()
        new.close()
