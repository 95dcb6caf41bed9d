"""In a cluster, a node's management API answers for queues other nodes own."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pika
import pytest

from compat_tests.mgmt_http import cluster_api as api
from harness.cluster import Cluster
from harness.etcd import EtcdServer
from harness.etcd import etcd_server_fixture as etcd_server_fixture  # the module-scoped `etcd_server`
from harness.pg import throwaway_postgres

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster(etcd_server: EtcdServer) -> Iterator[Cluster]:
    with throwaway_postgres() as dsn, Cluster(2, etcd=etcd_server, postgres_dsn=dsn, lease_ttl=2) as c:
        yield c
        print(c.diagnostics())



def test_queue_owned_elsewhere_shows_the_owners_counts(cluster: Cluster) -> None:
    name = f"mgmt.cl.{uuid.uuid4().hex[:8]}"
    conn = pika.BlockingConnection(pika.URLParameters(cluster.url("n1")))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(name, durable=True)
    for i in range(3):
        ch.basic_publish("", name, b"m%d" % i, pika.BasicProperties(delivery_mode=2))
    conn.close()
    owner = api(cluster, "n1").get(f"/api/queues/%2F/{name}")["node"]
    other = "n2" if owner == "n1" else "n1"
    deadline = time.monotonic() + 15
    while True:
        reply = api(cluster, other).request("GET", f"/api/queues/%2F/{name}")
        if reply.status == 200 and reply.body["messages"] == 3:
            break
        assert time.monotonic() < deadline, f"node {other} never showed the owner's count: {reply}"
        time.sleep(0.2)
    assert reply.body["node"] == owner
    assert sorted(n["name"] for n in api(cluster, other).get("/api/nodes")) == ["n1", "n2"]
    listed = {q["name"]: q for q in api(cluster, other).get("/api/queues/%2F")}
    assert listed[name]["messages"] == 3 and listed[name]["node"] == owner
    # Totals answer for the whole cluster too: the owner's 3 messages count on the other node.
    assert api(cluster, other).get("/api/overview")["queue_totals"]["messages"] >= 3
    assert api(cluster, other).get("/api/vhosts/%2F")["messages"] >= 3
    # Publish, get and purge through the node that does not own it.
    mgmt = api(cluster, other)
    assert mgmt.ok("POST", "/api/exchanges/%2F/amq.default/publish",
                   {"routing_key": name, "payload": "via-api", "properties": {"delivery_mode": 2}}).body == \
        {"routed": True}
    got = mgmt.ok("POST", f"/api/queues/%2F/{name}/get", {"count": 1, "ackmode": "ack_requeue_false",
                                                         "encoding": "auto"}).body
    assert got[0]["payload"] == "m0"
    mgmt.ok("DELETE", f"/api/queues/%2F/{name}/contents")
    deadline = time.monotonic() + 15
    while api(cluster, owner).get(f"/api/queues/%2F/{name}")["messages"] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    mgmt.ok("DELETE", f"/api/queues/%2F/{name}")
    deadline = time.monotonic() + 15
    while api(cluster, owner).request("GET", f"/api/queues/%2F/{name}").status != 404:
        assert time.monotonic() < deadline, "the delete did not reach the owner"
        time.sleep(0.2)


def test_user_and_vhost_added_on_one_node_log_in_on_the_other(cluster: Cluster) -> None:
    vhost, user = f"mgmt-vh-{uuid.uuid4().hex[:6]}", f"mgmt-u-{uuid.uuid4().hex[:6]}"
    n1 = api(cluster, "n1")
    n1.ok("PUT", f"/api/vhosts/{vhost}", {})
    n1.ok("PUT", f"/api/users/{user}", {"password": "pw", "tags": "management"})
    n1.ok("PUT", f"/api/permissions/{vhost}/{user}", {"configure": ".*", "write": ".*", "read": ".*"})
    url = pika.URLParameters(cluster.url("n2"))
    login = pika.ConnectionParameters(host=url.host, port=url.port, virtual_host=vhost,
                                      credentials=pika.PlainCredentials(user, "pw"))
    deadline = time.monotonic() + 15
    while True:
        try:
            conn = pika.BlockingConnection(login)
            break
        except pika.exceptions.AMQPError:
            assert time.monotonic() < deadline, "n2 never accepted the user made on n1"
            time.sleep(0.2)
    ch = conn.channel()
    ch.queue_declare("in-new-vhost")
    conn.close()
    assert any(q["name"] == "in-new-vhost" for q in n1.get(f"/api/queues/{vhost}"))
    n1.ok("DELETE", f"/api/users/{user}")
    deadline = time.monotonic() + 15
    while True:
        try:
            pika.BlockingConnection(login).close()
        except pika.exceptions.AMQPError:
            break
        assert time.monotonic() < deadline, "n2 still accepts a user deleted on n1"
        time.sleep(0.2)
