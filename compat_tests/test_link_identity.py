"""Shovels and federation links act as the user who set them (issue #26 item 1; leveret/links/identity.py).

A ``policymaker`` whose only vhost is ``A`` used to shovel a queue of ``/``
into ``A`` with ``src-uri amqp:///%2F`` (a URI without a host connected as
guest, an administrator), and a federation upstream ``amqp:///%2F`` copied
``/``'s ``amq.topic`` traffic into ``A``. One real node, pika and HTTP.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pika
import pytest

from compat_tests.mgmt_http import Mgmt, wait_http
from compat_tests.node_process import NodeProcess

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def node() -> Iterator[NodeProcess]:
    root = Path(tempfile.mkdtemp(prefix="leveret-link-identity-"))
    n = NodeProcess(root / "data", root / "logs")
    n.start()
    admin = _admin(n)
    admin.ok("PUT", "/api/vhosts/A")
    with pika.BlockingConnection(pika.URLParameters(n.url)) as conn:
        ch = conn.channel()
        ch.queue_declare("victim", durable=True)
        for i in range(3):
            ch.basic_publish("", "victim", f"secret {i}".encode())
    yield n
    if n.running():
        n.terminate()
    shutil.rmtree(root, ignore_errors=True)


def _admin(node: NodeProcess) -> Mgmt:
    m = Mgmt(f"http://127.0.0.1:{node.management_port}", "guest", "guest", node.url, leveret=True)
    m.node = node
    wait_http(m)
    return m


def _policymaker(node: NodeProcess, name: str) -> Mgmt:
    admin = _admin(node)
    admin.ok("PUT", f"/api/users/{name}", {"password": name + "-pw", "tags": "policymaker"})
    admin.ok("PUT", f"/api/permissions/A/{name}", {"configure": ".*", "write": ".*", "read": ".*"})
    return admin.as_user(name, name + "-pw")


def _until(what: Callable[[], Any], timeout: float = 20) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got:
            return got
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _shovel(admin: Mgmt, name: str) -> dict[str, Any]:
    found = [s for s in admin.get("/api/shovels/A") if s["name"] == name]
    return found[0] if found else {}


def test_a_direct_uri_to_a_vhost_the_setter_may_not_use_is_refused(node: NodeProcess) -> None:
    pm = _policymaker(node, "pm")
    steal = {"src-uri": "amqp:///%2F", "src-queue": "victim", "dest-uri": "amqp:///A", "dest-queue": "loot"}
    reply = pm.request("PUT", "/api/parameters/shovel/A/steal", {"value": steal})
    assert reply.status == 403, reply
    assert "user 'pm' may not access vhost '/'" in reply.body["reason"]
    # The default user's credentials to this node are an administrator's way, not a policymaker's.
    explicit = {**steal, "src-uri": f"amqp://guest:guest@localhost:{node.amqp_port}/%2F"}
    reply = pm.request("PUT", "/api/parameters/shovel/A/steal", {"value": explicit})
    assert reply.status == 403, reply
    assert "default user 'guest'" in reply.body["reason"]
    # Claiming to be someone else in the value does not help: the setter is the owner.
    reply = pm.request("PUT", "/api/parameters/shovel/A/steal", {"value": {**steal, "user": "guest"}})
    assert reply.status == 403, reply
    upstream = pm.request("PUT", "/api/parameters/federation-upstream/A/up", {"value": {"uri": "amqp:///%2F"}})
    assert upstream.status == 403, upstream
    # Nor through an upstream set's override of another upstream's uri.
    overriding = pm.request("PUT", "/api/parameters/federation-upstream-set/A/s",
                            {"value": [{"upstream": "admins", "uri": "amqp:///%2F"}]})
    assert overriding.status == 403, overriding
    admin = _admin(node)
    assert admin.get("/api/parameters/shovel") == []
    assert admin.get("/api/queues/%2F/victim")["messages"] == 3


def test_a_shovel_acts_as_its_owner_and_stops_when_the_owner_loses_the_vhost(node: NodeProcess) -> None:
    admin = _admin(node)
    pm = _policymaker(node, "mover")
    with pika.BlockingConnection(pika.URLParameters(f"amqp://guest:guest@127.0.0.1:{node.amqp_port}/%2F")):
        pass
    pm.ok("PUT", "/api/parameters/shovel/A/move", {"value": {
        "src-uri": "amqp:///A", "src-queue": "a1", "dest-uri": "amqp:///A", "dest-queue": "a2",
        "reconnect-delay": 0.2}})
    # The owner stays in the store; the API shows and exports RabbitMQ's keys only.
    assert "user" not in admin.get("/api/parameters/shovel/A/move")["value"]
    _until(lambda: _shovel(admin, "move").get("state") == "running")
    params = pika.URLParameters(f"amqp://mover:mover-pw@127.0.0.1:{node.amqp_port}/A")
    with pika.BlockingConnection(params) as conn:
        conn.channel().basic_publish("", "a1", b"moved")
    _until(lambda: admin.get("/api/queues/A/a2")["messages"] == 1)
    # Its connections are the owner's (not guest's).
    users = {c["user"] for c in admin.get("/api/connections") if c["vhost"] == "A"}
    assert users == {"mover"}, users
    admin.ok("DELETE", "/api/permissions/A/mover")
    state = _until(lambda: (s := _shovel(admin, "move")).get("state") == "terminated"
                   and "may not access vhost 'A'" in s.get("reason", "") and s)
    assert state["reason"] == "user 'mover' may not access vhost 'A'", state
    with pika.BlockingConnection(pika.URLParameters(f"amqp://guest:guest@127.0.0.1:{node.amqp_port}/A")) as conn:
        conn.channel().basic_publish("", "a1", b"stays")
    time.sleep(1.0)  # several reconnect delays: each refused
    assert admin.get("/api/queues/A/a1")["messages"] == 1
    assert _shovel(admin, "move")["state"] == "terminated"
    admin.ok("DELETE", "/api/users/mover")
    _until(lambda: "user 'mover', who set this parameter, no longer exists" in _shovel(admin, "move").get("reason",
                                                                                                          ""))
    admin.ok("DELETE", "/api/parameters/shovel/A/move")


def test_a_federation_link_stops_when_its_upstreams_owner_is_deleted(node: NodeProcess) -> None:
    admin = _admin(node)
    admin.ok("PUT", "/api/vhosts/B")
    pm = _policymaker(node, "feeder")
    admin.ok("PUT", "/api/permissions/B/feeder", {"configure": ".*", "write": ".*", "read": ".*"})
    pm.ok("PUT", "/api/parameters/federation-upstream/A/fromB", {"value": {"uri": "amqp:///B",
                                                                           "reconnect-delay": 0.2}})
    with pika.BlockingConnection(pika.URLParameters(f"amqp://guest:guest@127.0.0.1:{node.amqp_port}/A")) as c:
        c.channel().exchange_declare("fed.x", "topic", durable=True)
    pm.ok("PUT", "/api/policies/A/federate", {"pattern": r"^fed\.", "apply-to": "exchanges",
                                              "definition": {"federation-upstream": "fromB"}})

    def link() -> dict[str, Any]:
        found = [x for x in admin.get("/api/federation-links/A") if x["upstream"] == "fromB"]
        return found[0] if found else {}

    _until(lambda: link().get("status") == "running")
    admin.ok("DELETE", "/api/users/feeder")
    _until(lambda: "user 'feeder', who set this parameter, no longer exists" in link().get("error", ""))
    assert link()["status"] != "running"
