"""gRPC deliveries belong to their subscriber: another login's Ack/Nack with their ids changes nothing.

Two users, each allowed in one vhost only, each hold unacked deliveries of the
same queue name in their own vhost. Delivery ids are sequential per node, so
each can name the other's; before this rule a user of vhost ``vb`` acked (and
with ``requeue=false`` destroyed) the deliveries of a user in ``va``.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.node import REPO_ROOT, NodeProcess, _python, node_env
from leveret.client import Client, Message

USERS = {"ua": ("pass-a-123", "va"), "ub": ("pass-b-456", "vb")}


def _leveret(*args: str) -> None:
    subprocess.run([_python(), "-m", "leveret", *args], cwd=REPO_ROOT, env=node_env(), check=True,
                   capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def node() -> Iterator[NodeProcess]:
    root = Path(tempfile.mkdtemp(prefix="leveret-grpc-owner-"))
    data = root / "data"
    for name, (password, vhost) in USERS.items():
        _leveret("vhosts", "add", vhost, "--data-dir", str(data))
        _leveret("users", "add", name, "--password", password, "--vhost", vhost, "--data-dir", str(data))
    n = NodeProcess(data, root / "logs")
    n.start()
    yield n
    n.terminate()
    shutil.rmtree(root, ignore_errors=True)


def _client(node: NodeProcess, user: str) -> Client:
    password, vhost = USERS[user]
    return Client(f"127.0.0.1:{node.grpc_port}", username=user, password=password, vhost=vhost, timeout=10)


def _hold(c: Client, n: int) -> list[Message]:
    c.create_queue("jobs", exist_ok=True)
    ch = c.create_channel("jobs")
    for i in range(n):
        c.push("jobs", f"job-{i}".encode())
    sub = c.subscribe(ch, prefetch=100)
    got = [sub.get(timeout=10) for _ in range(n)]
    assert all(m is not None for m in got)
    return [m for m in got if m is not None]


def test_settles_with_another_users_ids_change_nothing(node: NodeProcess) -> None:
    with _client(node, "ua") as a, _client(node, "ub") as b:
        held_a = _hold(a, 5)
        held_b = _hold(b, 5)
        ids_a = {m.delivery_id for m in held_a}
        ids_b = {m.delivery_id for m in held_b}
        assert not ids_a & ids_b
        # Each settles the other's ids, every way there is: nothing is settled.
        assert b.ack(held_a) == 0
        assert b.nack(held_a, requeue=False) == 0
        assert a.nack(held_b, requeue=True) == 0
        assert a.ack(held_b) == 0
        # Had any of those settled, the owner's own settle would now find fewer than five.
        assert a.ack(held_a) == 5
        assert b.nack(held_b, requeue=False) == 5
        assert a.ack(held_a) == 0  # once
