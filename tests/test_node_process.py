"""The node as a process: it serves, logs structured lines, and stops cleanly on signals."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pika
import pytest

from harness.ports import free_port

ROOT = Path(__file__).resolve().parent.parent



def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"node exited early: {proc.stderr.read().decode() if proc.stderr else ''}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("node did not start listening")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_closes_connections_with_320_and_exits_zero(tmp_path: Path, sig: signal.Signals) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "leveret", "serve", "--amqp-port", str(port), "--grpc-port", str(free_port()),
         "--data-dir", str(tmp_path / "data"), "--log-format", "json"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        _wait_port(port, proc)
        conn = pika.BlockingConnection(pika.URLParameters(f"amqp://guest:guest@127.0.0.1:{port}/"))
        proc.send_signal(sig)
        with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as info:
            conn.process_data_events(time_limit=10)
        assert info.value.reply_code == 320
        assert info.value.reply_text.startswith("CONNECTION_FORCED")
        assert proc.wait(timeout=15) == 0
        lines = [json.loads(line) for line in proc.stderr.read().decode().splitlines() if line.startswith("{")]
        events = [line["msg"] for line in lines]
        assert "node started" in events and "node stopped" in events
        assert all({"ts", "level", "logger", "msg"} <= set(line) for line in lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(30)
def test_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "leveret", "serve", "--amqp-port", str(port), "--data-dir", str(tmp_path)],
            cwd=ROOT, capture_output=True, timeout=20,
        )
    assert proc.returncode == 1
    assert f"cannot serve on 127.0.0.1:{port}" in proc.stderr.decode()


def test_help_explains_options() -> None:
    out = subprocess.run([sys.executable, "-m", "leveret", "serve", "--help"], cwd=ROOT, capture_output=True,
                         timeout=20, text=True).stdout
    for flag in ("--bind", "--amqp-port", "--grpc-port", "--data-dir", "--node-id", "--config"):
        assert flag in out
