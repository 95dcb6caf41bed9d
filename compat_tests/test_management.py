"""The management HTTP API with plain HTTP against a real node (or a RabbitMQ: LEVERET_TEST_MGMT_URL)."""

from __future__ import annotations

import base64
import hashlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest

from compat_tests.mgmt_http import Mgmt, leveret_only, q, start_mgmt, wait_http
from harness.node import NodeProcess


@pytest.fixture(scope="module")
def mgmt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mgmt]:
    yield from start_mgmt(tmp_path_factory.mktemp("mgmt"))


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def rabbit_hash(password: str, salt: bytes = b"\x90\x8d\xc6\x0a") -> str:
    """RabbitMQ's rabbit_password_hashing_sha256: base64(salt + SHA-256(salt + password))."""
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


def amqp_params(mgmt: Mgmt, user: str, password: str, vhost: str) -> pika.ConnectionParameters:
    params = pika.URLParameters(mgmt.amqp_url)
    return pika.ConnectionParameters(host=params.host, port=params.port, virtual_host=vhost,
                                     credentials=pika.PlainCredentials(user, password))


def wait_for(check, timeout: float = 10.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.1)


def test_overview_nodes_whoami(mgmt: Mgmt) -> None:
    overview = mgmt.get("/api/overview")
    for key in ("management_version", "rabbitmq_version", "cluster_name", "node", "queue_totals", "object_totals",
                "listeners", "message_stats"):
        assert key in overview, key
    assert {"amqp", "http"} <= {listener["protocol"] for listener in overview["listeners"]}
    nodes = mgmt.get("/api/nodes")
    assert [n["name"] for n in nodes] == [overview["node"]]
    assert nodes[0]["running"] is True
    assert mgmt.get("/api/whoami")["name"] == "guest"


def test_no_credentials_or_wrong_password_is_401(mgmt: Mgmt) -> None:
    reply = mgmt.as_user("guest", "wrong").request("GET", "/api/overview")
    assert reply.status == 401 and reply.body["error"] == "not_authorized"
    assert reply.headers.get("www-authenticate", "").startswith("Basic")


def test_vhost_user_permissions_and_amqp_login(mgmt: Mgmt) -> None:
    vhost, user = unique("vh"), unique("user")
    assert mgmt.ok("PUT", f"/api/vhosts/{q(vhost)}", {}).status == 201
    assert mgmt.ok("PUT", f"/api/vhosts/{q(vhost)}", {}).status == 204
    assert vhost in {v["name"] for v in mgmt.get("/api/vhosts")}
    # The user who made it may use it at once (RabbitMQ grants it full permissions).
    assert {(p["user"], p["configure"]) for p in mgmt.get(f"/api/vhosts/{q(vhost)}/permissions")} == {("guest", ".*")}
    mgmt.ok("PUT", f"/api/users/{q(user)}", {"password": "s3cret", "tags": "management"})
    assert mgmt.get(f"/api/users/{q(user)}")["tags"] == ["management"]
    mgmt.ok("PUT", f"/api/permissions/{q(vhost)}/{q(user)}", {"configure": ".*", "write": ".*", "read": ".*"})
    perm = mgmt.get(f"/api/permissions/{q(vhost)}/{q(user)}")
    assert (perm["user"], perm["vhost"], perm["configure"]) == (user, vhost, ".*")
    # Applies at once: the new user opens the new vhost over AMQP with no restart.
    conn = pika.BlockingConnection(amqp_params(mgmt, user, "s3cret", vhost))
    conn.close()
    mgmt.ok("DELETE", f"/api/permissions/{q(vhost)}/{q(user)}")
    with pytest.raises(pika.exceptions.AMQPError):
        pika.BlockingConnection(amqp_params(mgmt, user, "s3cret", vhost))
    mgmt.ok("DELETE", f"/api/users/{q(user)}")
    assert mgmt.request("GET", f"/api/users/{q(user)}").status == 404
    guest = pika.BlockingConnection(amqp_params(mgmt, mgmt.username, mgmt.password, vhost))
    mgmt.ok("DELETE", f"/api/vhosts/{q(vhost)}")
    assert mgmt.request("GET", f"/api/vhosts/{q(vhost)}").status == 404
    with pytest.raises(pika.exceptions.ConnectionClosed) as closed:  # its connections go with it
        for _ in range(20):
            guest.process_data_events(time_limit=0.5)
    assert closed.value.reply_code == 320


def test_queue_lifecycle_counts_and_stats(mgmt: Mgmt) -> None:
    name = unique("q")
    path = f"/api/queues/%2F/{q(name)}"
    assert mgmt.ok("PUT", path, {"durable": False, "auto_delete": False, "arguments": {}}).status == 201
    for i in range(3):
        reply = mgmt.ok("POST", "/api/exchanges/%2F/amq.default/publish",
                        {"properties": {}, "routing_key": name, "payload": f"m{i}", "payload_encoding": "string"})
        assert reply.body == {"routed": True}
    # RabbitMQ's figures lag by its stats interval (5 s): wait for them.
    info = wait_for(lambda: (i := mgmt.get(path)).get("messages") == 3 and "consumers" in i and
                    i.get("message_stats", {}).get("publish") == 3 and i, timeout=20)
    assert info["messages_ready"] == 3 and info["messages_unacknowledged"] == 0 and info["consumers"] == 0
    assert info["message_stats"]["publish"] == 3
    assert "rate" in info["message_stats"]["publish_details"]
    got = mgmt.ok("POST", f"{path}/get", {"count": 2, "ackmode": "ack_requeue_false", "encoding": "auto"}).body
    assert [m["payload"] for m in got] == ["m0", "m1"]
    assert got[0]["routing_key"] == name and got[0]["payload_encoding"] == "string"
    got = mgmt.ok("POST", f"{path}/get", {"count": 1, "ackmode": "ack_requeue_true", "encoding": "auto"}).body
    assert got[0]["payload"] == "m2"
    again = mgmt.ok("POST", f"{path}/get", {"count": 1, "ackmode": "ack_requeue_true", "encoding": "auto"}).body
    assert again[0]["payload"] == "m2" and again[0]["redelivered"] is True
    info = wait_for(lambda: (i := mgmt.get(path)).get("messages") == 1 and
                    i.get("message_stats", {}).get("deliver_get") == 4 and i, timeout=20)
    assert info["message_stats"]["deliver_get"] == 4
    assert info["message_stats"]["redeliver"] == 1
    mgmt.ok("DELETE", f"{path}/contents")
    wait_for(lambda: mgmt.get(path).get("messages") == 0)
    mgmt.ok("DELETE", path)
    assert mgmt.request("GET", path).status == 404


def test_exchange_bindings_and_publish(mgmt: Mgmt) -> None:
    x, x2, name = unique("x"), unique("x2"), unique("q")
    mgmt.ok("PUT", f"/api/exchanges/%2F/{q(x)}", {"type": "topic", "durable": False})
    mgmt.ok("PUT", f"/api/exchanges/%2F/{q(x2)}", {"type": "fanout", "durable": False})
    mgmt.ok("PUT", f"/api/queues/%2F/{q(name)}", {"durable": False})
    assert mgmt.get(f"/api/exchanges/%2F/{q(x)}")["type"] == "topic"
    reply = mgmt.ok("POST", f"/api/bindings/%2F/e/{q(x)}/q/{q(name)}", {"routing_key": "a.#", "arguments": {}})
    assert reply.status == 201
    mgmt.ok("POST", f"/api/bindings/%2F/e/{q(x2)}/e/{q(x)}", {"routing_key": "", "arguments": {}})
    listed = mgmt.get(f"/api/bindings/%2F/e/{q(x)}/q/{q(name)}")
    assert [(b["source"], b["destination"], b["routing_key"]) for b in listed] == [(x, name, "a.#")]
    props = listed[0]["properties_key"]
    assert mgmt.get(f"/api/bindings/%2F/e/{q(x)}/q/{q(name)}/{q(props)}")["routing_key"] == "a.#"
    # Through the exchange-to-exchange binding and the topic binding.
    assert mgmt.ok("POST", f"/api/exchanges/%2F/{q(x2)}/publish",
                   {"properties": {"delivery_mode": 1}, "routing_key": "a.b", "payload": "aGk=",
                    "payload_encoding": "base64"}).body == {"routed": True}
    unrouted = {"properties": {}, "routing_key": "b", "payload": "x", "payload_encoding": "string"}
    assert mgmt.ok("POST", f"/api/exchanges/%2F/{q(x)}/publish", unrouted).body == {"routed": False}
    got = mgmt.ok("POST", f"/api/queues/%2F/{q(name)}/get", {"count": 1, "ackmode": "ack_requeue_false",
                                                            "encoding": "auto"}).body
    assert got[0]["payload"] == "hi" and got[0]["exchange"] == x2
    assert any(b["destination"] == name for b in mgmt.get("/api/bindings/%2F"))
    mgmt.ok("DELETE", f"/api/bindings/%2F/e/{q(x)}/q/{q(name)}/{q(props)}")
    assert mgmt.get(f"/api/bindings/%2F/e/{q(x)}/q/{q(name)}") == []
    mgmt.ok("DELETE", f"/api/exchanges/%2F/{q(x)}")
    mgmt.ok("DELETE", f"/api/exchanges/%2F/{q(x2)}")
    assert mgmt.request("GET", f"/api/exchanges/%2F/{q(x)}").status == 404
    mgmt.ok("DELETE", f"/api/queues/%2F/{q(name)}")


def test_connections_channels_consumers_and_close(mgmt: Mgmt) -> None:
    name = unique("q")
    params = pika.URLParameters(mgmt.amqp_url)
    params.client_properties = {"connection_name": name}
    conn = pika.BlockingConnection(params)
    ch = conn.channel()
    ch.queue_declare(name, auto_delete=True)
    tag = ch.basic_consume(name, lambda *a: None)

    def mine() -> list[dict]:  # type: ignore[type-arg]
        return [c for c in mgmt.get("/api/connections")
                if c.get("client_properties", {}).get("connection_name") == name]

    found = wait_for(lambda: [c for c in mine() if c.get("channels") == 1])[0]
    assert found["state"] == "running" and found["user"] == "guest" and found["vhost"] == "/"
    assert wait_for(lambda: any(c["connection_details"]["name"] == found["name"] for c in mgmt.get("/api/channels")))
    consumers = wait_for(lambda: [c for c in mgmt.get("/api/consumers/%2F") if c["consumer_tag"] == tag])
    assert consumers[0]["queue"]["name"] == name and consumers[0]["ack_required"] is True
    assert wait_for(lambda: mgmt.get(f"/api/queues/%2F/{q(name)}").get("consumers") == 1)
    reply = mgmt.request("DELETE", f"/api/connections/{q(found['name'])}", headers={"X-Reason": "maintenance"})
    assert reply.status == 204
    with pytest.raises(pika.exceptions.ConnectionClosed) as info:
        conn.process_data_events(time_limit=5)
        conn.process_data_events(time_limit=5)
    assert info.value.reply_code == 320 and "maintenance" in info.value.reply_text
    wait_for(lambda: not mine())


def test_paging_sorting_columns_and_name_filter(mgmt: Mgmt) -> None:
    prefix = unique("page")
    for i in range(7):
        mgmt.ok("PUT", f"/api/queues/%2F/{prefix}-{i}", {"durable": False})
    page = mgmt.get(f"/api/queues/%2F?page=2&page_size=3&name={prefix}&sort=name&sort_reverse=true"
                    "&columns=name,messages")
    assert page["filtered_count"] == 7 and page["page"] == 2 and page["page_count"] == 3
    assert page["item_count"] == 3 and page["page_size"] == 3
    assert [i["name"] for i in page["items"]] == [f"{prefix}-{i}" for i in (3, 2, 1)]
    # Only the columns asked for (RabbitMQ leaves out "messages" until its first stats of a queue).
    assert all("name" in i and set(i) <= {"name", "messages"} for i in page["items"])
    regex = mgmt.get(f"/api/queues/%2F?page=1&page_size=100&use_regex=true&name=^{prefix}-[0-2]$")
    assert sorted(i["name"] for i in regex["items"]) == [f"{prefix}-{i}" for i in range(3)]
    nested = mgmt.get(f"/api/queues/%2F/{prefix}-0?columns=name,message_stats.publish")
    assert nested["name"] == f"{prefix}-0" or "name" in nested  # RabbitMQ ignores columns on one object
    for i in range(7):
        mgmt.ok("DELETE", f"/api/queues/%2F/{prefix}-{i}")


def test_bad_input_is_400_with_rabbitmq_body_and_nothing_applied(mgmt: Mgmt) -> None:
    name = unique("bad")
    reply = mgmt.request("PUT", f"/api/queues/%2F/{name}", raw=b'{"durable": tru')
    assert reply.status == 400 and reply.body["error"] == "bad_request" and "reason" in reply.body
    assert mgmt.request("GET", f"/api/queues/%2F/{name}").status == 404
    reply = mgmt.request("PUT", "/api/policies/%2F/" + name, {"pattern": "(", "definition": {"max-length": 1}})
    assert reply.status == 400 and reply.body["error"] == "bad_request"
    assert mgmt.request("GET", "/api/policies/%2F/" + name).status == 404
    reply = mgmt.request("GET", "/api/queues?page=1&use_regex=true&name=(")
    assert reply.status == 400
    for props in ({"expiration": "soon"}, {"user_id": "someone-else"}, {"delivery_mode": "two"}):
        reply = mgmt.request("POST", "/api/exchanges/%2F/amq.default/publish",
                             {"routing_key": name, "payload": "x", "payload_encoding": "string",
                              "properties": props})
        assert reply.status == 400 and reply.body["error"] == "bad_request", props
    if mgmt.leveret:
        # Leveret refuses unknown fields (RabbitMQ ignores some of them).
        reply = mgmt.request("PUT", f"/api/queues/%2F/{name}", {"durable": False, "durible": True})
        assert reply.status == 400 and "durible" in reply.body["reason"]
        assert mgmt.request("GET", f"/api/queues/%2F/{name}").status == 404
        user = unique("u")
        mgmt.ok("PUT", f"/api/users/{user}", {"password": "p", "tags": ""})
        reply = mgmt.request("PUT", f"/api/permissions/%2F/{user}", {"configure": "[", "write": ".*", "read": ".*"})
        assert reply.status == 400
        assert all(p["user"] != user for p in mgmt.get("/api/permissions"))
        mgmt.ok("DELETE", f"/api/users/{user}")
        # A definitions file with one bad item applies nothing at all.
        vhost = unique("defs")
        bad = {"vhosts": [{"name": vhost}], "queues": [{"name": "fine", "vhost": vhost, "durable": True,
                                                        "auto_delete": False, "arguments": {}}],
               "policies": [{"vhost": vhost, "name": "p", "pattern": "*bad", "definition": {"max-length": 1},
                             "apply-to": "queues", "priority": 0}]}
        reply = mgmt.request("POST", "/api/definitions", bad)
        assert reply.status == 400 and reply.body["error"] == "bad_request"
        assert mgmt.request("GET", f"/api/vhosts/{vhost}").status == 404
        # An existing queue declared differently is refused before the new exchange is made.
        existing, x = unique("exists"), unique("newx")
        mgmt.ok("PUT", f"/api/queues/%2F/{existing}", {"durable": False})
        clash = {"exchanges": [{"name": x, "vhost": "/", "type": "direct", "durable": False, "auto_delete": False,
                                "internal": False, "arguments": {}}],
                 "queues": [{"name": existing, "vhost": "/", "durable": True, "auto_delete": False,
                             "arguments": {}}]}
        reply = mgmt.request("POST", "/api/definitions", clash)
        assert reply.status == 400 and "inequivalent" in reply.body["reason"]
        assert mgmt.request("GET", f"/api/exchanges/%2F/{x}").status == 404
        mgmt.ok("DELETE", f"/api/queues/%2F/{existing}")


def test_tags_decide_http_access(mgmt: Mgmt) -> None:
    users = {tag: unique(tag or "none") for tag in ("", "management", "monitoring", "policymaker")}
    for tag, user in users.items():
        mgmt.ok("PUT", f"/api/users/{user}", {"password": "pw", "tags": tag})
        mgmt.ok("PUT", f"/api/permissions/%2F/{user}", {"configure": ".*", "write": ".*", "read": ".*"})
    as_ = {tag: mgmt.as_user(user, "pw") for tag, user in users.items()}
    try:
        assert as_[""].request("GET", "/api/overview").status == 401
        assert as_["management"].request("GET", "/api/overview").status == 200
        assert as_["management"].request("GET", "/api/queues/%2F").status == 200
        assert as_["management"].request("GET", "/api/users").status == 401
        assert as_["management"].request("GET", "/api/nodes").status == 401
        assert as_["monitoring"].request("GET", "/api/nodes").status == 200
        assert as_["monitoring"].request("GET", "/api/connections").status == 200
        assert as_["monitoring"].request("PUT", "/api/vhosts/nope", {}).status == 401
        policy = unique("pol")
        body = {"pattern": "^nothing$", "definition": {"max-length": 5}, "apply-to": "queues"}
        assert as_["management"].request("PUT", f"/api/policies/%2F/{policy}", body).status == 401
        assert as_["policymaker"].request("PUT", f"/api/policies/%2F/{policy}", body).status == 201
        assert as_["policymaker"].request("DELETE", f"/api/policies/%2F/{policy}").status == 204
    finally:
        for user in users.values():
            mgmt.request("DELETE", f"/api/users/{user}")


def test_policies_operator_policies_and_parameters(mgmt: Mgmt) -> None:
    name = unique("pol")
    body = {"pattern": "^lim-", "definition": {"max-length": 2}, "priority": 3, "apply-to": "queues"}
    assert mgmt.ok("PUT", f"/api/policies/%2F/{name}", body).status == 201
    got = mgmt.get(f"/api/policies/%2F/{name}")
    assert (got["pattern"], got["definition"], got["priority"], got["apply-to"]) == \
        ("^lim-", {"max-length": 2}, 3, "queues")
    assert name in {p["name"] for p in mgmt.get("/api/policies")}
    mgmt.ok("DELETE", f"/api/policies/%2F/{name}")
    assert mgmt.request("GET", f"/api/policies/%2F/{name}").status == 404
    op = unique("op")
    mgmt.ok("PUT", f"/api/operator-policies/%2F/{op}", {"pattern": ".*", "definition": {"max-length": 1000},
                                                         "apply-to": "queues"})
    assert op in {p["name"] for p in mgmt.get("/api/operator-policies/%2F")}
    mgmt.ok("DELETE", f"/api/operator-policies/%2F/{op}")
    assert isinstance(mgmt.get("/api/parameters"), list)


def test_get_with_reject_dead_letters(mgmt: Mgmt) -> None:
    src, dlq = unique("src"), unique("dlq")
    mgmt.ok("PUT", f"/api/queues/%2F/{dlq}", {"durable": False})
    mgmt.ok("PUT", f"/api/queues/%2F/{src}", {"durable": False, "arguments": {
        "x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq}})
    mgmt.ok("POST", "/api/exchanges/%2F/amq.default/publish", {"routing_key": src, "payload": "bad",
                                                              "payload_encoding": "string", "properties": {}})
    got = mgmt.ok("POST", f"/api/queues/%2F/{src}/get", {"count": 1, "ackmode": "reject_requeue_false",
                                                         "encoding": "auto"}).body
    assert got[0]["payload"] == "bad"
    assert wait_for(lambda: mgmt.get(f"/api/queues/%2F/{dlq}").get("messages") == 1)
    assert wait_for(lambda: mgmt.get(f"/api/queues/%2F/{src}").get("messages") == 0)
    for name in (src, dlq):
        mgmt.ok("DELETE", f"/api/queues/%2F/{name}")


def test_health_checks_and_aliveness(mgmt: Mgmt) -> None:
    assert mgmt.get("/api/health/checks/alarms")["status"] == "ok"
    assert mgmt.get("/api/health/checks/local-alarms")["status"] == "ok"
    assert mgmt.get("/api/health/checks/virtual-hosts")["status"] == "ok"
    amqp_port = pika.URLParameters(mgmt.amqp_url).port
    assert mgmt.get(f"/api/health/checks/port-listener/{amqp_port}")["status"] == "ok"
    reply = mgmt.request("GET", "/api/health/checks/port-listener/1")
    assert reply.status == 503 and reply.body["status"] == "failed"
    assert mgmt.get("/api/aliveness-test/%2F") == {"status": "ok"}


def test_rabbitmq_definitions_import_and_users_log_in_with_rabbitmq_passwords(mgmt: Mgmt) -> None:
    """A file in RabbitMQ's export format (3.x): its users log in over AMQP with their RabbitMQ passwords."""
    vhost, user, x, name = unique("imported"), unique("alice"), unique("orders"), unique("orders-q")
    definitions = {
        "rabbit_version": "3.12.13", "rabbitmq_version": "3.12.13", "product_name": "RabbitMQ",
        "product_version": "3.12.13",
        "users": [{"name": user, "password_hash": rabbit_hash("rabbit-pw"),
                   "hashing_algorithm": "rabbit_password_hashing_sha256", "tags": ["management"], "limits": {}}],
        "vhosts": [{"name": vhost, "description": "imported", "tags": [], "metadata": {"description": "imported",
                                                                                         "tags": []}}],
        "permissions": [{"user": user, "vhost": vhost, "configure": ".*", "write": ".*", "read": ".*"}],
        "topic_permissions": [], "parameters": [], "global_parameters": [{"name": "cluster_name",
                                                                          "value": "rabbit@old"}],
        "policies": [{"vhost": vhost, "name": "cap", "pattern": "^orders", "apply-to": "queues",
                      "definition": {"max-length": 100}, "priority": 1}],
        "queues": [{"name": name, "vhost": vhost, "durable": True, "auto_delete": False,
                    "arguments": {"x-queue-type": "classic"}}],
        "exchanges": [{"name": x, "vhost": vhost, "type": "topic", "durable": True, "auto_delete": False,
                       "internal": False, "arguments": {}}],
        "bindings": [{"source": x, "vhost": vhost, "destination": name, "destination_type": "queue",
                      "routing_key": "order.*", "arguments": {}}],
    }
    assert mgmt.ok("POST", "/api/definitions", definitions).status in (200, 201, 204)
    conn = pika.BlockingConnection(amqp_params(mgmt, user, "rabbit-pw", vhost))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.basic_publish(x, "order.new", b"first")
    method, _, body = ch.basic_get(name, auto_ack=True)
    assert body == b"first"
    conn.close()
    with pytest.raises(pika.exceptions.AMQPError):
        pika.BlockingConnection(amqp_params(mgmt, user, "wrong", vhost))
    assert mgmt.as_user(user, "rabbit-pw").get("/api/whoami")["name"] == user
    exported = mgmt.get("/api/definitions")
    if not mgmt.leveret:
        mine = [u for u in exported["users"] if u["name"] == user][0]
        assert (mine["password_hash"], mine["hashing_algorithm"]) == (rabbit_hash("rabbit-pw"),
                                                                       "rabbit_password_hashing_sha256")
    else:
        # The first login re-hashed RabbitMQ's single SHA-256 with the node's argon2id
        # (docs/SECURITY.md): RabbitMQ cannot check that, so the user moves to leveret_users.
        assert user not in [u["name"] for u in exported["users"]]
        mine = [u for u in exported["leveret_users"] if u["name"] == user][0]
        assert mine["hashing_algorithm"] == "leveret_phc" and mine["password_hash"].startswith("$argon2id$")
    assert any(b["source"] == x and b["destination"] == name for b in exported["bindings"])
    assert any(p["name"] == "cap" and p["vhost"] == vhost for p in exported["policies"])
    mgmt.ok("DELETE", f"/api/vhosts/{q(vhost)}")
    mgmt.ok("DELETE", f"/api/users/{q(user)}")


def test_native_channels_of_a_queue(mgmt: Mgmt) -> None:
    leveret_only(mgmt)
    name = unique("nq")
    path = f"/api/queues/%2F/{q(name)}/channels"
    mgmt.ok("PUT", f"/api/queues/%2F/{q(name)}", {"durable": False})
    assert [c["name"] for c in mgmt.get(path)] == ["default"]
    reply = mgmt.request("POST", path, {"name": "eu", "topic": "eu.*"})
    assert reply.status == 201 and reply.body["topic"] == "eu.*"
    assert mgmt.request("POST", path, {"name": "eu", "topic": "x"}).status == 400
    mgmt.ok("POST", f"/api/bindings/%2F/e/amq.topic/q/{q(name)}", {"routing_key": "#", "arguments": {}})
    for key in ("eu.fr", "us.ny"):
        mgmt.ok("POST", "/api/exchanges/%2F/amq.topic/publish", {"routing_key": key, "payload": key,
                                                                "properties": {}})
    # The queue's default channel sees both messages; "eu" only the one its topic filter passes.
    assert mgmt.get(f"{path}/eu")["messages_ready"] == 1
    assert mgmt.get(f"{path}/default")["messages_ready"] == 2
    mgmt.ok("DELETE", f"{path}/eu")
    assert [c["name"] for c in mgmt.get(path)] == ["default"]
    assert mgmt.request("DELETE", f"{path}/default").status == 400
    mgmt.ok("DELETE", f"/api/queues/%2F/{q(name)}")


def test_export_then_import_brings_everything_back(mgmt: Mgmt) -> None:
    vhost, user, x, name = unique("round"), unique("ru"), unique("rx"), unique("rq")
    mgmt.ok("PUT", f"/api/vhosts/{vhost}", {})
    mgmt.ok("PUT", f"/api/users/{user}", {"password": "round-pw", "tags": "management"})
    mgmt.ok("PUT", f"/api/permissions/{vhost}/{user}", {"configure": "^r", "write": ".*", "read": ".*"})
    mgmt.ok("PUT", f"/api/exchanges/{vhost}/{x}", {"type": "topic", "durable": True})
    mgmt.ok("PUT", f"/api/queues/{vhost}/{name}", {"durable": True, "arguments": {"x-max-length": 10}})
    mgmt.ok("POST", f"/api/bindings/{vhost}/e/{x}/q/{name}", {"routing_key": "r.*", "arguments": {}})
    mgmt.ok("PUT", f"/api/policies/{vhost}/cap", {"pattern": "^r", "definition": {"max-length": 5},
                                                  "apply-to": "queues"})
    exported = mgmt.get("/api/definitions")
    mine = [u for u in exported["users"] + exported.get("leveret_users", []) if u["name"] == user]
    # RabbitMQ hashes with one SHA-256; Leveret with argon2id, which only Leveret re-imports.
    assert len(mine) == 1 and mine[0]["hashing_algorithm"] == (
        "leveret_phc" if mgmt.leveret else "rabbit_password_hashing_sha256")
    mgmt.ok("DELETE", f"/api/vhosts/{vhost}")
    mgmt.ok("DELETE", f"/api/users/{user}")
    mgmt.ok("POST", "/api/definitions", exported)
    assert mgmt.get(f"/api/queues/{vhost}/{name}")["arguments"] == {"x-max-length": 10}
    assert [b["routing_key"] for b in mgmt.get(f"/api/bindings/{vhost}/e/{x}/q/{name}")] == ["r.*"]
    assert mgmt.get(f"/api/policies/{vhost}/cap")["definition"] == {"max-length": 5}
    assert mgmt.get(f"/api/permissions/{vhost}/{user}")["configure"] == "^r"
    pika.BlockingConnection(amqp_params(mgmt, user, "round-pw", vhost)).close()
    mgmt.ok("DELETE", f"/api/vhosts/{vhost}")
    mgmt.ok("DELETE", f"/api/users/{user}")


def test_leveret_export_keeps_users_rabbitmq_cannot_check_apart(mgmt: Mgmt) -> None:
    leveret_only(mgmt)
    exported = mgmt.get("/api/definitions")
    # The default user has the node's argon2id record: under leveret_users, which RabbitMQ ignores,
    # so importing this file into a RabbitMQ does not replace its guest with an unusable one.
    assert "guest" not in {u["name"] for u in exported["users"]}
    assert {u["name"]: u["hashing_algorithm"] for u in exported["leveret_users"]}["guest"] == "leveret_phc"
    assert all(p["user"] != "guest" for p in exported["permissions"])
    assert any(p["user"] == "guest" for p in exported["leveret_permissions"])


def test_alarm_health_checks_fail_while_the_memory_alarm_is_set(tmp_path: Path) -> None:
    """A node with a tiny watermark: once queued bodies pass it, the alarm checks answer 503."""
    node = NodeProcess(tmp_path / "data", tmp_path / "logs", ["--memory-high-watermark", "4096"])
    node.start()
    try:
        mgmt = Mgmt(f"http://127.0.0.1:{node.management_port}", "guest", "guest", node.url, leveret=True)
        wait_http(mgmt)
        assert mgmt.get("/api/health/checks/alarms") == {"status": "ok"}
        mgmt.ok("PUT", "/api/queues/%2F/fill", {"durable": False})
        mgmt.ok("POST", "/api/exchanges/%2F/amq.default/publish",
                {"routing_key": "fill", "payload": "x" * 10_000, "payload_encoding": "string", "properties": {}})
        reply = wait_for(lambda: (r := mgmt.request("GET", "/api/health/checks/local-alarms")).status == 503 and r)
        assert reply.body["status"] == "failed"
        assert mgmt.get("/api/nodes")[0]["mem_alarm"] is True
        mgmt.ok("DELETE", "/api/queues/%2F/fill/contents")
        wait_for(lambda: mgmt.request("GET", "/api/health/checks/alarms").status == 200)
    finally:
        node.terminate()
