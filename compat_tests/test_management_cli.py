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
from harness.node import REPO_ROOT, NodeProcess, _python

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
    """A list's rows: after rabbitmqctl's informational line ("Listing ... ...") and the header."""
    lines = out.stdout.splitlines()
    if lines and lines[0].endswith("..."):
        lines = lines[1:]
    return [line.split("\t") for line in lines[1:]]


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
    assert bad.returncode == 65 and "400" in bad.stderr and "regular expression" in bad.stderr  # EX_DATAERR
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
    status = json.loads(ctl(mgmt, "--formatter", "json", "status").stdout)
    assert status["node"] and status["listeners"]
    assert json.loads(ctl(mgmt, "-q", "cluster_status").stdout)["running_nodes"] == [status["node"]]


def test_ctl_unreachable_node_says_so() -> None:
    from harness.ports import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("LEVERET_")}
    out = subprocess.run([_python(), "-m", "leveret", "ctl", "--node", f"127.0.0.1:{free_port()}", "list_queues"],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 69 and "cannot reach" in out.stderr  # EX_UNAVAILABLE, as rabbitmqctl


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


def test_rabbitmqctl_flags_columns_and_exit_codes(mgmt: Mgmt) -> None:
    """rabbitmqctl's global flags with its meaning, and 64 (EX_USAGE) for what it refuses."""
    leveret_only(mgmt)
    name = f"flags-{uuid.uuid4().hex[:6]}"
    mgmt.ok("PUT", f"/api/queues/%2F/{name}", {"durable": False})
    try:
        plain = ctl(mgmt, "list_queues", "name", "messages").stdout.splitlines()
        assert plain[0] == "Listing queues for vhost / ..." and plain[1] == "name\tmessages"
        assert f"{name}\t0" in plain
        quiet = ctl(mgmt, "-q", "list_queues", "name", "messages").stdout.splitlines()
        assert quiet[0] == "name\tmessages" and f"{name}\t0" in quiet  # -q keeps the header
        for flags in (["-s"], ["--silent"], ["-q", "--no-table-headers"]):
            out = ctl(mgmt, *flags, "list_queues", "name", "messages").stdout.splitlines()
            assert f"{name}\t0" in out and "name\tmessages" not in out and not any(x.endswith("...") for x in out)
        after = ctl(mgmt, "list_queues", "--no-table-headers", "-t", "10", "--online", "name").stdout.splitlines()
        assert name in after and "name" not in after  # flags after the command are flags, not columns
        assert ctl(mgmt, "list_queues", "name,messages", "-q").stdout.splitlines()[0] == "name\tmessages"
        as_json = json.loads(ctl(mgmt, "--formatter", "json", "list_queues", "name", "messages").stdout)
        assert {"name": name, "messages": 0} in as_json
        assert json.loads(ctl(mgmt, "--formatter=json", "-p", "/", "list_queues", "name").stdout)
        for bad in (["list_queues", "pid"], ["list_queues", "name", "nonsense"], ["list_channels", "pid"],
                    ["list_queues", "--bogus"], ["--bogus", "list_queues"], ["list_queues", "--if-empty"],
                    ["no_such_command"], ["list_queues", "-t", "soon"], ["--formatter", "xml", "list_queues"],
                    ["add_user", "only-a-name"]):
            out = ctl(mgmt, *bad, ok=False)
            assert out.returncode == 64, (bad, out.stdout, out.stderr)
            assert out.stdout == "" and "Traceback" not in out.stderr, bad
        # rabbitmqctl's other exit codes
        assert ctl(mgmt, "delete_user", f"nobody-{name}", ok=False).returncode == 67  # EX_NOUSER
        assert ctl(mgmt, "add_user", mgmt.username, "x", ok=False).returncode == 70  # exists: not overwritten
        assert mgmt.get("/api/whoami")["name"] == mgmt.username  # the password did not change
        assert ctl(mgmt, "clear_policy", f"none-{name}", ok=False).returncode == 69
    finally:
        mgmt.request("DELETE", f"/api/queues/%2F/{name}")


def test_rabbitmqctl_operator_commands(mgmt: Mgmt, tmp_path: Path) -> None:
    """The commands scripts, entrypoints and Kubernetes hooks call, run as rabbitmqctl command lines."""
    leveret_only(mgmt)
    user = f"ops-{uuid.uuid4().hex[:6]}"
    ctl(mgmt, "add_user", user, "s3cret")
    try:
        ctl(mgmt, "set_permissions", "-p", "/", user, "^a", "^b", "^c")
        perms = ctl(mgmt, "-q", "list_user_permissions", user).stdout.splitlines()
        assert perms == ["vhost\tconfigure\twrite\tread", "/\t^a\t^b\t^c"]
        ok = ctl(mgmt, "authenticate_user", user, "s3cret")
        assert ok.stdout.splitlines() == [f'Authenticating user "{user}" ...', "Success"]
        bad = ctl(mgmt, "authenticate_user", user, "wrong", ok=False)
        assert bad.returncode == 65 and "invalid credentials" in bad.stderr
    finally:
        ctl(mgmt, "delete_user", user)
    assert ctl(mgmt, "-t", "20", "await_startup").returncode == 0
    assert ctl(mgmt, "-q", "list_unresponsive_queues").stdout == ""
    flags = rows(ctl(mgmt, "list_feature_flags"))
    assert ["quorum_queue", "enabled"] in flags
    ctl(mgmt, "set_global_parameter", "cluster_name", '"ops-cluster"')
    assert ["cluster_name", '"ops-cluster"'] in rows(ctl(mgmt, "list_global_parameters"))
    assert mgmt.get("/api/overview")["cluster_name"] == "ops-cluster"
    assert ctl(mgmt, "set_global_parameter", "other", '"x"', ok=False).returncode == 65
    env = json.loads(ctl(mgmt, "--formatter", "json", "environment").stdout)
    assert env["management_port"] == int(mgmt.host_port.rsplit(":", 1)[1]) and env["default_pass"] == "********"
    ctl(mgmt, "set_vm_memory_high_watermark", "absolute", "3GB")
    node = mgmt.get("/api/nodes")[0]
    assert node["mem_limit"] == 3 * 1000**3
    ctl(mgmt, "set_vm_memory_high_watermark", "0.4")
    assert ctl(mgmt, "set_vm_memory_high_watermark", "2.5", ok=False).returncode == 65
    ctl(mgmt, "set_disk_free_limit", "60MB")
    assert mgmt.get("/api/nodes")[0]["disk_free_limit"] == 60 * 1000**2
    ctl(mgmt, "set_disk_free_limit", "mem_relative", "0.001")
    assert ctl(mgmt, "set_disk_free_limit", "lots", ok=False).returncode == 65
    ctl(mgmt, "set_disk_free_limit", "50MB")
    assert "Rotating logs" in ctl(mgmt, "rotate_logs").stdout
    assert ctl(mgmt, "node_health_check").stdout.strip().endswith("Health check passed")
    report = ctl(mgmt, "report").stdout
    assert "Listing queues for vhost / ..." in report and '"product_name": "Leveret"' in report

    vhost = f"lim-{uuid.uuid4().hex[:6]}"
    ctl(mgmt, "add_vhost", vhost)
    try:
        ctl(mgmt, "set_vhost_limits", "-p", vhost, '{"max-connections": 10, "max-queues": 5}')
        # rabbitmqctl prints the limits object alone, after its informational line
        assert ctl(mgmt, "list_vhost_limits", "-p", vhost).stdout.splitlines() == [
            f'Listing limits for vhost "{vhost}" ...', '{"max-connections":10,"max-queues":5}']
        assert ctl(mgmt, "-q", "list_vhost_limits", "-p", vhost).stdout == '{"max-connections":10,"max-queues":5}\n'
        assert ctl(mgmt, "-q", "list_vhost_limits").stdout == ""  # "/" has none
        listed = ctl(mgmt, "list_vhost_limits", "--global").stdout.splitlines()
        assert listed[:2] == ["Listing limits for all vhosts ...", "vhost\tlimits"]
        assert f'{vhost}\t{{"max-connections":10,"max-queues":5}}' in listed
        assert ctl(mgmt, "list_vhost_limits", "-p", f"no-{vhost}", ok=False).returncode == 65
    finally:
        ctl(mgmt, "delete_vhost", vhost)


def test_leveret_rabbitmqctl_entry_point(mgmt: Mgmt) -> None:
    """The entry point pyproject names takes rabbitmqctl's command line unchanged (-n NAME@HOST too)."""
    import tomllib

    leveret_only(mgmt)
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["leveret-rabbitmqctl"] == "leveret.cli.ctl:rabbitmqctl_main"
    assert scripts["leveret-rabbitmq-diagnostics"] == "leveret.cli.diagnostics:rabbitmq_diagnostics_main"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEVERET_")}
    env.update(LEVERET_CTL_NODE=mgmt.host_port)
    host = mgmt.host_port.rsplit(":", 1)[0]
    cmd = [_python(), "-c", "import sys; from leveret.cli.ctl import rabbitmqctl_main; sys.exit(rabbitmqctl_main())",
           "-n", f"rabbit@{host}", "-q", "list_vhosts", "name"]
    out = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.splitlines()[:2] == ["name", "/"], out
