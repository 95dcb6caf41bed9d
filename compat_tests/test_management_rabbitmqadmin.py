"""Every command of RabbitMQ's own rabbitmqadmin (Debian's 3.10.8) against a node's management API.

Each command runs as an operator would type it and must exit 0 with output that says what it
did. ``LEVERET_TEST_MGMT_URL=http://guest:guest@127.0.0.1:15672`` runs the same commands
against a RabbitMQ (how the table in docs/MANAGEMENT.md was checked); the commands that need
a plugin RabbitMQ does not have enabled there (federation parameters) run against Leveret only.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pika
import pytest

from compat_tests.mgmt_http import Mgmt, leveret_only, q, start_mgmt

RABBITMQADMIN = "/usr/bin/rabbitmqadmin"
pytestmark = pytest.mark.skipif(not os.path.exists(RABBITMQADMIN),
                                reason=f"{RABBITMQADMIN} is not installed (Debian's rabbitmq-server ships it)")

LISTABLE = ("connections", "channels", "consumers", "exchanges", "queues", "bindings", "users", "vhosts",
            "permissions", "nodes", "parameters", "policies", "operator_policies", "vhost_limits")


@pytest.fixture(scope="module")
def mgmt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mgmt]:
    yield from start_mgmt(tmp_path_factory.mktemp("rabbitmqadmin"))


def eventually(probe: Callable[[], Any], timeout: float = 20.0) -> Any:
    """``probe()`` once it is truthy: RabbitMQ's figures lag by its stats interval (Leveret's do not)."""
    deadline = time.monotonic() + timeout
    while not (result := probe()):
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.5)
    return result


class Admin:
    def __init__(self, mgmt: Mgmt) -> None:
        self.host, self.port = mgmt.host_port.rsplit(":", 1)
        self.mgmt = mgmt
        self.ran: list[tuple[str, ...]] = []

    def __call__(self, *args: str, ok: bool = True) -> str:
        cmd = [RABBITMQADMIN, "-H", self.host, "-P", self.port, "-u", self.mgmt.username, "-p",
               self.mgmt.password, *args]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if ok:
            assert out.returncode == 0, (args, out.stdout, out.stderr)
            assert "Traceback" not in out.stderr, (args, out.stderr)
        self.ran.append(args)
        return out.stdout

    def json(self, *args: str) -> list[dict]:  # type: ignore[type-arg]
        return json.loads(self("-f", "raw_json", *args))  # type: ignore[no-any-return]


def test_every_command(mgmt: Mgmt, tmp_path: Path) -> None:
    admin = Admin(mgmt)
    tag = uuid.uuid4().hex[:6]
    vhost, user, x, name = f"adm-v-{tag}", f"adm-u-{tag}", f"adm-x-{tag}", f"adm-q-{tag}"

    # declare: each says what it made, and the object is there afterwards.
    assert "vhost declared" in admin("declare", "vhost", f"name={vhost}")
    assert "user declared" in admin("declare", "user", f"name={user}", "password=pw", "tags=management")
    assert "permission declared" in admin("declare", "permission", f"vhost={vhost}", f"user={user}",
                                          "configure=.*", "write=.*", "read=.*")
    assert "exchange declared" in admin("declare", "exchange", f"name={x}", "type=topic")
    assert "queue declared" in admin("declare", "queue", f"name={name}", "durable=false")
    assert "binding declared" in admin("declare", "binding", f"source={x}", f"destination={name}",
                                       "routing_key=a.#")
    assert "policy declared" in admin("declare", "policy", f"name=p-{tag}", "pattern=^zz-",
                                      'definition={"max-length": 5}')
    assert "operator_policy declared" in admin("declare", "operator_policy", f"name=op-{tag}", "pattern=^zz-",
                                               'definition={"max-length": 7}')
    assert "vhost_limit declared" in admin("declare", "vhost_limit", f"vhost={vhost}", "name=max-connections",
                                           "value=10")
    assert mgmt.get(f"/api/permissions/{q(vhost)}/{user}")["configure"] == ".*"
    assert mgmt.get(f"/api/vhost-limits/{q(vhost)}")[0]["value"] == {"max-connections": 10}

    # publish and get
    assert "Message published" in admin("publish", f"exchange={x}", "routing_key=a.b", "payload=hello")
    assert "Message published" in admin("publish", f"routing_key={name}", "payload=second")
    got = admin.json("get", f"queue={name}", "ackmode=ack_requeue_true", "count=2")
    assert [m["payload"] for m in got] == ["hello", "second"]
    assert "hello" in admin("get", f"queue={name}", "ackmode=ack_requeue_true")

    # A consumer and a connection to list (rabbitmqadmin's table crashed on "consumer_timeout": null).
    conn = pika.BlockingConnection(pika.URLParameters(mgmt.amqp_url))
    try:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=1)
        ch.basic_consume(name, lambda *a: None, auto_ack=False, consumer_tag=f"ctag-{tag}")
        conn.process_data_events(time_limit=0.3)
        deadline = time.monotonic() + 20  # RabbitMQ's lists lag by its stats interval
        while not any(c["consumer_tag"] == f"ctag-{tag}" for c in admin.json("list", "consumers")):
            assert time.monotonic() < deadline
            conn.process_data_events(time_limit=0.5)
        for what in LISTABLE:
            table = admin("list", what)
            items = admin.json("list", what)
            assert isinstance(items, list), what
            # a table, headings and all ("No items" where there are none: parameters here)
            assert (table.startswith("+") and "|" in table) if items else table == "No items\n", (what, table)
        assert f"ctag-{tag}" in admin("list", "consumers")
        assert name in admin("list", "queues", "name", "messages")
        assert x in admin("list", "exchanges", "name", "type")
        assert "a.#" in admin("list", "bindings")
        assert user in admin("list", "users")
        assert vhost in admin("list", "vhosts")
        assert f"p-{tag}" in admin("list", "policies")
        assert f"op-{tag}" in admin("list", "operator_policies")
        assert "max-connections" in admin("list", "vhost_limits")
        assert any(p["user"] == user for p in admin.json("list", "permissions"))
        assert admin.json("list", "nodes")[0]["name"]
        assert admin.json("list", "connections") and admin.json("list", "channels")
        overview = admin.json("show", "overview")[0]
        assert overview["rabbitmq_version"] and overview["cluster_name"]
        assert "rabbitmq_version" in admin("show", "overview")

        # export and import
        defs = tmp_path / "defs.json"
        assert "Exported definitions" in admin("export", str(defs))
        assert any(v["name"] == vhost for v in json.loads(defs.read_text())["vhosts"])
        assert "Uploaded definitions" in admin("import", str(defs))

        # close a connection (by the name the list gives)
        port = conn._impl._transport._sock.getsockname()[1]  # type: ignore[attr-defined]
        mine = [c for c in admin.json("list", "connections") if c.get("peer_port") == port]
        assert "connection closed" in admin("close", "connection", f"name={mine[0]['name']}")
        with pytest.raises(pika.exceptions.ConnectionClosed):
            for _ in range(20):
                conn.process_data_events(time_limit=0.5)
    finally:
        if conn.is_open:
            conn.close()

    assert "queue purged" in admin("purge", "queue", f"name={name}")
    assert eventually(lambda: mgmt.get(f"/api/queues/%2F/{q(name)}")["messages"] == 0)

    # delete: each object goes, in reverse order of dependence
    assert "vhost_limit deleted" in admin("delete", "vhost_limit", f"vhost={vhost}", "name=max-connections")
    assert "operator_policy deleted" in admin("delete", "operator_policy", f"name=op-{tag}")
    assert "policy deleted" in admin("delete", "policy", f"name=p-{tag}")
    assert "binding deleted" in admin("delete", "binding", f"source={x}", "destination_type=queue",
                                      f"destination={name}", "properties_key=a.%23")
    assert "queue deleted" in admin("delete", "queue", f"name={name}")
    assert "exchange deleted" in admin("delete", "exchange", f"name={x}")
    assert "permission deleted" in admin("delete", "permission", f"vhost={vhost}", f"user={user}")
    assert "user deleted" in admin("delete", "user", f"name={user}")
    assert "vhost deleted" in admin("delete", "vhost", f"name={vhost}")
    assert mgmt.request("GET", f"/api/vhosts/{q(vhost)}").status == 404
    assert mgmt.request("GET", f"/api/users/{user}").status == 404
    # Deleting what is gone: RabbitMQ 3.10.8 answers 404 for a policy and an operator policy alike.
    gone = subprocess.run([RABBITMQADMIN, "-H", admin.host, "-P", admin.port, "-u", mgmt.username, "-p",
                           mgmt.password, "delete", "operator_policy", f"name=op-{tag}"],
                          capture_output=True, text=True, timeout=60)
    assert gone.returncode == 1 and "Not found" in gone.stderr
    assert len({a[:2] for a in admin.ran}) >= 38


def test_parameters(mgmt: Mgmt) -> None:
    leveret_only(mgmt)  # RabbitMQ answers 400 without the federation plugin enabled
    admin = Admin(mgmt)
    up = f"up-{uuid.uuid4().hex[:6]}"
    assert "parameter declared" in admin("declare", "parameter", "component=federation-upstream", f"name={up}",
                                         'value={"uri": "amqp://127.0.0.1:1"}')
    assert up in admin("list", "parameters")
    assert "parameter deleted" in admin("delete", "parameter", "component=federation-upstream", f"name={up}")


def test_download_and_operator_endpoints(mgmt: Mgmt) -> None:
    with urllib.request.urlopen(mgmt.base + "/cli/rabbitmqadmin", timeout=30) as resp:
        script = resp.read()
    assert script.startswith(b"#!") and b"rabbitmqadmin" in script
    node = mgmt.get("/api/overview")["node"]
    memory = mgmt.get(f"/api/nodes/{q(node)}/memory")["memory"]
    assert memory["total"]["rss"] > 0 and "queue_procs" in memory
    assert any(f["name"] == "quorum_queue" and f["state"] == "enabled" for f in mgmt.get("/api/feature-flags"))
    assert {p["name"] for p in mgmt.get("/api/global-parameters")} >= {"internal_cluster_id"}
    assert mgmt.get("/api/auth")["enable_uaa"] is False
    assert mgmt.get("/api/health/checks/certificate-expiration/1/months") == {"status": "ok"}
    assert mgmt.request("GET", "/api/health/checks/certificate-expiration/1/fortnights").status == 400
    assert mgmt.get("/api/health/checks/protocol-listener/amqp")["status"] == "ok"
    missing = mgmt.request("GET", "/api/health/checks/protocol-listener/stomp")
    assert missing.status == 503 and missing.body["missing"] == "stomp" and "amqp" in missing.body["protocols"]


def test_one_version_everywhere(mgmt: Mgmt) -> None:
    leveret_only(mgmt)
    from leveret import __version__

    overview = mgmt.get("/api/overview")
    assert overview["rabbitmq_version"] == overview["product_version"] == overview["management_version"]
    assert overview["product_version"] == __version__ and overview["product_name"] == "Leveret"
    assert overview["rabbitmq_api_version"].startswith("3.")
    conn = pika.BlockingConnection(pika.URLParameters(mgmt.amqp_url))
    try:
        version = conn._impl.server_properties["version"]  # type: ignore[attr-defined]
        assert (version.decode() if isinstance(version, bytes) else version) == __version__
    finally:
        conn.close()
    assert mgmt.get("/api/definitions")["rabbitmq_version"] == __version__


def test_stats_tools_read(mgmt: Mgmt) -> None:
    """The fields rabbitmqadmin and the console read, under the same traffic RabbitMQ shows them for."""
    name = f"stats-{uuid.uuid4().hex[:6]}"
    before = mgmt.get("/api/overview")["message_stats"]
    conn = pika.BlockingConnection(pika.URLParameters(mgmt.amqp_url))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare(name, durable=True)
        for i in range(4):
            ch.basic_publish("", name, b"x" * 100, pika.BasicProperties(delivery_mode=2, timestamp=1700000000 + i))
        ch.basic_publish("amq.direct", f"nowhere-{name}", b"y")  # unroutable: counted as published too
        method, _, _ = ch.basic_get(name)
        ch.basic_nack(method.delivery_tag, requeue=True)
        method, _, _ = ch.basic_get(name)
        assert method.redelivered
        ch.basic_ack(method.delivery_tag)
        deadline = time.monotonic() + 30  # a rate needs two samples (5 s apart)
        while True:
            overview = mgmt.get("/api/overview")
            stats = overview["message_stats"]
            if stats.get("publish", 0) - before.get("publish", 0) >= 5 and stats.get("get", 0) - before.get(
                    "get", 0) >= 2 or time.monotonic() > deadline:
                break
            conn.process_data_events(time_limit=0.5)
        assert stats["publish"] - before.get("publish", 0) >= 5
        assert stats["drop_unroutable"] - before.get("drop_unroutable", 0) >= 1
        assert stats["get"] - before.get("get", 0) >= 2 and stats["redeliver"] - before.get("redeliver", 0) >= 1
        for key in ("get_no_ack", "deliver", "deliver_no_ack", "confirm", "return_unroutable", "deliver_get", "ack"):
            assert key in stats and "rate" in stats[key + "_details"], key
        for key in ("connection_created", "channel_created", "queue_declared", "queue_created", "queue_deleted"):
            assert "rate" in overview["churn_rates"][key + "_details"], key
        assert "rate" in overview["queue_totals"]["messages_details"]
        queue = eventually(lambda: (lambda d: d if d.get("head_message_timestamp") else None)(
            mgmt.get(f"/api/queues/%2F/{q(name)}")))
        for key in ("messages_details", "messages_ready_details", "messages_unacknowledged_details"):
            assert "rate" in queue[key], key
        assert queue["head_message_timestamp"] == 1700000001
        assert queue["messages_persistent"] == 3 and queue["memory"] > 300
        assert "consumer_utilisation" in queue
        port = conn._impl._transport._sock.getsockname()[1]  # type: ignore[attr-defined]
        deadline = time.monotonic() + 20
        while True:
            mine = [c for c in mgmt.get("/api/connections") if c["peer_port"] == port]
            if mine or time.monotonic() > deadline:
                break
            conn.process_data_events(time_limit=0.5)
        assert mine[0]["recv_oct"] > 300 and mine[0]["send_oct"] > 100 and "rate" in mine[0]["recv_oct_details"]
        channels = [c for c in mgmt.get("/api/channels") if c["connection_details"]["peer_port"] == port]
        assert channels[0]["message_stats"]["publish"] == 5
        default = mgmt.get("/api/exchanges/%2F/amq.default")
        assert default["message_stats"]["publish_in"] >= 4
        ch.queue_delete(name)
    finally:
        conn.close()
    consumers = mgmt.get("/api/consumers")
    assert all("consumer_timeout" not in c for c in consumers)


def test_management_publishes_count_in_the_overview(mgmt: Mgmt) -> None:
    """RabbitMQ counts a publish over HTTP (rabbitmqadmin publish) as a channel's, routed or not."""
    leveret_only(mgmt)  # a shared RabbitMQ's counters move with everyone's traffic: nothing exact to check
    before = mgmt.get("/api/overview")["message_stats"]
    mgmt.ok("POST", "/api/exchanges/%2F/amq.direct/publish", {"routing_key": f"nowhere-{uuid.uuid4().hex}",
                                                            "payload": "x", "payload_encoding": "string",
                                                            "properties": {}})
    after = mgmt.get("/api/overview")["message_stats"]
    assert after["publish"] == before.get("publish", 0) + 1
    assert after["drop_unroutable"] == before.get("drop_unroutable", 0) + 1
