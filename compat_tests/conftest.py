"""Fixtures for the AMQP compatibility suite.

By default a Leveret node is started once per session on free ports.  Set
``LEVERET_TEST_AMQP_URL`` (e.g. ``amqp://guest:guest@127.0.0.1:5672/``) to run
the very same tests against an already running broker such as RabbitMQ.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlparse

import pika
import pika.exceptions
import pytest

from compat_tests.raw_amqp import RawAMQP
from compat_tests.util import Names, unique_name
from harness.ports import free_ports as _free_ports

# Nodes these tests start serve no Prometheus endpoint unless a test passes
# --prometheus-port: the default (15692) would collide between parallel runs.
os.environ.setdefault("LEVERET_PROMETHEUS_PORT", "0")

REPO_ROOT = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT = 15.0
URL_ENV = "LEVERET_TEST_AMQP_URL"



def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _python() -> str:
    venv_python = REPO_ROOT / ".venv" / "bin" / "python"
    return str(venv_python) if venv_python.exists() else sys.executable


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def amqp_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    external = os.environ.get(URL_ENV)
    if external:
        yield external
        return

    amqp_port, grpc_port = _free_ports(2)
    workdir = tmp_path_factory.mktemp("leveret-node")
    data_dir = workdir / "data"
    data_dir.mkdir()
    stdout_path = workdir / "stdout.log"
    stderr_path = workdir / "stderr.log"
    cmd = [
        _python(),
        "-m",
        "leveret",
        "serve",
        "--bind",
        "127.0.0.1",
        "--amqp-port",
        str(amqp_port),
        "--grpc-port",
        str(grpc_port),
        "--management-port",
        "0",
        "--data-dir",
        str(data_dir),
    ]
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=out, stderr=err)
    started = False
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"leveret node exited with code {proc.returncode} during startup:\n"
                    f"{stderr_path.read_text(errors='replace')}",
                    pytrace=False,
                )
            if _port_open("127.0.0.1", amqp_port):
                break
            if time.monotonic() > deadline:
                pytest.fail(
                    f"leveret node did not accept connections on port {amqp_port} "
                    f"within {STARTUP_TIMEOUT:.0f}s; stderr:\n"
                    f"{stderr_path.read_text(errors='replace')}",
                    pytrace=False,
                )
            time.sleep(0.05)
        started = True
        yield f"amqp://guest:guest@127.0.0.1:{amqp_port}/"
    finally:
        _stop(proc)
        if started and proc.returncode not in (0, -signal.SIGTERM):
            sys.stderr.write(
                f"\nleveret node exited with {proc.returncode}; stderr tail:\n"
                f"{stderr_path.read_text(errors='replace')[-5000:]}\n"
            )


@pytest.fixture(scope="session")
def amqp_host(amqp_url: str) -> str:
    return urlparse(amqp_url).hostname or "127.0.0.1"


@pytest.fixture(scope="session")
def amqp_port(amqp_url: str) -> int:
    return urlparse(amqp_url).port or 5672


@pytest.fixture
def names(amqp_url: str) -> Iterator[Names]:
    """``names.queue()`` / ``names.exchange()`` give unique, auto-deleted names."""
    n = Names()
    yield n
    n.cleanup(amqp_url)


@pytest.fixture
def unique() -> Callable[[str], str]:
    return unique_name


@pytest.fixture
def pika_params(amqp_url: str) -> pika.URLParameters:
    return pika.URLParameters(amqp_url)


@pytest.fixture
def connect(amqp_url: str) -> Iterator[Callable[..., pika.BlockingConnection]]:
    """Factory for BlockingConnections that are closed at teardown."""
    opened: list[pika.BlockingConnection] = []

    def factory(**params: object) -> pika.BlockingConnection:
        parameters = pika.URLParameters(amqp_url)
        for key, value in params.items():
            setattr(parameters, key, value)
        conn = pika.BlockingConnection(parameters)
        opened.append(conn)
        return conn

    yield factory
    for conn in opened:
        if conn.is_open:
            try:
                conn.close()
            except pika.exceptions.AMQPError:
                pass


@pytest.fixture
def connection(connect: Callable[..., pika.BlockingConnection]) -> pika.BlockingConnection:
    return connect()


@pytest.fixture
def channel(connection: pika.BlockingConnection) -> pika.adapters.blocking_connection.BlockingChannel:
    return connection.channel()


@pytest.fixture
def raw(amqp_host: str, amqp_port: int) -> Iterator[Callable[[], RawAMQP]]:
    """Factory for raw pamqp-level connections, closed at teardown."""
    opened: list[RawAMQP] = []

    def factory() -> RawAMQP:
        client = RawAMQP(amqp_host, amqp_port)
        opened.append(client)
        return client

    yield factory
    for client in opened:
        client.close_socket()
