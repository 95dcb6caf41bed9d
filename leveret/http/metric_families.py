"""Prometheus metric families read from a running node at scrape time.

Names, types, HELP texts and labels are rabbitmq_prometheus's (RabbitMQ
3.10-3.13: ``prometheus_rabbitmq_core_metrics_collector.erl``,
``rabbit_global_counters.erl``, ``prometheus_rabbitmq_alarm_metrics_collector.erl``),
so RabbitMQ's Grafana dashboards ("RabbitMQ-Overview" and friends) read a
Leveret node unchanged. Nothing here runs on the message path: the engine
keeps plain integers (``core.engine.node_stats.NodeStats``, queue lengths)
and a scrape walks them. Leveret's own series are under ``leveret_``.

Three views, as rabbitmq_prometheus serves them:
- ``aggregated`` (``/metrics``): per-object families summed over the node;
- ``per_object`` (``/metrics/per-object``): one series per queue;
- ``detailed`` (``/metrics/detailed?family=...``): only the families asked
  for, per object, under the ``rabbitmq_detailed_`` prefix.
"""

from __future__ import annotations

import functools
import json
import platform
import resource
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
    UnknownMetricFamily,
)

from core.engine.node_stats import SIZE_BUCKETS
from core.engine.stats import queue_counters
from leveret import __version__
from leveret.node import resources

if TYPE_CHECKING:
    from core.engine.queue import Queue
    from leveret.links.federation.link import FederationLink
    from leveret.node.wiring import Node

PROTOCOL = "amqp091"
QUEUE_TYPE = "rabbit_classic_queue"
# rabbitmq_queue_info's queue_type: RabbitMQ's queue type modules (as in its global counters' label).
QUEUE_TYPES = {"classic": QUEUE_TYPE, "quorum": "rabbit_quorum_queue", "stream": "rabbit_stream_queue"}
QUEUE_FAMILIES = ("queue_coarse_metrics", "queue_consumer_count", "queue_metrics")

# /metrics/detailed?family=NAME: the families this node can serve.
DETAILED_FAMILIES = (
    "queue_coarse_metrics",
    "queue_consumer_count",
    "queue_metrics",
    "connection_churn_metrics",
    "node_coarse_metrics",
    "node_metrics",
)


@dataclass(frozen=True)
class View:
    per_object: bool = False
    prefix: str = "rabbitmq_"
    families: tuple[str, ...] | None = None  # None: everything (not detailed)
    vhosts: frozenset[str] | None = None  # detailed only: restrict queue families
    endpoint: str = "aggregated"  # rabbitmq_identity_info's rabbitmq_endpoint

    def wants(self, family: str) -> bool:
        return self.families is None or family in self.families


AGGREGATED = View()
PER_OBJECT = View(per_object=True, endpoint="per-object")


def detailed(families: Iterable[str], vhosts: Iterable[str] = ()) -> View:
    vh = frozenset(vhosts)
    return View(per_object=True, prefix="rabbitmq_detailed_", families=tuple(families), vhosts=vh or None,
                endpoint="detailed")


def resident_memory_bytes() -> int:
    # No /proc: ru_maxrss (KiB on Linux) is the peak, the best left.
    return resources.rss_bytes() or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class NodeCollector:
    """A prometheus_client collector over one node, for one view."""

    def __init__(self, node: Node, view: View) -> None:
        self.node = node
        self.view = view

    def collect(self) -> Iterator[Metric]:
        view = self.view
        # Every view, /metrics/detailed with no family= too: the dashboards join on these.
        yield from self._identity()
        if view.families is None:
            yield from self._totals()
            yield from self._global_counters()
            yield from self._channel_counters()
            yield from self._auth_attempts()
            yield from self._alarms()
            yield from self._raft()
            yield from self._leveret()
        if view.wants("connection_churn_metrics"):
            yield from self._churn()
        if view.wants("node_coarse_metrics"):
            yield from self._node_coarse()
        if view.wants("node_metrics"):
            yield from self._node_limits()
        if view.wants("queue_coarse_metrics"):
            yield from self._queue_coarse()
        if view.wants("queue_metrics"):
            yield from self._queue_metrics()
        elif view.wants("queue_consumer_count"):
            yield from self._queue_consumers()
        if view.per_object and any(view.wants(f) for f in QUEUE_FAMILIES):
            yield self._queue_info()

    # -- helpers ---------------------------------------------------------------
    def _local_queues(self) -> list[Queue]:
        """Queues this node serves (a queue another node owns is reported there, as in RabbitMQ)."""
        vhosts = self.view.vhosts
        return [
            q for vh in self.node.broker.vhosts.values() if vhosts is None or vh.name in vhosts
            for q in vh.queues.values() if q.remote is None and not q.deleted
        ]

    def _name(self, name: str) -> str:
        return self.view.prefix + name

    # -- node totals -----------------------------------------------------------
    def _totals(self) -> Iterator[Metric]:
        node = self.node
        conns = [p.conn for p in node.amqp.connections if p.conn is not None]
        consumers = sum(
            len(ch.consumers) for vh in node.broker.vhosts.values() for q in vh.queues.values() for ch in q.channels
        )
        # MQTT connections count as RabbitMQ's MQTT plugin's do (they are connections, without channels).
        yield GaugeMetricFamily("rabbitmq_connections", "Connections currently open",
                                value=len(conns) + len(node.mqtt.open_links()))
        yield GaugeMetricFamily("rabbitmq_channels", "Channels currently open",
                                value=sum(len(c.channels) for c in conns))
        yield GaugeMetricFamily("rabbitmq_consumers", "Consumers currently connected", value=consumers)
        yield GaugeMetricFamily("rabbitmq_queues", "Queues available", value=len(self._local_queues()))

    def _cluster_name(self) -> str:
        """The cluster's name as /api/cluster-name says it (set_cluster_name; default: the node's name on a
        single node, the etcd cluster's otherwise): two unrelated nodes are not one cluster on a dashboard."""
        node = self.node
        federation = node.federation
        if federation is not None:
            return federation.cluster_name()
        return node.config.cluster if node.peers is not None else node.broker.node_id

    def _identity(self) -> Iterator[Metric]:
        node = self.node
        build = UnknownMetricFamily(
            "rabbitmq_build_info", "RabbitMQ & Erlang/OTP version info",
            labels=["product_name", "product_version", "rabbitmq_version", "prometheus_plugin_version",
                    "prometheus_client_version", "erlang_version"],
        )
        build.add_metric(["Leveret", __version__, __version__, __version__, _client_version(),
                          "Python " + platform.python_version()], 1)
        yield build
        # rabbitmq_endpoint: which of the three views answered (RabbitMQ 4's dashboards pin "aggregated").
        ident = UnknownMetricFamily("rabbitmq_identity_info", "RabbitMQ node & cluster identity info",
                                    labels=["rabbitmq_node", "rabbitmq_cluster", "rabbitmq_endpoint"])
        ident.add_metric([node.broker.node_id, self._cluster_name(), self.view.endpoint], 1)
        yield ident

    def _global_counters(self) -> Iterator[Metric]:
        s = self.node.broker.stats
        p = ["protocol"]
        pq = ["protocol", "queue_type"]
        for name, help_, value in (
            ("messages_received_total", "Total number of messages received from publishers", s.received),
            ("messages_received_confirm_total",
             "Total number of messages received from publishers expecting confirmations", s.received_confirm),
            ("messages_routed_total", "Total number of messages routed to queues or streams",
             max(0, s.received - s.unroutable_dropped - s.unroutable_returned)),
            ("messages_unroutable_dropped_total",
             "Total number of messages published as non-mandatory into an exchange and dropped as unroutable",
             s.unroutable_dropped),
            ("messages_unroutable_returned_total",
             "Total number of messages published as mandatory into an exchange and returned to the publisher "
             "as unroutable", s.unroutable_returned),
            ("messages_confirmed_total", "Total number of messages confirmed to publishers", s.confirmed),
        ):
            c = CounterMetricFamily("rabbitmq_global_" + name, help_, labels=p)
            c.add_metric([PROTOCOL], value)
            yield c
        publishers = GaugeMetricFamily("rabbitmq_global_publishers", "Current number of publishers", labels=p)
        publishers.add_metric([PROTOCOL], sum(  # open channels that have published
            1 for proto in self.node.amqp.connections if proto.conn is not None
            for ch in proto.conn.channels.values() if ch.own.received))
        yield publishers
        yield self._message_sizes()
        consumers = GaugeMetricFamily("rabbitmq_global_consumers", "Current number of consumers", labels=p)
        consumers.add_metric([PROTOCOL], sum(
            len(ch.consumers) for vh in self.node.broker.vhosts.values() for q in vh.queues.values()
            for ch in q.channels))
        yield consumers
        for name, help_, value in (
            ("messages_delivered_total", "Total number of messages delivered to consumers", s.delivered),
            ("messages_delivered_consume_manual_ack_total",
             "Total number of messages delivered to consumers using basic.consume with manual acknowledgment",
             s.delivered_consume_manual_ack),
            ("messages_delivered_consume_auto_ack_total",
             "Total number of messages delivered to consumers using basic.consume with automatic acknowledgment",
             s.delivered_consume_auto_ack),
            ("messages_delivered_get_manual_ack_total",
             "Total number of messages delivered to consumers using basic.get with manual acknowledgment",
             s.delivered_get_manual_ack),
            ("messages_delivered_get_auto_ack_total",
             "Total number of messages delivered to consumers using basic.get with automatic acknowledgment",
             s.delivered_get_auto_ack),
            ("messages_get_empty_total", "Total number of times basic.get operations fetched no message",
             s.get_empty),
            ("messages_redelivered_total", "Total number of messages redelivered to consumers", s.redelivered),
            ("messages_acknowledged_total", "Total number of messages acknowledged by consumers", s.acknowledged),
        ):
            c = CounterMetricFamily("rabbitmq_global_" + name, help_, labels=pq)
            c.add_metric([PROTOCOL, QUEUE_TYPE], value)
            yield c

    def _auth_attempts(self) -> Iterator[Metric]:
        """RabbitMQ 3.10's login counters, by protocol; Leveret counts MQTT's (the AMQP front end does not yet)."""
        s = self.node.mqtt.sessions
        for name, help_, value in (
            ("auth_attempts_total", "Total number of authorization attempts", s.auth_attempts),
            ("auth_attempts_succeeded_total", "Total number of successful authentication attempts",
             s.auth_attempts - s.auth_failed),
            ("auth_attempts_failed_total", "Total number of failed authentication attempts", s.auth_failed),
        ):
            c = CounterMetricFamily("rabbitmq_" + name, help_, labels=["protocol"])
            c.add_metric(["mqtt"], value)
            yield c

    def _channel_counters(self) -> Iterator[Metric]:
        """channel_exchange_metrics and channel_queue_metrics, summed over the node (what /metrics shows)."""
        s = self.node.broker.stats
        for name, help_, value in (
            ("channel_messages_published_total",
             "Total number of messages published into an exchange on a channel", s.received),
            ("channel_messages_confirmed_total",
             "Total number of messages published into an exchange and confirmed on the channel", s.confirmed),
            ("channel_messages_unroutable_returned_total",
             "Total number of messages published as mandatory into an exchange and returned to the publisher "
             "as unroutable", s.unroutable_returned),
            ("channel_messages_unroutable_dropped_total",
             "Total number of messages published as non-mandatory into an exchange and dropped as unroutable",
             s.unroutable_dropped),
            ("channel_get_ack_total",
             "Total number of messages fetched with basic.get in manual acknowledgement mode",
             s.delivered_get_manual_ack),
            ("channel_get_total", "Total number of messages fetched with basic.get in automatic acknowledgement mode",
             s.delivered_get_auto_ack),
            ("channel_messages_delivered_ack_total",
             "Total number of messages delivered to consumers in manual acknowledgement mode",
             s.delivered_consume_manual_ack),
            ("channel_messages_delivered_total",
             "Total number of messages delivered to consumers in automatic acknowledgement mode",
             s.delivered_consume_auto_ack),
            ("channel_messages_redelivered_total", "Total number of messages redelivered to consumers", s.redelivered),
            ("channel_messages_acked_total", "Total number of messages acknowledged by consumers", s.acknowledged),
            ("channel_get_empty_total", "Total number of times basic.get operations fetched no message", s.get_empty),
        ):
            yield CounterMetricFamily("rabbitmq_" + name, help_, value=value)
        channels = [ch for proto in self.node.amqp.connections if proto.conn is not None
                    for ch in proto.conn.channels.values()]
        yield GaugeMetricFamily("rabbitmq_channel_consumers", "Consumers on a channel",
                                value=sum(len(ch.consumers) for ch in channels))
        yield GaugeMetricFamily("rabbitmq_channel_messages_unconfirmed", "Published but not yet confirmed messages",
                                value=sum(ch.publish_seq - ch.confirmed_upto for ch in channels if ch.confirm))
        yield CounterMetricFamily("rabbitmq_queue_messages_published_total",
                                  "Total number of messages published to queues",
                                  value=sum(q.published for q in self._local_queues()))

    def _churn(self) -> Iterator[Metric]:
        s = self.node.broker.stats
        for name, help_, value in (
            ("connections_opened_total", "Total number of connections opened", s.connections_opened),
            ("connections_closed_total", "Total number of connections closed or terminated", s.connections_closed),
            ("channels_opened_total", "Total number of channels opened", s.channels_opened),
            ("channels_closed_total", "Total number of channels closed", s.channels_closed),
            ("queues_declared_total", "Total number of queues declared", s.queues_declared),
            ("queues_created_total", "Total number of queues created", s.queues_created),
            ("queues_deleted_total", "Total number of queues deleted", s.queues_deleted),
        ):
            yield CounterMetricFamily(self._name(name), help_, value=value)

    def _message_sizes(self) -> Metric:
        """RabbitMQ 4.1's rabbitmq_message_size_bytes: published body sizes, its buckets (100 B to 100 MB)."""
        s = self.node.broker.stats
        buckets: list[tuple[str, float]] = []
        seen = 0
        for bound, count in zip((*map(str, SIZE_BUCKETS), "+Inf"), s.message_sizes, strict=True):
            seen += count
            buckets.append((bound, seen))
        h = HistogramMetricFamily("rabbitmq_message_size_bytes", "Size of messages received from publishers",
                                  labels=["protocol"])
        h.add_metric([PROTOCOL], buckets, sum_value=s.message_bytes)
        return h

    def _node_coarse(self) -> Iterator[Metric]:
        node = self.node
        yield GaugeMetricFamily(self._name("process_open_fds"), "Open file descriptors", value=resources.open_fds())
        yield GaugeMetricFamily(self._name("process_open_tcp_sockets"), "Open TCP sockets",
                                value=len(node.amqp.connections) + len(node.mqtt.links))
        # What the memory alarm counts against rabbitmq_resident_memory_limit_bytes (leveret/node/resources.py),
        # so the dashboards' "memory available before publishers blocked" (limit minus this) reaches 0 when
        # the alarm goes off; the process's RSS is leveret_process_resident_memory_bytes.
        yield GaugeMetricFamily(self._name("process_resident_memory_bytes"), "Memory used in bytes",
                                value=resources.memory_use(node.broker, node.amqp, node.mqtt).total)
        yield GaugeMetricFamily("leveret_process_resident_memory_bytes", "Resident set size of the node's process",
                                value=resident_memory_bytes())
        try:
            free = shutil.disk_usage(node.config.data_dir).free
        except OSError:
            free = 0
        yield GaugeMetricFamily(self._name("disk_space_available_bytes"), "Disk space available in bytes",
                                value=free)

    def _node_limits(self) -> Iterator[Metric]:
        node = self.node
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        yield GaugeMetricFamily(self._name("process_max_fds"), "Open file descriptors limit", value=soft)
        yield GaugeMetricFamily(self._name("process_max_tcp_sockets"), "Open TCP sockets limit", value=soft)
        yield GaugeMetricFamily(self._name("resident_memory_limit_bytes"), "Memory high watermark in bytes",
                                value=node.watermark_bytes())
        yield GaugeMetricFamily(self._name("disk_space_available_limit_bytes"),
                                "Free disk space low watermark in bytes", value=node.disk_free_limit_bytes())
        yield GaugeMetricFamily(self._name("erlang_uptime_seconds"), "Node uptime",
                                value=time.monotonic() - node.started_at)

    def _alarms(self) -> Iterator[Metric]:
        # RabbitMQ 3.10's names (3.13 renamed them *_limit); the published dashboards read these.
        for name, help_, on in (
            ("file_descriptor_limit", "is 1 if file descriptor limit alarm is in effect", False),
            ("free_disk_space_watermark", "is 1 if free disk space watermark alarm is in effect",
             self.node.broker.disk_alarm),
            ("memory_used_watermark", "is 1 if VM memory watermark alarm is in effect", self.node.broker.memory_alarm),
        ):
            yield UnknownMetricFamily("rabbitmq_alarms_" + name, help_, value=1 if on else 0)

    # -- queues ----------------------------------------------------------------
    def _queue_coarse(self) -> Iterator[Metric]:
        queues = self._local_queues()
        ready = GaugeMetricFamily(self._name("queue_messages_ready"), "Messages ready to be delivered to consumers",
                                  labels=self._labels())
        unacked = GaugeMetricFamily(self._name("queue_messages_unacked"),
                                    "Messages delivered to consumers but not yet acknowledged", labels=self._labels())
        total = GaugeMetricFamily(self._name("queue_messages"),
                                  "Sum of ready and unacknowledged messages - total queue depth",
                                  labels=self._labels())
        if self.view.per_object:
            for q in queues:
                r, u = q.message_count, q.default.unacked
                key = [q.vhost, q.name]
                ready.add_metric(key, r)
                unacked.add_metric(key, u)
                total.add_metric(key, r + u)
        else:
            r = sum(q.message_count for q in queues)
            u = sum(q.default.unacked for q in queues)
            ready.add_metric([], r)
            unacked.add_metric([], u)
            total.add_metric([], r + u)
        yield ready
        yield unacked
        yield total

    def _raft(self) -> Iterator[Metric]:
        """The Quorum-Queues-Raft dashboard's log series, per quorum queue this node owns, with Leveret's
        meaning: a quorum queue is one owner writing to the store (no Raft log), so its "log" is its
        operations (publishes and settlements, every one committed before it is answered) and what
        lies past the "snapshot" is what the queue holds. docs/METRICS.md says which panels follow."""
        labels = ["vhost", "queue"]
        commit = GaugeMetricFamily("rabbitmq_raft_log_commit_index", "Raft log commit index", labels=labels)
        written = GaugeMetricFamily("rabbitmq_raft_log_last_written_index", "Raft log last written index",
                                    labels=labels)
        snapshot = GaugeMetricFamily("rabbitmq_raft_log_snapshot_index", "Raft log snapshot index", labels=labels)
        for q in self._local_queues():
            if not q.args.quorum:
                continue
            published, _delivered, acked, _redelivered = queue_counters(q)
            ops = published + acked
            key = [q.vhost, q.name]
            commit.add_metric(key, ops)
            written.add_metric(key, ops)
            snapshot.add_metric(key, ops - q.message_count - q.default.unacked)
        yield commit
        yield written
        yield snapshot

    def _labels(self) -> list[str]:
        return ["vhost", "queue"] if self.view.per_object else []

    def _queue_consumers(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(self._name("queue_consumers"), "Consumers on a queue", labels=self._labels())
        queues = self._local_queues()
        if self.view.per_object:
            for q in queues:
                g.add_metric([q.vhost, q.name], q.consumer_count)
        else:
            g.add_metric([], sum(q.consumer_count for q in queues))
        yield g

    def _queue_info(self) -> Metric:
        """The queue type, as RabbitMQ 4.1+ gives it (rabbitmq_queue_info): per-queue series carry no type label.

        Per object and, on /metrics/detailed, when a queue family is asked for. ``membership``
        is ``leader`` (the node serving the queue); a queue another node owns is reported there,
        as RabbitMQ leaves out queues a node is not a member of.
        """
        g = GaugeMetricFamily(self._name("queue_info"),
                              "A metric with a constant '1' value and labels that provide some queue details",
                              labels=["vhost", "queue", "queue_type", "membership"])
        for q in self._local_queues():
            g.add_metric([q.vhost, q.name, QUEUE_TYPES.get(q.args.queue_type, QUEUE_TYPE), "leader"], 1)
        return g

    def _queue_metrics(self) -> Iterator[Metric]:
        yield from self._queue_consumers()
        labels = self._labels()
        ready_bytes = GaugeMetricFamily(self._name("queue_messages_ready_bytes"), "Size in bytes of ready messages",
                                        labels=labels)
        queues = self._local_queues()
        if self.view.per_object:
            for q in queues:
                ready_bytes.add_metric([q.vhost, q.name], q.default.ready_bytes)
        else:
            ready_bytes.add_metric([], sum(q.default.ready_bytes for q in queues))
        yield ready_bytes

    # -- Leveret's own -------------------------------------------------------------
    def _leveret(self) -> Iterator[Metric]:
        node = self.node
        held = GaugeMetricFamily("leveret_memory_held_bytes", "What the memory alarm counts, by part "
                                 "(docs/AMQP.md, Resource alarms); compare with rabbitmq_process_resident_memory_bytes",
                                 labels=["part"])
        use = resources.memory_use(node.broker, node.amqp, node.mqtt)
        held.add_metric(["bodies"], use.bodies)
        held.add_metric(["index"], use.index)
        held.add_metric(["partial_and_buffers"], use.partial_and_buffers)
        yield held
        committer = node.broker.committer
        if committer is not None:
            yield SummaryMetricFamily(
                "leveret_group_commit_batch_size", "Store operations per group commit (count: commits)",
                count_value=committer.commits, sum_value=committer.committed_ops)
            yield SummaryMetricFamily(
                "leveret_group_commit_duration_seconds", "Time the store took to commit one group",
                count_value=committer.commits, sum_value=committer.commit_seconds)
            yield CounterMetricFamily("leveret_group_commit_failures_total", "Group commits the store refused",
                                      value=committer.failures)
            yield CounterMetricFamily(
                "leveret_group_commit_cancelled_appends_total",
                "Appends never written because their message was settled before the commit started",
                value=committer.cancelled)
        peers = node.peers
        if peers is not None:
            inflight = GaugeMetricFamily("leveret_forwarding_inflight_bytes",
                                         "Bytes forwarded to a peer's queues and not yet answered", labels=["peer"])
            congested = GaugeMetricFamily("leveret_forwarding_congested",
                                          "1 while forwarding to this peer holds publishers back", labels=["peer"])
            for peer, link in peers.links.items():
                inflight.add_metric([peer], link.inflight_bytes)
                congested.add_metric([peer], 1 if link.congested else 0)
            yield inflight
            yield congested
            yield GaugeMetricFamily("leveret_lease_age_seconds",
                                    "Seconds since this node's etcd lease was last refreshed",
                                    value=time.monotonic() - node.lease.granted_at if node.lease is not None else 0)
            owned = GaugeMetricFamily("leveret_owned_queues", "Queues each node owns, as this node sees the cluster",
                                      labels=["node"])
            for owner, count in sorted(node.broker.coordinator.owner_counts().items()):
                owned.add_metric([owner], count)
            yield owned
        federation = node.federation
        if federation is not None:
            yield from _federation(federation.running.values())
        retention = node.retention
        if retention is not None:
            yield CounterMetricFamily("leveret_retention_runs_total",
                                      "Retention job runs this node started and saw finish", value=retention.runs)
        yield from _last_retention_report(Path(node.config.data_dir) / "retention" / "last-report.json")


def _federation(links: Iterable[FederationLink]) -> Iterator[Metric]:
    """The federation links this node runs (docs/FEDERATION.md): a handful, so one series per link."""
    by_status = GaugeMetricFamily("leveret_federation_links", "Federation links this node runs, by status",
                                  labels=["status"])
    forwarded = CounterMetricFamily("leveret_federation_messages_forwarded",
                                    "Messages a federation link republished into its exchange",
                                    labels=["vhost", "exchange", "upstream"])
    dropped = CounterMetricFamily("leveret_federation_messages_dropped",
                                  "Messages a federation link dropped by loop prevention (max-hops, x-received-from)",
                                  labels=["vhost", "exchange", "upstream"])
    counts = dict.fromkeys(("running", "starting", "error"), 0)
    for link in links:
        counts[link.state] = counts.get(link.state, 0) + 1
        labels = [link.spec.vhost, link.spec.exchange, link.spec.upstream.name]
        forwarded.add_metric(labels, link.forwarded)
        dropped.add_metric(labels, link.dropped)
    for status, n in counts.items():
        by_status.add_metric([status], n)
    yield by_status
    yield forwarded
    yield dropped


_report_cache: dict[str, tuple[float, dict[str, Any]]] = {}


def _last_retention_report(path: Path) -> Iterator[Metric]:
    """Totals of the last scheduled retention run (--retention-interval), re-read only when the file changes."""
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return
    cached = _report_cache.get(str(path))
    if cached is None or cached[0] != mtime:
        try:
            report = json.loads(path.read_text())
            totals = {k: report["totals"][k] for k in ("kept_messages", "removed_messages", "archived_messages",
                                                       "kept_bytes", "removed_bytes")}
            totals["now"] = report["now"]
        except (OSError, ValueError, KeyError, TypeError):
            return  # being written, or from another version: no series rather than a failed scrape
        cached = _report_cache[str(path)] = (mtime, totals)
    totals = cached[1]
    yield GaugeMetricFamily("leveret_retention_last_run_timestamp_seconds",
                            "When the last retention run this node scheduled looked at the store (Unix time)",
                            value=totals["now"])
    messages = GaugeMetricFamily("leveret_retention_last_run_messages",
                                 "Messages the last retention run kept, removed and archived", labels=["outcome"])
    for outcome in ("kept", "removed", "archived"):
        messages.add_metric([outcome], totals[f"{outcome}_messages"])
    yield messages
    size = GaugeMetricFamily("leveret_retention_last_run_bytes", "Bytes the last retention run kept and removed",
                             labels=["outcome"])
    for outcome in ("kept", "removed"):
        size.add_metric([outcome], totals[f"{outcome}_bytes"])
    yield size


@functools.cache
def _client_version() -> str:
    try:
        from importlib.metadata import version

        return version("prometheus-client")
    except Exception:  # noqa: BLE001 - a label, never worth failing a scrape
        return "unknown"


def registry(node: Node, view: View) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(NodeCollector(node, view))
    return reg
