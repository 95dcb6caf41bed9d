"""MQTT over TLS (--mqtt-tls-port) with the AMQPS certificates, made by trustme; paho-mqtt as the client."""

from __future__ import annotations

import json
import queue
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from compat_tests.node_process import REPO_ROOT, NodeProcess, _python, node_env
from compat_tests.test_tls import CERT_USER, Certs
from tests.ports import free_port

TIMEOUT = 10.0


class MqttTLSNode(NodeProcess):
    def __init__(self, root: Path, certs: Certs) -> None:
        super().__init__(root / "data", root / "logs", mqtt=True)
        self.certs = certs
        self.mqtts_port = 0

    def command(self) -> list[str]:
        c = self.certs
        return [*super().command(), "--mqtt-tls-port", str(self.mqtts_port), "--tls-cert", str(c.server_cert),
                "--tls-key", str(c.server_key), "--tls-ca", str(c.ca_file), "--tls-verify", "peer"]

    def spawn(self) -> None:
        self.mqtts_port = free_port()
        super().spawn()

    def wait_ready(self, timeout: float = 30.0) -> None:
        super().wait_ready(timeout)
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.mqtts_port), timeout=0.5).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"no MQTT TLS listener:\n{self.stderr_tail()}") from None
                time.sleep(0.05)


@pytest.fixture(scope="module")
def certs() -> Iterator[Certs]:
    with tempfile.TemporaryDirectory(prefix="leveret-mqtt-certs-") as tmp:
        yield Certs(Path(tmp))


@pytest.fixture(scope="module")
def node(certs: Certs) -> Iterator[MqttTLSNode]:
    root = Path(tempfile.mkdtemp(prefix="leveret-mqtt-tls-"))
    subprocess.run([_python(), "-m", "leveret", "users", "add", CERT_USER, "--password", "unused-password-1",
                    "--vhost", "/", "--data-dir", str(root / "data")], cwd=REPO_ROOT, env=node_env(), check=True,
                   capture_output=True, timeout=60)
    n = MqttTLSNode(root, certs)
    n.start()
    yield n
    n.terminate()
    shutil.rmtree(root, ignore_errors=True)


def client(node: MqttTLSNode, certs: Certs, with_cert: bool, password: bool) -> tuple[paho.Client, queue.Queue]:
    c = paho.Client(CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
    c.tls_set_context(certs.client_context(with_cert))
    if password:
        c.username_pw_set("guest", "guest")
    got: queue.Queue[object] = queue.Queue()
    connected: queue.Queue[object] = queue.Queue()
    c.on_message = lambda _c, _u, m: got.put(m)
    c.on_connect = lambda _c, _u, _f, rc, _p: connected.put(rc)
    c.connect("127.0.0.1", node.mqtts_port)
    c.loop_start()
    rc = connected.get(timeout=TIMEOUT)
    assert not rc.is_failure, rc  # type: ignore[attr-defined]
    return c, got


def test_password_login_over_tls(node: MqttTLSNode, certs: Certs) -> None:
    c, got = client(node, certs, with_cert=True, password=True)
    c.subscribe("tls/#", qos=1)
    time.sleep(0.3)
    c.publish("tls/a", b"secret", qos=1).wait_for_publish(TIMEOUT)
    assert got.get(timeout=TIMEOUT).payload == b"secret"  # type: ignore[attr-defined]
    c.disconnect()
    c.loop_stop()


def test_client_certificate_names_the_user(node: MqttTLSNode, certs: Certs) -> None:
    c, got = client(node, certs, with_cert=True, password=False)
    c.subscribe("cert/#", qos=1)
    time.sleep(0.3)
    c.publish("cert/a", b"by certificate", qos=1).wait_for_publish(TIMEOUT)
    assert got.get(timeout=TIMEOUT).payload == b"by certificate"  # type: ignore[attr-defined]
    c.disconnect()
    c.loop_stop()
    opened = []
    for line in node.stderr_tail(10**7).splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("msg", doc.get("message")) == "MQTT connection opened":
            opened.append(doc)
    assert opened and opened[-1].get("user") == CERT_USER


def test_plaintext_client_on_the_tls_port_is_refused(node: MqttTLSNode) -> None:
    s = socket.create_connection(("127.0.0.1", node.mqtts_port))
    s.settimeout(TIMEOUT)
    s.sendall(b"\x10\x0c\x00\x04MQTT\x04\x02\x00\x3c\x00\x00")
    try:
        assert s.recv(100) in (b"",)  # closed, no CONNACK
    except (ConnectionResetError, ssl.SSLError):
        pass
