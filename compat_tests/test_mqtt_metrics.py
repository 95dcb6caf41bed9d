"""rabbitmq_prometheus's series over MQTT connections, checked against RabbitMQ 3.10.8's rabbitmq_mqtt:
rabbitmq_connections and rabbitmq_process_open_tcp_sockets count them, rabbitmq_auth_attempts_*{protocol="mqtt"}
count their logins; and what their buffers hold is in the memory the alarm counts."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from compat_tests.test_metrics import MetricsNode, samples
from compat_tests.test_mqtt import V5, Client, wait_port
from harness import mqtt_client as mc
from mqtt_frontend import codec

TIMEOUT = 10.0


@pytest.fixture
def node(tmp_path: Path) -> Iterator[MetricsNode]:
    n = MetricsNode(tmp_path / "data", tmp_path / "logs", mqtt=True)
    n.start()
    wait_port(n.mqtt_port)
    try:
        yield n
    finally:
        n.terminate()
        n.cleanup()


def value(node: MetricsNode, name: str, **labels: str) -> float:
    return samples(node.scrape()).get((name, frozenset(labels.items())), -1.0)


def raw_connect(port: int, password: bytes) -> tuple[socket.socket, bytes]:
    s = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    s.sendall(mc.connect(f"raw-{password.decode()}", password=password))
    return s, s.recv(4)


def eventually(check: object, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_connections_sockets_and_logins_count_mqtt(node: MetricsNode) -> None:
    base_sockets = value(node, "rabbitmq_process_open_tcp_sockets")
    a = Client(node.mqtt_port)
    b = Client(node.mqtt_port, protocol=V5)
    bad, answer = raw_connect(node.mqtt_port, b"wrong")
    try:
        assert answer[0] >> 4 == codec.CONNACK and answer[3] != 0  # refused
        assert value(node, "rabbitmq_connections") == 2
        assert value(node, "rabbitmq_process_open_tcp_sockets") >= base_sockets + 2
        assert value(node, "rabbitmq_auth_attempts_total", protocol="mqtt") == 3
        assert value(node, "rabbitmq_auth_attempts_succeeded_total", protocol="mqtt") == 2
        assert value(node, "rabbitmq_auth_attempts_failed_total", protocol="mqtt") == 1
    finally:
        bad.close()
        a.close()
    eventually(lambda: value(node, "rabbitmq_connections") == 1, "a closed MQTT connection is not counted")
    b.close()


def test_a_partial_publish_is_in_the_memory_the_alarm_counts(node: MetricsNode) -> None:
    """Bytes of a PUBLISH still arriving are held by the connection: the alarm must see them."""
    s, answer = raw_connect(node.mqtt_port, b"guest")
    try:
        assert answer == bytes((codec.CONNACK << 4, 2, 0, 0))
        body = 3_000_000
        head = codec.utf8("big/t")
        s.sendall(codec.packet(codec.PUBLISH, 0, head + b"x" * body)[:2_000_000])  # two thirds of it
        eventually(lambda: value(node, "leveret_memory_held_bytes", part="partial_and_buffers") >= 1_900_000,
                   "the partial PUBLISH is not counted")
        assert value(node, "rabbitmq_process_resident_memory_bytes") >= 1_900_000
    finally:
        s.close()
    eventually(lambda: value(node, "leveret_memory_held_bytes", part="partial_and_buffers") < 100_000,
               "a closed connection's buffer is still counted")
