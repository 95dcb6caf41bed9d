"""The etcd client over TLS with a client certificate, and with etcd's user/password auth (real etcd).

aetcd 1.0 dials plaintext only; coordination/etcd_client.py adds TLS. A
node's --etcd-cacert/--etcd-cert/--etcd-key and --etcd-user/--etcd-password
end up here.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from coordination.etcd_client import EtcdTLS, etcd_client
from harness.etcd import ETCD_BIN, ETCDCTL_BIN, skip_or_fail_without_etcd
from harness.ports import free_ports


class TLSEtcd:
    def __init__(self, root: Path) -> None:
        skip_or_fail_without_etcd()
        self.ca = trustme.CA()
        self.files: dict[str, Path] = {}
        server = self.ca.issue_cert("127.0.0.1")
        client = self.ca.issue_cert("leveret-node.invalid", common_name="root")
        for name, blob in (("ca", self.ca.cert_pem), ("server", server.cert_chain_pems[0]),
                           ("server-key", server.private_key_pem), ("client", client.cert_chain_pems[0]),
                           ("client-key", client.private_key_pem)):
            self.files[name] = root / f"{name}.pem"
            blob.write_to_path(str(self.files[name]))
        self.port, peer = free_ports(2)
        self.url = f"https://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
        self.log = open(root / "etcd.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([
            str(ETCD_BIN), "--name", "tls", "--data-dir", str(root / "data"),
            "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}", "--initial-cluster", f"tls=http://127.0.0.1:{peer}",
            "--cert-file", str(self.files["server"]), "--key-file", str(self.files["server-key"]),
            "--client-cert-auth", "--trusted-ca-file", str(self.files["ca"]),
        ], cwd=root, env=env, stdout=self.log, stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + 30
        while self.ctl("endpoint", "health", check=False).returncode != 0:
            assert self.proc.poll() is None and time.monotonic() < deadline, (root / "etcd.log").read_text()
            time.sleep(0.2)

    def ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([str(ETCDCTL_BIN), "--endpoints", self.url, "--cacert", str(self.files["ca"]),
                               "--cert", str(self.files["client"]), "--key", str(self.files["client-key"]),
                               *args], capture_output=True, timeout=30, check=check)  # fmt: skip

    def tls(self, with_cert: bool = True) -> EtcdTLS:
        return EtcdTLS.from_files(str(self.files["ca"]), str(self.files["client"]) if with_cert else "",
                                  str(self.files["client-key"]) if with_cert else "") or EtcdTLS()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="module")
def etcd() -> Iterator[TLSEtcd]:
    with tempfile.TemporaryDirectory(prefix="leveret-etcd-tls-") as tmp:
        server = TLSEtcd(Path(tmp))
        try:
            yield server
        finally:
            server.stop()


async def _put_get(client: object, key: bytes) -> bytes | None:
    c = client  # an aetcd.Client
    try:
        await asyncio.wait_for(c.put(key, b"v"), 10)  # type: ignore[attr-defined]
        got = await asyncio.wait_for(c.get(key), 10)  # type: ignore[attr-defined]
        return got.value if got is not None else None
    finally:
        await c.close()  # type: ignore[attr-defined]


def test_client_certificate_and_user_password(etcd: TLSEtcd) -> None:
    assert asyncio.run(_put_get(etcd_client("127.0.0.1", etcd.port, 5, etcd.tls()), b"/t/a")) == b"v"
    # Without our certificate (etcd demands one), or in plaintext, nothing gets through.
    for tls in (etcd.tls(with_cert=False), None):
        with pytest.raises(Exception):  # noqa: B017 - aetcd wraps gRPC's errors in its own classes
            asyncio.run(_put_get(etcd_client("127.0.0.1", etcd.port, 3, tls), b"/t/b"))
    # etcd's own users (--etcd-user/--etcd-password): the right password logs in, a wrong one is refused.
    etcd.ctl("user", "add", "root:root-pw-1")
    etcd.ctl("user", "add", "leveret:node-pw-1")
    etcd.ctl("role", "add", "nodes")
    etcd.ctl("role", "grant-permission", "nodes", "--prefix=true", "readwrite", "/t/")
    etcd.ctl("user", "grant-role", "leveret", "nodes")
    etcd.ctl("auth", "enable")
    try:
        client = etcd_client("127.0.0.1", etcd.port, 5, etcd.tls(with_cert=True), "leveret", "node-pw-1")
        assert asyncio.run(_put_get(client, b"/t/c")) == b"v"
        with pytest.raises(Exception):  # noqa: B017
            asyncio.run(_put_get(etcd_client("127.0.0.1", etcd.port, 3, etcd.tls(), "leveret", "wrong"), b"/t/d"))
    finally:
        etcd.ctl("--user", "root:root-pw-1", "auth", "disable", check=False)
