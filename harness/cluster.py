"""A Leveret cluster as processes, for the cluster tests and benchmarks.

``Cluster`` = one etcd (harness/etcd.py) + one PostgreSQL server (harness/pg.py,
a fresh database per cluster) + N node processes ``n1``..``nN``, each started
with ``python -m leveret serve --etcd ... --cluster NAME`` on fresh free ports.
The etcd and Postgres servers may be shared between clusters (each cluster has
its own name, hence its own etcd prefix, and its own database).

Nodes can be killed (-9), paused (SIGSTOP) and resumed (SIGCONT), stopped
(SIGTERM) and started again; etcd can be restarted on its data directory.
Every process logs into the cluster's work directory; ``diagnostics()`` gives
the tail of each log, for assertion messages. The work directory is removed at
close unless ``keep_workdir`` or the environment variable
``LEVERET_KEEP_CLUSTER_LOGS=1`` asks to keep it.

What the harness reads, it reads from the outside: owners straight from etcd
(``etcdctl``), rows straight from Postgres (psycopg), the cluster view through
the ``leveret cluster status --json`` command.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from harness.etcd import EtcdServer, KeyValue, skip_or_fail_without_etcd
from harness.node import REPO_ROOT, NodeProcess, _python, node_env
from harness.pg import throwaway_postgres
from harness.ports import free_port

STARTUP_TIMEOUT = 30.0
CLI_TIMEOUT = 60.0
DEFAULT_LEASE_TTL = 2
KEEP_ENV = "LEVERET_KEEP_CLUSTER_LOGS"


def owner_key(cluster: str, queue: str, vhost: str = "/") -> str:
    return f"/leveret/{quote(cluster, safe='')}/owners/{quote(vhost, safe='')}/{quote(queue, safe='')}"


class ClusterNode(NodeProcess):
    """One cluster member. Its data dir and id stay the same across restarts; its ports are fresh each start."""

    def __init__(self, node_id: str, region: str, cluster: Cluster, extra_args: Sequence[str] = ()) -> None:
        data_dir = cluster.workdir / node_id / "data"
        data_dir.mkdir(parents=True, exist_ok=True)
        super().__init__(data_dir, cluster.workdir / node_id)
        self.node_id = node_id
        self.name = node_id
        self.region = region
        self.cluster = cluster
        self.extra_args = list(extra_args)
        self.grpc_port = 0
        self.cluster_port = 0
        self.paused = False

    def command(self) -> list[str]:
        c = self.cluster
        return [
            _python(), "-m", "leveret", "serve",
            "--node-id", self.node_id,
            "--bind", "127.0.0.1",
            "--advertise-host", "127.0.0.1",
            "--amqp-port", str(self.amqp_port),
            "--grpc-port", str(self.grpc_port),
            "--management-port", str(self.management_port),
            # MQTT only on a free port when asked (mqtt=True); never the default 1883.
            "--mqtt-port", str(self.mqtt_port), "--mqtt-tls-port", "0", "--mqtt-ws-port", "0",
            "--data-dir", str(self.data_dir),
            "--log-format", "json",
            "--store", "postgres",
            "--postgres-dsn", c.dsn,
            "--etcd", c.etcd.url,
            "--cluster", c.name,
            "--region", self.region,
            "--lease-ttl", str(c.lease_ttl),
            "--cluster-port", str(self.cluster_port),
            *c.cluster_auth,
            *self.extra_args,
        ]  # fmt: skip

    def spawn(self) -> None:
        """Start the process without waiting for it (see wait_ready)."""
        self.paused = False
        self.cluster_port = free_port()
        super().spawn()

    def pause(self) -> None:
        """SIGSTOP: the process keeps its sockets but does nothing (its etcd lease runs out)."""
        assert self.proc is not None and self.running()
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        """SIGCONT."""
        assert self.proc is not None and self.running()
        os.kill(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def terminate(self) -> int:
        if self.paused and self.running():
            self.resume()
        return super().terminate()

    def logs(self) -> str:
        """Every start's stderr of this node, in order."""
        parts = []
        for i in range(1, self.starts + 1):
            path = self.log_dir / f"node-{i}.stderr"
            with contextlib.suppress(OSError):
                parts.append(path.read_text(errors="replace"))
        return "".join(parts)

    def log_records(self) -> list[dict[str, Any]]:
        """The JSON log lines of every start (other lines skipped)."""
        records = []
        for line in self.logs().splitlines():
            with contextlib.suppress(ValueError):
                doc = json.loads(line)
                if isinstance(doc, dict):
                    records.append(doc)
        return records


class Cluster:
    """etcd + Postgres + nodes n1..nN. Use as a context manager (or start()/close())."""

    def __init__(
        self,
        size: int = 3,
        *,
        name: str | None = None,
        etcd: EtcdServer | None = None,
        postgres_dsn: str | None = None,
        lease_ttl: int = DEFAULT_LEASE_TTL,
        regions: Sequence[str] | None = None,
        workdir: Path | None = None,
        node_args: Sequence[str] = (),
        keep_workdir: bool | None = None,
        cluster_auth: Sequence[str] | None = None,
        mqtt: bool = False,
    ) -> None:
        self.size = size
        self.mqtt = mqtt  # nodes listen for MQTT on free ports (node.mqtt_port)
        self.name = name or f"t{uuid.uuid4().hex[:10]}"
        self.lease_ttl = lease_ttl
        self.regions = list(regions) if regions else ["r1"] * size
        self.node_args = list(node_args)
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix=f"leveret-cluster-{self.name}-"))
        # Logs are removed with the work dir unless asked for (diagnostics() has their tails).
        self.keep_workdir = bool(os.environ.get(KEEP_ENV)) if keep_workdir is None else keep_workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        # How nodes prove membership to each other (docs/SECURITY.md): a shared secret
        # file by default, or the --cluster-tls-* flags a test passes.
        if cluster_auth is None:
            secret = self.workdir / "cluster-secret"
            secret.write_text(uuid.uuid4().hex + uuid.uuid4().hex)
            secret.chmod(0o600)  # a node refuses a secret others may read
            cluster_auth = ["--cluster-secret-file", str(secret)]
        self.cluster_auth = list(cluster_auth)
        self._given_etcd = etcd
        self._given_dsn = postgres_dsn
        self._stack = contextlib.ExitStack()
        self._server_dsn = ""
        self.dsn = ""
        self.etcd: EtcdServer = etcd  # type: ignore[assignment]  # set in start() when not given
        self.nodes: dict[str, ClusterNode] = {}
        self.started_at = 0.0  # time.monotonic() when every node had registered

    # -- life cycle --------------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def start(self) -> None:
        if self._given_etcd is None:
            skip_or_fail_without_etcd()
            self.etcd = EtcdServer()
            self._stack.callback(self.etcd.close)
            self._stack.callback(self._keep_etcd_log)  # runs before etcd.close removes it
            self.etcd.start()
        if self._given_dsn is None:
            self._server_dsn = self._stack.enter_context(throwaway_postgres())
        else:
            self._server_dsn = self._given_dsn
        self._create_database()
        for i in range(self.size):
            self.add_node(region=self.regions[i] if i < len(self.regions) else "r1", start=False)
        for node in self.nodes.values():
            node.spawn()
        for node in self.nodes.values():
            node.wait_ready()
        self.wait_members(list(self.nodes))
        self.started_at = time.monotonic()

    def _keep_etcd_log(self) -> None:
        if self.keep_workdir:
            with contextlib.suppress(OSError):
                shutil.copyfile(self.etcd.log_path, self.workdir / "etcd.log")

    def _create_database(self) -> None:
        db = f"leveret_cluster_{self.name}_{uuid.uuid4().hex[:8]}".lower()
        with psycopg.connect(self._server_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db)))
        self.dsn = make_conninfo(self._server_dsn, dbname=db)

        def drop() -> None:
            with contextlib.suppress(psycopg.Error):
                with psycopg.connect(self._server_dsn, autocommit=True) as conn:
                    conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(db)))

        self._stack.callback(drop)

    def add_node(self, region: str = "r1", start: bool = True, extra_args: Sequence[str] = ()) -> ClusterNode:
        """A new member n<k+1>; started (and waited for until it is registered in etcd) unless start=False."""
        node_id = f"n{len(self.nodes) + 1}"
        node = ClusterNode(node_id, region, self, [*self.node_args, *extra_args])
        node.mqtt = self.mqtt
        self.nodes[node_id] = node
        if start:
            node.start()
            self.wait_members([node_id])
        return node

    def close(self) -> None:
        for node in self.nodes.values():
            node.cleanup()  # kill -9 works on a stopped process too
        self._stack.close()
        if not self.keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # -- nodes -------------------------------------------------------------------------------
    def __getitem__(self, node_id: str) -> ClusterNode:
        return self.nodes[node_id]

    def url(self, node_id: str) -> str:
        return self.nodes[node_id].url

    def kill(self, node_id: str) -> None:
        self.nodes[node_id].kill()

    def pause(self, node_id: str) -> None:
        self.nodes[node_id].pause()

    def resume(self, node_id: str) -> None:
        self.nodes[node_id].resume()

    def terminate(self, node_id: str) -> int:
        return self.nodes[node_id].terminate()

    def restart_node(self, node_id: str) -> None:
        node = self.nodes[node_id]
        if node.running():
            node.kill()
        node.start()
        self.wait_members([node_id])

    def others(self, *node_ids: str) -> list[str]:
        """The running members other than ``node_ids``, in id order."""
        return [n for n, node in self.nodes.items() if n not in node_ids and node.running()]

    # -- etcd --------------------------------------------------------------------------------
    @property
    def prefix(self) -> str:
        return f"/leveret/{quote(self.name, safe='')}/"

    def restart_etcd(self, kill: bool = False) -> None:
        self.etcd.restart(kill=kill)

    def etcd_keys(self, sub: str = "") -> list[KeyValue]:
        return self.etcd.get_prefix(self.prefix + sub)

    def members(self) -> list[str]:
        """Node ids registered under /leveret/<cluster>/nodes/."""
        base = self.prefix + "nodes/"
        return sorted(kv.key[len(base) :] for kv in self.etcd.get_prefix(base))

    def wait_members(self, node_ids: Sequence[str], timeout: float = STARTUP_TIMEOUT) -> None:
        self.wait_for(lambda: set(node_ids) <= set(self.members()), f"nodes {list(node_ids)} registered", timeout)

    def owner_kv(self, queue: str, vhost: str = "/") -> KeyValue | None:
        return self.etcd.get(owner_key(self.name, queue, vhost))

    def owner(self, queue: str, vhost: str = "/") -> str | None:
        """The owner node id of a queue as etcd has it (None when no live owner)."""
        kv = self.owner_kv(queue, vhost)
        return kv.value if kv else None

    def epoch(self, queue: str, vhost: str = "/") -> int | None:
        """The queue's epoch: the create revision of its owner key."""
        kv = self.owner_kv(queue, vhost)
        return kv.create_revision if kv else None

    def wait_owner(
        self, queue: str, accept: Callable[[str | None], bool] = bool, timeout: float = 20.0, vhost: str = "/"
    ) -> str | None:
        """Poll etcd until the owner of ``queue`` satisfies ``accept``; the owner."""
        found: list[str | None] = [None]

        def check() -> bool:
            found[0] = self.owner(queue, vhost)
            return accept(found[0])

        self.wait_for(check, f"owner of {queue!r} acceptable (last seen {found[0]!r})", timeout)
        return found[0]

    # -- CLI ---------------------------------------------------------------------------------
    def cli(self, *args: str, timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess[str]:
        """``python -m leveret cluster ARGS --etcd URL --cluster NAME``."""
        cmd = [_python(), "-m", "leveret", "cluster", *args, "--etcd", self.etcd.url, "--cluster", self.name]
        return subprocess.run(
            cmd, cwd=REPO_ROOT, env=node_env(), stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip

    def status(self) -> dict[str, Any]:
        """``cluster status --json``, parsed."""
        done = self.cli("status", "--json")
        assert done.returncode == 0, f"cluster status exited with {done.returncode}:\n{done.stderr}"
        doc = json.loads(done.stdout)
        assert isinstance(doc, dict), done.stdout
        return doc

    def drain(self, node_id: str, timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess[str]:
        return self.cli("drain", node_id, timeout=timeout)

    # -- Postgres ----------------------------------------------------------------------------
    def sql(self, query: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return conn.execute(query, params).fetchall()  # type: ignore[arg-type]

    def stored_epoch(self, queue: str, vhost: str = "/") -> int | None:
        rows = self.sql("SELECT epoch FROM queue_epochs WHERE vhost = %s AND queue = %s", (vhost, queue))
        return int(rows[0][0]) if rows else None

    def stored_bodies(self, queue: str, vhost: str = "/") -> list[bytes]:
        rows = self.sql('SELECT body FROM messages WHERE vhost = %s AND queue = %s ORDER BY "offset"', (vhost, queue))
        return [bytes(r[0]) for r in rows]

    # -- diagnostics -------------------------------------------------------------------------
    def wait_for(self, check: Callable[[], bool], what: str, timeout: float = 20.0, interval: float = 0.1) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{self.diagnostics()}")
            time.sleep(interval)

    def diagnostics(self, chars: int = 2500) -> str:
        """The tail of every node's log and of etcd's, for assertion messages."""
        parts = [f"cluster {self.name}, work dir {self.workdir}"]
        for node_id, node in self.nodes.items():
            if node.proc is None:
                state = "not started"
            else:
                state = "running" if node.running() else f"exit {node.proc.returncode}"
            if node.paused:
                state += ", paused"
            parts.append(f"--- {node_id} ({state}, amqp {node.amqp_port}) stderr tail:\n{node.stderr_tail(chars)}")
        if self.etcd is not None:
            parts.append(f"--- etcd log tail:\n{self.etcd.log_tail(chars // 2)}")
        return "\n".join(parts)
