"""RPC client: asks ``rpc_server.py`` (or ``aio_rpc.py --role server``) for fib(n).

The client declares an exclusive, server-named callback queue (the broker
picks a name like ``amq.gen-...`` and deletes the queue when the client goes
away) and consumes from it.  For each call it publishes ``n`` to ``rpc_queue``
with ``reply_to`` set to the callback queue and a fresh ``correlation_id``,
then waits, up to ``--timeout`` seconds, for the reply carrying that id; the
request expires from the queue after the same time if no server takes it.
Requests are published as ``mandatory``, so if no queue named ``rpc_queue``
exists the broker returns the request at once instead of dropping it::

    python examples/rpc_server.py &
    python examples/rpc_client.py 10 20 30
    python examples/rpc_client.py --timeout 2 35

The broker address comes from ``--url`` or the ``AMQP_URL`` environment
variable (default ``amqp://guest:guest@127.0.0.1:5672/``).  Exit status is 0
when every call was answered, 1 when a call failed or timed out, 2 when the
client cannot connect.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
import uuid

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel
from pika.spec import Basic

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/"


def close_quietly(connection: pika.BlockingConnection) -> None:
    """Close the connection, ignoring errors.

    After Ctrl-C in the middle of an operation pika's state can be inconsistent and
    close() may fail; the socket is closed when the process exits anyway.
    """
    if connection.is_open:
        with contextlib.suppress(Exception):
            connection.close()


class RpcError(Exception):
    """The call failed: the server reported an error, or the request was returned."""


class FibonacciRpcClient:
    def __init__(self, url: str, queue: str = "rpc_queue") -> None:
        self.queue = queue
        self.connection = pika.BlockingConnection(pika.URLParameters(url))
        self.channel = self.connection.channel()
        # Exclusive + server-named: only this connection can use it, and it is
        # deleted when the connection closes.
        result = self.channel.queue_declare(queue="", exclusive=True)
        self.callback_queue: str = result.method.queue
        self.channel.basic_consume(queue=self.callback_queue, on_message_callback=self._on_response, auto_ack=True)
        self.channel.add_on_return_callback(self._on_return)
        self._pending: set[str] = set()
        self._replies: dict[str, str | RpcError] = {}

    def _on_response(self, channel: BlockingChannel, method: Basic.Deliver, properties: pika.BasicProperties,
                     body: bytes) -> None:
        correlation_id = properties.correlation_id
        if correlation_id not in self._pending:
            return  # a late reply to a call that timed out, or not ours at all
        error = (properties.headers or {}).get("error")
        self._replies[correlation_id] = RpcError(str(error)) if error else body.decode("utf-8", "replace")

    def _on_return(self, channel: BlockingChannel, method: Basic.Return, properties: pika.BasicProperties,
                   body: bytes) -> None:
        if properties.correlation_id in self._pending:
            self._replies[properties.correlation_id] = RpcError(
                f"request returned ({method.reply_code} {method.reply_text}): is an RPC server running "
                f"on {self.queue!r}?"
            )

    def call(self, n: int, timeout: float = 5.0) -> int:
        correlation_id = str(uuid.uuid4())
        self._pending.add(correlation_id)
        self.channel.basic_publish(
            exchange="",
            routing_key=self.queue,
            # expiration: a request nobody picks up before we give up is dropped from the queue
            # instead of being answered long after (in milliseconds, as a string).
            properties=pika.BasicProperties(reply_to=self.callback_queue, correlation_id=correlation_id,
                                            content_type="text/plain", expiration=str(int(timeout * 1000))),
            body=str(n),
            mandatory=True,
        )
        deadline = time.monotonic() + timeout
        try:
            while correlation_id not in self._replies:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no reply for fib({n}) within {timeout:g}s")
                self.connection.process_data_events(time_limit=remaining)
        finally:
            self._pending.discard(correlation_id)
        reply = self._replies.pop(correlation_id)
        if isinstance(reply, RpcError):
            raise reply
        return int(reply)

    def close(self) -> None:
        close_quietly(self.connection)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("numbers", metavar="N", type=int, nargs="*", default=[30],
                        help="compute fib(N) for each N (default 30)")
    parser.add_argument("--url", default=os.environ.get("AMQP_URL", DEFAULT_URL),
                        help="broker URL (env AMQP_URL; default %(default)s)")
    parser.add_argument("--queue", default="rpc_queue", help="request queue (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="seconds to wait for each reply (default %(default)s)")
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    return args


def run(args: argparse.Namespace) -> int:
    client = FibonacciRpcClient(args.url, args.queue)
    try:
        for n in args.numbers:
            print(f"requesting fib({n})", flush=True)
            try:
                result = client.call(n, timeout=args.timeout)
            except (TimeoutError, RpcError) as exc:
                print(f"fib({n}) failed: {exc}", file=sys.stderr, flush=True)
                return 1
            print(f"fib({n}) = {result}", flush=True)
        return 0
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Treat `kill` (SIGTERM) like Ctrl-C so the connection is closed politely.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 0
    except pika.exceptions.AMQPConnectionError as exc:
        params = pika.URLParameters(args.url)
        print(f"connection to {params.host}:{params.port} failed: {exc!r}", file=sys.stderr)
        return 2
    except pika.exceptions.AMQPError as exc:
        print(f"broker error: {exc!r}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
