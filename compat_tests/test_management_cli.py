"""``leveret ctl`` and RabbitMQ's own ``rabbitmqadmin`` against a node's management API."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest

from compat_tests.mgmt_http import MGMT_ENV, Mgmt, leveret_only, q, start_mgmt, wait_http
from compat_tests.node_process import REPO_ROOT, NodeProcess, _python

RABBITMQADMIN = "/usr/bin/rabbitmqadmin"


@pytest.fixture(scope="module")
def mgmt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mgmt]:
    yield from start_mgmt(tmp_path_factory.mktemp("mgmt-cli"))


def ctl(mgmt: Mgmt, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEVERET_")}
    env.update(LEVERET_CTL_NODE=mgmt.host_port, LEVERET_CTL_USERNAME=mgmt.username,
               LEVERET_CTL_PASSWORD=mgmt.password)
    out = subprocess.run([_python(), "-m", "leveret", "ctl", *args], cwd=REPO_ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    if ok:
        assert out.returncode == 0, (args, out.stdout, out.stderr)
    return out


def rows(out: subprocess.CompletedProcess[str]) -> list[list[str]]:
    return [line.split("\t") for line in out.stdout.splitlines()[1:]]


def test_ctl_users_vhosts_permissions_apply_at_once(mgmt: Mgmt) -> None:
    leveret_only(mgmt)
    vhost, user = f"ctl-{uuid.uuid4().hex[:6]}", f"ctl-{uuid.uuid4().hex[:6]}"
    ctl(mgmt, "add_vhost", vhost)
    assert [vhost] in rows(ctl(mgmt, "list_vhosts"))
    ctl(mgmt, "add_user", user, "pw1")
    ctl(mgmt, "set_user_tags", user, "monitoring", "management")
    ctl(mgmt, "set_permissions", "-p", vhost, user, ".*", ".*", ".*")
    assert [user, ".*", ".*", ".*"] in rows(ctl(mgmt, "list_permissions", "-p", vhost))
    assert [user, "[monitoring, management]"] in rows(ctl(mgmt, "list_users"))
    params = pika.URLParameters(mgmt.amqp_url)
    login = pika.ConnectionParameters(host=params.host, port=params.port, virtual_host=vhost,
                                      credentials=pika.PlainCredentials(user, "pw1"))
    pika.BlockingConnection(login).close()  # no restart needed
    ctl(mgmt, "change_password", user, "pw2")
    with pytest.raises(pika.exceptions.AMQPError):
        pika.BlockingConnection(login)
    assert mgmt.as_user(user, "pw2").get("/api/whoami")["tags"] == ["monitoring", "management"]
    ctl(mgmt, "set_topic_permissions", "-p", vhost, user, "amq.topic", "^a", "^b")
    assert any(t["user"] == user and t["write"] == "^a" for t in mgmt.get("/api/topic-permissions"))
    ctl(mgmt, "clear_permissions", "-p", vhost, user)
    assert [r[0] for r in rows(ctl(mgmt, "list_permissions", "-p", vhost))] == [mgmt.username]  # the creator
    bad = ctl(mgmt, "set_permissions", "-p", vhost, user, "(", ".*", ".*", ok=False)
    assert bad.returncode == 1 and "400" in bad.stderr and "regular expression" in bad.stderr
    ctl(mgmt, "delete_user", user)
    ctl(mgmt, "delete_vhost", vhost)
    assert [vhost] not in rows(ctl(mgmt, "list_vhosts"))


def test_ctl_queues_policies_connections_definitions(mgmt: Mgmt, tmp_path: Path) -> None:
    leveret_only(mgmt)
    name = f"ctlq-{uuid.uuid4().hex[:6]}"
    conn = pika.BlockingConnection(pika.URLParameters(mgmt.amqp_url))
    ch = conn.channel()
    ch.queue_declare(name)
    for _ in range(3):
        ch.basic_publish("", name, b"x")
    ch.basic_consume(name, lambda *a: None, auto_ack=False)
    conn.process_data_events(time_limit=0.5)
    deadline = time.monotonic() + 20  # RabbitMQ's figures lag by its stats interval; Leveret's do not
    while True:
        listed = {r[0]: r for r in rows(ctl(mgmt, "list_queues", "name", "messages", "consumers"))}
        if listed[name] == [name, "3", "1"] or time.monotonic() > deadline:
            break
        conn.process_data_events(time_limit=0.5)
    assert listed[name] == [name, "3", "1"]
    assert any(r[0] == "guest" for r in rows(ctl(mgmt, "list_connections")))
    assert rows(ctl(mgmt, "list_channels"))
    assert any(r[0] == name for r in rows(ctl(mgmt, "list_consumers")))
    assert any(r[2] == name for r in rows(ctl(mgmt, "list_bindings")))
    assert ["amq.topic", "topic"] in rows(ctl(mgmt, "list_exchanges"))
    ctl(mgmt, "set_policy", "--priority", "4", "--apply-to", "queues", "cap", "^ctlq-", '{"max-length": 9}')
    assert ["/", "cap", "^ctlq-", "queues", '{"max-length":9}', "4"] in rows(ctl(mgmt, "list_policies"))
    ctl(mgmt, "clear_policy", "cap")
    assert rows(ctl(mgmt, "list_policies")) == []
    peer_port = str(conn._impl._transport._sock.getsockname()[1])  # type: ignore[attr-defined]
    ctl(mgmt, "close_connection", peer_port, "go away")
    with pytest.raises(pika.exceptions.ConnectionClosed) as closed:
        for _ in range(20):
            conn.process_data_events(time_limit=0.5)
    assert closed.value.reply_code == 320 and "go away" in closed.value.reply_text
    ctl(mgmt, "purge_queue", name)
    assert mgmt.get(f"/api/queues/%2F/{q(name)}")["messages"] == 0
    defs = tmp_path / "defs.json"
    ctl(mgmt, "export_definitions", str(defs))
    exported = json.loads(defs.read_text())
    assert any(x["name"] == name for x in exported["queues"])
    ctl(mgmt, "delete_queue", name)
    assert mgmt.request("GET", f"/api/queues/%2F/{q(name)}").status == 404
    ctl(mgmt, "import_definitions", str(defs))
    assert mgmt.get(f"/api/queues/%2F/{q(name)}")["name"] == name
    ctl(mgmt, "delete_queue", name)
    status = json.loads(ctl(mgmt, "status").stdout)
    assert status["node"] and status["listeners"]
    assert json.loads(ctl(mgmt, "cluster_status").stdout)["running_nodes"] == [status["node"]]


def test_ctl_unreachable_node_says_so() -> None:
    from tests.ports import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("LEVERET_")}
    out = subprocess.run([_python(), "-m", "leveret", "ctl", "--node", f"127.0.0.1:{free_port()}", "list_queues"],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "cannot reach" in out.stderr


@pytest.mark.skipif(not os.path.exists(RABBITMQADMIN),
                    reason=f"{RABBITMQADMIN} is not installed (Debian's rabbitmq-server package ships it)")
def test_rabbitmqadmin_unchanged(mgmt: Mgmt, tmp_path: Path) -> None:
    host, port = mgmt.host_port.rsplit(":", 1)
    x, name = f"adm-x-{uuid.uuid4().hex[:6]}", f"adm-q-{uuid.uuid4().hex[:6]}"

    def admin(*args: str) -> str:
        cmd = [RABBITMQADMIN, "-H", host, "-P", port, "-u", mgmt.username, "-p", mgmt.password, *args]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, (args, out.stdout, out.stderr)
        return out.stdout

    admin("declare", "exchange", f"name={x}", "type=topic", "durable=false")
    admin("declare", "queue", f"name={name}", "durable=false")
    admin("declare", "binding", f"source={x}", f"destination={name}", "routing_key=a.#")
    assert name in admin("list", "queues")
    assert x in admin("list", "exchanges", "name", "type")
    assert "a.#" in admin("list", "bindings")
    admin("publish", f"exchange={x}", "routing_key=a.b", "payload=hello")
    got = admin("-f", "raw_json", "get", f"queue={name}", "ackmode=ack_requeue_false")
    assert json.loads(got)[0]["payload"] == "hello"
    defs = tmp_path / "export.json"
    admin("export", str(defs))
    assert any(b["source"] == x for b in json.loads(defs.read_text())["bindings"])
    def bound() -> list[dict]:  # type: ignore[type-arg]
        return [b for b in json.loads(admin("-f", "raw_json", "list", "bindings"))
                if b["source"] == x and b["destination"] == name]

    assert [b["routing_key"] for b in bound()] == ["a.#"]
    admin("delete", "binding", f"source={x}", "destination_type=queue", f"destination={name}",
          "properties_key=a.%23")
    assert bound() == []
    admin("delete", "queue", f"name={name}")
    admin("delete", "exchange", f"name={x}")
    assert name not in admin("list", "queues")
    admin("import", str(defs))
    assert name in admin("list", "queues")
    assert [b["routing_key"] for b in bound()] == ["a.#"]
    conn = pika.BlockingConnection(pika.URLParameters(mgmt.amqp_url))
    client_port = conn._impl._transport._sock.getsockname()[1]  # type: ignore[attr-defined]
    deadline = time.monotonic() + 20
    while True:
        listed = json.loads(admin("-f", "raw_json", "list", "connections"))
        mine = [c for c in listed if c.get("peer_port") == client_port]
        if mine or time.monotonic() > deadline:
            break
        conn.process_data_events(time_limit=0.5)
    assert len(mine) == 1
    admin("close", "connection", f"name={mine[0]['name']}")
    with pytest.raises(pika.exceptions.ConnectionClosed):
        for _ in range(20):
            conn.process_data_events(time_limit=0.5)
    admin("delete", "queue", f"name={name}")
    admin("delete", "exchange", f"name={x}")


@pytest.mark.skipif(not os.environ.get(MGMT_ENV), reason=f"needs a real RabbitMQ: set {MGMT_ENV}")
def test_leveret_export_imports_into_rabbitmq(tmp_path: Path) -> None:
    """A Leveret node's definitions, imported into the RabbitMQ of LEVERET_TEST_MGMT_URL: users log in there."""
    rabbit = next(start_mgmt(tmp_path / "unused"))  # the external RabbitMQ
    node = NodeProcess(tmp_path / "data", tmp_path / "logs")
    node.start()
    try:
        leveret = Mgmt(f"http://127.0.0.1:{node.management_port}", "guest", "guest", node.url, leveret=True)
        wait_http(leveret)
        vhost, user = f"from-leveret-{uuid.uuid4().hex[:6]}", f"lev-{uuid.uuid4().hex[:6]}"
        leveret.ok("PUT", f"/api/vhosts/{vhost}", {})
        leveret.ok("PUT", f"/api/users/{user}", {"password": "moved", "tags": "management"})
        leveret.ok("PUT", f"/api/permissions/{vhost}/{user}", {"configure": ".*", "write": ".*", "read": ".*"})
        leveret.ok("PUT", f"/api/queues/{vhost}/work", {"durable": True, "arguments": {}})
        exported = leveret.get("/api/definitions")
    finally:
        node.terminate()
    rabbit.ok("POST", "/api/definitions", exported)
    try:
        assert rabbit.get(f"/api/queues/{q(vhost)}/work")["name"] == "work"
        params = pika.URLParameters(rabbit.amqp_url)
        pika.BlockingConnection(pika.ConnectionParameters(
            host=params.host, port=params.port, virtual_host=vhost,
            credentials=pika.PlainCredentials(user, "moved"))).close()
        assert rabbit.get("/api/whoami")["name"] == rabbit.username  # its own admin still logs in
    finally:
        rabbit.request("DELETE", f"/api/vhosts/{q(vhost)}")
        rabbit.request("DELETE", f"/api/users/{q(user)}")
