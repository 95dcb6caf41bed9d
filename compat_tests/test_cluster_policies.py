"""A policy written once reaches every node of a cluster: the queue's owner trims it, every node reports it."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator

import pika
import pytest

from harness.cluster import Cluster
from harness.node import REPO_ROOT, _python, node_env

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(2) as c:
        yield c


def depth(cluster: Cluster, node: str, queue: str) -> int:
    conn = pika.BlockingConnection(pika.URLParameters(cluster.url(node)))
    try:
        return int(conn.channel().queue_declare(queue, passive=True).method.message_count)
    finally:
        conn.close()


def test_policy_applies_on_every_node_within_about_a_second(cluster: Cluster) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(cluster.url("n1")))
    ch = conn.channel()
    ch.queue_declare("cp-orders", durable=True)
    owner = cluster.wait_owner("cp-orders")
    other = "n2" if owner == "n1" else "n1"
    conn.close()
    conn = pika.BlockingConnection(pika.URLParameters(cluster.url(other)))  # publish through the non-owner
    ch = conn.channel()
    ch.confirm_delivery()
    for i in range(5):
        ch.basic_publish("", "cp-orders", f"m{i}".encode(), pika.BasicProperties(delivery_mode=2))
    conn.close()
    assert depth(cluster, other, "cp-orders") == 5
    out = subprocess.run(
        [_python(), "-m", "leveret", "policies", "set", "two", "^cp-", json.dumps({"max-length": 2}),
         "--store", "postgres", "--postgres-dsn", cluster.dsn],
        cwd=REPO_ROOT, env=node_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    written = time.monotonic()
    deadline = written + 5.0  # the nodes read every 0.5 s; slack for a loaded machine
    while depth(cluster, other, "cp-orders") != 2:
        assert time.monotonic() < deadline, cluster.diagnostics()
        time.sleep(0.05)
    took = time.monotonic() - written
    assert depth(cluster, owner, "cp-orders") == 2
    print(f"policy applied by the owner and seen through the other node {took:.2f}s after it was stored")
    # A queue declared afterwards on the other node gets the policy at declare.
    conn = pika.BlockingConnection(pika.URLParameters(cluster.url(other)))
    ch = conn.channel()
    ch.queue_declare("cp-later", durable=True)
    cluster.wait_owner("cp-later")
    ch.confirm_delivery()
    for i in range(4):
        ch.basic_publish("", "cp-later", f"n{i}".encode(), pika.BasicProperties(delivery_mode=2))
    conn.close()
    assert depth(cluster, owner, "cp-later") == 2
