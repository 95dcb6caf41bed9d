"""Who may speak the internal protocol: mutual TLS with a cluster CA, a shared secret, or both.

The internal ``leveret.internal.v1.Node`` service reads and removes messages
from any queue, so a node must know its caller is a member of its cluster.

- **Mutual TLS** (``--cluster-tls-cert/--cluster-tls-key/--cluster-tls-ca``):
  the listener demands a client certificate signed by the cluster CA and the
  dialler checks the listener's against the same CA (and its host name). The
  traffic is encrypted too. A CA also signs other certificates (AMQP client
  certificates, for one), so the caller's certificate must moreover be a
  node's: this node's own (the same certificate on every node) or one of
  ``--cluster-tls-peers`` (the other nodes' certificates, PEM).
- **A shared secret** (``--cluster-secret-file``, RabbitMQ's Erlang cookie):
  every call carries ``leveret-cluster-auth: v2.<time>.<nonce>.<HMAC-SHA256
  (secret, "v2.<time>.<nonce>.<method>")>``, the method being the gRPC
  method called: a token minted for ``Stats`` does not open ``Purge``. The
  secret itself never crosses the wire, so a sniffer of the (then plaintext)
  link cannot log in elsewhere with it; a captured token is refused outside
  a five-minute window and a second time inside it (the nonces seen lately
  are kept). Comparing the secret in constant time would be as safe only on
  an encrypted link; the HMAC costs ~2 us per call and calls are few (two
  standing streams per peer, and rare unary Purge/Stats/CommitOffset), so it
  is not worth a weaker variant.

With both configured, both are checked. The caller's channel (``channel``)
mints each call's token for its method; the listener's interceptor
(``server_interceptor``) checks both before the method runs, and the
service's own ``refusal`` check then passes only calls that interceptor
admitted: a server built without it refuses every call.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import logging
import os
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from core.model.ratelog import RateLimitedLog

log = logging.getLogger("leveret.cluster")

AUTH_KEY = "leveret-cluster-auth"
VERSION = "v2"  # v1 tokens did not cover the method
# A token older or newer than this (node clocks disagree, or it was captured) is refused.
WINDOW = 300.0
# Nonces remembered for replay detection; one per call, so this bounds memory
# even under a flood of forged calls (each refused before it is remembered).
MAX_NONCES = 100_000


# Set by the listener's interceptor for the call it admitted (the handler runs in the same context).
_ADMITTED: contextvars.ContextVar[bool] = contextvars.ContextVar("cluster_call_admitted", default=False)


@dataclass(frozen=True)
class ClusterTLS:
    """PEM bytes: this node's certificate chain and key, the cluster CA, and other nodes' certificates."""

    cert_chain: bytes
    key: bytes
    ca: bytes
    peers: bytes = b""  # --cluster-tls-peers: more certificates that are nodes' (PEM, any number)

    def pinned(self) -> frozenset[bytes]:
        """The DER of every certificate a caller may present: this node's own and the listed peers'."""
        leaf = _pem_blocks(self.cert_chain)[:1]
        return frozenset(ssl.PEM_cert_to_DER_cert(pem) for pem in leaf + _pem_blocks(self.peers))


def _pem_blocks(data: bytes) -> list[str]:
    text = data.decode("ascii", "replace")
    out = []
    end_marker = "-----END CERTIFICATE-----"
    while (start := text.find("-----BEGIN CERTIFICATE-----")) >= 0:
        end = text.find(end_marker, start)
        if end < 0:
            break
        out.append(text[start:end + len(end_marker)] + "\n")
        text = text[end + len(end_marker):]
    return out


class PeerAuth:
    """Both ends of the check: what a caller sends, and what a listener accepts."""

    def __init__(self, secret: bytes | None = None, tls: ClusterTLS | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if not secret and tls is None:
            raise ValueError("a cluster needs a shared secret or TLS certificates to authenticate its peers")
        self._secret = secret or None
        self.tls = tls
        self._pinned = tls.pinned() if tls is not None else frozenset()
        self._clock = clock
        self._seen: dict[bytes, float] = {}  # nonce -> when it stops mattering (insertion order ~ time)
        self._refused = RateLimitedLog(log)

    @property
    def mode(self) -> str:
        return " and ".join(m for m, on in (("mutual TLS", self.tls is not None),
                                            ("shared secret", self._secret is not None)) if on)

    # -- the caller's side -------------------------------------------------------
    def channel(self, address: str, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
        """A channel to a peer whose every call carries a token for its method (when there is a secret)."""
        interceptors: list[Any] = ([kind(self) for kind in (_MintUnaryUnary, _MintUnaryStream, _MintStreamUnary,
                                                             _MintStreamStream)]
                                   if self._secret is not None else [])
        if self.tls is None:
            return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
        creds = grpc.ssl_channel_credentials(root_certificates=self.tls.ca, private_key=self.tls.key,
                                             certificate_chain=self.tls.cert_chain)
        return grpc.aio.secure_channel(address, creds, options=options, interceptors=interceptors)

    def token(self, method: str) -> str:
        assert self._secret is not None
        stamp = f"{self._clock():.3f}.{os.urandom(12).hex()}"
        return f"{VERSION}.{stamp}.{self._mac(stamp, method)}"

    def _mac(self, stamp: str, method: str) -> str:
        assert self._secret is not None
        return hmac.new(self._secret, f"{VERSION}.{stamp}.{method}".encode(), hashlib.sha256).hexdigest()

    def metadata(self, base: tuple[tuple[str, str], ...], method: str | None = None) -> tuple[tuple[str, str], ...]:
        """``base`` plus a fresh token for ``method`` (nonces are single-use). Without a method, ``base``:
        the channel's interceptor adds each call's token."""
        if self._secret is None or method is None:
            return base
        return (*base, (AUTH_KEY, self.token(method)))

    # -- the listener's side -----------------------------------------------------
    def server_credentials(self) -> grpc.ServerCredentials | None:
        if self.tls is None:
            return None
        return grpc.ssl_server_credentials([(self.tls.key, self.tls.cert_chain)], root_certificates=self.tls.ca,
                                           require_client_auth=True)

    def server_interceptor(self) -> grpc.aio.ServerInterceptor:
        """The listener's check of every call (the peer's certificate, the token for the method called)."""
        return _Admission(self)

    def peer_refusal(self, auth_context: dict[str, list[bytes]]) -> str | None:
        """Under mutual TLS: None when the caller's certificate is a node's, else why not."""
        if self.tls is None:
            return None
        pems = auth_context.get("x509_pem_cert") or []
        if not pems:
            return "no client certificate"
        try:
            der = ssl.PEM_cert_to_DER_cert(pems[0].decode("ascii"))
        except (ValueError, UnicodeDecodeError):
            return "unreadable client certificate"
        if der not in self._pinned:
            names = b", ".join(auth_context.get("x509_common_name") or [b"(no CN)"]).decode("utf-8", "replace")
            return (f"a certificate of the cluster CA that is not a node's (CN {names}): only this node's "
                    "certificate and those of --cluster-tls-peers may call the cluster port")
        return None

    def refusal(self, metadata: Iterable[tuple[str, str | bytes]], method: str | None = None) -> str | None:
        """None when the call may proceed, else why not (for the log; the caller only learns 'refused').

        Without ``method`` (the service's own check): only a call the interceptor admitted passes.
        """
        if method is None:
            return None if _ADMITTED.get() else "the call was not checked by the cluster port's interceptor"
        if self._secret is None:
            return None  # TLS alone: the handshake demanded a certificate of the CA, peer_refusal pins it
        token = next((v for k, v in metadata if k == AUTH_KEY), None)
        if not isinstance(token, str):
            return "no cluster credentials sent (is --cluster-secret-file set on the calling node?)"
        parts = token.split(".")
        if len(parts) != 5 or parts[0] != VERSION:
            return "malformed cluster credentials (an older node's?)"
        stamp, mac = f"{parts[1]}.{parts[2]}.{parts[3]}", parts[4]
        if not hmac.compare_digest(self._mac(stamp, method), mac):
            return "wrong cluster secret, or a token minted for another method"
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


class _Minting:
    """The caller's side: each call gets a fresh token for its own method (unless it brings one)."""

    def __init__(self, auth: PeerAuth) -> None:
        self.auth = auth

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        if AUTH_KEY not in metadata:
            method = details.method.decode() if isinstance(details.method, bytes) else details.method
            metadata.add(AUTH_KEY, self.auth.token(method))
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


# grpc.aio files a channel's interceptor under the first of the four kinds it is: one class each.
class _MintUnaryUnary(_Minting, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _MintUnaryStream(_Minting, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _MintStreamUnary(_Minting, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(self._details(details), request_iterator)


class _MintStreamStream(_Minting, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(self._details(details), request_iterator)


class _Admission(grpc.aio.ServerInterceptor):
    """The listener's side: every method runs only after the caller proved it is a node of this cluster."""

    def __init__(self, auth: PeerAuth) -> None:
        self.auth = auth

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        metadata = tuple(handler_call_details.invocation_metadata or ())  # type: ignore[attr-defined]
        auth = self.auth

        async def admit(context: grpc.aio.ServicerContext) -> None:
            reason = auth.peer_refusal(context.auth_context()) or auth.refusal(metadata, method)
            if reason is not None:
                auth._refused.warning(context.peer().rpartition(":")[0],
                                      "a call to the cluster port was refused: not a member of this cluster",
                                      reason=reason, method=method)
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "not a member of this cluster")
            _ADMITTED.set(True)

        return _guarded(handler, admit)


def _guarded(handler: grpc.RpcMethodHandler,
             admit: Callable[[grpc.aio.ServicerContext], Awaitable[None]]) -> grpc.RpcMethodHandler:
    """``handler`` with ``admit`` run first, in the same context (so the method sees _ADMITTED)."""
    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        unary_unary = handler.unary_unary

        async def uu(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await admit(context)
            return await unary_unary(request, context)
        return grpc.unary_unary_rpc_method_handler(uu, **kw)
    if handler.stream_unary is not None:
        stream_unary = handler.stream_unary

        async def su(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            await admit(context)
            return await stream_unary(requests, context)
        return grpc.stream_unary_rpc_method_handler(su, **kw)
    if handler.unary_stream is not None:
        unary_stream = handler.unary_stream

        async def us(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await admit(context)
            async for response in unary_stream(request, context):
                yield response
        return grpc.unary_stream_rpc_method_handler(us, **kw)
    stream_stream = handler.stream_stream

    async def ss(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await admit(context)
        async for response in stream_stream(requests, context):
            yield response
    return grpc.stream_stream_rpc_method_handler(ss, **kw)
