"""The client as its own distribution (client/, leveret-client): installed alone into a fresh venv it
pushes and subscribes against a real node; and a publisher rides out a restart of its node."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from compat_tests.test_client_library import SamePortsNode
from harness.node import REPO_ROOT
from leveret_client import Client, LeveretError


@pytest.fixture
def node(tmp_path: Path) -> Iterator[SamePortsNode]:
    n = SamePortsNode(tmp_path / "data", tmp_path / "logs")
    n.start()
    try:
        yield n
    finally:
        n.cleanup()


def test_push_rides_out_a_restart_without_duplicates(node: SamePortsNode) -> None:
    """Pushes in a loop while the node restarts (a graceful stop, then a start on the same ports): no push
    raises, and every pushed id is in the queue once."""
    target = f"127.0.0.1:{node.grpc_port}"
    pushed: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    with Client(target) as c:
        c.create_queue("rides-out", durable=True, exist_ok=True)

        def publish() -> None:
            try:
                i = 0
                while not stop.is_set():
                    pushed.append(c.push("rides-out", b"m%d" % i, persistent=True))
                    i += 1
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

        thread = threading.Thread(target=publish)
        thread.start()
        try:
            time.sleep(0.5)
            before = len(pushed)
            node.restart()
            restarted_at = len(pushed)
            time.sleep(0.5)
        finally:
            stop.set()
            thread.join(60)
        assert not errors, errors
        assert before > 0 and len(pushed) > restarted_at, (before, restarted_at, len(pushed))

        got: Counter[str] = Counter()
        with c.subscribe("rides-out/", prefetch=1000) as sub:
            while sum(got.values()) < len(pushed):
                m = sub.get(timeout=10)
                if m is None:
                    break
                got[m.id] += 1
                sub.ack(m)
            extra = sub.get(timeout=0.3)
        assert extra is None, f"more messages than pushes: {extra}"
        assert set(got) == set(pushed), f"missing {len(set(pushed) - set(got))}"
        assert [i for i, n in got.items() if n > 1] == []


def test_push_keeps_the_id_it_was_given(node: SamePortsNode) -> None:
    with Client(f"127.0.0.1:{node.grpc_port}") as c:
        c.create_queue("ids", exist_ok=True)
        assert c.push("ids", b"x", id="order-42") == "order-42"
        with c.subscribe("ids/") as sub:
            m = sub.get(timeout=5)
            assert m is not None and m.id == "order-42"
            sub.ack(m)
        with pytest.raises(LeveretError) as exc:
            c.push("ids", b"x", id="x" * 256)
        assert exc.value.code.name == "INVALID_ARGUMENT"


def test_push_gives_up_after_push_retry_for() -> None:
    """No node at all: the push retries for push_retry_for seconds, then raises UNAVAILABLE."""
    from harness.ports import free_port

    with Client(f"127.0.0.1:{free_port()}", push_retry_for=1.0, timeout=5) as c:
        started = time.monotonic()
        with pytest.raises(LeveretError) as exc:
            c.push("q", b"x")
        took = time.monotonic() - started
    assert exc.value.code.name == "UNAVAILABLE"
    assert 0.9 <= took < 5, took


CLIENT_SCRIPT = textwrap.dedent("""
    import importlib.util, sys
    from leveret_client import Client, StreamsClient, FIRST
    # The client alone: none of the broker's packages came with it.
    assert all(importlib.util.find_spec(m) is None for m in ("leveret", "core", "persistence", "pamqp")), sys.path
    target = sys.argv[1]
    with Client(target) as c:
        c.create_queue("from-venv", exist_ok=True)
        ch = c.create_channel("from-venv", topic="a.*")
        c.push("from-venv", b"hello", topic="a.b")
        with c.subscribe(ch) as sub:
            m = sub.get(timeout=10)
            assert m is not None and m.content == b"hello", m
            sub.ack(m)
    with StreamsClient(target) as s:
        s.create_stream("venv-stream", exist_ok=True)
        s.publish("venv-stream", b"s1")
        with s.subscribe({"venv-stream": FIRST}) as sub:
            assert sub.get(timeout=10).body == b"s1"
    print("ok")
""")


def test_pip_install_client_into_a_fresh_venv(node: SamePortsNode, tmp_path: Path) -> None:
    """``pip install ./client`` (grpcio and protobuf from the index the host's pip uses), then push and
    subscribe from that venv: the distribution is complete on its own."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    install = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                              str(REPO_ROOT / "client")], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout + install.stderr
    listed = subprocess.run([str(py), "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"],
                            capture_output=True, text=True, check=True).stdout
    names = {line.split("==")[0].lower() for line in listed.split()}
    assert {"leveret-client", "grpcio", "protobuf"} <= names
    assert "leveret" not in names and "pamqp" not in names, names
    run = subprocess.run([str(py), "-c", CLIENT_SCRIPT, f"127.0.0.1:{node.grpc_port}"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr
