"""This node's session with etcd: the endpoints, the clients, the lease and its keep-alive, the node key.

The node's key lives on its lease, refreshed every TTL/4. The engine's
``Lease`` (core/engine/ownership.py) keeps the deadline: served until the last
refresh *asked* + TTL - margin, so a node that cannot refresh in time (paused,
cut off from etcd) stops serving its queues on its own (``on_lost``, set by
the facade) before anyone else may take them. A refresh answered after the
deadline proves nothing about now: the lease is given up and the node rejoins
(``on_rejoined``: the facade resyncs its mirror and takes back what its owner
keys still say is its own, each with a new fence).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aetcd
import grpc

from coordination.etcd_client import EtcdTLS, etcd_client
from coordination.keys import Layout
from core.cluster.auth import PeerAuth
from core.engine.ownership import Lease
from core.model.errors import BrokerError
from core.ports.coordinator import ClusterStartError
from core.ports.store import StoreError

log = logging.getLogger("leveret.cluster")

OP_TIMEOUT = 5.0


@dataclass
class ClusterSettings:
    endpoints: list[str]
    cluster: str = "leveret"
    region: str = ""
    lease_ttl: int = 2
    node_id: str = "leveret"
    amqp_address: str = ""
    grpc_address: str = ""
    # The internal listener (--cluster-port) peers dial, and how they prove membership.
    cluster_address: str = ""
    # What nodes of other regions dial instead (--advertise-cluster-remote): "" = cluster_address.
    cluster_remote_address: str = ""
    auth: PeerAuth | None = None
    # etcd's own transport and login (--etcd-cacert/--etcd-cert/--etcd-key, --etcd-user).
    etcd_tls: EtcdTLS | None = None
    etcd_user: str = ""
    etcd_password: str = ""


class ClusterUnavailable(BrokerError):
    code = 541  # internal error class: the client sees a clear text and may retry


def endpoint(url: str) -> tuple[str, int]:
    """``http://host:port`` (or ``host:port``, or ``host``) as (host, port)."""
    text = url.strip()
    for scheme in ("http://", "https://"):
        if text.startswith(scheme):
            text = text[len(scheme):]
    text = text.rstrip("/")
    host, _, port = text.rpartition(":")
    if not host:
        return text, 2379
    return host.strip("[]"), int(port)


class EtcdSession:
    def __init__(self, settings: ClusterSettings, keys: Layout, node_value: Callable[[], bytes],
                 on_rejoined: Callable[[], Awaitable[None]]) -> None:
        self.settings = settings
        self.keys = keys
        self._node_value = node_value  # the node key's value as it is now (load, draining)
        self._on_rejoined = on_rejoined
        ttl = settings.lease_ttl
        # Served until the last refresh asked + TTL - margin (core/engine/ownership.py).
        self.lease = Lease(ttl, margin=min(0.5, ttl / 4))
        self.lease_id = 0
        self.started = time.time()
        self._client: aetcd.Client | None = None
        self.watch_client: aetcd.Client | None = None
        self._endpoint_index = 0

    # -- connecting ---------------------------------------------------------------------------
    def new_client(self, timeout: float | None) -> aetcd.Client:
        host, port = endpoint(self.settings.endpoints[self._endpoint_index % len(self.settings.endpoints)])
        s = self.settings
        return etcd_client(host, port, timeout, s.etcd_tls, s.etcd_user, s.etcd_password)

    async def _connect(self, deadline: float) -> None:
        errors: list[str] = []
        for _ in range(len(self.settings.endpoints)):
            client = self.new_client(OP_TIMEOUT)
            try:
                await asyncio.wait_for(client.connect(), OP_TIMEOUT)
                await asyncio.wait_for(client.status(), max(0.5, min(OP_TIMEOUT, deadline - time.monotonic())))
                self._client = client
                self.watch_client = self.new_client(None)
                return
            except Exception as exc:  # noqa: BLE001 - every failure means "try the next endpoint"
                errors.append(f"{self.settings.endpoints[self._endpoint_index % len(self.settings.endpoints)]}: "
                              f"{type(exc).__name__} {exc}")
                with contextlib.suppress(Exception):
                    await client.close()
                self._endpoint_index += 1
        raise StoreError("cannot reach etcd at " + "; ".join(errors))

    @property
    def client(self) -> aetcd.Client:
        assert self._client is not None
        return self._client

    async def open(self) -> None:
        """Connected to one of the endpoints (for up to 15 s), with a lease and the node key on it."""
        deadline = time.monotonic() + 15
        while True:
            try:
                await self._connect(deadline)
                break
            except StoreError as exc:
                if time.monotonic() > deadline:
                    raise ClusterStartError(f"{exc} (--etcd {','.join(self.settings.endpoints)})") from None
                await asyncio.sleep(0.5)
        asked = time.monotonic()
        lease = await asyncio.wait_for(self.client.lease(self.settings.lease_ttl), OP_TIMEOUT)
        self.lease_id = lease.id
        self.lease.granted(asked)
        await self.put_node_info()

    async def put_node_info(self) -> None:
        await asyncio.wait_for(self.client.put(self.keys.node(self.settings.node_id), self._node_value(),
                                               lease=self.lease_id), OP_TIMEOUT)

    async def renew_watch_client(self) -> aetcd.Client:
        """A fresh client for the watch (the old one is closed): after the watch broke."""
        with contextlib.suppress(Exception):
            if self.watch_client is not None:
                await self.watch_client.close()
        self.watch_client = self.new_client(None)
        return self.watch_client

    async def txn(self, compare: list[Any], success: list[Any], failure: list[Any] | None = None) -> tuple[bool, Any]:
        try:
            return await asyncio.wait_for(self.client.transaction(compare=compare, success=success,
                                                                  failure=failure or []), OP_TIMEOUT)
        except (aetcd.exceptions.ClientError, grpc.aio.AioRpcError, TimeoutError, ConnectionError) as exc:
            raise ClusterUnavailable(f"cluster metadata store (etcd) unavailable: {exc}") from exc

    async def close(self, revoke: bool) -> None:
        if revoke and self._client is not None and self.lease_id:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.client.revoke_lease(self.lease_id), 2)
        for client in (self._client, self.watch_client):
            if client is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(client.close(), 2)

    # -- the lease ------------------------------------------------------------------------------
    async def keepalive_loop(self) -> None:
        ttl = self.settings.lease_ttl
        interval = ttl / 4
        watchdog = asyncio.get_running_loop().create_task(self._lease_watchdog())
        try:
            while True:
                await asyncio.sleep(interval)
                await self._refresh_once(ttl)
        finally:
            watchdog.cancel()

    async def _lease_watchdog(self) -> None:
        # Cut off from etcd while idle: nothing else would look at the
        # deadline, and a new owner may be loading our queues. (A node woken
        # from a pause meets the deadline earlier, at the first thing it does
        # for an owned queue: Queue.lease_valid.) The store's epoch check makes
        # anything still in flight fail.
        while True:
            await asyncio.sleep(0.1)
            self.lease.enforce()

    async def _refresh_once(self, ttl: int) -> None:
        sent = time.monotonic()
        try:
            # A slow answer still counts (from when it was asked): cutting it
            # short made loaded nodes fence themselves with a live lease.
            reply = await asyncio.wait_for(self.client.refresh_lease(self.lease_id), ttl)
            alive = reply is not None and reply.TTL > 0
        except Exception as exc:  # noqa: BLE001 - etcd unreachable: keep trying
            log.debug("lease refresh failed", extra={"error": f"{type(exc).__name__}: {exc}"})
            await self._reconnect_if_needed()
            return
        if alive and not self.lease.lost:
            if self.lease.granted(sent):
                return
            # Answered past the deadline (we were paused, or etcd was slow):
            # it proves nothing about now. Stop serving, then rejoin below.
            self.lease.expire("lease refresh answered after the deadline")
        if not alive and not self.lease.lost:
            self.lease.expire("lease expired")
        # A new lease, a new registration; the reconcile loop takes back
        # what our owner keys still say is ours, each with a new fence.
        try:
            if not alive:
                asked = time.monotonic()
                lease = await asyncio.wait_for(self.client.lease(ttl), OP_TIMEOUT)
                self.lease_id = lease.id
                sent = asked
            if not self.lease.granted(sent):
                return  # too slow again: the next refresh tries
            await self.put_node_info()
            log.warning("rejoined the cluster", extra={"node": self.settings.node_id, "lease": self.lease_id,
                                                        "new_lease": not alive})
            await self._on_rejoined()
        except Exception as exc:  # noqa: BLE001
            log.warning("rejoin failed; retrying", extra={"error": f"{type(exc).__name__}: {exc}"})

    async def _reconnect_if_needed(self) -> None:
        try:
            await asyncio.wait_for(self.client.status(), 1.0)
        except Exception:  # noqa: BLE001
            old = self._client
            try:
                await self._connect(time.monotonic() + 2)
            except StoreError:
                return
            if old is not None:
                with contextlib.suppress(Exception):
                    await old.close()
