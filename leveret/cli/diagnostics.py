"""``leveret diagnostics COMMAND``: health checks for orchestrators, by rabbitmq-diagnostics' names.

- ``ping``: the AMQP listener answers the protocol header with connection.start;
- ``check_running``: ping, and the node reports itself on its Prometheus
  endpoint (``rabbitmq_identity_info``: the broker is serving, not just
  accepting sockets); with ``--prometheus-port 0`` ping alone;
- ``check_local_alarms``: no resource alarm in effect (``rabbitmq_alarms_*``);
- ``check_port_connectivity``: every listener accepts a TCP connection.

Exit codes, as RabbitMQ's CLI (sysexits): 0 healthy, 69 (EX_UNAVAILABLE) the
node cannot be reached or a check failed, 64 (EX_USAGE) a configuration that
does not load, 2 a command line argparse refuses. The
ports come from the node's own configuration (``--config``, ``LEVERET_*``,
flags), so a probe run with the node's environment needs no arguments.
"""

from __future__ import annotations

import argparse
import socket
import struct
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from leveret.node.config import ConfigError, NodeConfig, load

OK = 0
EX_USAGE = 64
EX_UNAVAILABLE = 69
COMMANDS = ("ping", "check_running", "check_local_alarms", "check_port_connectivity")
AMQP_HEADER = b"AMQP\x00\x00\x09\x01"


class CheckFailed(Exception):
    """The node did not pass; the text says what a person should look at."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("diagnostics", help="health checks (ping, check_running, check_local_alarms, "
                                           "check_port_connectivity) with exit codes for probes",
                       description="Health checks by rabbitmq-diagnostics' names; exit 0 when healthy, 69 when "
                                   "not (docs/METRICS.md has compose and Kubernetes probe examples).")
    p.add_argument("diagnostics_command", choices=COMMANDS, metavar="COMMAND", help=", ".join(COMMANDS))
    p.add_argument("--config", metavar="FILE", help="the node's TOML config file (env LEVERET_CONFIG)")
    p.add_argument("--host", default=None, help="node host (default: its --advertise-host or --bind)")
    p.add_argument("--amqp-port", type=int, default=None)
    p.add_argument("--grpc-port", type=int, default=None)
    p.add_argument("--prometheus-port", type=int, default=None)
    p.add_argument("--management-port", type=int, default=0,
                   help="also check this port in check_port_connectivity (default: not checked)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds for each connection (default 5)")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")


def _host(cfg: NodeConfig, given: str | None) -> str:
    host = given or cfg.advertise_host or cfg.bind
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def ping(host: str, port: int, timeout: float) -> None:
    """Send the AMQP 0-9-1 protocol header; a broker answers with a connection.start method frame."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(AMQP_HEADER)
            head = _read(sock, 7, time.monotonic() + timeout)
    except OSError as exc:
        raise CheckFailed(f"AMQP port {host}:{port}: {exc.strerror or exc}") from exc
    kind, channel, _size = struct.unpack(">BHI", head)
    if kind != 1 or channel != 0:
        raise CheckFailed(f"AMQP port {host}:{port} answered something that is not connection.start")


def answer_ping(host: str, port: int, timeout: float) -> str:
    ping(host, port, timeout)
    return f"pong: the node at {host}:{port} answers AMQP"


def _read(sock: socket.socket, n: int, deadline: float) -> bytes:
    data = b""
    while len(data) < n:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise CheckFailed("the AMQP port closed the connection without answering")
        data += chunk
    return data


def scrape(host: str, port: int, timeout: float) -> str:
    url = f"http://{host}:{port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return str(resp.read().decode("utf-8"))
    except (urllib.error.URLError, OSError) as exc:
        raise CheckFailed(f"metrics endpoint {url}: {getattr(exc, 'reason', None) or exc}") from exc


def _samples(text: str) -> dict[str, float]:
    """name{labels} -> value, for the unlabelled gauges the checks read (no parser needed for those)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


def check_running(cfg: NodeConfig, host: str, timeout: float) -> str:
    ping(host, cfg.amqp_port, timeout)
    if not cfg.prometheus_port:
        return f"node at {host}:{cfg.amqp_port} is running (AMQP answered; no metrics port to ask)"
    text = scrape(host, cfg.prometheus_port, timeout)
    for line in text.splitlines():
        if line.startswith("rabbitmq_identity_info{"):
            node = line.split('rabbitmq_node="', 1)[-1].split('"', 1)[0]
            return f"node {node} is running"
    raise CheckFailed("the metrics endpoint does not report the node's identity")


def check_local_alarms(cfg: NodeConfig, host: str, timeout: float) -> str:
    if not cfg.prometheus_port:
        raise CheckFailed("check_local_alarms reads the metrics endpoint: the node runs with --prometheus-port 0")
    samples = _samples(scrape(host, cfg.prometheus_port, timeout))
    alarms = sorted(name.removeprefix("rabbitmq_alarms_") for name, v in samples.items()
                    if name.startswith("rabbitmq_alarms_") and v)
    if alarms:
        raise CheckFailed(f"resource alarms in effect: {', '.join(alarms)}")
    return "no local alarms in effect"


def check_port_connectivity(cfg: NodeConfig, host: str, timeout: float, management: int) -> str:
    ports = [("amqp", cfg.amqp_port), ("grpc", cfg.grpc_port), ("prometheus", cfg.prometheus_port),
             ("management", management)]
    failed = []
    checked = []
    for name, port in ports:
        if not port:
            continue
        checked.append(f"{name} {port}")
        try:
            socket.create_connection((host, port), timeout=timeout).close()
        except OSError as exc:
            failed.append(f"{name} {host}:{port} ({exc.strerror or exc})")
    if failed:
        raise CheckFailed("listeners not reachable: " + "; ".join(failed))
    return f"every listener accepts connections on {host}: {', '.join(checked)}"


def main(args: argparse.Namespace) -> int:
    overrides = {"amqp_port": args.amqp_port, "grpc_port": args.grpc_port, "prometheus_port": args.prometheus_port}
    try:
        cfg = load(args.config, overrides)
    except ConfigError as exc:
        print(f"leveret diagnostics: {exc}", file=sys.stderr)
        return EX_USAGE
    host = _host(cfg, args.host)
    command = args.diagnostics_command
    checks: dict[str, Callable[[], str]] = {
        "ping": lambda: answer_ping(host, cfg.amqp_port, args.timeout),
        "check_running": lambda: check_running(cfg, host, args.timeout),
        "check_local_alarms": lambda: check_local_alarms(cfg, host, args.timeout),
        "check_port_connectivity": lambda: check_port_connectivity(cfg, host, args.timeout, args.management_port),
    }
    try:
        said = checks[command]()
    except CheckFailed as exc:
        print(f"leveret diagnostics {command}: {exc}", file=sys.stderr)
        return EX_UNAVAILABLE
    if not args.quiet:
        print(said)
    return OK
