"""``leveret diagnostics`` against a real node: healthy, in alarm, and gone, with the exit codes probes read."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest
from pamqp import commands, frame

from compat_tests.test_metrics import MetricsNode
from harness.node import REPO_ROOT, _python, node_env
from leveret import __version__


class TinyWatermarkNode(MetricsNode):
    """A node whose memory alarm goes off once 2000 bytes of messages wait in queues."""

    def command(self) -> list[str]:
        return [*super().command(), "--memory-high-watermark", "2000"]


def diagnostics(node: MetricsNode, command: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_python(), "-m", "leveret", "diagnostics", command, "--amqp-port", str(node.amqp_port),
         "--grpc-port", str(node.grpc_port), "--prometheus-port", str(node.metrics_port), "--timeout", "5", *extra],
        cwd=REPO_ROOT, env=node_env(), capture_output=True, text=True, timeout=60)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[TinyWatermarkNode]:
    n = TinyWatermarkNode(tmp_path / "data", tmp_path / "logs")
    n.start()
    try:
        yield n
    finally:
        n.cleanup()


def test_diagnostics_healthy_alarm_and_down(node: TinyWatermarkNode) -> None:
    for command in ("ping", "check_running", "check_local_alarms", "check_port_connectivity"):
        done = diagnostics(node, command)
        assert done.returncode == 0, f"{command}: {done.stderr}"
    assert "is running" in diagnostics(node, "check_running").stdout
    assert diagnostics(node, "ping", "-q").stdout == ""

    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    ch = conn.channel()
    ch.queue_declare("diag-fill")
    for _ in range(5):
        ch.basic_publish("", "diag-fill", b"x" * 1000)
    conn.close()
    deadline = time.monotonic() + 10
    while (done := diagnostics(node, "check_local_alarms")).returncode == 0:
        assert time.monotonic() < deadline, "the memory alarm never showed"
        time.sleep(0.3)
    assert done.returncode == 69
    assert "memory_used_watermark" in done.stderr and "Traceback" not in done.stderr

    node.terminate()
    for command in ("ping", "check_running", "check_port_connectivity"):
        done = diagnostics(node, command)
        assert done.returncode == 69, f"{command} on a stopped node: {done.returncode} {done.stdout}"
        assert "Traceback" not in done.stderr


def _api_diagnostics(node: MetricsNode, *argv: str, entry: str | None = None) -> subprocess.CompletedProcess[str]:
    """A command that reads the management API too; ``entry``: run through that entry point's function."""
    ports = ["--amqp-port", str(node.amqp_port), "--grpc-port", str(node.grpc_port), "--prometheus-port",
             str(node.metrics_port), "--management-port", str(node.management_port)]
    if entry is None:
        cmd = [_python(), "-m", "leveret", "diagnostics", *argv, *ports]
    else:
        module, func = entry.split(":")
        cmd = [_python(), "-c", f"import sys; from {module} import {func}; sys.exit({func}())", *argv, *ports]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=node_env(), capture_output=True, text=True, timeout=60)


def test_rabbitmq_diagnostics_commands(node: TinyWatermarkNode) -> None:
    """rabbitmq-diagnostics' commands, their output and exit codes, against a real node."""
    expect = {
        ("check_alarms",): "reported no alarms",
        ("alarms",): "reported no alarms",
        ("listeners",): f"port: {node.amqp_port}, protocol: amqp",
        ("check_virtual_hosts",): "reported all vhosts as running",
        ("check_if_node_is_quorum_critical",): "not critical",
        ("memory_breakdown",): "other_proc: ",
        ("server_version",): __version__,
        ("check_certificate_expiration",): "No certificates are expiring within 4 weeks.",
        ("check_certificate_expiration", "--within", "2", "--unit", "months"): "within 2 months",
        ("check_protocol_listener", "amqp"): "A listener for protocol amqp is running",
        ("check_protocol_listener", "http/prometheus"): "is running",
        ("is_booting",): "is fully booted",
        ("log_tail", "-N", "3"): "Last 3 log lines",
        ("status",): '"product_name": "Leveret"',
    }
    for argv, text in expect.items():
        done = _api_diagnostics(node, *argv)
        assert done.returncode == 0 and text in done.stdout, (argv, done.stdout, done.stderr)
    assert len(_api_diagnostics(node, "log_tail", "-N", "3").stdout.splitlines()) == 4  # the line and 3
    assert _api_diagnostics(node, "-q", "server_version").stdout == f"{__version__}\n"
    assert _api_diagnostics(node, "server_version", "-s").stdout == ""
    status = json.loads(_api_diagnostics(node, "status", "--formatter", "json").stdout)
    assert status["node"] and status["memory"]["limit"] == 2000

    missing = _api_diagnostics(node, "check_protocol_listener", "stomp")
    assert missing.returncode == 69 and "No listener for protocol stomp" in missing.stderr
    for bad in (("ping", "--bogus"), ("--no-such-flag", "status"), ("check_protocol_listener",),
                ("status", "extra"), ("check_certificate_expiration", "--unit", "fortnights")):
        done = _api_diagnostics(node, *bad)
        assert done.returncode == 64 and "Traceback" not in done.stderr, (bad, done.stderr)

    # The same command lines through the leveret-rabbitmq-diagnostics entry point.
    via = _api_diagnostics(node, "check_protocol_listener", "amqp",
                           entry="leveret.cli.diagnostics:rabbitmq_diagnostics_main")
    assert via.returncode == 0 and "is running" in via.stdout
    assert _api_diagnostics(node, "--bogus", entry="leveret.cli.diagnostics:rabbitmq_diagnostics_main"
                            ).returncode == 64

    # An alarm: check_alarms fails (69), alarms reports it (0).
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    ch = conn.channel()
    ch.queue_declare("diag-api-fill")
    for _ in range(5):
        ch.basic_publish("", "diag-api-fill", b"x" * 1000)
    conn.close()
    deadline = time.monotonic() + 10
    while (done := _api_diagnostics(node, "check_alarms")).returncode == 0:
        assert time.monotonic() < deadline, "the memory alarm never showed"
        time.sleep(0.3)
    assert done.returncode == 69 and "memory" in done.stderr
    assert _api_diagnostics(node, "alarms").returncode == 0


class NotLeveret(threading.Thread):
    """A server on a free port that answers the AMQP header as a RabbitMQ does (connection.start)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]

    def run(self) -> None:
        start = commands.Connection.Start(server_properties={
            "product": "RabbitMQ", "version": "3.10.8", "cluster_name": "rabbit@elsewhere"})
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(8)
                conn.sendall(frame.marshal(start, 0))


def test_ping_names_the_node_and_refuses_another_broker(node: TinyWatermarkNode) -> None:
    done = diagnostics(node, "ping")
    assert done.returncode == 0
    assert f"Ping succeeded: Leveret {__version__}, node " in done.stdout and f":{node.amqp_port}" in done.stdout
    name = done.stdout.split(", node ", 1)[1].split(",", 1)[0]
    assert diagnostics(node, "ping", "-n", name).returncode == 0
    other = diagnostics(node, "ping", "-n", "leveret@some-other-node")
    assert other.returncode == 69 and f"Leveret node {name}, not leveret@some-other-node" in other.stderr
    fake = NotLeveret()
    fake.start()
    try:
        done = subprocess.run([_python(), "-m", "leveret", "diagnostics", "ping", "--amqp-port", str(fake.port)],
                              cwd=REPO_ROOT, env=node_env(), capture_output=True, text=True, timeout=60)
    finally:
        fake.sock.close()
    assert done.returncode == 69
    assert "is RabbitMQ 3.10.8 (cluster_name rabbit@elsewhere), not a Leveret node" in done.stderr
