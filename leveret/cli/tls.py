"""``leveret tls make-test-ca DIR``: a development CA and certificates, for trying AMQPS, gRPC TLS and a
mutually authenticated cluster on one machine (never for production: the CA key sits beside the certs).

Made with trustme (which builds on the ``cryptography`` package): ECDSA P-256 keys.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    tls = sub.add_parser("tls", help="TLS helpers (a development CA)")
    actions = tls.add_subparsers(dest="tls_command", metavar="ACTION")
    make = actions.add_parser(
        "make-test-ca", help="write a development CA, a server certificate and client certificates to DIR",
        description="Writes DIR/ca.pem (the CA certificate: --tls-ca, --cluster-tls-ca, a client's CA), "
        "DIR/ca.key, DIR/server.pem + DIR/server.key (--tls-cert/--tls-key, also usable as "
        "--cluster-tls-cert/--cluster-tls-key: it is valid as a client certificate too), and "
        "DIR/client-NAME.pem + .key per --client NAME (its subject CN is NAME: the user of SASL EXTERNAL).")
    make.add_argument("dir")
    make.add_argument("--host", action="append", default=[], dest="hosts",
                      help="a name or IP the server certificate is valid for (repeatable; "
                      "default localhost and 127.0.0.1)")
    make.add_argument("--client", action="append", default=[], dest="clients",
                      help="a client certificate whose CN is this user name (repeatable)")


def main(args: argparse.Namespace) -> int:
    if args.tls_command != "make-test-ca":
        print("leveret tls: say make-test-ca DIR", file=sys.stderr)
        return 2
    try:
        import trustme
    except ImportError:
        print("leveret tls: make-test-ca needs the trustme package (pip install trustme)", file=sys.stderr)
        return 1
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA(organization_name="Leveret development CA")
    ca.cert_pem.write_to_path(str(out / "ca.pem"))
    ca.private_key_pem.write_to_path(str(out / "ca.key"))
    hosts = args.hosts or ["localhost", "127.0.0.1"]
    server = ca.issue_cert(*hosts, common_name=hosts[0])
    server.private_key_pem.write_to_path(str(out / "server.key"))
    _chain(server, out / "server.pem")
    for name in args.clients:
        client = ca.issue_cert(f"{name}.client.invalid", common_name=name)
        client.private_key_pem.write_to_path(str(out / f"client-{name}.key"))
        _chain(client, out / f"client-{name}.pem")
    for key in out.glob("*.key"):
        key.chmod(0o600)
    print(f"wrote a development CA and certificates to {out} (ca.pem, server.pem, server.key"
          + "".join(f", client-{n}.pem" for n in args.clients) + ")")
    return 0


def _chain(leaf: Any, path: Path) -> None:
    path.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
