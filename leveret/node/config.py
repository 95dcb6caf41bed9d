"""Node configuration: defaults < TOML file < LEVERET_* environment < flags."""

from __future__ import annotations

import os
import stat
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any


@dataclass
class NodeConfig:
    bind: str = "127.0.0.1"
    amqp_port: int = 5672
    grpc_port: int = 50051
    management_port: int = 15672
    data_dir: str = "./leveret-data"
    node_id: str = ""
    log_level: str = "info"
    log_format: str = "auto"
    heartbeat: int = 60
    frame_max: int = 131072
    channel_max: int = 2047
    max_message_size: int = 128 * 1024 * 1024
    store: str = "sqlite"
    postgres_dsn: str = ""
    postgres_commit_timeout: float = 5.0
    memory_high_watermark: float = 0.4
    disk_free_limit: str = "50MB"
    stream_memory_bytes: int = 64 * 1024 * 1024
    queue_memory_bytes: int = 64 * 1024 * 1024
    queue_memory_node_bytes: int = 1024 * 1024 * 1024
    body_store_threshold: int = 32 * 1024  # persistence/sqlite_bodies.py DEFAULT_THRESHOLD
    default_user: str = "guest"
    default_pass: str = "guest"
    loopback_users: str = "guest"
    etcd: str = ""
    cluster: str = "leveret"
    region: str = ""
    lease_ttl: int = 2
    advertise_host: str = ""
    retention_interval: float = 0.0
    # -- transport security and cluster membership (docs/SECURITY.md)
    amqps_port: int = -1
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    tls_verify: str = "none"
    tls_fail_if_no_peer_cert: bool = False
    grpc_tls: bool = False
    http_tls: bool = False
    # Not 25672: that is RabbitMQ's Erlang distribution port (see HELP).
    cluster_port: int = 27672
    advertise_cluster_port: int = 0
    advertise_cluster_remote: str = ""
    cluster_secret_file: str = ""
    cluster_tls_cert: str = ""
    cluster_tls_key: str = ""
    cluster_tls_ca: str = ""
    cluster_tls_peers: str = ""
    etcd_cacert: str = ""
    etcd_cert: str = ""
    etcd_key: str = ""
    etcd_user: str = ""
    etcd_password: str = ""
    prometheus_port: int = 15692
    # -- MQTT (docs/MQTT.md)
    mqtt_port: int = 1883
    mqtt_tls_port: int = -1
    mqtt_ws_port: int = 15675
    mqtt_vhost: str = "/"

    @property
    def resolved_node_id(self) -> str:
        return self.node_id or f"leveret@{os.uname().nodename}"

    @property
    def loopback_user_names(self) -> frozenset[str]:
        return frozenset(n.strip() for n in self.loopback_users.split(",") if n.strip())

    @property
    def resolved_amqps_port(self) -> int:
        """The AMQPS port: 5671 by default once a certificate is configured, 0 (no listener) otherwise."""
        if self.amqps_port >= 0:
            return self.amqps_port if self.tls_cert else 0
        return 5671 if self.tls_cert else 0

    @property
    def resolved_mqtt_tls_port(self) -> int:
        """The MQTT-over-TLS port: 8883 by default once a certificate is configured, 0 (none) otherwise."""
        if self.mqtt_tls_port >= 0:
            return self.mqtt_tls_port if self.tls_cert else 0
        return 8883 if self.tls_cert else 0


HELP = {
    "bind": "address the listeners bind to",
    "amqp_port": "AMQP 0-9-1 port",
    "grpc_port": "native gRPC API port (see docs/GRPC.md)",
    "management_port": "management HTTP API and web console port, RabbitMQ's (docs/MANAGEMENT.md); 0 disables it",
    "data_dir": "directory of the embedded store",
    "node_id": "this node's name in logs and the cluster (default leveret@<hostname>)",
    "log_level": "debug, info, warning or error",
    "log_format": "json, text, or auto (text on a terminal, json otherwise)",
    "heartbeat": "heartbeat interval in seconds the server proposes (0 disables)",
    "frame_max": "largest frame in bytes the server accepts",
    "channel_max": "most channels per connection",
    "max_message_size": "largest message body in bytes",
    "store": "message store: sqlite (a file in --data-dir) or postgres (--postgres-dsn)",
    "postgres_dsn": "Postgres connection string for --store postgres, e.g. postgresql://user:pw@host/db",
    "postgres_commit_timeout": "seconds a store commit may take before it fails (its publishes nacked, its "
    "connection dropped and made again); 0: no limit",
    "memory_high_watermark": "block publishers when messages waiting in queues take more than this: a fraction "
    "of RAM (<= 1) or bytes (> 1)",
    "disk_free_limit": "block publishers when the data dir's disk has less free space than this, as RabbitMQ's "
    "disk_free_limit: bytes with a unit (50MB, 2GiB) or relative to RAM (mem_relative:1.5)",
    "stream_memory_bytes": "bytes of message bodies each stream keeps in memory (its newest); older ones are "
    "read back from the store in pages",
    "queue_memory_bytes": "bytes of ready message bodies each classic queue keeps in memory; the rest wait in "
    "segment files under --data-dir and are read back in pages ahead of consumers (docs/notes/paging.md)",
    "queue_memory_node_bytes": "bytes of ready message bodies all classic queues of the node keep in memory "
    "together; past it the largest queues page out (0: no node-wide cap)",
    "body_store_threshold": "with the embedded store, bodies of at least this many bytes are kept in append-only "
    "segment files under --data-dir/bodies and SQLite holds a reference (docs/notes/bodystore.md); 0 keeps every "
    "body in SQLite",
    "default_user": "administrator created at start (loopback-only only when named in --loopback-users)",
    "loopback_users": "comma-separated users who may log in from loopback addresses only, whatever their record "
    "(RabbitMQ's loopback_users; a TOML list works too); empty: none",
    "default_pass": "password of the default user",
    "etcd": "comma-separated etcd endpoints (http://host:port); turns on cluster mode (needs --store postgres)",
    "cluster": "cluster name: the etcd key prefix /leveret/<cluster>/",
    "region": "this node's region: queues declared through it are owned by a node of the same region while one "
    "is live, failovers and drains prefer that region, and clients pick a node of their own region "
    "(docs/notes/region.md); empty: the \"\" region",
    "lease_ttl": "seconds a node's etcd lease lives without refresh; its queues move after that",
    "advertise_host": "host other nodes and clients use to reach this node (default: --bind, or 127.0.0.1 "
    "when binding to all addresses)",
    "retention_interval": "run the retention job (docs/RETENTION.md) every this many seconds in a subprocess, "
    "one run at a time (0: never)",
    "mqtt_port": "MQTT 3.1.1/5.0 port (docs/MQTT.md); 0 disables",
    "mqtt_tls_port": "MQTT over TLS port (the --tls-cert of AMQPS); -1: 8883 when --tls-cert is set, 0: none",
    "mqtt_ws_port": "MQTT over WebSocket port (path /ws, as RabbitMQ's Web-MQTT); 0 disables",
    "mqtt_vhost": "vhost of MQTT connections whose user name does not name one ('vhost:user')",
    "amqps_port": "AMQP over TLS port; -1: 5671 when --tls-cert is set, 0: no TLS listener",
    "tls_cert": "PEM certificate chain of this node (AMQPS, and gRPC with --grpc-tls); SIGHUP reloads it",
    "tls_key": "PEM private key of --tls-cert",
    "tls_ca": "PEM CA bundle that client certificates are verified against",
    "tls_verify": "none, or peer: ask clients for a certificate and verify it against --tls-ca",
    "tls_fail_if_no_peer_cert": "with --tls-verify peer, refuse clients that present no certificate",
    "grpc_tls": "serve the gRPC API over TLS only, with --tls-cert/--tls-key (client certificates as for AMQPS)",
    "http_tls": "serve the management API, console and Prometheus endpoint over HTTPS only, with --tls-cert/--tls-key "
    "(no client certificate asked: browsers and scrapers log in with passwords); SIGHUP reloads it",
    "cluster_port": "internal node-to-node listener (cluster mode only); never the public gRPC port. 27672 by "
    "default, not 25672: that is RabbitMQ's Erlang distribution port (its AMQP port + 20000), so a RabbitMQ and a "
    "Leveret node could not share a host; 27672 is none of RabbitMQ's ports, no AMQP port + 20000 of a second "
    "local RabbitMQ (5673 -> 25673 ...), and below Linux's ephemeral range (32768-60999), so an outgoing "
    "connection cannot hold it at start-up",
    "advertise_cluster_port": "port other nodes dial for --cluster-port when it is forwarded or proxied "
    "(0: --cluster-port itself)",
    "advertise_cluster_remote": "HOST:PORT that nodes of other regions dial for this node's --cluster-port (a WAN "
    "or VPN address, a gateway); empty: the same address as nodes of its own region",
    "cluster_secret_file": "file holding the secret every node of the cluster shares (as RabbitMQ's Erlang "
    "cookie); cluster mode needs it or --cluster-tls-*",
    "cluster_tls_cert": "PEM certificate of this node for mutual TLS between nodes",
    "cluster_tls_key": "PEM private key of --cluster-tls-cert",
    "cluster_tls_ca": "PEM CA that signed every node's cluster certificate",
    "cluster_tls_peers": "PEM file of the other nodes' cluster certificates, when nodes do not share one "
                         "(only a node's certificate may call the cluster port, not any of the CA's)",
    "etcd_cacert": "PEM CA of etcd's server certificate: dial etcd over TLS",
    "etcd_cert": "PEM client certificate for etcd (with --etcd-key)",
    "etcd_key": "PEM private key of --etcd-cert",
    "etcd_user": "etcd user name (etcd's auth); with --etcd-password",
    "etcd_password": "etcd password (prefer LEVERET_ETCD_PASSWORD or the config file to a flag)",
    "prometheus_port": "Prometheus metrics port (/metrics, rabbitmq_prometheus names; see docs/METRICS.md); 0 disables",
}


class ConfigError(ValueError):
    pass


def _coerce(name: str, kind: Any, value: Any, source: str) -> Any:
    try:
        if kind is bool or kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(text)
        if kind is int or kind == "int":
            return int(value)
        if kind is float or kind == "float":
            return float(value)
        if isinstance(value, list):  # a TOML list for a comma-separated option (loopback_users)
            return ",".join(str(v) for v in value)
        return str(value)
    except (TypeError, ValueError) as exc:
        what = {"bool": "true or false", "float": "a number"}.get(str(getattr(kind, "__name__", kind)), "an integer")
        raise ConfigError(f"{source}: {name} must be {what}, got {value!r}") from exc


def load(config_file: str | None, overrides: dict[str, Any], environ: dict[str, str] | None = None) -> NodeConfig:
    environ = dict(os.environ if environ is None else environ)
    cfg = NodeConfig()
    kinds = {f.name: f.type for f in fields(NodeConfig)}
    config_file = config_file or environ.get("LEVERET_CONFIG")
    if config_file:
        path = Path(config_file)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {path} does not exist") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
        section = data.get("leveret", data)
        for key, value in section.items():
            name = key.replace("-", "_")
            if name not in kinds:
                raise ConfigError(f"config file {path}: unknown option {key!r}")
            setattr(cfg, name, _coerce(name, kinds[name], value, str(path)))
    for name in kinds:
        env_name = "LEVERET_" + name.upper()
        if env_name in environ:
            setattr(cfg, name, _coerce(name, kinds[name], environ[env_name], env_name))
    for name, value in overrides.items():
        if value is not None:
            setattr(cfg, name, _coerce(name, kinds[name], value, "--" + name.replace("_", "-")))
    return cfg


def _check_secret_mode(path: str) -> None:
    """Refuse a cluster secret others on the host may read, as RabbitMQ refuses such an Erlang cookie
    (a file that cannot be read is reported when the node reads it)."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return
    if mode & 0o077:
        raise ConfigError(f"the cluster secret file {path} is readable or writable by group or others "
                          f"(mode {mode:04o}): anyone on this host could join the cluster; `chmod 600 {path}`")


def validate(cfg: NodeConfig) -> None:
    from leveret.node.resources import parse_disk_free_limit, total_memory

    try:
        parse_disk_free_limit(cfg.disk_free_limit, total_memory())
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if cfg.etcd and cfg.store != "postgres":
        raise ConfigError(
            "cluster mode (--etcd) needs the shared Postgres store: add --store postgres --postgres-dsn DSN "
            f"(got --store {cfg.store}); with SQLite each node would keep its own copy and a failover would lose it"
        )
    if cfg.etcd and not (cfg.cluster_secret_file or cfg.cluster_tls_cert):
        raise ConfigError(
            "cluster mode (--etcd) needs a way for nodes to authenticate each other: --cluster-secret-file FILE "
            "(the same secret on every node, as RabbitMQ's Erlang cookie) or --cluster-tls-cert/--cluster-tls-key/"
            "--cluster-tls-ca (mutual TLS); see docs/SECURITY.md"
        )
    if cfg.cluster_tls_cert and not (cfg.cluster_tls_key and cfg.cluster_tls_ca):
        raise ConfigError("--cluster-tls-cert needs --cluster-tls-key and --cluster-tls-ca (the cluster's CA)")
    if cfg.cluster_secret_file:
        _check_secret_mode(cfg.cluster_secret_file)
    if cfg.tls_verify not in ("none", "peer"):
        raise ConfigError(f"--tls-verify must be none or peer, got {cfg.tls_verify!r}")
    if cfg.tls_cert and not cfg.tls_key:
        raise ConfigError("--tls-cert needs --tls-key")
    if cfg.tls_verify == "peer" and not cfg.tls_ca:
        raise ConfigError("--tls-verify peer needs --tls-ca: the CA that client certificates are checked against")
    if cfg.amqps_port > 0 and not cfg.tls_cert:
        raise ConfigError("--amqps-port needs --tls-cert and --tls-key")
    if cfg.mqtt_tls_port > 0 and not cfg.tls_cert:
        raise ConfigError("--mqtt-tls-port needs --tls-cert and --tls-key")
    if cfg.grpc_tls and not cfg.tls_cert:
        raise ConfigError("--grpc-tls needs --tls-cert and --tls-key")
    if cfg.http_tls and not cfg.tls_cert:
        raise ConfigError("--http-tls needs --tls-cert and --tls-key")
    if bool(cfg.etcd_cert) != bool(cfg.etcd_key):
        raise ConfigError("--etcd-cert and --etcd-key go together")
    if bool(cfg.etcd_user) != bool(cfg.etcd_password):
        raise ConfigError("--etcd-user and --etcd-password go together")
    if cfg.advertise_cluster_remote:
        _host, _, port = cfg.advertise_cluster_remote.rpartition(":")
        if not _host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--advertise-cluster-remote must be HOST:PORT, got {cfg.advertise_cluster_remote!r}")
    if cfg.lease_ttl < 1:
        raise ConfigError(f"--lease-ttl must be at least 1 second, got {cfg.lease_ttl}")
    if cfg.body_store_threshold < 0:
        raise ConfigError(f"--body-store-threshold must be 0 (off) or a size in bytes, got {cfg.body_store_threshold}")
