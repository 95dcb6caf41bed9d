"""The native gRPC listener (``leveret.v1.Broker``, core/grpc_api) on the node's event loop."""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from core.engine.broker import Broker
from core.grpc_api.auth_first import AuthFirst
from core.grpc_api.servicer import BrokerServicer
from core.grpc_api.streams_servicer import StreamsServicer
from leveret_client.proto import leveret_pb2_grpc as pb_grpc

log = logging.getLogger("leveret.grpc")

# Deliveries are batched per response; allow large messages both ways.
MAX_MESSAGE = 256 * 1024 * 1024
# Streams one client connection may hold open at once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS): each
# open call holds buffers, so a client cannot open thousands on one socket. RabbitMQ's default
# channel_max is 2047; a gRPC client needs one stream per subscription and per call in flight. grpc's
# client does not hold a burst back at this limit: calls past it on one channel fail UNAVAILABLE
# (REFUSED_STREAM); 1024 leaves room for the concurrency clients use (measured: 1000 in flight pass).
MAX_CONCURRENT_STREAMS = 1024


class GRPCServer:
    def __init__(self, broker: Broker, max_message_size: int = 128 * 1024 * 1024) -> None:
        self.broker = broker
        self.servicer = BrokerServicer(broker)
        self.max_message = min(MAX_MESSAGE, max_message_size + 1024 * 1024)
        self.server: grpc.aio.Server | None = None
        self.port = 0
        # More services on the same listener.
        self.extra_services: list[Callable[[grpc.aio.Server], None]] = []

    async def start(self, host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> None:
        """Listen (over TLS with ``credentials``); the cluster's internal service is never served here."""
        server = grpc.aio.server(
            # Credentials are checked before a request message is read (core/grpc_api/auth_first.py).
            interceptors=[AuthFirst(self.servicer, self.max_message)],
            options=[
                ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
                ("grpc.max_receive_message_length", self.max_message),
                ("grpc.max_send_message_length", self.max_message),
                ("grpc.so_reuseport", 0),
                # Cluster peers ping their standing streams every 5 s (core/forwarding.py);
                # the default policy answers such pings with GOAWAY "too_many_pings".
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 4000),
                ("grpc.http2.max_ping_strikes", 0),
            ]
        )
        pb_grpc.add_BrokerServicer_to_server(self.servicer, server)
        for add in self.extra_services:
            add(server)
        pb_grpc.add_StreamsServicer_to_server(StreamsServicer(self.servicer), server)
        self.port = await bind_and_start(server, host, port, credentials, "gRPC")
        self.server = server

    async def stop(self, grace: float = 1.0) -> None:
        if self.server is None:
            return
        self.servicer.close()
        await self.server.stop(grace)
        self.server = None


async def bind_and_start(server: grpc.aio.Server, host: str, port: int,
                         credentials: grpc.ServerCredentials | None, what: str) -> int:
    """Bind ``server`` (plaintext, or TLS with ``credentials``) and start it; the port bound."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        raise OSError(f"cannot bind the {what} listener on {address}: {exc}") from None
    if bound == 0:
        raise OSError(f"cannot bind the {what} listener on {address}")
    await server.start()
    return bound
