"""Quorum queues in a cluster (issue #17): x-queue-leader-locator places the queue.

``client-local``: on the node the declaring client is connected to;
``balanced`` (and no locator): on the node owning the fewest queues, as every
durable queue of a Leveret cluster is placed (coordination/etcd.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pika
import pika.exceptions
import pytest

from harness.cluster import Cluster
from harness.etcd import EtcdServer
from harness.etcd import etcd_server_fixture as etcd_server_fixture  # the module-scoped `etcd_server`
from harness.pg import throwaway_postgres

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def cluster(etcd_server: EtcdServer) -> Iterator[Cluster]:
    with throwaway_postgres() as dsn, Cluster(3, etcd=etcd_server, postgres_dsn=dsn, lease_ttl=2) as c:
        yield c
        print(c.diagnostics())


def _declare(cluster: Cluster, node_id: str, locator: str) -> str:
    name = f"qq.{locator}.{uuid.uuid4().hex[:8]}"
    with pika.BlockingConnection(pika.URLParameters(cluster.url(node_id))) as conn:
        conn.channel().queue_declare(name, durable=True, arguments={
            "x-queue-type": "quorum", "x-queue-leader-locator": locator, "x-quorum-initial-group-size": 3})
    return name


def test_leader_locator_client_local_and_balanced(cluster: Cluster) -> None:
    local = [_declare(cluster, "n2", "client-local") for _ in range(3)]
    assert [cluster.wait_owner(q) for q in local] == ["n2", "n2", "n2"], cluster.diagnostics()
    # n2 now owns the most queues: balanced declarations through n2 go elsewhere.
    balanced = [_declare(cluster, "n2", "balanced") for _ in range(2)]
    owners = [cluster.wait_owner(q) for q in balanced]
    assert "n2" not in owners and set(owners) <= {"n1", "n3"}, owners


def test_a_non_durable_quorum_declaration_leaves_nothing_in_the_cluster(cluster: Cluster) -> None:
    """Refused (406) before the cluster agrees on it: a durable redeclaration of the name then succeeds."""
    name = f"qq.transient.{uuid.uuid4().hex[:8]}"
    with pika.BlockingConnection(pika.URLParameters(cluster.url("n1"))) as conn:
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as info:
            conn.channel().queue_declare(name, durable=False, arguments={"x-queue-type": "quorum"})
        assert info.value.reply_code == 406 and "invalid property 'non-durable'" in info.value.reply_text
        conn.channel().queue_declare(name, durable=True, arguments={"x-queue-type": "quorum"})
    assert cluster.wait_owner(name) in {"n1", "n2", "n3"}
