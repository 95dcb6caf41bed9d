"""A rolling upgrade: a cluster of three nodes running the previous release's code is moved to this code
one node at a time (drain, stop, start on the new code), new beside old, under a publisher with confirms:
every confirmed message is there at the end, and every node runs the new code.

The previous release's code is this repository at PREVIOUS_RELEASE (``git archive``): skipped where the
checkout lacks that commit (a shallow clone).
"""

from __future__ import annotations

import base64
import json
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pika
import pika.exceptions
import pytest

import leveret
from harness.cluster import Cluster, ClusterNode
from harness.node import REPO_ROOT, node_env
from harness.ports import free_port, free_ports

# Release 0.1.0: the commit this branch's first change was made on.
PREVIOUS_RELEASE = "44cd89893940c571e78430fa57c7ce84533b5046"
QUEUES = [f"upgrade-{i}" for i in range(4)]

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def previous_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    known = subprocess.run(["git", "-C", str(REPO_ROOT), "cat-file", "-e", f"{PREVIOUS_RELEASE}^{{commit}}"],
                           capture_output=True)
    if known.returncode != 0:
        pytest.skip(f"this checkout lacks the previous release's commit {PREVIOUS_RELEASE[:10]} (a shallow clone?)")
    tree = tmp_path_factory.mktemp("previous-release")
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", PREVIOUS_RELEASE, "core", "amqp_frontend",
                              "coordination", "persistence", "spark", "leveret"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


class VersionedNode(ClusterNode):
    """A cluster node that runs the code of ``source`` (a checkout of some release): ``python -m leveret``
    started in that folder imports its packages."""

    source: Path = REPO_ROOT

    def command(self) -> list[str]:
        argv = super().command()
        if self.source == REPO_ROOT:
            return argv
        # The previous release has no MQTT listener, so no --mqtt-* options: drop each with its value.
        out: list[str] = []
        skip = False
        for arg in argv:
            if skip:
                skip = False
            elif arg.startswith("--mqtt-"):
                skip = True
            else:
                out.append(arg)
        return out

    def spawn(self) -> None:
        self.paused = False
        self.cluster_port = free_port()
        self.starts += 1
        self.amqp_port, self.grpc_port, self.management_port = free_ports(3)
        self.stderr_path = self.log_dir / f"node-{self.starts}.stderr"
        with open(self.log_dir / f"node-{self.starts}.stdout", "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(self.command(), cwd=self.source, stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL, env=node_env())


@pytest.fixture
def old_cluster(previous_tree: Path) -> Iterator[Cluster]:
    with Cluster(size=0) as cluster:
        for i in (1, 2, 3):
            node = VersionedNode(f"n{i}", "r1", cluster, cluster.node_args)
            node.source = previous_tree
            cluster.nodes[node.node_id] = node
            node.start()
        cluster.wait_members(["n1", "n2", "n3"])
        yield cluster


def _version(cluster: Cluster, node_id: str) -> str:
    """The version a node reports (GET /api/overview)."""
    request = urllib.request.Request(f"http://127.0.0.1:{cluster[node_id].management_port}/api/overview",
                                     headers={"Authorization": "Basic " + base64.b64encode(b"guest:guest").decode()})
    with urllib.request.urlopen(request, timeout=10) as response:
        return str(json.loads(response.read())["product_version"])


def test_rolling_upgrade_one_node_at_a_time_under_a_confirmed_publisher(old_cluster: Cluster) -> None:
    cluster = old_cluster
    assert {_version(cluster, n) for n in cluster.nodes} == {"0.1.0"}
    setup = pika.BlockingConnection(pika.URLParameters(cluster.url("n1")))
    ch = setup.channel()
    for q in QUEUES:
        ch.queue_declare(q, durable=True)
    setup.close()

    confirmed: dict[str, list[int]] = {q: [] for q in QUEUES}
    stop = threading.Event()
    failures: list[str] = []

    def publish() -> None:
        """Publishes with confirms to whichever node is up, moving on when its node goes away."""
        i = 0
        while not stop.is_set():
            for node_id in ("n3", "n2", "n1"):
                if stop.is_set():
                    return
                node = cluster[node_id]
                if not node.running():
                    continue
                try:
                    conn = pika.BlockingConnection(pika.URLParameters(node.url + "?connection_attempts=1"))
                    ch = conn.channel()
                    ch.confirm_delivery()
                    while not stop.is_set():
                        q = QUEUES[i % len(QUEUES)]
                        ch.basic_publish("", q, b"%d" % i, pika.BasicProperties(delivery_mode=2))
                        confirmed[q].append(i)
                        i += 1
                    conn.close()
                except (pika.exceptions.AMQPError, OSError) as exc:
                    failures.append(f"{node_id}: {exc!r}")  # its node went away: the next one
                    time.sleep(0.1)

    thread = threading.Thread(target=publish)
    thread.start()
    try:
        time.sleep(1.0)
        for node_id in ("n1", "n2", "n3"):
            drained = cluster.drain(node_id)
            assert drained.returncode == 0, drained.stderr
            cluster.terminate(node_id)
            node = cluster[node_id]
            assert isinstance(node, VersionedNode)
            node.source = REPO_ROOT  # the new code, beside the old nodes still running
            node.start()
            cluster.wait_members([node_id])
            time.sleep(0.5)
    finally:
        stop.set()
        thread.join(60)
    assert {_version(cluster, n) for n in cluster.nodes} == {leveret.__version__}
    total = sum(len(v) for v in confirmed.values())
    assert total > 100, (total, failures)

    conn = pika.BlockingConnection(pika.URLParameters(cluster.url("n2")))
    ch = conn.channel()
    for q in QUEUES:
        got: set[int] = set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            method, _props, body = ch.basic_get(q, auto_ack=True)
            if method is None:
                if set(confirmed[q]) <= got:
                    break
                time.sleep(0.2)  # a queue still loading after its move
                continue
            got.add(int(body))
        lost = set(confirmed[q]) - got
        assert not lost, f"{q}: {len(lost)} confirmed messages lost in the upgrade, e.g. {sorted(lost)[:5]}"
    conn.close()
