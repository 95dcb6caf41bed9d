"""Consume news headlines from a topic exchange, with manual acks and prefetch.

Declares the durable topic exchange ``news``, a queue, and binds the queue
with the pattern(s) given by ``--topic`` (default ``news.#``: everything).
In a topic pattern ``*`` matches exactly one word and ``#`` zero or more, so
``news.sport.*`` gets sport from every region and ``news.*.uk`` every section
for the UK.  Each message is acknowledged after it has been handled; at most
``--prefetch`` unacknowledged messages are in flight at a time.

By default the queue is exclusive and server-named, so it disappears with the
consumer.  With ``--queue NAME`` a durable named queue is used instead: it keeps
collecting (persistent) messages while no consumer is running, and several
consumers sharing it split the messages between them::

    python examples/news_consumer.py                                # all news until Ctrl-C
    python examples/news_consumer.py --topic 'news.sport.#' --topic 'news.*.uk'
    python examples/news_consumer.py --queue uk-desk --topic 'news.*.uk' --count 5 --idle-timeout 30

The broker address comes from ``--url`` or the ``AMQP_URL`` environment
variable (default ``amqp://guest:guest@127.0.0.1:5672/``).  The program exits
with status 0 after ``--count`` messages, after ``--idle-timeout`` seconds
without a message, or on Ctrl-C; unacknowledged messages go back to the queue.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

import pika
import pika.exceptions

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/"


def close_quietly(connection: pika.BlockingConnection) -> None:
    """Close the connection, ignoring errors.

    After Ctrl-C in the middle of an operation pika's state can be inconsistent and
    close() may fail; the socket is closed when the process exits anyway.
    """
    if connection.is_open:
        with contextlib.suppress(Exception):
            connection.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("AMQP_URL", DEFAULT_URL),
                        help="broker URL (env AMQP_URL; default %(default)s)")
    parser.add_argument("--exchange", default="news", help="topic exchange to bind to (default %(default)s)")
    parser.add_argument("--topic", action="append", dest="topics", metavar="PATTERN",
                        help="binding pattern, repeatable (default news.#)")
    parser.add_argument("--queue", default="",
                        help="durable queue to use; default: an exclusive server-named queue")
    parser.add_argument("--prefetch", type=int, default=10,
                        help="most unacknowledged messages at a time (default %(default)s)")
    parser.add_argument("--count", type=int, default=0,
                        help="exit after this many messages, 0 for no limit (default %(default)s)")
    parser.add_argument("--idle-timeout", type=float, default=0.0,
                        help="exit after this many seconds without a message, 0 to wait forever "
                             "(default %(default)s)")
    args = parser.parse_args(argv)
    if args.prefetch < 1 or args.prefetch > 65535:
        parser.error("--prefetch must be between 1 and 65535")
    if args.count < 0:
        parser.error("--count must be 0 or more")
    if args.idle_timeout < 0:
        parser.error("--idle-timeout must be 0 or more")
    args.topics = args.topics or ["news.#"]
    return args


def handle(routing_key: str, properties: pika.BasicProperties, body: bytes, redelivered: bool) -> None:
    """Process one message; here we only print it."""
    note = " (redelivered)" if redelivered else ""
    print(f"received {routing_key} {body.decode('utf-8', 'replace')}{note}", flush=True)


def run(args: argparse.Namespace) -> int:
    connection = pika.BlockingConnection(pika.URLParameters(args.url))
    try:
        channel = connection.channel()
        channel.exchange_declare(exchange=args.exchange, exchange_type="topic", durable=True)
        if args.queue:
            result = channel.queue_declare(queue=args.queue, durable=True)
        else:
            result = channel.queue_declare(queue="", exclusive=True)
        queue = result.method.queue
        for topic in args.topics:
            channel.queue_bind(queue=queue, exchange=args.exchange, routing_key=topic)
        channel.basic_qos(prefetch_count=args.prefetch)
        print(f"waiting for news on queue {queue!r} bound to {args.exchange!r} with {' '.join(args.topics)}",
              flush=True)

        received = 0
        inactivity = args.idle_timeout or None
        for method, properties, body in channel.consume(queue, auto_ack=False, inactivity_timeout=inactivity):
            if method is None:
                print(f"no message for {args.idle_timeout:g}s, stopping", flush=True)
                break
            handle(method.routing_key, properties, body, method.redelivered)
            # Ack only once the message has been dealt with: if we crash before
            # this line the broker hands the message to another consumer.
            channel.basic_ack(delivery_tag=method.delivery_tag)
            received += 1
            if args.count and received >= args.count:
                break
        # Cancel the consumer; messages prefetched but not yet handled are requeued.
        channel.cancel()
        print(f"done: {received} message(s) received", flush=True)
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
