"""Subscribe to a topic over Leveret's native gRPC API, and ack what arrives.

Run against `make run` (gRPC on 127.0.0.1:50051):

    .venv/bin/python examples/grpc_subscriber.py --queue news --topic 'news.sport.#' --count 10

It creates the queue if missing and a channel on it whose topic filter is an
AMQP pattern, so messages published over AMQP (e.g. examples/news_producer.py
to a queue bound as `news`) or pushed over gRPC with a matching topic reach
it. Duplicates after a failover are dropped by message id.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from leveret_client import Client, Deduplicator, LeveretError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=os.environ.get("LEVERET_GRPC", "127.0.0.1:50051"))
    parser.add_argument("--username", default="guest")
    parser.add_argument("--password", default="guest")
    parser.add_argument("--queue", default="news")
    parser.add_argument("--topic", default="news.#", help="exact topic, prefix, or AMQP pattern with * and #")
    parser.add_argument("--count", type=int, default=0, help="stop after N messages (0: until Ctrl-C)")
    parser.add_argument("--idle-timeout", type=float, default=0.0, help="stop after S seconds without a message")
    parser.add_argument("--prefetch", type=int, default=100)
    args = parser.parse_args()

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    client = Client(args.target, username=args.username, password=args.password)
    try:
        try:
            client.create_queue(args.queue)
        except LeveretError as exc:
            if exc.code.name != "ALREADY_EXISTS":
                raise
        channel_id = client.create_channel(args.queue, topic=args.topic)
        print(f"subscribed to {args.topic!r} on {args.queue!r} as {channel_id}", flush=True)
        subscriber = client.subscribe(channel_id, prefetch=args.prefetch)
        seen = Deduplicator()
        received = 0
        while not args.count or received < args.count:
            message = subscriber.get(timeout=args.idle_timeout or None)
            if message is None:
                print("idle, stopping", flush=True)
                break
            if not seen.seen(message):
                received += 1
                print(f"{message.topic} {message.content.decode(errors='replace')}", flush=True)
            subscriber.ack(message)
        client.delete_channel(channel_id)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    except LeveretError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
