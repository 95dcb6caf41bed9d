"""RPC with aio-pika: a fib(n) server and client in one asyncio program.

The same request/reply pattern as ``rpc_server.py`` / ``rpc_client.py`` and
the same messages on the wire, so the pika and aio-pika halves can be mixed
freely.  The server consumes ``rpc_queue`` one request at a time
(``prefetch_count=1``), publishes ``str(fib(n))`` to the request's
``reply_to`` queue with the request's ``correlation_id``, and acks.  The client
declares an exclusive server-named callback queue, keeps one future per
outstanding ``correlation_id``, and waits for each reply with a timeout; its
requests are ``mandatory`` on a channel with ``on_return_raises``, so a request
that no queue receives fails at once.  Both use ``connect_robust``, which
reconnects and re-declares queues and consumers if the connection drops::

    python examples/aio_rpc.py --role both 10 20 30           # server + client in one process
    python examples/aio_rpc.py --role server                  # serve until Ctrl-C
    python examples/aio_rpc.py --role server --count 3        # serve three requests, then exit
    python examples/aio_rpc.py --role client --timeout 2 10 20 30

The broker address comes from ``--url`` or the ``AMQP_URL`` environment
variable (default ``amqp://guest:guest@127.0.0.1:5672/``).  Exit status is 0
on success, 1 when a call failed or timed out, 2 when it cannot connect.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import uuid

import aio_pika
import aio_pika.exceptions
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue, AbstractRobustConnection

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/"
MAX_N = 10_000


def fib(n: int) -> int:
    """The n-th Fibonacci number: fib(0) = 0, fib(1) = 1."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def answer(body: bytes) -> tuple[str, str | None]:
    """Compute the reply body for a request body, and an error text if it is invalid."""
    try:
        n = int(body.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        return "", f"expected an integer, got {body[:50]!r}"
    if not 0 <= n <= MAX_N:
        return "", f"n must be between 0 and {MAX_N}, got {n}"
    return str(fib(n)), None


# --------------------------------------------------------------------- server


async def serve(connection: AbstractRobustConnection, queue_name: str, count: int = 0,
                ready: asyncio.Event | None = None) -> int:
    """Answer requests on ``queue_name``; return after ``count`` of them (0: never)."""
    channel = await connection.channel()
    try:
        await channel.set_qos(prefetch_count=1)
        queue = await channel.declare_queue(queue_name)
        print(f"awaiting RPC requests on {queue_name!r}", flush=True)
        if ready is not None:
            ready.set()
        served = 0
        async with queue.iterator() as requests:
            async for message in requests:
                # process() acks when the block succeeds and rejects (here: requeues) if it raises,
                # so the ack comes only after the reply has been published.
                async with message.process(requeue=True):
                    text = message.body.decode("utf-8", "replace")
                    result, error = answer(message.body)
                    if message.reply_to:
                        reply = aio_pika.Message(
                            body=result.encode(),
                            correlation_id=message.correlation_id,
                            content_type="text/plain",
                            headers={"error": error} if error else None,
                        )
                        await channel.default_exchange.publish(reply, routing_key=message.reply_to,
                                                               mandatory=False)
                        print(f"request {text!r} -> {error or result}", flush=True)
                    else:
                        print(f"request {text!r} has no reply_to, dropped", flush=True)
                served += 1
                if count and served >= count:
                    break
        print(f"done: {served} request(s) answered", flush=True)
        return served
    finally:
        await channel.close()


# --------------------------------------------------------------------- client


class RpcError(Exception):
    """The call failed: the server reported an error, or the request was returned."""


class FibonacciRpcClient:
    def __init__(self, connection: AbstractRobustConnection, queue_name: str = "rpc_queue") -> None:
        self.connection = connection
        self.queue_name = queue_name
        self.futures: dict[str, asyncio.Future[str]] = {}
        self.channel: AbstractChannel | None = None
        self.callback_queue: AbstractQueue | None = None

    async def start(self) -> FibonacciRpcClient:
        # on_return_raises: a mandatory message the broker cannot route raises PublishError.
        self.channel = await self.connection.channel(on_return_raises=True)
        # No name + exclusive: the broker names the queue and deletes it when we disconnect.
        self.callback_queue = await self.channel.declare_queue(exclusive=True)
        await self.callback_queue.consume(self.on_response, no_ack=True)
        return self

    async def close(self) -> None:
        for future in self.futures.values():
            future.cancel()
        if self.channel is not None:
            await self.channel.close()

    async def on_response(self, message: AbstractIncomingMessage) -> None:
        future = self.futures.pop(message.correlation_id or "", None)
        if future is None or future.done():
            return  # a late reply to a call that timed out, or not ours at all
        error = (message.headers or {}).get("error")
        if error:
            future.set_exception(RpcError(str(error)))
        else:
            future.set_result(message.body.decode("utf-8", "replace"))

    async def call(self, n: int, timeout: float = 5.0) -> int:
        assert self.channel is not None and self.callback_queue is not None, "call start() first"
        correlation_id = str(uuid.uuid4())
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.futures[correlation_id] = future
        try:
            request = aio_pika.Message(
                body=str(n).encode(),
                correlation_id=correlation_id,
                reply_to=self.callback_queue.name,
                content_type="text/plain",
                expiration=timeout,  # seconds; a request nobody takes in time is dropped, not answered late
            )
            try:
                await self.channel.default_exchange.publish(request, routing_key=self.queue_name, mandatory=True)
            except aio_pika.exceptions.PublishError as exc:
                raise RpcError(f"request returned ({exc}): is an RPC server running on {self.queue_name!r}?") from None
            try:
                return int(await asyncio.wait_for(future, timeout))
            except TimeoutError:
                raise TimeoutError(f"no reply for fib({n}) within {timeout:g}s") from None
        finally:
            self.futures.pop(correlation_id, None)


async def run_client(connection: AbstractRobustConnection, queue_name: str, numbers: list[int],
                     timeout: float) -> int:
    client = await FibonacciRpcClient(connection, queue_name).start()
    try:
        for n in numbers:
            print(f"requesting fib({n})", flush=True)
            try:
                result = await client.call(n, timeout=timeout)
            except (TimeoutError, RpcError) as exc:
                print(f"fib({n}) failed: {exc}", file=sys.stderr, flush=True)
                return 1
            print(f"fib({n}) = {result}", flush=True)
        return 0
    finally:
        await client.close()


# ----------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("numbers", metavar="N", type=int, nargs="*", default=[30],
                        help="client: compute fib(N) for each N (default 30)")
    parser.add_argument("--role", choices=["server", "client", "both"], default="both",
                        help="run the server, the client, or both (default %(default)s)")
    parser.add_argument("--url", default=os.environ.get("AMQP_URL", DEFAULT_URL),
                        help="broker URL (env AMQP_URL; default %(default)s)")
    parser.add_argument("--queue", default="rpc_queue", help="request queue (default %(default)s)")
    parser.add_argument("--count", type=int, default=0,
                        help="server: exit after answering this many requests, 0 for no limit (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="client: seconds to wait for each reply (default %(default)s)")
    args = parser.parse_args(argv)
    if args.count < 0:
        parser.error("--count must be 0 or more")
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    return args


async def amain(args: argparse.Namespace) -> int:
    # Let `kill` (SIGTERM) stop the program like Ctrl-C: cancel, close connections, exit.
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)

    async with await aio_pika.connect_robust(args.url) as connection:
        if args.role == "server":
            await serve(connection, args.queue, args.count)
            return 0
        if args.role == "client":
            return await run_client(connection, args.queue, args.numbers, args.timeout)

        # both: start the server, wait until its queue exists, run the client, stop the server.
        ready = asyncio.Event()
        server = asyncio.create_task(serve(connection, args.queue, args.count, ready))
        ready_wait = asyncio.create_task(ready.wait())
        await asyncio.wait([server, ready_wait], return_when=asyncio.FIRST_COMPLETED)
        if server.done():  # it failed before becoming ready
            ready_wait.cancel()
            await server
            return 1
        try:
            return await run_client(connection, args.queue, args.numbers, args.timeout)
        finally:
            server.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await server


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return asyncio.run(amain(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted", file=sys.stderr)
        return 0
    except (OSError, aio_pika.exceptions.AMQPConnectionError) as exc:
        print(f"connection failed: {exc!r}", file=sys.stderr)
        return 2
    except aio_pika.exceptions.AMQPError as exc:
        print(f"broker error: {exc!r}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
