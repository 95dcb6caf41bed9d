"""A client id connected twice in a cluster: the first connection, on the other node, is closed.

Each node takes the coordinator's hold mqtt/<vhost>/<client id> at CONNECT whoever held it; the
node whose connection took it earlier hears the later take and closes its connection (v5:
DISCONNECT 0x8E session taken over), as RabbitMQ does across its cluster.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from compat_tests.test_mqtt import V5, V311, Client, wait_port
from harness.cluster import Cluster
from harness.etcd import EtcdServer
from harness.etcd import etcd_server_fixture as etcd_server_fixture  # the module-scoped `etcd_server`
from harness.pg import throwaway_postgres

pytestmark = pytest.mark.timeout(240)
TIMEOUT = 15.0


@pytest.fixture
def cluster(etcd_server: EtcdServer) -> Iterator[Cluster]:
    with throwaway_postgres() as dsn, Cluster(2, etcd=etcd_server, postgres_dsn=dsn, lease_ttl=2, mqtt=True) as c:
        for node in c.nodes.values():
            wait_port(node.mqtt_port)
        yield c
        print(c.diagnostics())


def test_same_client_id_on_two_nodes_closes_the_first(cluster: Cluster) -> None:
    n1, n2 = cluster["n1"], cluster["n2"]
    first = Client(n1.mqtt_port, client_id="twice", protocol=V5)
    first.client.reconnect_delay_set(120, 120)  # paho would reconnect and take the id back
    time.sleep(0.5)  # its take is answered and seen by n2 before the second CONNECT
    second = Client(n2.mqtt_port, client_id="twice", protocol=V5)
    try:
        assert first.disconnected.wait(TIMEOUT), "the first connection (n1) was not closed"
        assert int(first.disconnect_reason.value) == 0x8E  # type: ignore[attr-defined]  # session taken over
        first.client.loop_stop()
        time.sleep(1.0)
        assert not second.disconnected.is_set(), "the newer connection (n2) was closed"
        # and back: a 3.1.1 connection of the id on n1 closes the one on n2
        second.client.reconnect_delay_set(120, 120)
        third = Client(n1.mqtt_port, client_id="twice", protocol=V311)
        try:
            assert second.disconnected.wait(TIMEOUT), "the connection on n2 was not closed"
            second.client.loop_stop()
            time.sleep(1.0)
            assert not third.disconnected.is_set()
        finally:
            third.close()
    finally:
        second.close()
        first.close()


def test_other_client_ids_are_left_alone(cluster: Cluster) -> None:
    a = Client(cluster["n1"].mqtt_port, client_id="alone-a", protocol=V311)
    b = Client(cluster["n2"].mqtt_port, client_id="alone-b", protocol=V311)
    try:
        time.sleep(2.0)
        assert not a.disconnected.is_set() and not b.disconnected.is_set()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("clean", [True, False], ids=["clean", "persistent"])
def test_the_session_works_on_the_new_node_after_the_takeover(cluster: Cluster, clean: bool) -> None:
    """The closed connection's node must not delete the session queue the new connection uses."""
    n1, n2 = cluster["n1"], cluster["n2"]
    cid = f"moving-{clean}"
    first = Client(n1.mqtt_port, client_id=cid, protocol=V5, clean=clean, session_expiry=None if clean else 600)
    first.subscribe("moving/#", qos=1)
    first.client.reconnect_delay_set(120, 120)  # paho would reconnect and take the id back
    time.sleep(0.5)
    second = Client(n2.mqtt_port, client_id=cid, protocol=V5, clean=clean, session_expiry=None if clean else 600)
    try:
        second.subscribe("moving/#", qos=1)  # at once: n1 may close its connection after this
        assert first.disconnected.wait(TIMEOUT)
        first.client.loop_stop()
        time.sleep(1.5)  # whatever n1 does at the close is done by now
        pub = Client(n1.mqtt_port, protocol=V311)
        try:
            pub.publish("moving/t", b"after", qos=1)
        finally:
            pub.close()
        assert second.get().payload == b"after"
    finally:
        second.close()
        first.close()
