"""The Prometheus endpoint of a real node, read with Prometheus's own text parser after real AMQP traffic.

Names, types, HELP and labels are checked against rabbitmq_prometheus's, since
RabbitMQ's Grafana dashboards query them by name.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from harness.node import NodeProcess
from harness.ports import free_port


class MetricsNode(NodeProcess):
    """A node with its Prometheus endpoint on a free port."""

    metrics_port = 0

    def command(self) -> list[str]:
        self.metrics_port = free_port()
        return [*super().command(), "--prometheus-port", str(self.metrics_port)]

    def scrape(self, path: str = "/metrics") -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}{path}", timeout=10) as resp:
            assert resp.headers["Content-Type"].startswith("text/plain")
            return str(resp.read().decode())


@pytest.fixture
def node(tmp_path: Path) -> Iterator[MetricsNode]:
    n = MetricsNode(tmp_path / "data", tmp_path / "logs")
    n.start()
    try:
        yield n
    finally:
        n.terminate()
        n.cleanup()


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert isinstance(s, Sample)
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(found: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in found, f"{name}{labels} not exposed; have {sorted(n for n, _ in found if n.startswith(name[:20]))}"
    return found[key]


def traffic(node: MetricsNode) -> None:
    """5 confirmed publishes to a queue, 2 unroutable, 3 consumed and acked, 1 fetched with no-ack."""
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("metrics-q", durable=True)
    for i in range(5):
        ch.basic_publish("", "metrics-q", f"m{i}".encode(), pika.BasicProperties(delivery_mode=2))
    for i in range(2):
        ch.basic_publish("amq.direct", "nowhere", f"lost{i}".encode())
    for _ in range(3):
        method, _props, _body = ch.basic_get("metrics-q", auto_ack=False)
        assert method is not None
        ch.basic_ack(method.delivery_tag)
    method, _props, _body = ch.basic_get("metrics-q", auto_ack=True)
    assert method is not None
    conn.close()


def test_metrics_after_amqp_traffic(node: MetricsNode) -> None:
    traffic(node)
    # A connection that stays open, with a consumer, for the gauges.
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    ch = conn.channel()
    ch.basic_consume("metrics-q", lambda *_: None, auto_ack=False)
    conn.channel()  # nothing to do with it: a second channel on the connection
    conn.process_data_events(0.2)
    try:
        text = node.scrape()
        found = samples(text)
        amqp = {"protocol": "amqp091"}
        classic = {"protocol": "amqp091", "queue_type": "rabbit_classic_queue"}
        assert value(found, "rabbitmq_global_messages_received_total", **amqp) == 7
        assert value(found, "rabbitmq_global_messages_confirmed_total", **amqp) == 7
        assert value(found, "rabbitmq_global_messages_unroutable_dropped_total", **amqp) == 2
        # The consumer took the one message left, so 3 gets + 1 get + 1 delivery.
        assert value(found, "rabbitmq_global_messages_delivered_total", **classic) == 5
        assert value(found, "rabbitmq_global_messages_acknowledged_total", **classic) == 3
        assert value(found, "rabbitmq_connections") == 1
        assert value(found, "rabbitmq_channels") == 2
        assert value(found, "rabbitmq_consumers") == 1
        assert value(found, "rabbitmq_queues") == 1
        assert value(found, "rabbitmq_queue_messages_ready") == 0
        assert value(found, "rabbitmq_queue_messages_unacked") == 1
        assert value(found, "rabbitmq_queue_messages") == 1
        # The alarm's measure under the name the dashboards' memory panel reads; RSS apart.
        held = sum(v for (n, _), v in found.items() if n == "leveret_memory_held_bytes")
        assert 0 < value(found, "rabbitmq_process_resident_memory_bytes") < 10_000_000
        assert abs(value(found, "rabbitmq_process_resident_memory_bytes") - held) < 1_000_000
        assert value(found, "leveret_process_resident_memory_bytes") > 10_000_000
        assert value(found, "rabbitmq_resident_memory_limit_bytes") > 0
        assert value(found, "rabbitmq_alarms_memory_used_watermark") == 0
        build = [labels for (name, labels) in found if name == "rabbitmq_build_info"]
        assert len(build) == 1 and dict(build[0])["product_name"] == "Leveret"
        assert {"rabbitmq_version", "erlang_version"} <= dict(build[0]).keys()
        ident = [dict(labels) for (name, labels) in found if name == "rabbitmq_identity_info"]
        # A single node's cluster is named after the node, as RabbitMQ's (so two nodes are not one cluster).
        assert ident and ident[0]["rabbitmq_cluster"] == ident[0]["rabbitmq_node"] != ""
        assert value(found, "rabbitmq_global_publishers", **amqp) == 0  # the publishing connection closed
        assert value(found, "rabbitmq_queues_declared_total") == 1
        assert value(found, "rabbitmq_queues_created_total") == 1
        assert value(found, "rabbitmq_queues_deleted_total") == 0
        # 7 bodies of 2-5 bytes, all in the first bucket (100 B); one body of 1000 B below.
        assert value(found, "rabbitmq_message_size_bytes_bucket", le="100", **amqp) == 7
        assert value(found, "rabbitmq_message_size_bytes_count", **amqp) == 7
        # basic.get redeliveries are counted (RabbitMQ 3.10.8 counts 2 for get, nack-requeue, get)
        ch2 = conn.channel()
        ch2.queue_declare("metrics-redeliver")
        ch2.basic_publish("", "metrics-redeliver", b"r" * 1000)
        method, _, _ = ch2.basic_get("metrics-redeliver")
        ch2.basic_nack(method.delivery_tag, requeue=True)
        method, _, _ = ch2.basic_get("metrics-redeliver")
        ch2.basic_ack(method.delivery_tag)
        again = samples(node.scrape())
        assert value(again, "rabbitmq_global_messages_redelivered_total", **classic) == 1
        assert value(again, "rabbitmq_global_publishers", **amqp) == 1
        assert value(again, "rabbitmq_message_size_bytes_bucket", le="1000", **amqp) == 8
        assert value(again, "rabbitmq_message_size_bytes_bucket", le="100", **amqp) == 7
        assert value(again, "rabbitmq_message_size_bytes_bucket", le="+Inf", **amqp) == 8
        assert value(again, "rabbitmq_message_size_bytes_sum", **amqp) > 1000
        assert value(found, "leveret_group_commit_batch_size_count") >= 1
        # Aggregated: no per-queue label on /metrics.
        assert not [k for k in found if k[0] == "rabbitmq_queue_messages" and k[1]]
        # rabbitmq_prometheus's HELP and TYPE, as the dashboards' tooltips show them.
        assert "# HELP rabbitmq_queue_messages_ready Messages ready to be delivered to consumers\n" in text
        assert "# TYPE rabbitmq_global_messages_received_total counter\n" in text
        assert "# TYPE rabbitmq_build_info untyped\n" in text
        assert ("# HELP rabbitmq_alarms_memory_used_watermark is 1 if VM memory watermark alarm is in effect\n"
                in text)
    finally:
        conn.close()


def test_per_object_and_detailed(node: MetricsNode) -> None:
    traffic(node)
    q = {"vhost": "/", "queue": "metrics-q"}
    found = samples(node.scrape("/metrics/per-object"))
    assert value(found, "rabbitmq_queue_messages_ready", **q) == 1
    assert value(found, "rabbitmq_queue_messages_unacked", **q) == 0
    assert value(found, "rabbitmq_queue_consumers", **q) == 0
    assert value(found, "rabbitmq_connections") == 0  # per-object keeps the totals
    detailed = samples(node.scrape("/metrics/detailed?family=queue_coarse_metrics&vhost=/"))
    assert value(detailed, "rabbitmq_detailed_queue_messages", **q) == 1
    assert {name for name, _ in detailed} == {
        "rabbitmq_detailed_queue_messages_ready", "rabbitmq_detailed_queue_messages_unacked",
        "rabbitmq_detailed_queue_messages", "rabbitmq_detailed_queue_info", "rabbitmq_identity_info",
        "rabbitmq_build_info"}
    # With no family=: the identity only, as the dashboards join every panel on it.
    assert {name for name, _ in samples(node.scrape("/metrics/detailed"))} == {
        "rabbitmq_identity_info", "rabbitmq_build_info"}
    assert value(detailed, "rabbitmq_detailed_queue_info", queue_type="rabbit_classic_queue", membership="leader",
                 **q) == 1
    other = samples(node.scrape("/metrics/detailed?family=queue_coarse_metrics&vhost=other"))
    assert not other.get(("rabbitmq_detailed_queue_messages", frozenset(q.items())))
    with pytest.raises(urllib.error.HTTPError) as err:
        node.scrape("/metrics/detailed?family=no_such_family")
    assert err.value.code == 400
    assert b"no_such_family" in err.value.read()


def test_queue_info_gives_each_queue_its_type_as_rabbitmq_does(node: MetricsNode) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    try:
        ch = conn.channel()
        ch.queue_declare("info-classic", durable=True)
        ch.queue_declare("info-quorum", durable=True, arguments={"x-queue-type": "quorum"})
        ch.queue_declare("info-stream", durable=True, arguments={"x-queue-type": "stream"})
    finally:
        conn.close()
    text = node.scrape("/metrics/per-object")
    assert ("# HELP rabbitmq_queue_info A metric with a constant '1' value and labels that provide some queue "
            "details\n# TYPE rabbitmq_queue_info gauge\n") in text
    found = samples(text)
    for name, type_ in (("info-classic", "rabbit_classic_queue"), ("info-quorum", "rabbit_quorum_queue"),
                        ("info-stream", "rabbit_stream_queue")):
        assert value(found, "rabbitmq_queue_info", vhost="/", queue=name, queue_type=type_, membership="leader") == 1
    infos = [labels for n, labels in found if n == "rabbitmq_queue_info"]
    assert len(infos) == 3  # one series per queue, whatever its type
    # The aggregated endpoint has no per-queue series, as RabbitMQ's (return_per_object_metrics off).
    assert not [n for n, _ in samples(node.scrape("/metrics")) if n == "rabbitmq_queue_info"]
    # /metrics/detailed only with a queue family.
    assert not [n for n, _ in samples(node.scrape("/metrics/detailed?family=node_coarse_metrics"))
                if n.endswith("queue_info")]


def test_last_retention_report_totals(node: MetricsNode) -> None:
    found = samples(node.scrape())
    assert not [name for name, _ in found if name.startswith("leveret_retention_last_run")]  # no run yet
    report = node.data_dir / "retention" / "last-report.json"
    report.parent.mkdir(parents=True, exist_ok=True)
    # What spark/retention_job.py writes (its totals and time), as a scheduled run leaves it.
    report.write_text(json.dumps({"now": 1_763_942_400.0, "queues": [], "totals": {
        "kept_messages": 7, "removed_messages": 3, "archived_messages": 2, "kept_bytes": 700, "removed_bytes": 300}}))
    found = samples(node.scrape())
    assert value(found, "leveret_retention_last_run_timestamp_seconds") == 1_763_942_400.0
    assert value(found, "leveret_retention_last_run_messages", outcome="removed") == 3
    assert value(found, "leveret_retention_last_run_messages", outcome="archived") == 2
    assert value(found, "leveret_retention_last_run_bytes", outcome="kept") == 700


PROMETHEUS = "/usr/bin/prometheus"
PANELS = Path(__file__).with_name("data") / "rabbitmq_overview_panels.json"


def evaluate_panels(prometheus_port: int, cluster: str, which: str = "panels") -> dict[str, list[Any]]:
    """Each RabbitMQ-Overview panel's PromQL, as Grafana sends it, evaluated now: title -> result.
    ``which``: "panels" (the 3.x dashboard) or "panels_4x" (the 4.1+ one's panels that differ)."""
    out: dict[str, list[Any]] = {}
    for panel in json.loads(PANELS.read_text())[which]:
        expr = (panel["expr"].replace("$rabbitmq_cluster", cluster).replace("$namespace", "")
                .replace("$endpoint", "aggregated").replace("$__range", "60s"))
        url = f"http://127.0.0.1:{prometheus_port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as resp:
            answer = json.loads(resp.read())
        assert answer["status"] == "success", (panel["title"], answer)
        out[panel["title"]] = answer["data"]["result"]
    return out


@pytest.mark.skipif(not os.path.exists(PROMETHEUS), reason="needs Debian's prometheus package (scripts/bootstrap.sh)")
def test_every_overview_dashboard_panel_has_data(node: MetricsNode, tmp_path: Path) -> None:
    """A real Prometheus scrapes the node under traffic; every panel of RabbitMQ's official
    RabbitMQ-Overview dashboard (41) must return data, as Grafana would draw it."""
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "leveret", "static_configs": [
            {"targets": [f"127.0.0.1:{node.metrics_port}"]}]}]}))
    prometheus = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))
    try:
        conn = pika.BlockingConnection(pika.URLParameters(node.url))
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare("dash-q")
        consumer = conn.channel()
        consumer.basic_qos(prefetch_count=1)
        consumer.basic_consume("dash-q", lambda c, m, p, b: None, auto_ack=False)  # one held unacked
        cluster = ""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for i in range(5):
                ch.basic_publish("", "dash-q", f"m{i}".encode())
            ch.basic_publish("amq.direct", "nowhere", b"lost")
            method, _, _ = ch.basic_get("dash-q", auto_ack=True)
            conn.process_data_events(time_limit=0.3)
            if not cluster:
                try:
                    evaluate_panels(port, "")  # answers once Prometheus is up
                except OSError:
                    continue  # Prometheus still starting
                ident = samples(node.scrape())
                cluster = next(dict(labels)["rabbitmq_cluster"] for name, labels in ident
                               if name == "rabbitmq_identity_info")
                continue
            results = evaluate_panels(port, cluster)
            newer = evaluate_panels(port, cluster, "panels_4x")
            empty = [title for title, result in results.items() if not result]
            empty += [f"4.x {title}" for title, result in newer.items() if not result]
            if not empty:
                break
        assert cluster, "Prometheus never answered"
        assert empty == [], f"panels without data: {empty}"
        assert len(results) == 41
        # The memory panel: limit minus what the alarm counts, positive while no alarm is set.
        memory = results["Memory available before publishers blocked"]
        assert float(memory[0]["value"][1]) > 0
        assert float(results["Publishers"][0]["value"][1]) >= 1
        conn.close()
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)


def test_quorum_queue_log_series(node: MetricsNode) -> None:
    """The Quorum-Queues-Raft dashboard's log series, per quorum queue, with Leveret's meaning
    (operations committed; what lies past the "snapshot" is what the queue holds)."""
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare("raft-q", durable=True, arguments={"x-queue-type": "quorum"})
        ch.queue_declare("classic-q", durable=True)
        for i in range(3):
            ch.basic_publish("", "raft-q", f"m{i}".encode(), pika.BasicProperties(delivery_mode=2))
        method, _, _ = ch.basic_get("raft-q")
        ch.basic_ack(method.delivery_tag)
        found = samples(node.scrape())
        q = {"vhost": "/", "queue": "raft-q"}
        assert value(found, "rabbitmq_raft_log_commit_index", **q) == 4  # 3 publishes, 1 settlement
        assert value(found, "rabbitmq_raft_log_last_written_index", **q) == 4
        assert value(found, "rabbitmq_raft_log_snapshot_index", **q) == 2  # 2 messages held
        assert not [k for k in found if k[0] == "rabbitmq_raft_log_commit_index" and ("queue", "classic-q") in k[1]]
    finally:
        conn.close()
