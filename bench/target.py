"""Broker targets given on the command line (``NAME=amqp://user:pass@127.0.0.1:port/vhost``).

``amqps://...`` measures over TLS (default port 5671); ``?cafile=PATH`` names
the CA that signed the broker's certificate, which is verified (host 127.0.0.1).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

# The harness must only ever talk to this machine.
LOOPBACK_HOSTS = {"127.0.0.1", "localhost"}


@dataclass(frozen=True)
class BrokerUrl:
    host: str
    port: int
    user: str
    password: str
    vhost: str
    tls: bool = False
    cafile: str = ""  # the broker's CA for amqps (empty: the system's roots)

    def ssl_context(self) -> ssl.SSLContext | None:
        """For amqps: a client context verifying the broker's certificate for 127.0.0.1, TLS 1.2+."""
        if not self.tls:
            return None
        ctx = ssl.create_default_context(cafile=self.cafile or None)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        return ctx

    @classmethod
    def parse(cls, url: str) -> BrokerUrl:
        parts = urlsplit(url)
        if parts.scheme not in ("amqp", "amqps"):
            raise ValueError(f"only amqp:// and amqps:// URLs are supported: {url}")
        tls = parts.scheme == "amqps"
        host = parts.hostname or "127.0.0.1"
        if host not in LOOPBACK_HOSTS:
            raise ValueError(f"refusing non-loopback host {host!r}: the harness only connects to 127.0.0.1")
        # Empty path or "/" both mean the default vhost, as most clients treat them.
        path = parts.path[1:] if parts.path.startswith("/") else parts.path
        return cls(
            host="127.0.0.1",
            port=parts.port or (5671 if tls else 5672),
            user=unquote(parts.username or "guest"),
            password=unquote(parts.password or "guest"),
            vhost=unquote(path) if path else "/",
            tls=tls,
            cafile=parse_qs(parts.query).get("cafile", [""])[0],
        )


@dataclass(frozen=True)
class Target:
    """A named broker; the first target given is the subject, the rest are baselines."""

    name: str
    url: BrokerUrl
    pid: str | None = None  # a PID, "auto", or None when memory can't be measured


def parse_named(value: str) -> tuple[str, str]:
    name, sep, rest = value.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"expected NAME=VALUE, got {value!r}")
    return name, rest
