"""Read a stream (or every partition of a partitioned stream) as a consumer group, over gRPC.

Run against `make run` (gRPC on 127.0.0.1:50051):

    .venv/bin/python -m leveret streams create orders --partitions 4 --max-age 7D --exist-ok
    .venv/bin/python examples/stream_reader.py --topic orders --group billing --count 10

Each message is printed with the partition (stream) and offset it has there,
then its offset is committed for the group: stop the reader at any point and
start it again, and it resumes right after the last message it committed.
Start two readers of the same group and they split the partitions.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from leveret_client import FIRST, LAST, NEXT, LeveretError, StreamsClient

STARTS = {"first": FIRST, "last": LAST, "next": NEXT}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=os.environ.get("LEVERET_GRPC", "127.0.0.1:50051"))
    parser.add_argument("--username", default="guest")
    parser.add_argument("--password", default="guest")
    parser.add_argument("--topic", default="orders", help="a stream or a partitioned stream")
    parser.add_argument("--group", default="example", help="consumer group (its offsets are kept by the broker)")
    parser.add_argument("--start", default="first", choices=sorted(STARTS),
                        help="where a group with no committed offset starts")
    parser.add_argument("--count", type=int, default=0, help="stop after N messages (0: until Ctrl-C)")
    parser.add_argument("--idle-timeout", type=float, default=0.0, help="stop after S seconds without a message")
    args = parser.parse_args()

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    client = StreamsClient(args.target, username=args.username, password=args.password)
    try:
        with client.subscribe({args.topic: STARTS[args.start]}, group=args.group) as sub:
            received = 0
            while not args.count or received < args.count:
                m = sub.get(timeout=args.idle_timeout or None)
                if m is None:
                    print("idle, stopping", flush=True)
                    break
                received += 1
                print(f"{m.stream}@{m.offset} key={m.key} {m.body.decode(errors='replace')}", flush=True)
                client.commit(args.group, m.stream, m.offset)
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
