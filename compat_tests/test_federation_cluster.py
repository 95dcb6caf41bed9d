"""A federated exchange in a cluster: its link runs on exactly one node, and moves when that node dies (kill -9).

The upstream is a single-node broker outside the cluster. The downstream queue
is declared through the node that does not run the link, so the kill -9 takes
only the link away: every message confirmed upstream during the run arrives.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pytest

from compat_tests.mgmt_http import cluster_api as api
from compat_tests.test_federation import X, named
from compat_tests.test_shovel import drain
from compat_tests.test_shovel_cluster import publish_across_kill9
from harness.cluster import Cluster
from harness.etcd import EtcdServer
from harness.etcd import etcd_server_fixture as etcd_server_fixture  # the module-scoped `etcd_server`
from harness.pg import throwaway_postgres

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def cluster(etcd_server: EtcdServer) -> Iterator[Cluster]:
    with throwaway_postgres() as dsn, Cluster(2, etcd=etcd_server, postgres_dsn=dsn, lease_ttl=2) as c:
        yield c
        print(c.diagnostics())



def links(cluster: Cluster, node_id: str) -> list[dict[str, Any]]:
    return list(api(cluster, node_id).get("/api/federation-links"))


def runners(cluster: Cluster, node_id: str) -> list[str]:
    """The nodes that run the link, as node_id's API lists it."""
    return [link["node"] for link in links(cluster, node_id) if link["status"] == "running"]


def test_link_runs_on_one_node_and_moves_when_it_dies(cluster: Cluster, tmp_path: Path) -> None:
    up = named(tmp_path, "upstream")
    try:
        n1 = api(cluster, "n1")
        n1.ok("PUT", "/api/cluster-name", {"name": "downstream"})
        n1.ok("PUT", "/api/parameters/federation-upstream/%2F/up", {"value": {
            "uri": up.node.url, "prefetch-count": 20, "reconnect-delay": 0.5}})
        n1.ok("PUT", "/api/policies/%2F/federate", {"pattern": r"^fed\.", "apply-to": "exchanges",
                                                    "definition": {"federation-upstream": "up"}})
        n1.ok("PUT", f"/api/exchanges/%2F/{X}", {"type": "topic", "durable": True})
        cluster.wait_for(lambda: len(runners(cluster, "n1")) == 1, "the link to run", timeout=20)
        holder = runners(cluster, "n1")[0]
        other = "n2" if holder == "n1" else "n1"
        cluster.wait_for(lambda: runners(cluster, other) == [holder], "the other node to list the holder")
        # Every node agrees on the cluster name: the one stored, not each node's own.
        cluster.wait_for(lambda: api(cluster, other).get("/api/cluster-name") == {"name": "downstream"},
                         "the cluster name to reach the other node")
        conn = pika.BlockingConnection(pika.URLParameters(cluster.url(other)))
        ch = conn.channel()
        ch.queue_declare("got", durable=True)  # owned by the node that stays up
        ch.queue_bind("got", X, "orders.#")
        conn.close()

        def upstream_consumers() -> int:
            queue = f"federation: {X} to downstream"
            return int(next((q.get("consumers", 0) for q in up.mgmt.get("/api/queues/%2F") if q["name"] == queue), 0))

        cluster.wait_for(lambda: upstream_consumers() == 1, "one consumer upstream (one node runs the link)")

        def send(ch: Any, i: int, body: bytes) -> None:
            ch.basic_publish(X, f"orders.{i % 5}", body, pika.BasicProperties(delivery_mode=2))

        # The binding reached upstream before publishing starts: what is confirmed from now on is routed there.
        deadline = time.monotonic() + 20
        while not any(link.get("bindings") for link in links(cluster, holder)) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        confirmed = publish_across_kill9(cluster, up.node.url, send, holder, other, runners, "link")
        wanted = set(confirmed)
        got = drain(cluster.url(other), "got", lambda got: wanted <= set(got), timeout=60)
        assert not wanted - set(got), f"{len(wanted - set(got))} confirmed messages never arrived"
        assert len(got) - len(set(got)) <= 20  # redeliveries of the prefetch window in flight at the kill
    finally:
        up.node.cleanup()
