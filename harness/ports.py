"""Free loopback ports for the servers tests start (never a fixed port: a RabbitMQ may hold 5672).

Ports come from below the kernel's ephemeral range. A port that the kernel
hands out for ``bind(0)`` is from the same range it uses for the source port
of every outgoing connection, so between picking it and the server binding
it, a connection to etcd, Postgres or a peer node could take it (seen in CI
as "address already in use" at a node's start). Outside that range only a
listener could take it, and the bind check below skips those.
"""

from __future__ import annotations

import random
import socket

_LOW = 10_000
# Ports handed out in this process: never hand one out twice, even after the
# server that used it stopped (a test may restart a server on its old port).
_given: set[int] = set()


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1 that no outgoing connection can take."""
    high = _ephemeral_start()
    if high - _LOW < 1000:  # an unusual port range: fall back to the kernel's choice
        return _kernel_ports(count)
    ports: list[int] = []
    for _ in range(50 * count):
        port = random.randrange(_LOW, high)
        if port in _given or not _bindable(port):
            continue
        _given.add(port)
        ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"no {count} free loopback ports between {_LOW} and {high}")


def free_port() -> int:
    """One free TCP port on 127.0.0.1, as ``free_ports``."""
    return free_ports(1)[0]


def _kernel_ports(count: int) -> list[int]:
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()
