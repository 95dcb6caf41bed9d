"""TLS on the AMQP and gRPC listeners (docs/SECURITY.md), with certificates made by trustme.

Real node processes, real pika / aio-pika / gRPC clients: server verification,
client certificates with SASL EXTERNAL, a plaintext client on the TLS port,
a certificate reload on SIGHUP.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import pika
import pika.credentials
import pika.exceptions
import pytest
import trustme

from harness.node import REPO_ROOT, NodeProcess, _python, node_env
from harness.ports import free_port
from leveret.client import AsyncClient, Client, LeveretError
from leveret.streams_client import StreamsClient

CERT_USER = "certuser"


class TLSNode(NodeProcess):
    """A node with an AMQPS listener (and whatever TLS flags ``tls_args`` gives)."""

    def __init__(self, data_dir: Path, log_dir: Path, tls_args: list[str]) -> None:
        super().__init__(data_dir, log_dir)
        self.tls_args = tls_args
        self.amqps_port = 0

    def command(self) -> list[str]:
        return [*super().command(), "--amqps-port", str(self.amqps_port), *self.tls_args]

    def spawn(self) -> None:
        self.amqps_port = free_port()
        super().spawn()

    def wait_ready(self, timeout: float = 30.0) -> None:
        super().wait_ready(timeout)
        deadline = time.monotonic() + timeout
        while True:  # the AMQPS listener starts right after the AMQP one
            try:
                socket.create_connection(("127.0.0.1", self.amqps_port), timeout=0.5).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"no AMQPS listener:\n{self.stderr_tail()}") from None
                time.sleep(0.05)

    def log_records(self) -> list[dict[str, object]]:
        out = []
        for line in self.stderr_tail(10**7).splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict):
                out.append(doc)
        return out


class Certs:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = trustme.CA()
        self.ca_file = root / "ca.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        self.server_cert, self.server_key = self.issue("server", "127.0.0.1", "localhost")
        self.client_cert, self.client_key = self.issue("client", f"{CERT_USER}.example", common_name=CERT_USER)

    def issue(self, name: str, *identities: str, common_name: str | None = None) -> tuple[Path, Path]:
        leaf = self.ca.issue_cert(*identities, common_name=common_name)
        cert, key = self.root / f"{name}.pem", self.root / f"{name}.key"
        cert.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
        leaf.private_key_pem.write_to_path(str(key))
        return cert, key

    def client_context(self, with_cert: bool = False) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        if with_cert:
            ctx.load_cert_chain(str(self.client_cert), str(self.client_key))
        return ctx


@pytest.fixture(scope="module")
def certs() -> Iterator[Certs]:
    with tempfile.TemporaryDirectory(prefix="leveret-tls-certs-") as tmp:
        yield Certs(Path(tmp))


def _start(certs: Certs, *extra: str, users: tuple[tuple[str, str], ...] = ()) -> TLSNode:
    """A started node; ``_stop`` ends it and removes its directory."""
    root = Path(tempfile.mkdtemp(prefix="leveret-tls-node-"))
    for name, password in users:
        subprocess.run([_python(), "-m", "leveret", "users", "add", name, "--password", password, "--vhost", "/",
                        "--data-dir", str(root / "data")], cwd=REPO_ROOT, env=node_env(), check=True,
                       capture_output=True, timeout=60)  # fmt: skip
    node = TLSNode(root / "data", root / "logs",
                   ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
                    "--tls-ca", str(certs.ca_file), *extra])  # fmt: skip
    node.start()
    return node


def _stop(node: TLSNode) -> None:
    node.terminate()
    shutil.rmtree(node.data_dir.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def tls_node(certs: Certs) -> Iterator[TLSNode]:
    node = _start(certs, "--grpc-tls")
    yield node
    _stop(node)


@pytest.fixture(scope="module")
def peer_node(certs: Certs) -> Iterator[TLSNode]:
    """--tls-verify peer --tls-fail-if-no-peer-cert, and a user named as the client certificate's CN."""
    node = _start(certs, "--tls-verify", "peer", "--tls-fail-if-no-peer-cert",
                  users=((CERT_USER, "unused-password-1"),))
    yield node
    _stop(node)


def _roundtrip(channel: pika.adapters.blocking_connection.BlockingChannel, body: bytes) -> None:
    q = channel.queue_declare("", exclusive=True).method.queue
    channel.basic_publish("", q, body)
    deadline = time.monotonic() + 10
    while True:
        _, _, got = channel.basic_get(q, auto_ack=True)
        if got is not None:
            assert got == body
            return
        assert time.monotonic() < deadline, "message not delivered"
        time.sleep(0.02)


def test_pika_over_amqps_verifies_the_server(tls_node: TLSNode, certs: Certs) -> None:
    params = pika.ConnectionParameters(
        "127.0.0.1", tls_node.amqps_port, credentials=pika.PlainCredentials("guest", "guest"),
        ssl_options=pika.SSLOptions(certs.client_context(), server_hostname="127.0.0.1"))
    with pika.BlockingConnection(params) as conn:
        _roundtrip(conn.channel(), b"over tls")
    # A client that trusts another CA refuses the node's certificate: verification is real.
    other = ssl.create_default_context(cafile=None)
    other.load_verify_locations(cadata=trustme.CA().cert_pem.bytes().decode())
    with pytest.raises(ssl.SSLCertVerificationError):
        pika.BlockingConnection(pika.ConnectionParameters(
            "127.0.0.1", tls_node.amqps_port, ssl_options=pika.SSLOptions(other, server_hostname="127.0.0.1"),
            connection_attempts=1))


def test_aio_pika_over_amqps(tls_node: TLSNode, certs: Certs) -> None:
    async def go() -> bytes:
        conn = await aio_pika.connect(host="127.0.0.1", port=tls_node.amqps_port, login="guest",
                                      password="guest", ssl=True, ssl_context=certs.client_context())
        async with conn:
            ch = await conn.channel()
            q = await ch.declare_queue("", exclusive=True)
            await ch.default_exchange.publish(aio_pika.Message(b"aio over tls"), routing_key=q.name)
            msg = await q.get(timeout=10, fail=True)
            assert msg is not None
            await msg.ack()
            return msg.body

    assert asyncio.run(go()) == b"aio over tls"


def test_plaintext_client_on_the_tls_port_is_closed_with_one_line(tls_node: TLSNode) -> None:
    # From 127.0.0.2: refusals are rate-limited per client address, and other tests' come from 127.0.0.1.
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", tls_node.amqps_port), timeout=5,
                                      source_address=("127.0.0.2", 0)) as s:
            s.sendall(b"AMQP\x00\x00\x09\x01")
            s.settimeout(5)
            try:
                assert s.recv(100) == b""  # closed, and no AMQP header sent back in plaintext
            except ConnectionResetError:
                pass
    time.sleep(0.3)
    refused = [r for r in tls_node.log_records()
               if r.get("msg") == "TLS handshake failed; connection closed" and r.get("peer") == "127.0.0.2"]
    assert len(refused) == 1, refused  # three attempts, one line (rate-limited per client address)
    assert "plaintext" in str(refused[0].get("reason"))
    assert "Traceback" not in tls_node.stderr_tail(10**7)
    # The plain AMQP port still speaks plaintext.
    with pika.BlockingConnection(pika.URLParameters(tls_node.url)) as conn:
        _roundtrip(conn.channel(), b"plain")


def test_peer_verification_refuses_a_client_without_certificate(peer_node: TLSNode, certs: Certs) -> None:
    params = pika.ConnectionParameters(
        "127.0.0.1", peer_node.amqps_port, credentials=pika.PlainCredentials("guest", "guest"),
        ssl_options=pika.SSLOptions(certs.client_context(), server_hostname="127.0.0.1"), connection_attempts=1)
    with pytest.raises((pika.exceptions.AMQPConnectionError, ssl.SSLError)):
        pika.BlockingConnection(params)
    time.sleep(0.3)
    reasons = [str(r.get("reason")) for r in peer_node.log_records()
               if r.get("msg") == "TLS handshake failed; connection closed"]
    assert reasons and "certificate" in reasons[-1].lower(), reasons


def test_client_certificate_logs_in_with_external(peer_node: TLSNode, certs: Certs) -> None:
    params = pika.ConnectionParameters(
        "127.0.0.1", peer_node.amqps_port, credentials=pika.credentials.ExternalCredentials(),
        ssl_options=pika.SSLOptions(certs.client_context(with_cert=True), server_hostname="127.0.0.1"))
    with pika.BlockingConnection(params) as conn:
        _roundtrip(conn.channel(), b"external")
    opened = [r for r in peer_node.log_records() if r.get("msg") == "connection opened"]
    assert opened and opened[-1].get("user") == CERT_USER


def test_external_is_not_offered_on_the_plain_port(peer_node: TLSNode) -> None:
    params = pika.ConnectionParameters("127.0.0.1", peer_node.amqp_port,
                                       credentials=pika.credentials.ExternalCredentials(), connection_attempts=1)
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        pika.BlockingConnection(params)


def test_sighup_serves_the_new_certificate_to_new_connections(certs: Certs) -> None:
    node = _start(certs, "--grpc-tls")
    try:
        def served(port: int) -> bytes:
            ctx = certs.client_context()
            ctx.set_alpn_protocols(["h2"])  # what a gRPC client offers; AMQPS ignores it
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
                    ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                cert = s.getpeercert(binary_form=True)
                assert cert is not None
                return cert

        ports = (node.amqps_port, node.grpc_port)
        before = [served(p) for p in ports]
        fresh = certs.ca.issue_cert("127.0.0.1", common_name="renewed")
        fresh.private_key_pem.write_to_path(str(certs.server_key))
        certs.server_cert.write_bytes(b"".join(blob.bytes() for blob in fresh.cert_chain_pems))
        assert [served(p) for p in ports] == before  # nothing changes until told
        assert node.proc is not None
        node.proc.send_signal(signal.SIGHUP)
        for port, old in zip(ports, before, strict=True):
            deadline = time.monotonic() + 10
            while served(port) == old:
                assert time.monotonic() < deadline, f"port {port} did not serve the new certificate after SIGHUP"
                time.sleep(0.1)
            assert ssl.DER_cert_to_PEM_cert(served(port)).encode() == fresh.cert_chain_pems[0].bytes()
        with Client(f"127.0.0.1:{node.grpc_port}", ca=str(certs.ca_file), timeout=10) as c:
            c.create_queue("after-reload", exist_ok=True)  # and gRPC still works with it
    finally:
        _stop(node)


def test_grpc_client_over_tls(tls_node: TLSNode, certs: Certs) -> None:
    with Client(f"127.0.0.1:{tls_node.grpc_port}", ca=str(certs.ca_file), timeout=10) as c:
        c.create_queue("tls-q", exist_ok=True)
        ch = c.create_channel("tls-q")
        c.push("tls-q", b"grpc over tls")
        sub = c.subscribe(ch, prefetch=10)
        m = sub.get(timeout=10)
        assert m is not None and m.content == b"grpc over tls"
        assert sub.ack(m) == 1
    async def with_async_client() -> list[str]:
        async with AsyncClient(f"127.0.0.1:{tls_node.grpc_port}", ca=certs.ca_file.read_bytes(), timeout=10) as ac:
            return [q.name for q in await ac.list_queues()]

    assert "tls-q" in asyncio.run(with_async_client())
    with StreamsClient(f"127.0.0.1:{tls_node.grpc_port}", ca=str(certs.ca_file), timeout=10) as sc:
        sc.create_stream("tls-stream", exist_ok=True)
    # Plaintext to the TLS gRPC port fails, it does not fall back.
    with Client(f"127.0.0.1:{tls_node.grpc_port}", timeout=3) as plain, pytest.raises(LeveretError):
        plain.create_queue("tls-q", exist_ok=True)


def test_management_and_metrics_over_https(certs: Certs) -> None:
    """--http-tls: the management API, console and Prometheus endpoint answer over HTTPS only; leveret ctl follows."""
    import base64
    import os
    import urllib.error
    import urllib.request

    metrics_port = free_port()
    node = _start(certs, "--http-tls", "--prometheus-port", str(metrics_port))
    try:
        deadline = time.monotonic() + 30
        while True:  # the management listener starts right after AMQP
            try:
                socket.create_connection(("127.0.0.1", node.management_port), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline, node.stderr_tail()
                time.sleep(0.05)
        ctx = certs.client_context()
        auth = {"Authorization": "Basic " + base64.b64encode(b"guest:guest").decode()}
        url = f"https://127.0.0.1:{node.management_port}/api/overview"
        with urllib.request.urlopen(urllib.request.Request(url, headers=auth), context=ctx, timeout=10) as resp:
            assert resp.status == 200 and json.loads(resp.read())["product_name"]
        with urllib.request.urlopen(f"https://127.0.0.1:{metrics_port}/metrics", context=ctx, timeout=10) as resp:
            assert b"rabbitmq_build_info" in resp.read()
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            urllib.request.urlopen(urllib.request.Request(url.replace("https:", "http:"), headers=auth), timeout=10)
        # leveret ctl over HTTPS, trusting the CA through OpenSSL's SSL_CERT_FILE.
        out = subprocess.run(
            [_python(), "-m", "leveret", "ctl", "--node", f"https://127.0.0.1:{node.management_port}", "list_vhosts"],
            cwd=REPO_ROOT, env={**node_env(), "SSL_CERT_FILE": str(certs.ca_file)}, capture_output=True, text=True,
            timeout=60, check=False)
        assert out.returncode == 0, out.stderr
        assert "/" in out.stdout.split()
        assert os.path.exists(certs.ca_file)
    finally:
        _stop(node)
