"""The cluster channel (docs/SECURITY.md): node-to-node calls only on --cluster-port, from members only.

Real etcd, Postgres and node processes. A cluster with the shared secret and
one with mutual TLS (certificates by trustme) both forward publishes between
nodes; a caller without the secret or the cluster certificate gets nothing
from the cluster port, and the public gRPC port does not serve the internal
service at all.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pika
import pytest
import trustme

from compat_tests.cluster_process import Cluster
from compat_tests.node_process import REPO_ROOT, _python, free_ports, node_env
from core.cluster import internal_pb2, internal_pb2_grpc
from core.cluster.auth import PeerAuth
from core.cluster.wire import PROTOCOL_MD
from tests.etcd import EtcdServer
from tests.etcd import etcd_server_fixture as etcd_server_fixture  # the module-scoped `etcd_server`
from tests.pg import throwaway_postgres

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster_postgres() -> Iterator[str]:
    with throwaway_postgres() as dsn:
        yield dsn


def _forward_roundtrip(cluster: Cluster) -> None:
    """A durable queue owned by one node, published through another and read through the third."""
    queue = f"sec.{uuid.uuid4().hex[:8]}"
    with pika.BlockingConnection(pika.URLParameters(cluster.url("n1"))) as conn:
        conn.channel().queue_declare(queue, durable=True)
    owner = cluster.wait_owner(queue)
    assert owner is not None
    publisher, consumer = cluster.others(owner)
    with pika.BlockingConnection(pika.URLParameters(cluster.url(publisher))) as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish("", queue, b"across nodes", pika.BasicProperties(delivery_mode=2))
    deadline = time.monotonic() + 15
    with pika.BlockingConnection(pika.URLParameters(cluster.url(consumer))) as conn:
        while True:
            _, _, body = conn.channel().basic_get(queue, auto_ack=True)
            if body is not None:
                assert body == b"across nodes"
                return
            assert time.monotonic() < deadline, f"not forwarded\n{cluster.diagnostics()}"
            time.sleep(0.05)


STATS, PURGE = "/leveret.internal.v1.Node/Stats", "/leveret.internal.v1.Node/Purge"


def _stats(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...] = PROTOCOL_MD) -> grpc.StatusCode:
    try:
        internal_pb2_grpc.NodeStub(channel).Stats(internal_pb2.QueueRef(vhost="/", queue="none"), timeout=5,
                                                  metadata=metadata)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def _purge(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]) -> grpc.StatusCode:
    try:
        internal_pb2_grpc.NodeStub(channel).Purge(internal_pb2.QueueRef(vhost="/", queue="none"), timeout=5,
                                                  metadata=metadata)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def _session(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]) -> grpc.StatusCode:
    """Open the Session stream and ask for a message (GET, no_ack): what a thief would do."""
    get = internal_pb2.SessionControl(kind=internal_pb2.SessionControl.GET, sub=1, vhost="/", queue="none",
                                      no_ack=True)
    try:
        for _ in internal_pb2_grpc.NodeStub(channel).Session(iter([get]), timeout=5, metadata=metadata):
            return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_secret_cluster_refuses_strangers(etcd_server: EtcdServer, cluster_postgres: str) -> None:
    with Cluster(3, etcd=etcd_server, postgres_dsn=cluster_postgres) as cluster:
        _forward_roundtrip(cluster)
        node = cluster["n1"]
        # The public gRPC port does not serve the internal service, credentials or not.
        secret = Path(cluster.cluster_auth[1]).read_bytes().strip()
        member = PeerAuth(secret=secret)
        with grpc.insecure_channel(f"127.0.0.1:{node.grpc_port}") as public:
            assert _stats(public, member.metadata(PROTOCOL_MD, STATS)) == grpc.StatusCode.UNIMPLEMENTED
        with grpc.insecure_channel(f"127.0.0.1:{node.cluster_port}") as internal:
            assert _stats(internal) == grpc.StatusCode.UNAUTHENTICATED  # nothing sent
            wrong = PeerAuth(secret=b"a guess at the cluster secret")
            assert _stats(internal, wrong.metadata(PROTOCOL_MD, STATS)) == grpc.StatusCode.UNAUTHENTICATED
            session = "/leveret.internal.v1.Node/Session"
            for md in (PROTOCOL_MD, wrong.metadata(PROTOCOL_MD, session)):  # and no stream opens
                assert _session(internal, md) == grpc.StatusCode.UNAUTHENTICATED
            # A token covers its method: one minted for Stats does not purge.
            assert _purge(internal, member.metadata(PROTOCOL_MD, STATS)) == grpc.StatusCode.UNAUTHENTICATED
            token = member.metadata(PROTOCOL_MD, STATS)
            # The right secret gets an answer (this node owns no queue "none"), and its token is single-use.
            assert _stats(internal, token) == grpc.StatusCode.NOT_FOUND
            assert _stats(internal, token) == grpc.StatusCode.UNAUTHENTICATED
        refused = [r for r in node.log_records() if "not a member of this cluster" in str(r.get("msg"))]
        assert refused, "refusals are logged"


def test_tls_cluster_refuses_callers_without_the_cluster_certificate(
        etcd_server: EtcdServer, cluster_postgres: str, tmp_path: Path) -> None:
    ca = trustme.CA()
    ca_file = tmp_path / "cluster-ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    node_cert = ca.issue_cert("127.0.0.1", common_name="leveret-node")
    cert, key = tmp_path / "node.pem", tmp_path / "node.key"
    cert.write_bytes(b"".join(blob.bytes() for blob in node_cert.cert_chain_pems))
    node_cert.private_key_pem.write_to_path(str(key))
    auth = ["--cluster-tls-cert", str(cert), "--cluster-tls-key", str(key), "--cluster-tls-ca", str(ca_file)]
    with Cluster(3, etcd=etcd_server, postgres_dsn=cluster_postgres, cluster_auth=auth) as cluster:
        _forward_roundtrip(cluster)
        target = f"127.0.0.1:{cluster['n2'].cluster_port}"
        with grpc.insecure_channel(target) as plain:
            assert _stats(plain) == grpc.StatusCode.UNAVAILABLE  # no TLS: no handshake
        anon = grpc.ssl_channel_credentials(root_certificates=ca.cert_pem.bytes())
        with grpc.secure_channel(target, anon) as no_cert:
            assert _stats(no_cert) == grpc.StatusCode.UNAVAILABLE  # TLS without a client certificate
        stranger_ca = trustme.CA()
        stranger = stranger_ca.issue_cert("127.0.0.1")
        other = grpc.ssl_channel_credentials(
            root_certificates=ca.cert_pem.bytes(), private_key=stranger.private_key_pem.bytes(),
            certificate_chain=stranger.cert_chain_pems[0].bytes())
        with grpc.secure_channel(target, other) as wrong_ca:
            assert _stats(wrong_ca) == grpc.StatusCode.UNAVAILABLE  # a certificate of another CA
        # A certificate of the cluster CA that is not a node's: an AMQP client's, as `leveret tls make-test-ca`
        # issues them (CN alice) beside the node's.
        alice = ca.issue_cert("alice.client.invalid", common_name="alice")
        client = grpc.ssl_channel_credentials(
            root_certificates=ca.cert_pem.bytes(), private_key=alice.private_key_pem.bytes(),
            certificate_chain=alice.cert_chain_pems[0].bytes())
        with grpc.secure_channel(target, client) as amqp_client:
            assert _stats(amqp_client) == grpc.StatusCode.UNAUTHENTICATED
            assert _purge(amqp_client, PROTOCOL_MD) == grpc.StatusCode.UNAUTHENTICATED
        member = grpc.ssl_channel_credentials(
            root_certificates=ca.cert_pem.bytes(), private_key=node_cert.private_key_pem.bytes(),
            certificate_chain=cert.read_bytes())
        with grpc.secure_channel(target, member) as ok:
            assert _stats(ok) == grpc.StatusCode.NOT_FOUND  # answered: the check is not a wall for members


def test_cluster_mode_without_secret_or_certificate_is_refused(tmp_path: Path) -> None:
    amqp_port, grpc_port = free_ports(2)
    cmd = [
        _python(), "-m", "leveret", "serve", "--node-id", "n1", "--bind", "127.0.0.1",
        "--amqp-port", str(amqp_port), "--grpc-port", str(grpc_port), "--data-dir", str(tmp_path),
        "--store", "postgres", "--postgres-dsn", "postgresql://nobody@127.0.0.1:1/none",
        "--etcd", "http://127.0.0.1:1", "--cluster", "refused",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=node_env(), capture_output=True, text=True, timeout=30)
    assert done.returncode == 2, done.stderr
    assert "--cluster-secret-file" in done.stderr and "--cluster-tls-cert" in done.stderr, done.stderr


def test_a_cluster_secret_readable_by_others_is_refused_at_start(tmp_path: Path) -> None:
    """As RabbitMQ refuses an Erlang cookie that group or others may read."""
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123456789abcdef")
    secret.chmod(0o644)
    amqp_port, grpc_port, cluster_port = free_ports(3)
    cmd = [
        _python(), "-m", "leveret", "serve", "--node-id", "n1", "--bind", "127.0.0.1",
        "--amqp-port", str(amqp_port), "--grpc-port", str(grpc_port), "--cluster-port", str(cluster_port),
        "--data-dir", str(tmp_path / "data"), "--store", "postgres",
        "--postgres-dsn", "postgresql://nobody@127.0.0.1:1/none",
        "--etcd", "http://127.0.0.1:1", "--cluster", "refused", "--cluster-secret-file", str(secret),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=node_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "readable or writable by group or others (mode 0644)" in done.stderr, done.stderr
    assert f"chmod 600 {secret}" in done.stderr
