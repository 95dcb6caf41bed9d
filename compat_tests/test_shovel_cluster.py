"""A shovel defined in a cluster runs on exactly one node, and moves to another when that node dies (kill -9).

The shovel's ends are two single-node brokers outside the cluster, so killing
the node that runs it loses no queue: only the shovel has to move. Every
message confirmed at the source during the run arrives at the destination.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pika
import pytest

from compat_tests.mgmt_http import cluster_api as api
from compat_tests.test_shovel import Broker, declare, drain
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



def publish_across_kill9(cluster: Cluster, url: str, send: Callable[[Any, int, bytes], None], holder: str,
                         other: str, runners: Callable[[Cluster, str], list[str]], what: str) -> list[bytes]:
    """Publish with confirms through ``url`` from a thread (``send(channel, i, body)``), kill -9 ``holder``
    after 300 are confirmed, wait until ``other`` runs ``what``, then 300 more: the confirmed bodies."""
    confirmed: list[bytes] = []
    stop = threading.Event()

    def publisher() -> None:
        c = pika.BlockingConnection(pika.URLParameters(url))
        ch = c.channel()
        ch.confirm_delivery()
        i = 0
        while not stop.is_set():
            body = f"m{i}".encode()
            send(ch, i, body)
            confirmed.append(body)
            i += 1
            time.sleep(0.002)
        c.close()

    t = threading.Thread(target=publisher)
    t.start()
    try:
        cluster.wait_for(lambda: len(confirmed) >= 300, "messages published before the kill", timeout=30)
        cluster.kill(holder)  # kill -9 of the node running it
        started = time.monotonic()
        cluster.wait_for(lambda: runners(cluster, other) == [other], f"the {what} to move", timeout=30)
        print(f"{what} moved from {holder} to {other} {time.monotonic() - started:.1f} s after the kill -9")
        n = len(confirmed)
        cluster.wait_for(lambda: len(confirmed) >= n + 300, "messages published after the move", timeout=30)
    finally:
        stop.set()
        t.join(10)
    return confirmed


def runners(cluster: Cluster, node_id: str) -> list[str]:
    """The nodes that say they run the shovel, as node_id's API lists it."""
    return [s["node"] for s in api(cluster, node_id).get("/api/shovels") if s["name"] == "move"
            and s["state"] == "running"]


def test_shovel_runs_on_one_node_and_moves_when_it_dies(cluster: Cluster, tmp_path: Path) -> None:
    src, dest = Broker(tmp_path / "src"), Broker(tmp_path / "dest")
    src.start()
    dest.start()
    try:
        declare(src.node.url, "src")
        api(cluster, "n1").ok("PUT", "/api/parameters/shovel/%2F/move", {"value": {
            "src-uri": src.node.url, "src-queue": "src", "dest-uri": dest.node.url, "dest-queue": "dst",
            "src-prefetch-count": 20, "reconnect-delay": 0.5}})
        cluster.wait_for(lambda: len(runners(cluster, "n1")) == 1, "the shovel to run", timeout=20)
        holder = runners(cluster, "n1")[0]
        other = "n2" if holder == "n1" else "n1"
        # Both nodes agree on who runs it; the other node runs nothing (one consumer at the source).
        cluster.wait_for(lambda: runners(cluster, other) == [holder], "the other node to list the holder")
        conn = pika.BlockingConnection(pika.URLParameters(src.node.url))
        consumers = conn.channel().queue_declare("src", passive=True).method.consumer_count
        conn.close()
        assert consumers == 1

        def send(ch: Any, i: int, body: bytes) -> None:
            ch.basic_publish("", "src", body, pika.BasicProperties(delivery_mode=2))

        confirmed = publish_across_kill9(cluster, src.node.url, send, holder, other, runners, "shovel")
        wanted = set(confirmed)
        got = drain(dest.node.url, "dst", lambda got: wanted <= set(got), timeout=60)
        assert not wanted - set(got), f"{len(wanted - set(got))} confirmed messages never arrived"
        assert len(got) - len(set(got)) <= 20  # redeliveries of the prefetch window in flight at the kill
    finally:
        src.node.cleanup()
        dest.node.cleanup()
