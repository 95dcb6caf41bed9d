"""The cluster port (``--cluster-port``): the internal ``leveret.internal.v1.Node`` service, alone.

Node-to-node calls read and remove messages from any queue, so they have a
listener of their own, never the public gRPC port (which answers them
UNIMPLEMENTED). Every call is authenticated (core/cluster/auth.py): the
listener demands a client certificate of the cluster CA under mutual TLS,
and ``NodeService`` checks the shared secret's token on every call.
"""

from __future__ import annotations

import grpc

from core.cluster import internal_pb2_grpc
from core.cluster.auth import PeerAuth
from core.cluster.service import NodeService
from leveret.node.grpc_server import MAX_MESSAGE, bind_and_start


class ClusterServer:
    def __init__(self, service: NodeService, auth: PeerAuth) -> None:
        self.service = service
        self.auth = auth
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        server = grpc.aio.server(
            # Every call proves membership before its method runs (core/cluster/auth.py).
            interceptors=[self.auth.server_interceptor()],
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE),
                ("grpc.max_send_message_length", MAX_MESSAGE),
                ("grpc.so_reuseport", 0),
                # Peers ping their standing streams every 5 s (core/cluster/link.py GRPC_OPTIONS);
                # the default policy answers such pings with GOAWAY "too_many_pings".
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 4000),
                ("grpc.http2.max_ping_strikes", 0),
            ]
        )
        internal_pb2_grpc.add_NodeServicer_to_server(self.service, server)
        self.port = await bind_and_start(server, host, port, self.auth.server_credentials(), "cluster")
        self.server = server

    async def stop(self, grace: float = 1.0) -> None:
        if self.server is not None:
            await self.server.stop(grace)
            self.server = None
