"""Who may speak the internal protocol: mutual TLS with a cluster CA, a shared secret, or both.

The internal ``leveret.internal.v1.Node`` service reads and removes messages
from any queue, so a node must know its caller is a member of its cluster.

- **Mutual TLS** (``--cluster-tls-cert/--cluster-tls-key/--cluster-tls-ca``):
  the listener demands a client certificate signed by the cluster CA and the
  dialler checks the listener's against the same CA (and its host name). The
  traffic is encrypted too.
- **A shared secret** (``--cluster-secret-file``, RabbitMQ's Erlang cookie):
  every call carries ``leveret-cluster-auth: v1.<time>.<nonce>.<HMAC-SHA256
  (secret, "<time>.<nonce>")>``. The secret itself never crosses the wire, so
  a sniffer of the (then plaintext) link cannot log in elsewhere with it; a
  captured token is refused outside a five-minute window and a second time
  inside it (the nonces seen lately are kept). Comparing the secret in
  constant time would be as safe only on an encrypted link; the HMAC costs
  ~2 us per call and calls are few (two standing streams per peer, and rare
  unary Purge/Stats/CommitOffset), so it is not worth a weaker variant.

With both configured, both are checked.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

AUTH_KEY = "leveret-cluster-auth"
# A token older or newer than this (node clocks disagree, or it was captured) is refused.
WINDOW = 300.0
# Nonces remembered for replay detection; one per call, so this bounds memory
# even under a flood of forged calls (each refused before it is remembered).
MAX_NONCES = 100_000


@dataclass(frozen=True)
class ClusterTLS:
    """PEM bytes: this node's certificate chain and key, and the cluster CA."""

    cert_chain: bytes
    key: bytes
    ca: bytes


class PeerAuth:
    """Both ends of the check: what a caller sends, and what a listener accepts."""

    def __init__(self, secret: bytes | None = None, tls: ClusterTLS | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if not secret and tls is None:
            raise ValueError("a cluster needs a shared secret or TLS certificates to authenticate its peers")
        self._secret = secret or None
        self.tls = tls
        self._clock = clock
        self._seen: dict[bytes, float] = {}  # nonce -> when it stops mattering (insertion order ~ time)

    @property
    def mode(self) -> str:
        return " and ".join(m for m, on in (("mutual TLS", self.tls is not None),
                                            ("shared secret", self._secret is not None)) if on)

    # -- the caller's side -------------------------------------------------------
    def channel(self, address: str, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
        if self.tls is None:
            return grpc.aio.insecure_channel(address, options=options)
        creds = grpc.ssl_channel_credentials(root_certificates=self.tls.ca, private_key=self.tls.key,
                                             certificate_chain=self.tls.cert_chain)
        return grpc.aio.secure_channel(address, creds, options=options)

    def token(self) -> str:
        assert self._secret is not None
        stamp = f"{self._clock():.3f}.{os.urandom(12).hex()}"
        mac = hmac.new(self._secret, stamp.encode(), hashlib.sha256).hexdigest()
        return f"v1.{stamp}.{mac}"

    def metadata(self, base: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
        """``base`` plus a fresh token (a new one for every call: nonces are single-use)."""
        if self._secret is None:
            return base
        return (*base, (AUTH_KEY, self.token()))

    # -- the listener's side -----------------------------------------------------
    def server_credentials(self) -> grpc.ServerCredentials | None:
        if self.tls is None:
            return None
        return grpc.ssl_server_credentials([(self.tls.key, self.tls.cert_chain)], root_certificates=self.tls.ca,
                                           require_client_auth=True)

    def refusal(self, metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
        """None when the call may proceed, else why not (for the log; the caller only learns 'refused')."""
        if self._secret is None:
            return None  # TLS alone: the handshake already demanded a certificate of the cluster CA
        token = next((v for k, v in metadata if k == AUTH_KEY), None)
        if not isinstance(token, str):
            return "no cluster credentials sent (is --cluster-secret-file set on the calling node?)"
        parts = token.split(".")
        if len(parts) != 5 or parts[0] != "v1":
            return "malformed cluster credentials"
        stamp, mac = f"{parts[1]}.{parts[2]}.{parts[3]}", parts[4]
        expected = hmac.new(self._secret, stamp.encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(expected, mac):
            return "wrong cluster secret"
        now = self._clock()
        try:
            sent = float(f"{parts[1]}.{parts[2]}")
        except ValueError:
            return "malformed cluster credentials"
        if abs(now - sent) > WINDOW:
            return f"cluster credentials {now - sent:.0f} s old (clocks apart, or a replay)"
        nonce = parts[3].encode()
        self._forget_old(now)
        if nonce in self._seen:
            return "cluster credentials replayed"
        self._seen[nonce] = now + 2 * WINDOW
        return None

    def _forget_old(self, now: float) -> None:
        seen = self._seen
        while seen:
            nonce, until = next(iter(seen.items()))
            if until > now and len(seen) < MAX_NONCES:
                return
            del seen[nonce]
