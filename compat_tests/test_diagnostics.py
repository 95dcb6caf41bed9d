"""``leveret diagnostics`` against a real node: healthy, in alarm, and gone, with the exit codes probes read."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest

from compat_tests.node_process import REPO_ROOT, _python, node_env
from compat_tests.test_metrics import MetricsNode


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
