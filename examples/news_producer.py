"""Publish news headlines to a topic exchange, with publisher confirms.

Every message goes to the durable topic exchange ``news`` with a routing key
of the form ``news.<section>.<region>`` (``news.sport.uk``, ``news.tech.eu``,
...), is marked persistent, and is confirmed by the broker before the next
one is sent.  Run one or more ``news_consumer.py`` first so that there is a
queue bound to receive the messages::

    python examples/news_consumer.py --topic 'news.sport.#' &
    python examples/news_producer.py --count 10
    python examples/news_producer.py --count 3 --routing-key news.sport.uk --routing-key news.tech.eu
    python examples/news_producer.py --count 0 --interval 1      # publish until Ctrl-C

The broker address comes from ``--url`` or the ``AMQP_URL`` environment
variable (default ``amqp://guest:guest@127.0.0.1:5672/``).  Exit status is 0
when every message was confirmed, 1 when the broker refused one (nack or, with
``--mandatory``, no queue bound for its routing key), 2 when it cannot connect.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import sys
import time

import pika
import pika.exceptions

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/"
DEFAULT_KEYS = ["news.sport.uk", "news.politics.uk", "news.sport.us", "news.tech.eu", "news.weather.uk"]


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
    parser.add_argument("--exchange", default="news", help="topic exchange to publish to (default %(default)s)")
    parser.add_argument("--routing-key", action="append", dest="routing_keys", metavar="KEY",
                        help="routing key to use, repeatable; messages cycle through the keys "
                             f"(default {' '.join(DEFAULT_KEYS)})")
    parser.add_argument("--count", type=int, default=10,
                        help="number of messages to publish, 0 for no limit (default %(default)s)")
    parser.add_argument("--interval", type=float, default=0.0,
                        help="seconds to wait between messages (default %(default)s)")
    parser.add_argument("--mandatory", action="store_true",
                        help="fail when a message matches no bound queue instead of letting it be dropped")
    args = parser.parse_args(argv)
    if args.count < 0:
        parser.error("--count must be 0 or more")
    if args.interval < 0:
        parser.error("--interval must be 0 or more")
    args.routing_keys = args.routing_keys or DEFAULT_KEYS
    return args


def run(args: argparse.Namespace) -> int:
    connection = pika.BlockingConnection(pika.URLParameters(args.url))
    try:
        channel = connection.channel()
        channel.exchange_declare(exchange=args.exchange, exchange_type="topic", durable=True)
        # From here on every basic_publish waits for the broker's ack and raises
        # NackError / UnroutableError when the broker did not take the message.
        channel.confirm_delivery()
        print(f"publishing to exchange {args.exchange!r} with confirms", flush=True)

        keys = itertools.cycle(args.routing_keys)
        numbers = itertools.count(1) if args.count == 0 else range(1, args.count + 1)
        sent = 0
        for number in numbers:
            routing_key = next(keys)
            section = routing_key.split(".")[1] if "." in routing_key else routing_key
            body = json.dumps({"id": number, "headline": f"{section} headline #{number}"})
            properties = pika.BasicProperties(
                content_type="application/json",
                delivery_mode=pika.DeliveryMode.Persistent,
                message_id=f"news-{number}",
                timestamp=int(time.time()),
            )
            try:
                channel.basic_publish(exchange=args.exchange, routing_key=routing_key, body=body,
                                      properties=properties, mandatory=args.mandatory)
            except pika.exceptions.UnroutableError:
                print(f"unroutable: no queue bound for {routing_key}", file=sys.stderr, flush=True)
                return 1
            except pika.exceptions.NackError:
                print(f"nacked by the broker: {routing_key} {body}", file=sys.stderr, flush=True)
                return 1
            sent += 1
            print(f"sent {routing_key} {body}", flush=True)
            if args.interval:
                # sleep() keeps heartbeats going while we wait.
                connection.sleep(args.interval)
        print(f"done: {sent} message(s) confirmed", flush=True)
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
