"""What checking credentials before the body costs a unary Push (core/grpc_api/auth_first.py).

    .venv/bin/python -m bench.grpc_auth_first [--calls 200] [--without]

An in-process node's public gRPC server and one client channel: ``--calls``
concurrent 256-byte Push calls, best of three rounds; ``--without`` serves the
same server with the interceptor replaced by a pass-through (what main did).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import grpc

import leveret.node.grpc_server as grpc_server
from coordination.local import LocalCoordinator
from core.engine.broker import Broker
from leveret_client.proto import leveret_pb2 as pb
from leveret_client.proto import leveret_pb2_grpc as pb_grpc


class _PassThrough(grpc.aio.ServerInterceptor):
    def __init__(self, *args: Any) -> None:
        pass

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        return await continuation(details)


async def run(calls: int, without: bool) -> float:
    if without:
        grpc_server.AuthFirst = _PassThrough  # type: ignore[misc,assignment]
    broker = Broker(node_id="bench", coordinator=LocalCoordinator("bench"))
    server = grpc_server.GRPCServer(broker)
    await server.start("127.0.0.1", 0)
    md = (("username", "guest"), ("password", "guest"))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.BrokerStub(channel)
            await stub.CreateQueue(pb.CreateQueueRequest(name="b", max_length=1000), metadata=md)
            request = pb.PushRequest(queue="b", content=b"x" * 256)
            for _ in range(300):  # warm: the login cache, the connection
                await stub.Push(request, metadata=md)
            best = 0.0
            for _ in range(3):
                start = time.perf_counter()
                await asyncio.gather(*(stub.Push(request, metadata=md) for _ in range(calls)))
                best = max(best, calls / (time.perf_counter() - start))
            return best
    finally:
        await server.stop(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="concurrent Push calls per round")
    parser.add_argument("--without", action="store_true", help="the interceptor replaced by a pass-through")
    args = parser.parse_args()
    rate = asyncio.run(run(args.calls, args.without))
    print(f"{'without' if args.without else 'with'} AuthFirst: {rate:,.0f} Push/s "
          f"({args.calls} concurrent, best of 3)")


if __name__ == "__main__":
    main()
