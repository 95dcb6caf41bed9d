"""An etcd client with the transport and login the node's options ask for.

aetcd 1.0.0 authenticates with a user and password (etcd's token auth) but
always dials in plaintext (``Client.connect`` calls ``insecure_channel``), so
TLS (``--etcd-cacert``, and a client certificate with ``--etcd-cert/--etcd-key``)
needs the subclass below: the same ``connect`` over ``secure_channel``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import aetcd
import grpc
from aetcd import rpc, watcher


@dataclass(frozen=True)
class EtcdTLS:
    """PEM bytes: the CA that signed etcd's certificate, and optionally our client certificate and key."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None

    @classmethod
    def from_files(cls, cacert: str, cert: str, key: str) -> EtcdTLS | None:
        """None when no file is named (plaintext etcd); OSError when one cannot be read."""
        if not (cacert or cert or key):
            return None
        if bool(cert) != bool(key):
            raise ValueError("--etcd-cert and --etcd-key go together")
        return cls(*(Path(p).read_bytes() if p else None for p in (cacert, cert, key)))


class _TLSClient(aetcd.Client):
    def __init__(self, tls: EtcdTLS, host: str, port: int, username: str | None, password: str | None,
                 timeout: float | None) -> None:
        super().__init__(host=host, port=port, username=username, password=password,
                         timeout=timeout)  # type: ignore[arg-type]  # aetcd annotates int, uses any number
        self._tls = tls

    async def connect(self) -> None:
        # aetcd's connect(), with the channel made secure.
        if self._connected.is_set():
            return
        if self._is_connecting:  # type: ignore[has-type]
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            creds = grpc.ssl_channel_credentials(root_certificates=self._tls.ca, private_key=self._tls.key,
                                                 certificate_chain=self._tls.cert)
            self.channel = rpc.secure_channel(f"{self._host}:{self._port}", creds, options=self._options.items())
            if self._username is not None and self._password is not None:
                self.auth_stub = rpc.AuthStub(self.channel)
                resp = await self.auth_stub.Authenticate(
                    rpc.AuthenticateRequest(name=self._username, password=self._password), timeout=self._timeout)
                self.metadata = (("token", resp.token),)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout,
                                            metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False


def etcd_client(host: str, port: int, timeout: float | None, tls: EtcdTLS | None = None,
                user: str = "", password: str = "") -> aetcd.Client:
    username, secret = (user, password) if user else (None, None)
    if tls is None:
        return aetcd.Client(host=host, port=port, username=username, password=secret,
                            timeout=timeout)  # type: ignore[arg-type]
    return _TLSClient(tls, host, port, username, secret, timeout)
