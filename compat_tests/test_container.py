"""The container image (deploy/Containerfile) and the compose cluster (deploy/compose.yaml), with Debian's
podman: build the image (cached between runs: scripts/build-image.sh does nothing when an image of the
same sources is there), run it, pika and the management API from the host, kill -9 under a confirmed
publisher and start again on the same volume; three nodes with podman-compose, the owner of a queue
stopped, the queue served by another node.

Host networking and free ports (../shared/CONTAINERS.md). Skipped where podman is not installed
(`make test`'s bootstrap installs it as root).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest

import leveret
from harness.node import REPO_ROOT
from harness.ports import free_ports

pytestmark = [
    pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed (apt-get install podman)"),
    # The first run builds the base and the images (minutes on 2 cores); later runs reuse them.
    pytest.mark.timeout(1500),
]

PODMAN = str(REPO_ROOT / "scripts" / "podman.sh")
IMAGE = os.environ.get("LEVERET_TEST_IMAGE", "localhost/leveret:test")
USER, PASSWORD = "admin", "s3cret-pass"
MAX_IMAGE_BYTES = 250_000_000


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([PODMAN, *args], capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: {out.returncode}\n{out.stdout}\n{out.stderr}")
    return out


def wait_for(what: str, ok: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f}s")
        time.sleep(0.2)


def amqp_up(port: int, host: str = "127.0.0.1", user: str = USER, password: str = PASSWORD) -> bool:
    try:
        pika.BlockingConnection(pika.ConnectionParameters(
            host, port, credentials=pika.PlainCredentials(user, password), connection_attempts=1,
            socket_timeout=2)).close()
    except pika.exceptions.AMQPError:
        return False
    return True


def api(port: int, path: str, host: str = "127.0.0.1", method: str = "GET", body: Any = None,
        user: str = USER, password: str = PASSWORD) -> Any:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    request = urllib.request.Request(f"http://{host}:{port}/api/{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"Basic {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        raw = response.read()
    return json.loads(raw) if raw.strip() else None


@pytest.fixture(scope="module")
def image() -> str:
    """The image of this checkout (made once per source change; scripts/build-image.sh skips it otherwise)."""
    build = subprocess.run([str(REPO_ROOT / "scripts" / "build-image.sh"), "cluster"], cwd=REPO_ROOT,
                           env={**os.environ, "IMAGE": IMAGE}, capture_output=True, text=True, timeout=1400)
    assert build.returncode == 0, build.stdout + build.stderr
    return IMAGE


class Container:
    """One node container on host networking, free ports, a named volume of its own."""

    def __init__(self, image: str, env: dict[str, str] | None = None) -> None:
        self.name = f"leveret-test-{uuid.uuid4().hex[:8]}"
        self.volume = f"{self.name}-data"
        self.amqp, self.management, self.prometheus, self.grpc, self.cluster = free_ports(5)
        self.image = image
        self.env = {"LEVERET_AMQP_PORT": str(self.amqp), "LEVERET_MANAGEMENT_PORT": str(self.management),
                    "LEVERET_PROMETHEUS_PORT": str(self.prometheus), "LEVERET_GRPC_PORT": str(self.grpc),
                    "LEVERET_CLUSTER_PORT": str(self.cluster), "LEVERET_DEFAULT_USER": USER,
                    "LEVERET_DEFAULT_PASS": PASSWORD,
                    # Host networking: no MQTT listener on its default ports (1883 may be RabbitMQ's);
                    # a node without MQTT ignores these.
                    "LEVERET_MQTT_PORT": "0", "LEVERET_MQTT_TLS_PORT": "0", "LEVERET_MQTT_WS_PORT": "0",
                    **(env or {})}

    def run(self) -> None:
        args = ["run", "-d", "--name", self.name, "--network", "host", "-v", f"{self.volume}:/var/lib/leveret"]
        for k, v in self.env.items():
            args += ["-e", f"{k}={v}"]
        podman(*args, self.image)
        self.wait_ready()

    def wait_ready(self) -> None:
        try:
            wait_for("the node in its container answers AMQP", lambda: amqp_up(self.amqp))
        except AssertionError:
            raise AssertionError(podman("logs", "--tail", "30", self.name, check=False).stderr) from None

    def remove(self) -> None:
        podman("rm", "-f", "-t", "0", self.name, check=False)
        podman("volume", "rm", "-f", self.volume, check=False)


@pytest.fixture
def container(image: str) -> Iterator[Container]:
    c = Container(image)
    c.run()
    try:
        yield c
    finally:
        c.remove()


def test_image_serves_amqp_and_the_management_api_from_the_host(image: str, container: Container) -> None:
    size = int(podman("image", "inspect", "--format", "{{.Size}}", image).stdout)
    assert size < MAX_IMAGE_BYTES, f"image is {size / 1e6:.0f} MB"
    (inspected,) = json.loads(podman("image", "inspect", image).stdout)
    config = inspected["Config"]
    assert config["User"] == "leveret" and "/var/lib/leveret" in config["Volumes"]
    assert {f"{p}/tcp" for p in (5672, 5671, 15672, 15692, 50051, 27672)} <= set(config["ExposedPorts"])
    assert inspected["Healthcheck"]["Test"][-3:] == ["leveret", "diagnostics", "check_running"]
    assert podman("exec", container.name, "id", "-u").stdout.strip() != "0"
    # Neither the test nor the Spark toolchains are in the image.
    missing = podman("exec", container.name, "python3", "-c",
                     "import importlib.util as u; print([m for m in ('pytest', 'pyspark', 'playwright', 'bench',"
                     " 'tests') if u.find_spec(m)])")
    assert missing.stdout.strip() == "[]"

    conn = pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", container.amqp, credentials=pika.PlainCredentials(USER, PASSWORD)))
    ch = conn.channel()
    ch.queue_declare("in-a-container", durable=True)
    ch.confirm_delivery()
    ch.basic_publish("", "in-a-container", b"hello", pika.BasicProperties(delivery_mode=2))
    method, _props, body = ch.basic_get("in-a-container", auto_ack=True)
    assert method is not None and body == b"hello"
    conn.close()

    overview = api(container.management, "overview")
    assert overview["product_name"] == "Leveret" and overview["product_version"] == leveret.__version__
    assert any(q["name"] == "in-a-container" for q in api(container.management, "queues"))
    # The image's HEALTHCHECK command passes.
    assert podman("healthcheck", "run", container.name, check=False).returncode == 0
    # The data is in the volume.
    listing = podman("exec", container.name, "ls", "/var/lib/leveret").stdout.split()
    assert "leveret.sqlite3" in listing


def _non_loopback_address() -> str | None:
    import socket

    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.254", 9))  # no packet is sent: only the route's source address is chosen
        address = str(probe.getsockname()[0])
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address


def test_default_user_logs_in_from_outside_the_container(container: Container) -> None:
    """LEVERET_DEFAULT_USER is not loopback-only (only guest is, as in RabbitMQ): a client on a non-loopback
    address of the host logs in, over AMQP and the management API."""
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    assert amqp_up(container.amqp, host=address), f"{USER} refused from {address}"
    assert api(container.management, "whoami", host=address)["name"] == USER


def test_kill_9_under_a_confirmed_publisher_then_start_on_the_same_volume(container: Container) -> None:
    confirmed: list[int] = []
    stop = threading.Event()
    failure: list[BaseException] = []

    def publish() -> None:
        try:
            conn = pika.BlockingConnection(pika.ConnectionParameters(
                "127.0.0.1", container.amqp, credentials=pika.PlainCredentials(USER, PASSWORD)))
            ch = conn.channel()
            ch.queue_declare("survives", durable=True)
            ch.confirm_delivery()
            i = 0
            while not stop.is_set():
                ch.basic_publish("", "survives", b"%d" % i, pika.BasicProperties(delivery_mode=2))
                confirmed.append(i)
                i += 1
        except (pika.exceptions.AMQPError, OSError) as exc:
            failure.append(exc)  # the kill ends the connection: expected

    thread = threading.Thread(target=publish)
    thread.start()
    try:
        wait_for("confirmed publishes", lambda: len(confirmed) >= 200 or bool(failure), timeout=30)
        assert not failure, failure
        podman("kill", "--signal", "KILL", container.name)
        thread.join(30)
    finally:
        stop.set()
        thread.join(30)
    acked = set(confirmed)
    assert len(acked) >= 200
    podman("start", container.name)
    container.wait_ready()
    conn = pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", container.amqp, credentials=pika.PlainCredentials(USER, PASSWORD)))
    ch = conn.channel()
    got: set[int] = set()
    while True:
        method, _props, body = ch.basic_get("survives", auto_ack=True)
        if method is None:
            break
        got.add(int(body))
    conn.close()
    lost = acked - got
    assert not lost, f"{len(lost)} confirmed messages lost across kill -9, e.g. {sorted(lost)[:5]}"


# -- the compose cluster ------------------------------------------------------------------------


# The compose cluster runs on a bridge network: a client on the host reaches a node through its
# published port from the bridge's gateway, not from loopback. The test therefore makes its own user
# from inside node1 (over loopback, as the default user) and works as that user from the host.
TESTER, TESTER_PASSWORD = "tester", "tester-pass"


@pytest.fixture
def cluster(image: str, tmp_path: Path) -> Iterator[tuple[str, dict[str, dict[str, int]]]]:
    project = f"lvtest{uuid.uuid4().hex[:6]}"
    ports = iter(free_ports(3 * 4))
    nodes = {f"node{i}": {kind: next(ports) for kind in ("amqp", "management", "prometheus", "grpc")}
             for i in (1, 2, 3)}
    if os.geteuid() != 0:
        pytest.skip("the cluster secret must belong to the image's user (uid 999): chown needs root")
    secret = tmp_path / "cluster-secret"
    secret.write_text(base64.b64encode(os.urandom(32)).decode())
    # Bind-mounted as it is: the image's user (uid 999) reads it, nobody else may (a node refuses a
    # secret readable by group or others, as RabbitMQ refuses such an Erlang cookie).
    secret.chmod(0o600)
    os.chown(secret, 999, 999)
    env = {**os.environ, "LEVERET_IMAGE": image, "CLUSTER_SECRET_FILE": str(secret), "PG_PASSWORD": "pw-" + project,
           "LEVERET_DEFAULT_USER": USER, "LEVERET_DEFAULT_PASS": PASSWORD}
    for node, its in nodes.items():
        for kind, port in its.items():
            env[f"{node.upper()}_{kind.upper()}_PORT"] = str(port)
    compose = [PODMAN, "compose", "-p", project, "-f", str(REPO_ROOT / "deploy" / "compose.yaml")]

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        out = subprocess.run([*compose, *args], env=env, capture_output=True, text=True, timeout=300)
        if check and out.returncode != 0:
            raise AssertionError(f"podman-compose {' '.join(args)}: {out.returncode}\n{out.stdout}\n{out.stderr}")
        return out

    def healthy(node: str) -> bool:
        return podman("healthcheck", "run", f"{project}_{node}_1", check=False).returncode == 0

    run("up", "-d")
    try:
        for node in nodes:
            try:
                wait_for(f"{node} passes its healthcheck", lambda node=node: healthy(node), timeout=90)  # type: ignore[misc]
            except AssertionError:
                logs = podman("logs", "--tail", "40", f"{project}_{node}_1", check=False)
                raise AssertionError(logs.stdout + logs.stderr) from None
        node1 = f"{project}_node1_1"
        for args in (("add_user", TESTER, TESTER_PASSWORD), ("set_user_tags", TESTER, "administrator"),
                     ("set_permissions", "-p", "/", TESTER, ".*", ".*", ".*")):
            podman("exec", node1, "leveret", "ctl", "--username", USER, "--password", PASSWORD, *args)
        for its in nodes.values():  # the user reached every node (etcd)
            wait_for("the tester user on every node", lambda its=its: amqp_up(  # type: ignore[misc]
                its["amqp"], user=TESTER, password=TESTER_PASSWORD), timeout=30)
        yield project, nodes
    finally:
        run("down", "-v", "-t", "1", check=False)
        podman("network", "rm", "-f", f"{project}_default", check=False)  # podman-compose 1.0.3 leaves it


def test_compose_cluster_moves_a_queue_off_a_stopped_node(cluster: tuple[str, dict[str, dict[str, int]]]) -> None:
    project, nodes = cluster
    credentials = pika.PlainCredentials(TESTER, TESTER_PASSWORD)
    n1 = nodes["node1"]
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", n1["amqp"], credentials=credentials))
    ch = conn.channel()
    ch.queue_declare("moves", durable=True)
    ch.confirm_delivery()
    for i in range(50):
        ch.basic_publish("", "moves", b"%d" % i, pika.BasicProperties(delivery_mode=2))
    conn.close()
    owner = str(api(n1["management"], "queues/%2F/moves", user=TESTER, password=TESTER_PASSWORD)["node"])
    owner_node = next((n for n in nodes if owner.startswith(n)), None)
    assert owner_node is not None, f"owner {owner!r} is none of {list(nodes)}"
    podman("stop", "-t", "5", f"{project}_{owner_node}_1")
    survivor = nodes[next(n for n in nodes if n != owner_node)]

    def moved() -> bool:
        try:
            q = api(survivor["management"], "queues/%2F/moves", user=TESTER, password=TESTER_PASSWORD)
        except OSError:
            return False
        return bool(q.get("node")) and not str(q["node"]).startswith(owner_node) and q.get("messages") == 50

    wait_for("the queue moves to a live node with its 50 messages", moved, timeout=60)
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", survivor["amqp"], credentials=credentials))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.basic_publish("", "moves", b"after", pika.BasicProperties(delivery_mode=2))
    got = []
    while True:
        method, _props, body = ch.basic_get("moves", auto_ack=True)
        if method is None:
            break
        got.append(body)
    conn.close()
    assert sorted(got) == sorted([b"%d" % i for i in range(50)] + [b"after"])
