"""``leveret diagnostics COMMAND`` (and ``leveret-rabbitmq-diagnostics``): rabbitmq-diagnostics' commands.

- ``ping``: the AMQP listener answers the protocol header with connection.start, and
  its server properties say it is a Leveret node (which one: product, version, cluster
  name); another broker (a RabbitMQ on the port) fails the ping;
- ``check_running``: ping, and the node reports itself on its Prometheus
  endpoint (``rabbitmq_identity_info``: the broker is serving, not just
  accepting sockets); with ``--prometheus-port 0`` ping alone;
- ``check_local_alarms``: no resource alarm in effect (``rabbitmq_alarms_*``);
- ``check_port_connectivity``: every listener accepts a TCP connection;
- over the management API (``--management-port``, default the node's; ``--username``/
  ``--password``, env LEVERET_CTL_USERNAME/PASSWORD): ``status``, ``listeners``, ``alarms``,
  ``check_alarms``, ``check_virtual_hosts``, ``check_if_node_is_quorum_critical``,
  ``memory_breakdown``, ``server_version``, ``check_certificate_expiration``, ``log_tail``,
  ``check_protocol_listener``, ``is_booting``.

Exit codes, as RabbitMQ's CLI (sysexits): 0 healthy, 69 (EX_UNAVAILABLE) the
node cannot be reached or a check failed, 64 (EX_USAGE) a configuration that
does not load or a command line it refuses (an unknown flag too). The
ports come from the node's own configuration (``--config``, ``LEVERET_*``,
flags), so a probe run with the node's environment needs no arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, NoReturn

from pamqp import frame as amqp_frame
from pamqp.exceptions import PAMQPException

from leveret.node.config import ConfigError, NodeConfig, load

OK = 0
EX_USAGE = 64
EX_UNAVAILABLE = 69
COMMANDS = ("ping", "check_running", "check_local_alarms", "check_port_connectivity", "check_alarms", "alarms",
            "status", "listeners", "check_virtual_hosts", "check_if_node_is_quorum_critical", "memory_breakdown",
            "server_version", "check_certificate_expiration", "log_tail", "check_protocol_listener", "is_booting")
AMQP_HEADER = b"AMQP\x00\x00\x09\x01"
PRODUCT = "Leveret"
UNITS = ("days", "weeks", "months", "years")


class CheckFailed(Exception):
    """The node did not pass; the text says what a person should look at."""


def _usage_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """rabbitmq-diagnostics answers a command line it refuses (an unknown flag too) with 64."""
    parser.print_usage(sys.stderr)
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    sys.exit(EX_USAGE)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("diagnostics_command", choices=COMMANDS, metavar="COMMAND", help=", ".join(COMMANDS))
    p.add_argument("command_args", nargs="*", metavar="ARG", help="check_protocol_listener: the protocol")
    p.add_argument("--config", metavar="FILE", help="the node's TOML config file (env LEVERET_CONFIG)")
    p.add_argument("--host", default=None, help="node host (default: its --advertise-host or --bind)")
    p.add_argument("--amqp-port", type=int, default=None)
    p.add_argument("--grpc-port", type=int, default=None)
    p.add_argument("--prometheus-port", type=int, default=None)
    p.add_argument("--management-port", type=int, default=None,
                   help="the management API (default: the node's --management-port); check_port_connectivity "
                        "checks it when given")
    p.add_argument("--username", default=os.environ.get("LEVERET_CTL_USERNAME", "guest"),
                   help="management API user (env LEVERET_CTL_USERNAME; default guest)")
    p.add_argument("--password", default=os.environ.get("LEVERET_CTL_PASSWORD", "guest"),
                   help="env LEVERET_CTL_PASSWORD; default guest")
    p.add_argument("-t", "--timeout", type=float, default=5.0, help="seconds for each connection (default 5)")
    p.add_argument("-q", "--quiet", action="store_true", help="no informational line")
    p.add_argument("-s", "--silent", action="store_true", help="print nothing on success")
    p.add_argument("-n", "--node", default=None,
                   help="the node name expected (e.g. leveret@host): a node of another name fails the check")
    p.add_argument("--formatter", choices=["table", "json"], default="table")
    p.add_argument("-l", "--longnames", action="store_true", help="accepted for rabbitmq-diagnostics' sake")
    p.add_argument("-N", "--number", type=int, default=50, help="log_tail: how many lines (default 50)")
    p.add_argument("--within", type=int, default=4, help="check_certificate_expiration: how many units (4)")
    p.add_argument("--unit", choices=UNITS, default="weeks", help="check_certificate_expiration: (weeks)")
    p.error = lambda message: _usage_error(p, message)  # type: ignore[method-assign]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("diagnostics", help="rabbitmq-diagnostics' health checks and reports (ping, check_running, "
                                           "check_alarms, status, listeners, ...) with its exit codes",
                       description="rabbitmq-diagnostics' commands; exit 0 when healthy, 69 when not, 64 for a "
                                   "command line it refuses (docs/METRICS.md has compose and Kubernetes probe "
                                   "examples).")
    _arguments(p)


def _host(cfg: NodeConfig, given: str | None) -> str:
    host = given or cfg.advertise_host or cfg.bind
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def ping(host: str, port: int, timeout: float) -> dict[str, Any]:
    """Send the AMQP 0-9-1 protocol header; a broker answers with connection.start: its server properties."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(AMQP_HEADER)
            deadline = time.monotonic() + timeout
            head = _read(sock, 7, deadline)
            kind, channel, size = struct.unpack(">BHI", head)
            if kind != 1 or channel != 0 or size > 1 << 20:
                raise CheckFailed(f"AMQP port {host}:{port} answered something that is not connection.start")
            data = head + _read(sock, size + 1, deadline)
    except OSError as exc:
        raise CheckFailed(f"AMQP port {host}:{port}: {exc.strerror or exc}") from exc
    try:
        _, _, start = amqp_frame.unmarshal(data)
    except PAMQPException as exc:
        raise CheckFailed(f"AMQP port {host}:{port}: connection.start does not decode: {exc}") from exc
    props = getattr(start, "server_properties", None)
    if not isinstance(props, dict):
        raise CheckFailed(f"AMQP port {host}:{port} answered something that is not connection.start")
    return {k: (v.decode("utf-8", "replace") if isinstance(v, bytes) else v) for k, v in props.items()}


def identify(props: dict[str, Any], host: str, port: int, expected: str | None) -> str:
    product, version, name = props.get("product", "?"), props.get("version", "?"), props.get("cluster_name", "?")
    if product != PRODUCT:
        raise CheckFailed(f"{host}:{port} is {product} {version} (cluster_name {name}), not a Leveret node")
    if expected and name != expected:
        raise CheckFailed(f"{host}:{port} is Leveret node {name}, not {expected}")
    return f"{product} {version}, node {name}, at {host}:{port}"


def answer_ping(host: str, port: int, timeout: float, expected: str | None = None) -> str:
    return f"Ping succeeded: {identify(ping(host, port, timeout), host, port, expected)}"


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
    identify(ping(host, cfg.amqp_port, timeout), host, cfg.amqp_port, None)
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


class Api:
    """The node's management API, for the commands that read more than AMQP and metrics say."""

    def __init__(self, host: str, port: int, args: argparse.Namespace) -> None:
        from leveret.cli.ctl import Client

        self.client = Client(f"{host}:{port}", args.username, args.password, args.timeout)

    def get(self, path: str, failed_ok: bool = False) -> Any:
        """GET /api/path; with ``failed_ok`` a 503 health answer is returned rather than raised."""
        from leveret.cli.ctl import CtlError

        try:
            return self.client.call("GET", path)
        except CtlError as exc:
            if failed_ok and ": 503 " in str(exc):
                return {"status": "failed", "reason": str(exc).split(": 503 ", 1)[1]}
            raise CheckFailed(str(exc)) from None

    def health(self, path: str) -> dict[str, Any]:
        """A health check's JSON, a 503 included (its body is what failed)."""
        req = urllib.request.Request(self.client.base + "/api/" + path, headers=self.client.headers)
        try:
            with urllib.request.urlopen(req, timeout=self.client.timeout) as resp:
                return dict(json.loads(resp.read()))
        except urllib.error.HTTPError as exc:
            body = exc.read()
            if exc.code == 503:
                return dict(json.loads(body))
            raise CheckFailed(f"GET /api/{path}: {exc.code} {body.decode('utf-8', 'replace')}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise CheckFailed(f"cannot reach the node's management API at {self.client.base}: "
                              f"{getattr(exc, 'reason', exc)}") from None

    def node(self) -> str:
        return str(self.get("overview")["node"])

    def protocols(self) -> dict[str, int]:
        """Protocol -> port, as the protocol-listener check lists them (a protocol nothing serves fails it)."""
        found = self.health("health/checks/protocol-listener/none").get("listeners", [])
        return {listener["protocol"]: listener["port"] for listener in found}


def _gb(n: int) -> str:
    return f"{n / 1e9:.4f} gb"


def api_check(command: str, api: Api, args: argparse.Namespace, say: Callable[[str], None]) -> str:
    """The commands the management API answers: the text to print, or CheckFailed."""
    node = api.node()
    if args.node and node != args.node:
        raise CheckFailed(f"the node there is {node}, not {args.node}")
    if command in ("check_alarms", "alarms"):
        say(f"Asking node {node} to report any {'local' if command == 'check_alarms' else 'known'} "
            "resource alarms ...")
        found = api.health("health/checks/alarms")
        if found.get("status") != "ok":
            alarms = ", ".join(f"{a['resource']} on {a['node']}" for a in found.get("alarms", []))
            if command == "alarms":
                return f"Node {node} reported alarms: {alarms}"
            raise CheckFailed(f"Node {node} reported alarms: {alarms}")
        return f"Node {node} reported no alarms, local or clusterwide"
    if command == "status":
        say(f"Status of node {node} ...")
        overview, me = api.get("overview"), api.get(f"nodes/{_q(node)}")
        status = {"node": node, "product_name": overview["product_name"],
                  "product_version": overview["product_version"], "cluster_name": overview["cluster_name"],
                  "uptime_seconds": me.get("uptime", 0) // 1000, "os_pid": me.get("os_pid"),
                  "memory": {"used": me.get("mem_used"), "limit": me.get("mem_limit"), "rss": me.get("mem_rss")},
                  "alarms": [r for r, on in (("memory", me.get("mem_alarm")), ("disk", me.get("disk_free_alarm")))
                             if on],
                  "disk_free": me.get("disk_free"), "disk_free_limit": me.get("disk_free_limit"),
                  "file_descriptors": {"used": me.get("fd_used"), "total": me.get("fd_total")},
                  "listeners": overview["listeners"], "totals": overview["object_totals"]}
        return json.dumps(status, indent=None if args.formatter == "json" else 2)
    if command == "listeners":
        say(f"Asking node {node} to report its protocol listeners ...")
        ports = api.protocols()
        if args.formatter == "json":
            return json.dumps([{"protocol": p, "port": port} for p, port in ports.items()])
        return "\n".join(f"Interface: {args.host_shown}, port: {port}, protocol: {p}" for p, port in ports.items())
    if command == "check_virtual_hosts":
        say(f"Checking if all vhosts are running on node {node} ...")
        api.get("health/checks/virtual-hosts")
        return f"Node {node} reported all vhosts as running"
    if command == "check_if_node_is_quorum_critical":
        say(f"Checking if node {node} is critical for quorum of any quorum queues ...")
        found = api.health("health/checks/node-is-quorum-critical")
        if found.get("status") != "ok":
            raise CheckFailed(found.get("reason", "quorum critical"))
        return f"Node {node} is not critical for quorum of any queue (Leveret's quorum queues have one owner)"
    if command == "memory_breakdown":
        say(f"Reporting memory breakdown on node {node}...")
        memory = api.get(f"nodes/{_q(node)}/memory")["memory"]
        total = memory["total"]["rss"] or 1
        parts = sorted(((k, v) for k, v in memory.items() if isinstance(v, int) and v), key=lambda kv: -kv[1])
        if args.formatter == "json":
            return json.dumps(dict(parts))
        return "\n".join(f"{k}: {_gb(v)} ({100 * v / total:.2f}%)" for k, v in parts)
    if command == "server_version":
        say(f"Asking node {node} for its Leveret version...")
        return str(api.get("overview")["product_version"])
    if command == "check_certificate_expiration":
        say(f"Checking certificate expiration on node {node} ...")
        found = api.health(f"health/checks/certificate-expiration/{args.within}/{args.unit}")
        if found.get("status") != "ok":
            raise CheckFailed("Certificates expiring: " + "; ".join(
                f"{c['certfile']} ({c.get('expires') or c.get('error')})" for c in found.get("expired", [])))
        return f"No certificates are expiring within {args.within} {args.unit}."
    if command == "log_tail":
        say(f"Last {args.number} log lines on node {node} ...")
        return "\n".join(api.get(f"leveret/log-tail?lines={max(0, args.number)}"))
    if command == "check_protocol_listener":
        if len(args.command_args) != 1:
            raise UsageFailed("usage: check_protocol_listener PROTOCOL")
        protocol = args.command_args[0]
        say(f"Asking node {node} if there's an active listener for protocol {protocol} ...")
        found = api.health(f"health/checks/protocol-listener/{_q(protocol)}")
        if found.get("status") != "ok":
            raise CheckFailed(f"No listener for protocol {protocol} is active on node {node}. Found listeners "
                              f"for the following protocols: {', '.join(found.get('protocols', []))}")
        return f"A listener for protocol {protocol} is running on node {node}."
    raise UsageFailed(f"unknown command {command}")


class UsageFailed(Exception):
    """A command's arguments are wrong: exit 64."""


def _q(text: str) -> str:
    from urllib.parse import quote

    return quote(text, safe="")




def main(args: argparse.Namespace) -> int:
    overrides = {"amqp_port": args.amqp_port, "grpc_port": args.grpc_port, "prometheus_port": args.prometheus_port}
    try:
        cfg = load(args.config, overrides)
    except ConfigError as exc:
        print(f"leveret diagnostics: {exc}", file=sys.stderr)
        return EX_USAGE
    host = _host(cfg, args.host)
    args.host_shown = host
    command = args.diagnostics_command
    quiet = args.quiet or args.silent

    def say(text: str) -> None:
        if not quiet and args.formatter != "json":
            print(text)

    if args.command_args and command != "check_protocol_listener":
        print(f"leveret diagnostics {command}: unexpected arguments {' '.join(args.command_args)}", file=sys.stderr)
        return EX_USAGE
    management = args.management_port if args.management_port is not None else cfg.management_port
    checks: dict[str, Callable[[], str]] = {
        "ping": lambda: answer_ping(host, cfg.amqp_port, args.timeout, args.node),
        "check_running": lambda: check_running(cfg, host, args.timeout),
        "check_local_alarms": lambda: check_local_alarms(cfg, host, args.timeout),
        "check_port_connectivity": lambda: check_port_connectivity(cfg, host, args.timeout,
                                                                   args.management_port or 0),
    }
    if command == "is_booting":
        # Leveret serves once its listeners are up: a node is never seen half booted.
        try:
            node = identify(ping(host, cfg.amqp_port, args.timeout), host, cfg.amqp_port, args.node)
            said = f"{node} is fully booted (check with check_running)"
        except CheckFailed:
            said = f"Leveret at {host}:{cfg.amqp_port} is stopped or has not started booting yet"
        if not args.silent:
            print(said)
        return OK
    try:
        if command in checks:
            said = checks[command]()
        else:
            said = api_check(command, Api(host, management, args), args, say)
    except UsageFailed as exc:
        print(f"leveret diagnostics {command}: {exc}", file=sys.stderr)
        return EX_USAGE
    except CheckFailed as exc:
        print(f"Error:\n{exc}" if command not in checks else f"leveret diagnostics {command}: {exc}",
              file=sys.stderr)
        return EX_UNAVAILABLE
    if not args.silent and not (args.quiet and command in checks):
        print(said)
    return OK


def standalone_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="rabbitmq-diagnostics' commands against a Leveret node")
    _arguments(parser)
    return parser


def check_command_line(argv: list[str]) -> None:
    """Exit 64 for a command line rabbitmq-diagnostics would refuse, before ``leveret``'s own parser
    (whose refusal of an unknown flag after a sub-command is argparse's exit 2)."""
    standalone_parser("leveret diagnostics").parse_args(argv)


def rabbitmq_diagnostics_main() -> int:
    """The ``leveret-rabbitmq-diagnostics`` entry point: rabbitmq-diagnostics' command lines."""
    return main(standalone_parser("leveret-rabbitmq-diagnostics").parse_args())
