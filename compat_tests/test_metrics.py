"""The Prometheus endpoint of a real node, read with Prometheus's own text parser after real AMQP traffic.

Names, types, HELP and labels are checked against rabbitmq_prometheus's, since
RabbitMQ's Grafana dashboards query them by name.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from compat_tests.node_process import NodeProcess
from tests.ports import free_port


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
        assert value(found, "rabbitmq_process_resident_memory_bytes") > 10_000_000
        assert value(found, "rabbitmq_resident_memory_limit_bytes") > 0
        assert value(found, "rabbitmq_alarms_memory_used_watermark") == 0
        build = [labels for (name, labels) in found if name == "rabbitmq_build_info"]
        assert len(build) == 1 and dict(build[0])["product_name"] == "Leveret"
        assert {"rabbitmq_version", "erlang_version"} <= dict(build[0]).keys()
        ident = [dict(labels) for (name, labels) in found if name == "rabbitmq_identity_info"]
        assert ident and ident[0]["rabbitmq_cluster"] == "leveret" and ident[0]["rabbitmq_node"]
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
        "rabbitmq_detailed_queue_messages", "rabbitmq_detailed_queue_info"}
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
