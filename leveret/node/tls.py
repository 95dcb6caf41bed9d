"""Server TLS contexts from the node's options, and their reload without restart.

Choices (docs/SECURITY.md): TLS 1.2 and 1.3 only; for 1.2, Mozilla's
"intermediate" suites (forward-secret key exchange, AEAD ciphers only: the
ssl module's defaults less its CBC-SHA256/384 suites); every 1.3 suite (OpenSSL
allows only AEAD ones); compression off. ``--tls-verify peer`` asks
clients for a certificate and checks it against ``--tls-ca``; with
``--tls-fail-if-no-peer-cert`` one without a certificate is refused in the
handshake, else it may still log in with a password.

``reload()`` loads the files again into the same ``SSLContext``: OpenSSL
copies the context's certificate into each new connection, so connections
made afterwards get the new chain and open ones keep theirs.
"""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("leveret.tls")

TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20:DHE+AESGCM:DHE+CHACHA20:!aNULL:!eNULL:!aDSS:@SECLEVEL=2"


@dataclass(frozen=True)
class TLSFiles:
    cert: str
    key: str
    ca: str = ""
    verify: str = "none"  # none | peer
    fail_if_no_peer_cert: bool = False

    @property
    def verifies_peers(self) -> bool:
        return self.verify == "peer"


class ServerTLS:
    def __init__(self, files: TLSFiles) -> None:
        self.files = files
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.context.options |= ssl.OP_NO_COMPRESSION
        self.context.set_ciphers(TLS12_CIPHERS)
        if files.verifies_peers:
            self.context.verify_mode = ssl.CERT_REQUIRED if files.fail_if_no_peer_cert else ssl.CERT_OPTIONAL
        self._load()

    def _load(self) -> None:
        f = self.files
        self.context.load_cert_chain(f.cert, f.key)
        if f.ca:
            self.context.load_verify_locations(cafile=f.ca)

    def reload(self) -> bool:
        """Read the files again for new connections; on an error keep the old ones (and say why)."""
        try:
            self._load()
        except (OSError, ssl.SSLError) as exc:
            log.error("TLS certificate reload failed: the previous certificate stays in use",
                      extra={"cert": self.files.cert, "error": str(exc)})
            return False
        log.info("TLS certificate reloaded for new connections", extra={"cert": self.files.cert})
        return True

    def pem(self) -> tuple[bytes, bytes, bytes | None]:
        """The files' bytes, for gRPC's credentials: (key, chain, CA or None)."""
        f = self.files
        return Path(f.key).read_bytes(), Path(f.cert).read_bytes(), Path(f.ca).read_bytes() if f.ca else None

