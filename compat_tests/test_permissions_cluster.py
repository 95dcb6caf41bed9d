"""In a cluster, permissions, limits and user deletion set through one node apply on every node at once
(etcd's user and vhost records carry them; the Postgres store keeps them: migration 030)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from urllib.parse import quote

import pika
import pika.exceptions
import pytest

from compat_tests.mgmt_http import cluster_api as api
from compat_tests.mgmt_http import q
from compat_tests.util import assert_reply
from harness.cluster import Cluster
from harness.etcd import EtcdServer
from harness.etcd import etcd_server_fixture as etcd_server_fixture  # the module-scoped `etcd_server`
from harness.pg import throwaway_postgres

pytestmark = pytest.mark.timeout(180)
PASSWORD = "cl-secret"


@pytest.fixture(scope="module")
def cluster(etcd_server: EtcdServer) -> Iterator[Cluster]:
    with throwaway_postgres() as dsn, Cluster(2, etcd=etcd_server, postgres_dsn=dsn, lease_ttl=2) as c:
        yield c



def params(cluster: Cluster, node_id: str, user: str, vhost: str = "/") -> pika.URLParameters:
    node = cluster.nodes[node_id]
    return pika.URLParameters(f"amqp://{user}:{PASSWORD}@127.0.0.1:{node.amqp_port}/{quote(vhost, safe='')}"
                              "?heartbeat=0&connection_attempts=1")


def eventually(check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_changes_through_one_node_apply_on_the_other(cluster: Cluster) -> None:
    n1 = api(cluster, "n1")
    user = f"cl-{uuid.uuid4().hex[:8]}"
    n1.ok("PUT", f"/api/users/{q(user)}", {"password": PASSWORD, "tags": ""})
    n1.ok("PUT", f"/api/permissions/%2F/{q(user)}", {"configure": r"^cl\.", "write": ".*", "read": ".*"})

    def opens() -> bool:
        try:
            pika.BlockingConnection(params(cluster, "n2", user)).close()
            return True
        except pika.exceptions.AMQPConnectionError:
            return False

    eventually(opens, "the user never reached n2")
    conn = pika.BlockingConnection(params(cluster, "n2", user))
    ch = conn.channel()
    ch.queue_declare(f"cl.{user}", auto_delete=True)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as info:
        ch.queue_declare(f"other.{user}")
    assert_reply(info.value, 403, f"access to queue 'other.{user}' in vhost '/' refused for user '{user}'")

    # A change through n1 reaches the connection open on n2.
    n1.ok("PUT", f"/api/permissions/%2F/{q(user)}", {"configure": ".*", "write": ".*", "read": ".*"})
    ch = conn.channel()

    def declares() -> bool:
        nonlocal ch
        try:
            ch.queue_declare(f"other.{user}", auto_delete=True)
            return True
        except pika.exceptions.ChannelClosedByBroker:
            ch = conn.channel()
            return False

    eventually(declares, "the permission change never reached n2")

    # Limits: a user limit set through n1 applies on n2.
    n1.ok("PUT", f"/api/user-limits/{q(user)}/max-channels", {"value": 1})
    eventually(lambda: api(cluster, "n2").get(f"/api/user-limits/{q(user)}") != [], "the user limit never reached n2")
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as closed:
        conn.channel()
    assert_reply(closed.value, 530, f"number of channels opened for user '{user}'")

    # Deleting the user through n1 closes its connection on n2.
    conn = pika.BlockingConnection(params(cluster, "n2", user))
    n1.ok("DELETE", f"/api/users/{q(user)}")
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as gone:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.2)
    assert_reply(gone.value, 320, f"user '{user}' is deleted")


def test_vhost_limits_reach_every_node(cluster: Cluster) -> None:
    n1 = api(cluster, "n1")
    vhost = f"clv-{uuid.uuid4().hex[:6]}"
    n1.ok("PUT", f"/api/vhosts/{q(vhost)}")
    n1.ok("PUT", f"/api/vhost-limits/{q(vhost)}/max-connections", {"value": 0})
    eventually(lambda: api(cluster, "n2").request("GET", f"/api/vhost-limits/{q(vhost)}").body ==
               [{"vhost": vhost, "value": {"max-connections": 0}}], "the vhost limit never reached n2")
    guest = pika.URLParameters(f"amqp://guest:guest@127.0.0.1:{cluster.nodes['n2'].amqp_port}/{quote(vhost, safe='')}"
                               "?connection_attempts=1")
    with pytest.raises(pika.exceptions.AMQPConnectionError) as info:
        pika.BlockingConnection(guest)
    assert "connection limit (0) is reached" in str(info.value)
