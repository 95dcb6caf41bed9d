"""Permissions and limits on a Leveret node: the gRPC API checks what AMQP checks (core/engine/access.py;
the management API's checks are in test_permissions.py, which runs against RabbitMQ too), and
permissions, topic permissions and limits survive a restart."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import grpc
import pika
import pika.exceptions
import pytest

from compat_tests.mgmt_http import Mgmt, q, wait_http
from compat_tests.util import channel_error
from harness.node import NodeProcess
from leveret.client import Client, LeveretError

pytestmark = pytest.mark.timeout(120)
VHOST, USER, PASSWORD = "pv", "pu", "pu-secret"
WRITE = r"^mine\.|^amq\.(default|topic)$"


def _mgmt(node: NodeProcess) -> Mgmt:
    m = Mgmt(f"http://127.0.0.1:{node.management_port}", "guest", "guest", node.url, leveret=True)
    m.node = node
    wait_http(m)
    return m


@pytest.fixture(scope="module")
def node() -> Iterator[NodeProcess]:
    root = Path(tempfile.mkdtemp(prefix="leveret-perms-"))
    n = NodeProcess(root / "data", root / "logs")
    n.start()
    m = _mgmt(n)
    m.ok("PUT", f"/api/vhosts/{VHOST}")
    m.ok("PUT", f"/api/users/{USER}", {"password": PASSWORD, "tags": "management"})
    m.ok("PUT", f"/api/permissions/{VHOST}/{USER}", {"configure": r"^mine\.", "write": WRITE,
                                                    "read": r"^mine\."})
    m.ok("PUT", f"/api/permissions/{VHOST}/guest", {"configure": ".*", "write": ".*", "read": ".*"})
    with pika.BlockingConnection(pika.URLParameters(f"amqp://guest:guest@127.0.0.1:{n.amqp_port}/{VHOST}")) as c:
        ch = c.channel()
        ch.queue_declare("theirs.q")
        ch.queue_declare("mine.q")
        ch.exchange_declare("theirs.x", "direct")
    yield n
    if n.running():
        n.terminate()
    shutil.rmtree(root, ignore_errors=True)


def _client(node: NodeProcess) -> Client:
    return Client(f"127.0.0.1:{node.grpc_port}", username=USER, password=PASSWORD, vhost=VHOST, timeout=10)


def _denied(call: object) -> str:
    with pytest.raises(LeveretError) as info:
        call()  # type: ignore[operator]
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED, info.value
    return str(info.value)


def test_grpc_maps_operations_onto_the_same_checks(node: NodeProcess) -> None:
    with _client(node) as c:
        c.create_queue("mine.g", exist_ok=True)
        assert "access to queue 'theirs.g' in vhost 'pv' refused for user 'pu'" in \
            _denied(lambda: c.create_queue("theirs.g"))
        _denied(lambda: c.delete_queue("theirs.q"))
        _denied(lambda: c.create_channel("theirs.q"))
        c.push("mine.g", b"m")  # write on amq.default: the user has it
        _denied(lambda: c.subscribe("theirs.q/", prefetch=1))
        got = c.subscribe("mine.g/", prefetch=1)
        assert got.get(timeout=10) is not None
        got.close()
        c.delete_queue("mine.g")


def test_grpc_push_needs_write_on_amq_default(node: NodeProcess) -> None:
    m = _mgmt(node)
    m.ok("PUT", f"/api/permissions/{VHOST}/{USER}", {"configure": r"^mine\.", "write": r"^mine\.",
                                                    "read": r"^mine\."})
    try:
        with _client(node) as c:
            assert "exchange 'amq.default'" in _denied(lambda: c.push("mine.q", b"m"))
    finally:
        m.ok("PUT", f"/api/permissions/{VHOST}/{USER}", {"configure": r"^mine\.",
                                                        "write": WRITE, "read": r"^mine\."})


def test_permissions_topic_permissions_and_limits_survive_a_restart(node: NodeProcess) -> None:
    m = _mgmt(node)
    m.ok("PUT", f"/api/topic-permissions/{VHOST}/{USER}", {"exchange": "amq.topic", "write": "^a", "read": "^b"})
    m.ok("PUT", f"/api/user-limits/{USER}/max-channels", {"value": 3})
    m.ok("PUT", f"/api/vhost-limits/{VHOST}/max-queues", {"value": 50})
    before = (m.get(f"/api/users/{USER}/permissions"), m.get(f"/api/topic-permissions/{VHOST}/{USER}"),
              m.get(f"/api/user-limits/{USER}"), m.get(f"/api/vhost-limits/{VHOST}"))
    node.terminate()
    node.start()
    m = _mgmt(node)
    after = (m.get(f"/api/users/{USER}/permissions"), m.get(f"/api/topic-permissions/{VHOST}/{USER}"),
             m.get(f"/api/user-limits/{USER}"), m.get(f"/api/vhost-limits/{VHOST}"))
    assert after == before
    assert after[0][0]["configure"] == r"^mine\."
    params = pika.URLParameters(f"amqp://{USER}:{PASSWORD}@127.0.0.1:{node.amqp_port}/{quote(VHOST, safe='')}")
    with pika.BlockingConnection(params) as conn:
        ch = conn.channel()
        with channel_error(403, "access to queue 'theirs.q' in vhost 'pv' refused for user 'pu'"):
            ch.queue_purge("theirs.q")
        ch = conn.channel()
        ch.confirm_delivery()
        with channel_error(403, "access to topic 'z' in exchange 'amq.topic'"):
            ch.basic_publish("amq.topic", "z", b"m")


def test_password_change_applies_at_once(node: NodeProcess) -> None:
    m = _mgmt(node)
    name = "pw-user"
    m.ok("PUT", f"/api/users/{name}", {"password": "old-pass", "tags": ""})
    m.ok("PUT", f"/api/permissions/{VHOST}/{name}", {"configure": ".*", "write": ".*", "read": ".*"})
    url = f"127.0.0.1:{node.amqp_port}/{VHOST}"
    pika.BlockingConnection(pika.URLParameters(f"amqp://{name}:old-pass@{url}")).close()
    m.ok("PUT", f"/api/users/{name}", {"password": "new-pass", "tags": ""})
    time.sleep(0.1)
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        pika.BlockingConnection(pika.URLParameters(f"amqp://{name}:old-pass@{url}?connection_attempts=1"))
    pika.BlockingConnection(pika.URLParameters(f"amqp://{name}:new-pass@{url}")).close()
    # The permissions stayed with the user across the password change.
    assert m.get(f"/api/users/{name}/permissions")[0]["write"] == ".*"
    m.ok("DELETE", f"/api/users/{q(name)}")


def test_grpc_streams_check_the_same_rules(node: NodeProcess) -> None:
    from leveret.streams_client import StreamsClient

    s = StreamsClient(f"127.0.0.1:{node.grpc_port}", username=USER, password=PASSWORD, vhost=VHOST)
    try:
        s.create_stream("mine.s")
        s.publish("mine.s", b"m")  # a plain stream: a publish to the default exchange
        assert "access to queue 'theirs.s'" in _denied(lambda: s.create_stream("theirs.s"))
        _denied(lambda: s.commit("g", "theirs.q", 0))
        s.delete_stream("mine.s")
    finally:
        s.close()
