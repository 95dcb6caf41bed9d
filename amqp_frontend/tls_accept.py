"""The AMQPS listener: accept, TLS handshake, then the usual AMQP protocol on the decrypted stream.

It accepts sockets itself and hands each to ``loop.connect_accepted_socket(ssl=...)``
rather than passing ``ssl=`` to ``create_server``: that call raises when the
handshake fails, where ``create_server`` (asyncio's and uvloop's alike) drops
the connection silently, and an operator needs to see that a client spoke
plaintext to the TLS port or offered no certificate. (``loop.start_tls`` from
the protocol's ``connection_made`` is no way either: uvloop starts reading
after ``connection_made`` returns, so the first bytes of the ClientHello reach
the plain protocol before the TLS one takes over, and the handshake hangs.)
Each failed handshake is one log line (at most one per client address every
10 s, with the count of those not logged) and the socket is closed; nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Callable

from core.model.ratelog import RateLimitedLog

log = logging.getLogger("leveret.amqp")

HANDSHAKE_TIMEOUT = 10.0
# OpenSSL's reasons when the first bytes are not a TLS record (a plaintext client).
_NOT_TLS = ("WRONG_VERSION_NUMBER", "HTTP_REQUEST", "UNKNOWN_PROTOCOL", "RECORD_LAYER_FAILURE",
            "PACKET_LENGTH_TOO_LONG")


def peer_identity(cert: object) -> str | None:
    """The user name of a verified client certificate: its subject CN, else its first SAN (as RabbitMQ's
    rabbitmq_auth_mechanism_ssl with ``ssl_cert_login_from = common_name``)."""
    if not isinstance(cert, dict) or not cert:
        return None
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName" and value:
                return str(value)
    for kind, value in cert.get("subjectAltName", ()):
        if kind in ("DNS", "email", "URI") and value:
            return str(value)
    return None


def describe(exc: BaseException) -> str:
    """A handshake error in words an operator can act on."""
    reason = str(getattr(exc, "reason", None) or "")
    if reason in _NOT_TLS:
        return f"not a TLS client ({reason}): a plaintext AMQP client on the TLS port?"
    if reason in ("TLSV1_ALERT_UNKNOWN_CA", "SSLV3_ALERT_BAD_CERTIFICATE"):
        return f"the client does not trust this node's certificate ({reason}): give it the CA of --tls-cert"
    if "CERTIFICATE" in reason:
        return f"client certificate refused ({reason})"
    if isinstance(exc, TimeoutError) or "taking longer" in str(exc):
        return f"no TLS handshake within {HANDSHAKE_TIMEOUT:.0f} s"
    return f"{type(exc).__name__}: {exc}".rstrip(": ")


class TLSListener:
    """Accepts on ``host:port``; every handshaken connection gets a protocol from ``make_protocol``."""

    def __init__(self, context: ssl.SSLContext, make_protocol: Callable[[], asyncio.Protocol]) -> None:
        self.context = context
        self.make_protocol = make_protocol
        self.refused = RateLimitedLog(log)
        self.sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._handshakes: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family, backlog=1024, reuse_port=False)
        sock.setblocking(False)
        self.sock = sock
        self._accepting = asyncio.get_running_loop().create_task(self._accept_forever(sock))

    @property
    def port(self) -> int:
        assert self.sock is not None
        return int(self.sock.getsockname()[1])

    async def _accept_forever(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, addr = await loop.sock_accept(sock)
            except OSError as exc:  # EMFILE and the like: say so, breathe, go on
                log.warning("amqps accept failed", extra={"error": str(exc)})
                await asyncio.sleep(0.1)
                continue
            task = loop.create_task(self._handshake(conn, addr))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _handshake(self, conn: socket.socket, addr: object) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.connect_accepted_socket(self.make_protocol, conn, ssl=self.context,
                                               ssl_handshake_timeout=HANDSHAKE_TIMEOUT)
        except (OSError, ssl.SSLError, TimeoutError, ConnectionError) as exc:
            host = str(addr[0]) if isinstance(addr, tuple) else "-"
            client = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else "-"
            with contextlib.suppress(OSError):
                conn.close()
            if isinstance(exc, ConnectionResetError) and not getattr(exc, "reason", None):
                # Closed before saying anything: a port probe or a load balancer's health check.
                log.debug("amqps connection closed before the TLS handshake", extra={"client": client})
                return
            self.refused.warning(host, "TLS handshake failed; connection closed", reason=describe(exc),
                                 client=client)

    async def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
        for task in list(self._handshakes):
            task.cancel()
        if self.sock is not None:
            self.sock.close()
