"""Free loopback ports for the servers tests start (never a fixed port: a RabbitMQ may hold 5672)."""

from __future__ import annotations

import socket


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1 (held together while picked, so distinct)."""
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
