"""The endpoints operators' tools call that the rest of the API lacked, in RabbitMQ's shapes.

``/api/nodes/{node}/memory`` (what the memory alarm counts, by kind), ``/api/feature-flags``,
``/api/global-parameters``, ``/api/auth``, the certificate-expiration and protocol-listener
health checks, and ``/cli/rabbitmqadmin`` (the management CLI's download, served from
Debian's rabbitmq-server package when it is installed). ``/api/leveret/samples``: the
server-side samples the console charts (leveret/http/rates.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import resource
import ssl
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from leveret.http.errors import bad_request, not_found
from leveret.http.responses import json_response
from leveret.node import resources

if TYPE_CHECKING:
    from leveret.http.context import NodeView
    from leveret.http.routing import Router
    from leveret.http.server import Call, ManagementAPI

# Where a user downloads rabbitmqadmin from (RabbitMQ serves it from the management plugin).
log = logging.getLogger("leveret.http")

RABBITMQADMIN = Path(os.environ.get("LEVERET_RABBITMQADMIN", "/usr/bin/rabbitmqadmin"))

# Feature flags RabbitMQ 3.10 reports whose behaviour Leveret has (it has no flag to turn off).
FEATURE_FLAGS = (
    ("drop_unroutable_metric", "Count unroutable publishes to be dropped in stats", "rabbitmq_management_agent"),
    ("empty_basic_get_metric", "Count AMQP `basic.get` on empty queues in stats", "rabbitmq_management_agent"),
    ("implicit_default_bindings", "Default bindings are now implicit, instead of being stored in the database",
     "rabbit"),
    ("maintenance_mode_status", "Maintenance mode status", "rabbit"),
    ("quorum_queue", "Support queues of type `quorum`", "rabbit"),
    ("stream_queue", "Support queues of type `stream`", "rabbit"),
    ("user_limits", "Configure connection and channel limits for a user", "rabbit"),
    ("virtual_host_metadata", "Virtual host metadata (description, tags, etc)", "rabbit"),
)

UNITS = {"days": 86400, "weeks": 7 * 86400, "months": 30 * 86400, "years": 365 * 86400}


def register(r: Router) -> None:
    r.add("nodes/{node}/memory", GET=(node_memory, "monitoring"))
    r.add("feature-flags", GET=(feature_flags, "monitoring"))
    r.add("global-parameters", GET=(global_parameters, "administrator"))
    r.add("global-parameters/{name}", GET=(global_parameter, "administrator"))
    r.add("auth", GET=(auth, "management"))
    r.add("health/checks/certificate-expiration/{within}/{unit}", GET=(certificate_expiration, "monitoring"))
    r.add("health/checks/protocol-listener/{protocol}", GET=(protocol_listener, "monitoring"))
    r.add("leveret/samples", GET=(samples, "management"))
    r.add("leveret/environment", GET=(environment, "administrator"))
    r.add("leveret/node-limits", PUT=(node_limits_put, "administrator"))
    r.add("leveret/log-tail", GET=(log_tail, "administrator"))


def register_app(app: web.Application, api: ManagementAPI) -> None:
    install_log_tail()
    api.rates.gauges = lambda: node_gauges(api.node)
    app.router.add_get("/cli/rabbitmqadmin", rabbitmqadmin)
    app.router.add_get("/cli/", rabbitmqadmin)


async def rabbitmqadmin(request: web.Request) -> web.StreamResponse:
    if not RABBITMQADMIN.is_file():
        return json_response({"error": "Object Not Found", "reason": (
            f"rabbitmqadmin is not installed on this node ({RABBITMQADMIN}): install Debian's rabbitmq-server "
            "package, or take it from https://github.com/rabbitmq/rabbitmq-server "
            "(deps/rabbitmq_management/bin/rabbitmqadmin)")}, status=404)
    return web.FileResponse(RABBITMQADMIN, headers={
        "Content-Type": "application/octet-stream", "Content-Disposition": 'attachment; filename="rabbitmqadmin"'})


def memory_breakdown(call: Call) -> dict[str, Any]:
    """RabbitMQ's categories where Leveret has them; the rest of the process is ``other_proc``."""
    use = resources.memory_use(call.broker, call.node.amqp, call.node.mqtt)
    rss = resources.rss_bytes()
    counted = use.total
    return {
        "connection_readers": 0, "connection_writers": 0, "connection_channels": 0,
        "connection_other": use.partial_and_buffers,  # unparsed input, partial bodies, unwritten output
        "queue_procs": use.bodies + use.index,  # message bodies and the per-message index
        "quorum_queue_procs": 0, "stream_queue_procs": 0, "plugins": 0, "metrics": 0, "mgmt_db": 0,
        "other_proc": max(0, rss - counted),  # the interpreter, code, and what Python has not given back
        "binary": 0, "code": 0, "atom": 0, "other_ets": 0, "other_system": 0,
        "allocated_unused": 0, "reserved_unallocated": 0,
        "strategy": "rss",
        # "erlang": what the memory alarm counts (docs/AMQP.md), "rss": the process.
        "total": {"erlang": counted, "rss": rss, "allocated": rss},
    }


async def node_memory(call: Call) -> dict[str, Any]:
    if call.params["node"] != call.node_name:
        raise not_found(f"node '{call.params['node']}' not found (ask that node's own API)")
    return {"memory": memory_breakdown(call)}


async def feature_flags(call: Call) -> list[dict[str, Any]]:
    return [{"name": n, "desc": d, "doc_url": "", "state": "enabled", "stability": "stable", "provided_by": p}
            for n, d, p in FEATURE_FLAGS]


def global_parameter_list(call: Call) -> list[dict[str, Any]]:
    from leveret.http.api_admin import cluster_name_of

    return [{"name": "cluster_name", "value": cluster_name_of(call)},
            {"name": "internal_cluster_id", "value": f"leveret-cluster-id-{cluster_name_of(call)}"}]


async def global_parameters(call: Call) -> list[dict[str, Any]]:
    return global_parameter_list(call)


async def global_parameter(call: Call) -> dict[str, Any]:
    for p in global_parameter_list(call):
        if p["name"] == call.params["name"]:
            return p
    raise not_found()


async def auth(call: Call) -> dict[str, Any]:
    return {"enable_uaa": False, "uaa_client_id": "", "uaa_location": ""}  # basic auth only, no OAuth 2


def certificate_files(call: Call) -> list[str]:
    cfg = call.node.config
    return [f for f in (cfg.tls_cert, cfg.cluster_tls_cert) if f]


def not_after(path: str) -> float:
    """The first certificate of a PEM file's expiry (Unix time). The standard library decodes it
    without the ``cryptography`` package, which Leveret does not depend on."""
    decode = ssl._ssl._test_decode_cert  # type: ignore[attr-defined]
    return float(ssl.cert_time_to_seconds(decode(path)["notAfter"]))


def expiring(call: Call, seconds: float) -> list[dict[str, Any]]:
    deadline = time.time() + seconds
    out = []
    for path in certificate_files(call):
        try:
            expires = not_after(path)
        except (OSError, ssl.SSLError, ValueError, KeyError) as exc:
            out.append({"certfile": path, "error": f"cannot read: {exc}"})
            continue
        if expires < deadline:
            out.append({"certfile": path, "expires": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(expires))})
    return out


async def certificate_expiration(call: Call) -> Any:
    unit = call.params["unit"]
    if unit not in UNITS:
        raise bad_request("Time unit not recognised. Supported units: days, weeks, months, years.")
    try:
        within = int(call.params["within"])
    except ValueError:
        raise bad_request("Invalid expiration value.") from None
    if within < 0:
        raise bad_request("Invalid expiration value.")
    found = expiring(call, within * UNITS[unit])
    if found:
        return json_response({"status": "failed", "reason": "Certificates expiring", "expired": found}, status=503)
    return {"status": "ok"}


def protocols(call: Call) -> dict[str, int]:
    """Listening protocols by RabbitMQ's names, with their ports."""
    cfg = call.node.config
    out = {"amqp": call.node.amqp.port, "http": call.api.port}
    amqps = cfg.resolved_amqps_port
    if amqps:
        out["amqp/ssl"] = amqps
    if cfg.prometheus_port:
        out["http/prometheus"] = cfg.prometheus_port
    if cfg.cluster_port and call.node.peers is not None:
        out["clustering"] = cfg.cluster_port
    if cfg.grpc_port:
        out["grpc"] = cfg.grpc_port  # Leveret's own (docs/GRPC.md)
    return out


PROTOCOL_ALIASES = {"amqp091": "amqp", "amqp0-9-1": "amqp", "amqps": "amqp/ssl", "prometheus": "http/prometheus",
                    "https": "http"}


async def protocol_listener(call: Call) -> Any:
    wanted = call.params["protocol"].lower()
    wanted = PROTOCOL_ALIASES.get(wanted, wanted)
    listening = protocols(call)
    if wanted in listening:
        return {"status": "ok", "protocol": wanted}
    # "listeners" is Leveret's: the ports too (rabbitmq-diagnostics listeners prints them).
    return json_response({"status": "failed", "reason": "No active listener", "missing": wanted,
                          "protocols": sorted(listening),
                          "listeners": [{"protocol": p, "port": port} for p, port in sorted(listening.items())]},
                         status=503)


def node_gauges(node: NodeView) -> dict[str, float]:
    """What the console charts for the node, each sample: the memory alarm's measure and limit, disk, fds."""
    watermark = getattr(node, "watermark_bytes", None)
    disk_limit = getattr(node, "disk_free_limit_bytes", None)
    try:
        disk_free = resources.disk_free(node.config.data_dir)
    except OSError:
        disk_free = 0
    try:
        fd_total = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        fd_total = 0
    return {"mem_used": resources.memory_use(node.broker, node.amqp, node.mqtt).total,
            "mem_limit": watermark() if callable(watermark) else 0, "mem_rss": resources.rss_bytes(),
            "disk_free": disk_free, "disk_free_limit": disk_limit() if callable(disk_limit) else 0,
            "fd_used": resources.open_fds(), "fd_total": fd_total, "sockets_used": len(node.amqp.connections)}


async def samples(call: Call) -> dict[str, Any]:
    """The node's totals every sample interval for the last minutes: (unix ms, fields) oldest first.
    ``?vhost=V&queue=Q`` or ``?connection=NAME``: that object's own samples, kept from the first
    time it is asked for (leveret/http/rates.py WATCHED)."""
    rates = call.api.rates
    if "queue" in call.query:
        vh = call.vhost(call.query.get("vhost", "/"))
        if call.query["queue"] not in vh.queues:
            raise not_found(f"no queue '{call.query['queue']}' in vhost '{vh.name}'")
        history = rates.watch(("queue", vh.name, call.query["queue"]))
    elif "connection" in call.query:
        if not call.sees_all:
            raise not_found()
        history = rates.watch(("connection", call.query["connection"]))
    else:
        history = list(rates.history)
    return {"interval": rates.interval, "samples": [{"timestamp": int(t * 1000), **point} for t, point in history]}


def node_extras(call: Call) -> dict[str, Any]:
    """What RabbitMQ's node view adds that the console's gauges and tools read: limits, totals, churn."""
    node = call.node
    disk_limit = getattr(node, "disk_free_limit_bytes", None)
    try:
        disk_free = resources.disk_free(node.config.data_dir)
    except OSError:
        disk_free = 0
    try:
        fd_total = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        fd_total = 0
    return {
        "disk_free": disk_free, "disk_free_limit": disk_limit() if callable(disk_limit) else 0,
        "fd_total": fd_total, "sockets_total": fd_total,
        # mem_used is what the memory alarm counts against mem_limit (docs/AMQP.md), RSS beside it.
        "mem_calculation_strategy": "leveret_held_bytes", "mem_rss": resources.rss_bytes(),
        **{k: v for k, v in call.api.rates.churn_rates(call.broker.stats).items()},
    }


# -- what rabbitmqctl's environment, set_vm_memory_high_watermark, set_disk_free_limit and
# -- rabbitmq-diagnostics log_tail ask of a node (Leveret's own paths: RabbitMQ uses Erlang RPC for them)
SECRET = ("password", "pass", "dsn", "secret")


async def environment(call: Call) -> dict[str, Any]:
    """The node's configuration, secrets blanked (rabbitmqctl environment prints the app environment)."""
    cfg = dataclasses.asdict(call.node.config)
    return {k: ("********" if v and any(s in k for s in SECRET) else v) for k, v in cfg.items()}


async def node_limits_put(call: Call) -> web.Response:
    body = await call.body(frozenset({"vm_memory_high_watermark", "disk_free_limit"}))
    cfg = call.node.config
    if "vm_memory_high_watermark" in body:
        mark = body["vm_memory_high_watermark"]
        if isinstance(mark, dict) and set(mark) == {"absolute"}:
            try:
                absolute = resources.parse_disk_free_limit(str(mark["absolute"]), resources.total_memory())
            except ValueError:
                raise bad_request(f"absolute watermark {mark['absolute']!r} is not bytes (1GB, 512MiB)") from None
            if absolute <= 1:
                raise bad_request("an absolute watermark must be more than 1 byte")
            value = float(absolute)
        elif isinstance(mark, (int, float)) and not isinstance(mark, bool) and 0 <= mark <= 1:
            value = float(mark)  # a fraction of RAM, as RabbitMQ's vm_memory_high_watermark
        else:
            raise bad_request("vm_memory_high_watermark: a fraction of RAM (0.0-1.0) or {\"absolute\": \"1GB\"}")
        cfg.memory_high_watermark = value
    if "disk_free_limit" in body:
        text = str(body["disk_free_limit"])
        try:
            resources.parse_disk_free_limit(text, resources.total_memory())
        except ValueError as exc:
            raise bad_request(str(exc).removeprefix("--disk-free-limit: ")) from None
        cfg.disk_free_limit = text
    log.info("node limits changed", extra={"memory_high_watermark": cfg.memory_high_watermark,
                                          "disk_free_limit": cfg.disk_free_limit, "user": call.user.name})
    return web.Response(status=204)


class LogTail(logging.Handler):
    """The node's last log lines, formatted as its own log handler formats them, for log_tail."""

    def __init__(self, lines: int = 1000) -> None:
        super().__init__()
        self.lines: deque[str] = deque(maxlen=lines)

    def emit(self, record: logging.LogRecord) -> None:
        root = logging.getLogger().handlers
        formatter = next((h.formatter for h in root if h is not self and h.formatter is not None), None)
        try:
            self.lines.append((formatter or logging.Formatter()).format(record))
        except Exception:  # a record that does not format must not break logging
            self.handleError(record)


TAIL = LogTail()


def install_log_tail() -> None:
    root = logging.getLogger()
    if TAIL not in root.handlers:
        root.addHandler(TAIL)


async def log_tail(call: Call) -> list[str]:
    try:
        n = int(call.query.get("lines", "50"))
    except ValueError:
        raise bad_request("lines must be an integer") from None
    if n < 0:
        raise bad_request("lines must not be negative")
    return list(TAIL.lines)[-n:] if n else []
