"""A Leveret node: the core, the AMQP listener, and their lifecycle."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from amqp_frontend.connection import ServerSettings
from amqp_frontend.server import AMQPServer
from core.durable.durability import Durability
from core.durable.group_commit import GroupCommitter
from core.engine.broker import Broker
from core.engine.stream import StreamQueue
from core.ports.store import MessageStore, StoreError
from leveret import __version__, logs
from leveret.config import NodeConfig
from leveret.grpc_server import GRPCServer
from leveret.retention_schedule import RetentionService

if TYPE_CHECKING:
    from coordination.etcd import EtcdCluster

log = logging.getLogger("leveret.node")


class Node:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.broker = Broker(
            node_id=config.resolved_node_id, default_user=(config.default_user, config.default_pass)
        )
        self.store: MessageStore | None = None
        self.retention: RetentionService | None = None  # retention watch and schedule (leveret/retention_schedule.py)
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
        self.cluster: EtcdCluster | None = None
        StreamQueue.memory_limit = config.stream_memory_bytes

    def _make_store(self) -> MessageStore:
        return make_store(self.config)

    async def _open_store(self) -> None:
        store = self._make_store()
        await store.open()
        self.store = store
        committer = GroupCommitter(store, on_fenced=self._fenced)
        self.broker.committer = committer
        durability = Durability(store, committer)
        if self.config.etcd:
            # Cluster mode: etcd holds the topology; each queue's owner loads
            # its backlog when it takes the queue (coordination/etcd.py).
            # Stored users and vhosts seed the cluster's when it has none.
            await durability.restore_users(self.broker)
            log.info("store opened", extra={"store": store.description, "mode": "cluster"})
        else:
            queues, messages = await durability.restore(self.broker)
            log.info("store opened", extra={"store": store.description, "durable_queues": queues,
                                            "messages_restored": messages})
        from leveret.retention_schedule import start_retention

        self.retention = await start_retention(self)

    def _advertised(self, port: int) -> str:
        host = self.config.advertise_host or self.config.bind
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def _make_cluster(self) -> EtcdCluster:
        from coordination.etcd import ClusterSettings, EtcdCluster
        from core.grpc_api import internal_pb2_grpc

        cfg = self.config
        assert self.store is not None and self.broker.committer is not None
        settings = ClusterSettings(
            endpoints=[e for e in (part.strip() for part in cfg.etcd.split(",")) if e],
            cluster=cfg.cluster, region=cfg.region, lease_ttl=cfg.lease_ttl, node_id=self.broker.node_id,
            amqp_address=self._advertised(cfg.amqp_port), grpc_address=self._advertised(cfg.grpc_port),
        )
        cluster = EtcdCluster(self.broker, self.store, self.broker.committer, settings,
                              on_event=self.grpc.servicer.cluster_event)
        self.grpc.extra_services.append(lambda server: internal_pb2_grpc.add_NodeServicer_to_server(
            cluster.service, server))
        return cluster

    def _fenced(self, queues: list[tuple[str, str]]) -> None:
        if self.cluster is not None:
            self.cluster.fenced(queues)
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
        Path(self.config.data_dir).mkdir(parents=True, exist_ok=True)
        await self._open_store()
        if self.config.etcd:
            # Peers reach us over gRPC as soon as we register, and clients
            # must not be served before the cluster's metadata is mirrored.
            self.cluster = self._make_cluster()
            await self.grpc.start(self.config.bind, self.config.grpc_port)
            await self.cluster.start()
            self.broker.cluster = self.cluster
            await self.amqp.start(self.config.bind, self.config.amqp_port)
        else:
            await self.amqp.start(self.config.bind, self.config.amqp_port)
            await self.grpc.start(self.config.bind, self.config.grpc_port)
        self._monitor = asyncio.create_task(self._watch_memory())
        log.info(
            "node started",
            extra={
                "node": self.broker.node_id,
                "amqp": f"{self.config.bind}:{self.amqp.port}",
                "grpc": f"{self.config.bind}:{self.grpc.port}",
                "data_dir": os.path.abspath(self.config.data_dir),
                "pid": os.getpid(),
            },
        )

    def watermark_bytes(self) -> int:
        mark = self.config.memory_high_watermark
        if mark > 1:
            return int(mark)
        return int(mark * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    def queued_bytes(self) -> int:
        # A stream's retained log is held in memory too (core/stream.py): it counts.
        return sum(
            ch.ready_bytes for vh in self.broker.vhosts.values() for q in vh.queues.values() for ch in q.channels
        ) + sum(q.mem_bytes for vh in self.broker.vhosts.values() for q in vh.queues.values()
                if isinstance(q, StreamQueue))

    async def _watch_memory(self) -> None:
        """The memory alarm, on the bytes of messages waiting in queues.

        Bodies held by queues are what grows without bound when consumers
        fall behind; RSS is not used because CPython rarely returns freed
        memory, so an alarm on it would never clear.
        """
        limit = self.watermark_bytes()
        while True:
            await asyncio.sleep(0.5)
            used = self.queued_bytes()
            if used > limit and not self.broker.memory_alarm:
                log.warning("memory high watermark reached", extra={"queued_bytes": used, "limit": limit})
                self.amqp.set_memory_alarm(True)
            elif used <= limit * 0.9 and self.broker.memory_alarm:
                self.amqp.set_memory_alarm(False)

    async def stop(self) -> None:
        log.info("node stopping", extra={"node": self.broker.node_id, "connections": len(self.amqp.connections)})
        self._monitor.cancel()
        if self.cluster is not None:
            # Hand our queues to the other nodes first, while we still serve them.
            await self.cluster.stop(handover=True)
        await self.grpc.stop()
        await self.amqp.stop()
        if self.retention is not None:
            await self.retention.stop()
        if self.broker.committer is not None:
            try:
                await asyncio.wait_for(self.broker.committer.drain(), timeout=10)
            except TimeoutError:
                log.error("store writes still pending at shutdown (store unreachable?); they are lost",
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
        await self.start()
        await stop.wait()
        await self.stop()


def make_store(cfg: NodeConfig) -> MessageStore:
    """The store the config names (also used by the ``users``/``vhosts`` commands)."""
    if cfg.store == "sqlite":
        from persistence.sqlite import SQLiteStore

        return SQLiteStore(str(Path(cfg.data_dir) / "leveret.sqlite3"))
    if cfg.store == "postgres":
        if not cfg.postgres_dsn:
            raise StoreError("--store postgres needs --postgres-dsn (or LEVERET_POSTGRES_DSN)")
        from persistence.postgres import PostgresStore

        return PostgresStore(cfg.postgres_dsn)
    raise StoreError(f"unknown store {cfg.store!r}; use sqlite or postgres")


def run(config: NodeConfig) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency, but stay usable without it
        asyncio.run(Node(config).run_until_signalled())
        return
    uvloop.run(Node(config).run_until_signalled())
