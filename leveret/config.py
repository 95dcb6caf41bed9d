"""Node configuration: defaults < TOML file < LEVERET_* environment < flags."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any


@dataclass
class NodeConfig:
    bind: str = "127.0.0.1"
    amqp_port: int = 5672
    grpc_port: int = 50051
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
    memory_high_watermark: float = 0.4
    stream_memory_bytes: int = 64 * 1024 * 1024
    default_user: str = "guest"
    default_pass: str = "guest"
    etcd: str = ""
    cluster: str = "leveret"
    region: str = ""
    lease_ttl: int = 2
    advertise_host: str = ""
    retention_interval: float = 0.0
    prometheus_port: int = 15692

    @property
    def resolved_node_id(self) -> str:
        return self.node_id or f"leveret@{os.uname().nodename}"


HELP = {
    "bind": "address the listeners bind to",
    "amqp_port": "AMQP 0-9-1 port",
    "grpc_port": "native gRPC API port (see docs/GRPC.md)",
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
    "memory_high_watermark": "block publishers when messages waiting in queues take more than this: a fraction "
    "of RAM (<= 1) or bytes (> 1)",
    "stream_memory_bytes": "bytes of message bodies each stream keeps in memory (its newest); older ones are "
    "read back from the store in pages",
    "default_user": "user created at start, allowed from loopback only (as RabbitMQ's guest)",
    "default_pass": "password of the default user",
    "etcd": "comma-separated etcd endpoints (http://host:port); turns on cluster mode (needs --store postgres)",
    "cluster": "cluster name: the etcd key prefix /leveret/<cluster>/",
    "region": "this node's region, shown in cluster status",
    "lease_ttl": "seconds a node's etcd lease lives without refresh; its queues move after that",
    "advertise_host": "host other nodes and clients use to reach this node (default: --bind, or 127.0.0.1 "
    "when binding to all addresses)",
    "retention_interval": "run the retention job (docs/RETENTION.md) every this many seconds in a subprocess, "
    "one run at a time (0: never)",
    "prometheus_port": "Prometheus metrics port (/metrics, rabbitmq_prometheus names; see docs/METRICS.md); 0 disables",
}


class ConfigError(ValueError):
    pass


def _coerce(name: str, kind: Any, value: Any, source: str) -> Any:
    try:
        if kind is int or kind == "int":
            return int(value)
        if kind is float or kind == "float":
            return float(value)
        return str(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: {name} must be an integer, got {value!r}") from exc


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


def validate(cfg: NodeConfig) -> None:
    if cfg.etcd and cfg.store != "postgres":
        raise ConfigError(
            "cluster mode (--etcd) needs the shared Postgres store: add --store postgres --postgres-dsn DSN "
            f"(got --store {cfg.store}); with SQLite each node would keep its own copy and a failover would lose it"
        )
    if cfg.lease_ttl < 1:
        raise ConfigError(f"--lease-ttl must be at least 1 second, got {cfg.lease_ttl}")
