"""Plain HTTP against a management API: a Leveret node process, or a RabbitMQ given by LEVERET_TEST_MGMT_URL.

``LEVERET_TEST_MGMT_URL=http://guest:guest@host:15672`` points the management
tests at a running RabbitMQ with the management plugin (its AMQP port is
taken from LEVERET_TEST_AMQP_URL, default amqp://guest:guest@host:5672/).
"""

from __future__ import annotations

import base64
import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness.cluster import Cluster
from urllib.parse import quote, urlsplit

import pytest

from harness.node import NodeProcess

MGMT_ENV = "LEVERET_TEST_MGMT_URL"


@dataclass
class Reply:
    status: int
    body: Any
    headers: dict[str, str]  # names in lower case


class Mgmt:
    def __init__(self, base: str, username: str, password: str, amqp_url: str, leveret: bool) -> None:
        self.base = base.rstrip("/")
        self.username, self.password = username, password
        self.amqp_url = amqp_url
        self.leveret = leveret  # False against a real RabbitMQ: Leveret-only checks skip
        self.node: NodeProcess | None = None

    @property
    def host_port(self) -> str:
        return urlsplit(self.base).netloc.rsplit("@", 1)[-1]

    def as_user(self, username: str, password: str) -> Mgmt:
        other = Mgmt(self.base, username, password, self.amqp_url, self.leveret)
        other.node = self.node
        return other

    def request(self, method: str, path: str, body: Any = None, raw: bytes | None = None,
                headers: dict[str, str] | None = None) -> Reply:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        token = base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
        req = urllib.request.Request(self.base + path, data=data, method=method, headers={
            "Authorization": f"Basic {token}", "Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                status, text, hdrs = resp.status, resp.read(), {k.lower(): v for k, v in resp.headers.items()}
        except urllib.error.HTTPError as exc:
            status, text, hdrs = exc.code, exc.read(), {k.lower(): v for k, v in exc.headers.items()}
        try:
            parsed = json.loads(text) if text.strip() else None
        except ValueError:
            parsed = text.decode("utf-8", "replace")
        return Reply(status, parsed, hdrs)

    def get(self, path: str) -> Any:
        reply = self.request("GET", path)
        assert reply.status == 200, (path, reply)
        return reply.body

    def ok(self, method: str, path: str, body: Any = None, **kw: Any) -> Reply:
        reply = self.request(method, path, body, **kw)
        assert reply.status in (200, 201, 204), (method, path, reply)
        return reply


def q(name: str) -> str:
    return quote(name, safe="")


def start_mgmt(workdir: Path) -> Iterator[Mgmt]:
    external = os.environ.get(MGMT_ENV)
    if external:
        parts = urlsplit(external)
        host = parts.hostname or "127.0.0.1"
        amqp = os.environ.get("LEVERET_TEST_AMQP_URL", f"amqp://guest:guest@{host}:5672/")
        base = f"{parts.scheme}://{host}:{parts.port or 15672}"
        yield Mgmt(base, parts.username or "guest", parts.password or "guest", amqp, leveret=False)
        return
    node = NodeProcess(workdir / "data", workdir / "logs")
    node.start()
    try:
        mgmt = Mgmt(f"http://127.0.0.1:{node.management_port}", "guest", "guest", node.url, leveret=True)
        mgmt.node = node
        wait_http(mgmt)
        yield mgmt
    finally:
        node.terminate()


def wait_http(mgmt: Mgmt) -> None:
    import time

    deadline = time.monotonic() + 30
    while True:
        try:
            if mgmt.request("GET", "/api/overview").status == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError("the management API did not answer within 30 s")
        time.sleep(0.1)


def leveret_only(mgmt: Mgmt) -> None:
    if not mgmt.leveret:
        pytest.skip("Leveret-only behaviour (the API runs against a real RabbitMQ)")


def cluster_api(cluster: Cluster, node_id: str) -> Mgmt:
    """The management API of one node of a test cluster, once it answers (a node's AMQP port opens
    a moment before its HTTP one)."""
    node = cluster.nodes[node_id]
    mgmt = Mgmt(f"http://127.0.0.1:{node.management_port}", "guest", "guest", node.url, leveret=True)
    wait_http(mgmt)
    return mgmt
