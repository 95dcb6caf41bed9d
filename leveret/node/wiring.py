"""A Leveret node: the core, the AMQP listener, and their lifecycle."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from amqp_frontend.connection import ServerSettings
from amqp_frontend.server import AMQPServer
from coordination.local import LocalCoordinator
from core.durable.durability import Durability
from core.durable.group_commit import GroupCommitter
from core.engine import paging
from core.engine.alarms import DISK, MEMORY
from core.engine.broker import Broker
from core.engine.stream import StreamQueue
from core.model import private_files
from core.model.tasks import spawn
from core.ports.store import MessageStore, StoreError
from leveret import __version__
from leveret.http.metrics import MetricsServer
from leveret.links.federation.manager import FederationManager
from leveret.links.shovel.manager import ShovelManager
from leveret.node import logs, resources
from leveret.node.config import NodeConfig
from leveret.node.grpc_server import GRPCServer
from leveret.node.policy_watch import PolicyWatch
from leveret.node.retention_schedule import RetentionService
from leveret.node.tls import ServerTLS, TLSFiles
from mqtt_frontend.connection import MqttSettings
from mqtt_frontend.server import MQTTServer
from mqtt_frontend.websocket import WebSocketListener

if TYPE_CHECKING:
    import grpc

    from coordination.etcd import EtcdCoordinator
    from core.cluster.auth import PeerAuth
    from core.cluster.link import Peers
    from core.engine.broker import User
    from core.engine.ownership import Lease
    from leveret.http.server import ManagementAPI
    from leveret.node.cluster_server import ClusterServer

log = logging.getLogger("leveret.node")


class Node:
    def __init__(self, config: NodeConfig) -> None:
        from leveret.node import passwords

        passwords.install()  # argon2id for every password hashed from now on (the default user's too)
        self.config = config
        self.local = LocalCoordinator(config.resolved_node_id)
        # In a cluster the etcd coordinator replaces it once it has joined (start()).
        self.broker = Broker(
            node_id=config.resolved_node_id, default_user=(config.default_user, config.default_pass),
            coordinator=self.local, loopback_users=config.loopback_user_names,
        )
        self.local.attach(self.broker)
        self.local.region = config.region
        self.store: MessageStore | None = None
        # The retention watch and schedule (leveret/node/retention_schedule.py).
        self.retention: RetentionService | None = None
        self.amqp = AMQPServer(
            self.broker,
            ServerSettings(
                channel_max=config.channel_max,
                frame_max=config.frame_max,
                heartbeat=config.heartbeat,
                max_message_size=config.max_message_size,
                version=__version__,
            ),
        )
        self.grpc = GRPCServer(self.broker, config.max_message_size)
        self.mqtt = MQTTServer(self.broker, MqttSettings(vhost=config.mqtt_vhost,
                                                         max_packet_size=config.max_message_size))
        self.mqtt_ws: WebSocketListener | None = None
        self.grpc.servicer.region = config.region
        self.etcd: EtcdCoordinator | None = None
        self.cluster_server: ClusterServer | None = None
        # AMQPS (and gRPC with --grpc-tls): one context, reloaded on SIGHUP for new connections.
        self.tls: ServerTLS | None = None
        if config.tls_cert:
            self.tls = ServerTLS(TLSFiles(config.tls_cert, config.tls_key, config.tls_ca, config.tls_verify,
                                          config.tls_fail_if_no_peer_cert))
        # The HTTP listeners (--http-tls): the same files, but no client certificate asked for.
        self.http_tls: ServerTLS | None = None
        if config.http_tls and config.tls_cert:
            self.http_tls = ServerTLS(TLSFiles(config.tls_cert, config.tls_key, config.tls_ca, "none", False))
        self._grpc_renewed: object = None  # a gRPC certificate configuration waiting for the next handshake
        self._grpc_current: Callable[[], object] | None = None
        self.broker.on_user_rehashed.append(self._save_rehashed)
        self.management: ManagementAPI | None = None
        self.metrics: MetricsServer | None = None  # --prometheus-port (leveret/http/metrics.py)
        self.policy_watch: PolicyWatch | None = None
        self.shovels: ShovelManager | None = None
        self.federation: FederationManager | None = None  # leveret/links/federation/, fed by the shovels' parameters
        self.started_at = time.monotonic()
        self._background: set[asyncio.Task[object]] = set()  # fire-and-forget work, held until it ends
        StreamQueue.memory_limit = config.stream_memory_bytes
        paging.configure(config.queue_memory_bytes, config.queue_memory_node_bytes,
                         str(Path(config.data_dir) / "paging"))

    def _save_rehashed(self, user: User) -> None:
        """A login replaced an old password record (core/engine/passwords.py): keep the new one."""
        spawn(self._persist_user(user), self._background)

    async def _persist_user(self, user: User) -> None:
        try:
            await self.broker.coordinator.save_user(user)  # the store, and in a cluster every node
        except Exception as exc:  # noqa: BLE001 - the old record still verifies; retried at the next login
            log.warning("could not save a re-hashed password record", extra={"user": user.name, "error": str(exc)})
            return
        log.info("password record upgraded", extra={"user": user.name})

    def _grpc_credentials(self) -> grpc.ServerCredentials | None:
        """--grpc-tls: the node's certificate on the gRPC port too, renewed by SIGHUP as for AMQPS."""
        if not self.config.grpc_tls or self.tls is None:
            return None
        import grpc

        tls = self.tls

        def current() -> grpc.ServerCertificateConfiguration:
            key, chain, ca = tls.pem()
            return grpc.ssl_server_certificate_configuration([(key, chain)], root_certificates=ca)

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            # gRPC asks before each handshake; a reload leaves the new files here once.
            pending, self._grpc_renewed = self._grpc_renewed, None
            return pending

        self._grpc_current = current
        return grpc.dynamic_ssl_server_credentials(
            current(), fetch, require_client_authentication=self.config.tls_fail_if_no_peer_cert)

    def _peer_auth(self) -> PeerAuth:
        from core.cluster.auth import ClusterTLS, PeerAuth
        from core.ports.coordinator import ClusterStartError

        cfg = self.config
        try:
            secret = Path(cfg.cluster_secret_file).read_bytes().strip() if cfg.cluster_secret_file else None
            tls = (ClusterTLS(Path(cfg.cluster_tls_cert).read_bytes(), Path(cfg.cluster_tls_key).read_bytes(),
                              Path(cfg.cluster_tls_ca).read_bytes(),
                              Path(cfg.cluster_tls_peers).read_bytes() if cfg.cluster_tls_peers else b"")
                   if cfg.cluster_tls_cert else None)
        except OSError as exc:
            raise ClusterStartError(f"cannot read the cluster credentials: {exc}") from None
        if secret is not None and len(secret) < 16:
            raise ClusterStartError(f"the cluster secret in {cfg.cluster_secret_file} is shorter than 16 bytes: "
                                    "too easy to guess (e.g. `openssl rand -hex 32 > FILE`)")
        return PeerAuth(secret=secret, tls=tls)

    @property
    def peers(self) -> Peers | None:
        """The links to the other nodes (forwarding metrics); None on a single node."""
        return self.etcd.peers if self.etcd is not None else None

    @property
    def lease(self) -> Lease | None:
        """This node's etcd lease once granted (its age is a metric); None on a single node."""
        return self.etcd.lease if self.etcd is not None and self.etcd.lease_id else None

    def _make_store(self) -> MessageStore:
        return make_store(self.config)

    async def _open_store(self) -> None:
        store = self._make_store()
        await store.open()
        self.store = store
        self.local.attach(self.broker, store)
        committer = GroupCommitter(store, on_fenced=self._fenced)
        self.broker.committer = committer
        durability = Durability(store, committer)
        # Policies set through any vhost go to the store, where every node reads them (policy_watch).
        self.broker.set_policy_writer(durability.policy_changed)
        if self.config.etcd:
            # Cluster mode: etcd holds the topology; each queue's owner loads
            # its backlog when it takes the queue (coordination/etcd.py).
            # Stored users and vhosts seed the cluster's when it has none.
            await durability.restore_users(self.broker)
            await durability.restore_policies(self.broker)
            log.info("store opened", extra={"store": store.description, "mode": "cluster"})
        else:
            queues = await durability.restore_topology(self.broker)
            messages = await self.local.take_over_stored_queues(durability, queues, self.broker.vhosts.values())
            log.info("store opened", extra={"store": store.description, "durable_queues": len(queues),
                                            "messages_restored": messages})
        # Policies `leveret policies` and `leveret retention policy` write to the store with no node
        # involved (leveret/node/policy_watch.py); those set through a node reach the others through
        # the coordinator.
        self.policy_watch = PolicyWatch(self.broker, store)
        await self.policy_watch.start()
        from leveret.node.retention_schedule import start_retention

        self.retention = await start_retention(self)

    def _advertised(self, port: int) -> str:
        host = self.config.advertise_host or self.config.bind
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def _make_etcd(self) -> EtcdCoordinator:
        from coordination.etcd import ClusterSettings, EtcdCoordinator
        from coordination.etcd_client import EtcdTLS
        from core.ports.coordinator import ClusterStartError
        from leveret.node.cluster_server import ClusterServer

        cfg = self.config
        assert self.store is not None and self.broker.committer is not None
        auth = self._peer_auth()
        try:
            etcd_tls = EtcdTLS.from_files(cfg.etcd_cacert, cfg.etcd_cert, cfg.etcd_key)
        except (OSError, ValueError) as exc:
            raise ClusterStartError(f"cannot read the etcd TLS files: {exc}") from None
        settings = ClusterSettings(
            endpoints=[e for e in (part.strip() for part in cfg.etcd.split(",")) if e],
            cluster=cfg.cluster, region=cfg.region, lease_ttl=cfg.lease_ttl, node_id=self.broker.node_id,
            amqp_address=self._advertised(cfg.amqp_port), grpc_address=self._advertised(cfg.grpc_port),
            cluster_address=self._advertised(cfg.advertise_cluster_port or cfg.cluster_port),
            cluster_remote_address=cfg.advertise_cluster_remote,
            auth=auth, etcd_tls=etcd_tls,
            etcd_user=cfg.etcd_user, etcd_password=cfg.etcd_password,
        )
        cluster = EtcdCoordinator(self.broker, self.store, self.broker.committer, settings,
                              on_event=self.grpc.servicer.cluster_event)
        self.grpc.servicer.members = lambda: [m.as_dict() for m in cluster.members()]
        self.cluster_server = ClusterServer(cluster.service, auth)
        log.info("cluster peers authenticate with " + auth.mode)
        return cluster

    def _fenced(self, queues: list[tuple[str, str]]) -> None:
        if self.etcd is not None:
            self.etcd.fenced(queues)
            return
        for vhost, name in queues:
            vh = self.broker.vhosts.get(vhost)
            if vh is not None:
                vh.abandon_queue(name)

    async def start(self) -> None:
        # Bounded logs and no exception lost in the loop (docs/notes/reliability.md).
        logs.install()
        # Every message allocates a few GC-tracked objects; with the default
        # threshold (700) the collector ran ~30 % of the publish path in
        # profiles (bench/inprocess.py). Messages hold no cycles, so collect
        # the young generation far less often and keep start-up objects out.
        gc.collect()
        gc.freeze()
        gc.set_threshold(50_000, 20, 100)
        private_files.private_dir(self.config.data_dir)  # 0700: hashes, bodies, URIs (docs/SECURITY.md)
        await self._open_store()
        # Scrapeable before clients are served: a probe that saw AMQP answer can read the metrics too.
        if self.config.prometheus_port:
            self.metrics = MetricsServer(self)
            try:
                await self.metrics.start(self.config.bind, self.config.prometheus_port, self._http_ssl())
            except OSError as exc:
                raise OSError(exc.errno, f"Prometheus port {self.config.prometheus_port}: "
                                         f"{exc.strerror or exc}") from exc
        if self.config.etcd:
            # Peers reach us over gRPC as soon as we register, and clients
            # must not be served before the cluster's metadata is mirrored.
            self.etcd = self._make_etcd()
            assert self.cluster_server is not None
            await self.cluster_server.start(self.config.bind, self.config.cluster_port)
            await self.grpc.start(self.config.bind, self.config.grpc_port, self._grpc_credentials())
            await self.etcd.start()
            self.broker.coordinator = self.etcd
            if self.policy_watch is not None:
                self.policy_watch.on_store_change.append(self.etcd.policy_stored)
            await self._start_amqp()
        else:
            await self._start_amqp()
            await self.grpc.start(self.config.bind, self.config.grpc_port, self._grpc_credentials())
        await self._start_mqtt()
        self._monitor = asyncio.create_task(self._watch_memory())
        await self._start_shovels()
        await self._start_management()
        log.info(
            "node started",
            extra={
                "node": self.broker.node_id,
                "amqp": f"{self.config.bind}:{self.amqp.port}",
                "grpc": f"{self.config.bind}:{self.grpc.port}" + (" (tls)" if self.config.grpc_tls else ""),
                "amqps": f"{self.config.bind}:{self.amqp.tls_port}" if self.config.resolved_amqps_port else "off",
                "cluster_port": self.cluster_server.port if self.cluster_server is not None else "off",
                "prometheus": f"{self.config.bind}:{self.metrics.port}" if self.metrics else "off",
                "data_dir": os.path.abspath(self.config.data_dir),
                "pid": os.getpid(),
            },
        )

    async def _start_shovels(self) -> None:
        """Runtime parameters back from the store; the shovels and federation links this node holds started."""
        assert self.store is not None
        node = self.broker.node_id
        coordinator = self.broker.coordinator
        self.shovels = ShovelManager(self.broker, coordinator, node, self.amqp.port)
        # RabbitMQ's default cluster name is its first node's name; a cluster here has its own name.
        self.federation = FederationManager(self.broker, coordinator, node, self.amqp.port,
                                            self.config.cluster if self.etcd is not None else node,
                                            self._advertise_cluster_name)
        self.shovels.listeners.append(self.federation)
        await self.shovels.start()
        await self.federation.start()

    def _advertise_cluster_name(self, name: str) -> None:
        """The AMQP server properties' cluster_name, which federation links upstream of us record."""
        self.amqp.settings.server_properties_extra["cluster_name"] = name

    async def _start_amqp(self) -> None:
        await self.amqp.start(self.config.bind, self.config.amqp_port)
        if self.tls is not None and self.config.resolved_amqps_port:
            await self.amqp.start_tls(self.config.bind, self.config.resolved_amqps_port, self.tls.context)

    async def _start_mqtt(self) -> None:
        """MQTT, MQTT over TLS (the AMQPS certificate) and over WebSocket; a port of 0 is no listener."""
        cfg = self.config
        port = cfg.mqtt_port
        try:
            if port:
                await self.mqtt.start(cfg.bind, port)
            port = cfg.resolved_mqtt_tls_port
            if self.tls is not None and port:
                await self.mqtt.start_tls(cfg.bind, port, self.tls.context)
            port = cfg.mqtt_ws_port
            if port:
                self.mqtt_ws = WebSocketListener(self.mqtt)
                await self.mqtt_ws.start(cfg.bind, port, self._http_ssl())
        except OSError as exc:  # say which port (a RabbitMQ with rabbitmq_mqtt may hold 1883): --mqtt-port 0
            raise OSError(exc.errno, f"MQTT port {port}: {exc.strerror or exc}") from exc

    def _http_ssl(self) -> ssl.SSLContext | None:
        return self.http_tls.context if self.http_tls is not None else None

    def reload_tls(self) -> None:
        """SIGHUP: new connections get the certificate files as they are now."""
        if self.http_tls is not None:
            self.http_tls.reload()
        if self.tls is None:
            log.info("SIGHUP: no TLS certificate configured, nothing to reload")
            return
        if self.tls.reload() and self._grpc_current is not None:
            try:
                self._grpc_renewed = self._grpc_current()
            except OSError as exc:
                log.error("gRPC certificate reload failed", extra={"error": str(exc)})

    async def _start_management(self) -> None:
        if not self.config.management_port:
            return
        from leveret.http.server import ManagementAPI

        api = ManagementAPI(self)
        try:
            await api.start(self.config.bind, self.config.management_port, self._http_ssl())
        except OSError as exc:
            # The broker itself is up; an operator sees this line and the missing
            # port-listener check rather than a node that will not start.
            log.error("management API not started", extra={
                "host": self.config.bind, "port": self.config.management_port, "error": exc.strerror or str(exc)})
            await api.stop()
            return
        self.management = api

    def watermark_bytes(self) -> int:
        mark = self.config.memory_high_watermark
        if mark > 1:
            return int(mark)
        return int(mark * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    def disk_free_limit_bytes(self) -> int:
        """``--disk-free-limit`` in bytes (validated at start: leveret/node/config.py)."""
        return resources.parse_disk_free_limit(self.config.disk_free_limit, resources.total_memory())

    def queued_bytes(self) -> int:
        """What the memory alarm counts (leveret/node/resources.py): bodies, index, partial bodies, buffers."""
        return resources.memory_use(self.broker, self.amqp, self.mqtt).total

    async def _watch_memory(self) -> None:
        """The memory and disk alarms (leveret/node/resources.py says what they count), every half second.

        RSS is not the memory alarm's input because CPython rarely returns freed
        memory, so an alarm on it would never clear; the log line gives both.
        """
        while True:
            await asyncio.sleep(0.5)
            # Read each time: `leveret ctl set_vm_memory_high_watermark` / `set_disk_free_limit` change them.
            limit = self.watermark_bytes()
            disk_limit = self.disk_free_limit_bytes()
            # Paged queues hold only their window in memory (core/engine/paging.py): the node-wide
            # cap pages the largest ones out before the alarm would block publishers.
            paging.enforce_node_cap((ch for vh in self.broker.vhosts.values() for q in vh.queues.values()
                                     for ch in q.channels), paging.settings.node_bytes)
            use = resources.memory_use(self.broker, self.amqp, self.mqtt)
            used = use.total
            if used > limit and not self.broker.memory_alarm:
                log.warning("memory high watermark reached", extra={
                    "held_bytes": used, "bodies": use.bodies, "index": use.index,
                    "partial_and_buffers": use.partial_and_buffers, "rss": resources.rss_bytes(), "limit": limit})
                self.amqp.set_alarm(MEMORY, True)
            elif used <= limit * 0.9 and self.broker.memory_alarm:
                self.amqp.set_alarm(MEMORY, False)
            try:
                free = resources.disk_free(self.config.data_dir)
            except OSError:
                continue
            if free < disk_limit and not self.broker.disk_alarm:
                log.warning("disk free space below the limit", extra={"free": free, "limit": disk_limit})
                self.amqp.set_alarm(DISK, True)
            elif free >= disk_limit and self.broker.disk_alarm:
                self.amqp.set_alarm(DISK, False)

    async def stop(self) -> None:
        log.info("node stopping", extra={"node": self.broker.node_id, "connections": len(self.amqp.connections)})
        self._monitor.cancel()
        if self.management is not None:
            await self.management.stop()
        if self.federation is not None:
            await self.federation.stop()
        if self.shovels is not None:
            await self.shovels.stop()
        if self.etcd is not None:
            # Hand our queues to the other nodes first, while we still serve them.
            await self.etcd.stop(handover=True)
        await self.grpc.stop()
        if self.cluster_server is not None:
            await self.cluster_server.stop()
        if self.mqtt_ws is not None:
            await self.mqtt_ws.stop()
        await self.mqtt.stop()
        await self.amqp.stop()
        if self.metrics is not None:
            await self.metrics.stop()
        if self.retention is not None:
            await self.retention.stop()
        if self.policy_watch is not None:
            await self.policy_watch.stop()
        # Everything pending is written, however long it takes while the store keeps
        # committing (50,000 declarations pending at SIGTERM once outlasted a fixed 10 s).
        if self.broker.committer is not None and not await self.broker.committer.drain_while_progressing():
            log.error("store writes still pending at shutdown and the store makes no progress; they are lost",
                      extra={"store": self.store.description if self.store else "-"})
        if self.store is not None:
            await self.store.close()
        log.info("node stopped", extra={"node": self.broker.node_id})
        logs.flush_rate_limit()

    async def run_until_signalled(self) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, self.reload_tls)
        await self.start()
        await stop.wait()
        await self.stop()


def make_store(cfg: NodeConfig) -> MessageStore:
    """The store the config names (also used by the ``users``/``vhosts`` commands)."""
    if cfg.store == "sqlite":
        from persistence.sqlite import SQLiteStore

        threshold = cfg.body_store_threshold if cfg.body_store_threshold > 0 else 2**63 - 1
        return SQLiteStore(str(Path(cfg.data_dir) / "leveret.sqlite3"), body_threshold=threshold)
    if cfg.store == "postgres":
        if not cfg.postgres_dsn:
            raise StoreError("--store postgres needs --postgres-dsn (or LEVERET_POSTGRES_DSN)")
        from persistence.postgres import PostgresStore

        return PostgresStore(cfg.postgres_dsn, commit_timeout=cfg.postgres_commit_timeout)
    raise StoreError(f"unknown store {cfg.store!r}; use sqlite or postgres")


def run(config: NodeConfig) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency, but stay usable without it
        asyncio.run(Node(config).run_until_signalled())
        return
    uvloop.run(Node(config).run_until_signalled())
