"""RPC server: answers fib(n) requests arriving on the queue ``rpc_queue``.

Classic request/reply over AMQP.  A client publishes ``n`` (as decimal text)
to ``rpc_queue`` with two properties set: ``reply_to``, the name of a queue of
its own, and ``correlation_id``, an id it picked for the call.  This server
publishes the answer to the ``reply_to`` queue through the default exchange,
copying the ``correlation_id`` so the client can match it to its call, and only
then acknowledges the request.  With ``prefetch_count=1`` the broker gives each
of several servers one request at a time, so you can start as many as you like
to share the load.  A bad request is answered with an ``error`` header::

    python examples/rpc_server.py                  # serve until Ctrl-C
    python examples/rpc_server.py --count 3        # serve three requests, then exit
    python examples/rpc_client.py 10 20 30         # in another terminal

The broker address comes from ``--url`` or the ``AMQP_URL`` environment
variable (default ``amqp://guest:guest@127.0.0.1:5672/``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel
from pika.spec import Basic

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/"
MAX_N = 10_000


def close_quietly(connection: pika.BlockingConnection) -> None:
    """Close the connection, ignoring errors.

    After Ctrl-C in the middle of an operation pika's state can be inconsistent and
    close() may fail; the socket is closed when the process exits anyway.
    """
    if connection.is_open:
        with contextlib.suppress(Exception):
            connection.close()


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("AMQP_URL", DEFAULT_URL),
                        help="broker URL (env AMQP_URL; default %(default)s)")
    parser.add_argument("--queue", default="rpc_queue", help="request queue (default %(default)s)")
    parser.add_argument("--count", type=int, default=0,
                        help="exit after answering this many requests, 0 for no limit (default %(default)s)")
    args = parser.parse_args(argv)
    if args.count < 0:
        parser.error("--count must be 0 or more")
    return args


def run(args: argparse.Namespace) -> int:
    connection = pika.BlockingConnection(pika.URLParameters(args.url))
    served = 0

    def on_request(channel: BlockingChannel, method: Basic.Deliver, properties: pika.BasicProperties,
                   body: bytes) -> None:
        nonlocal served
        result, error = answer(body)
        if properties.reply_to:
            reply = pika.BasicProperties(
                correlation_id=properties.correlation_id,
                content_type="text/plain",
                headers={"error": error} if error else None,
            )
            channel.basic_publish(exchange="", routing_key=properties.reply_to, properties=reply, body=result)
            print(f"request {body.decode('utf-8', 'replace')!r} -> {error or result}", flush=True)
        else:
            print(f"request {body.decode('utf-8', 'replace')!r} has no reply_to, dropped", flush=True)
        # Ack after replying: if we die in between, the request is redelivered.
        channel.basic_ack(delivery_tag=method.delivery_tag)
        served += 1
        if args.count and served >= args.count:
            channel.stop_consuming()

    try:
        channel = connection.channel()
        channel.queue_declare(queue=args.queue)
        channel.basic_qos(prefetch_count=1)
        channel.basic_consume(queue=args.queue, on_message_callback=on_request)
        print(f"awaiting RPC requests on {args.queue!r}", flush=True)
        channel.start_consuming()
        print(f"done: {served} request(s) answered", flush=True)
        return 0
    finally:
        close_quietly(connection)


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
