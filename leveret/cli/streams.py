"""``leveret streams ...``: create, inspect and delete (partitioned) streams on a running node over gRPC."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from google.protobuf.json_format import MessageToDict

from leveret_client.proto import leveret_pb2 as pb


def add_parser(sub: Any) -> None:
    streams = sub.add_parser(
        "streams",
        help="create, show and delete streams and partitioned streams (over gRPC)",
        description="Streams on a running node (docs/STREAMS.md), through its gRPC API.",
    )
    streams.add_argument("--grpc", default="127.0.0.1:50051", metavar="HOST:PORT",
                         help="the node's gRPC address (default 127.0.0.1:50051)")
    streams.add_argument("--username", default="guest")
    streams.add_argument("--password", default="guest")
    streams.add_argument("--vhost", default="/")
    group = streams.add_subparsers(dest="streams_command", metavar="ACTION")
    create = group.add_parser("create", help="a stream, or with --partitions N a partitioned stream NAME-0..N-1")
    create.add_argument("name")
    create.add_argument("--partitions", type=int, default=0,
                        help="N >= 1: N streams behind an x-partition exchange NAME (default: one stream NAME)")
    create.add_argument("--max-age", default="", help="x-max-age per stream, e.g. 7D, 12h, 30m")
    create.add_argument("--max-bytes", type=int, default=0, help="x-max-length-bytes per stream")
    create.add_argument("--exist-ok", action="store_true", help="an equivalent existing stream is not an error")
    info = group.add_parser("info", help="offsets, sizes and consumer-group offsets of each partition")
    info.add_argument("name")
    delete = group.add_parser("delete", help="delete a stream or a partitioned stream with its partitions")
    delete.add_argument("name")


def _show(info: pb.StreamInfo) -> None:
    print(json.dumps(MessageToDict(info, always_print_fields_with_no_presence=True), indent=2))


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from leveret_client import LeveretError, StreamsClient

    command = getattr(args, "streams_command", None)
    if command not in ("create", "info", "delete"):
        print("leveret streams: say create, info or delete (see leveret streams --help)", file=sys.stderr)
        return 2
    if command == "create" and args.partitions < 0:
        print("leveret streams create: --partitions must be 0 or more", file=sys.stderr)
        return 2
    try:
        with StreamsClient(args.grpc, args.username, args.password, args.vhost, timeout=30) as client:
            if command == "create":
                _show(client.create_stream(args.name, args.partitions, args.max_age, args.max_bytes, args.exist_ok))
            elif command == "info":
                _show(client.get_stream(args.name))
            else:
                print(f"deleted {args.name}: {client.delete_stream(args.name)} messages dropped")
    except LeveretError as exc:
        print(f"leveret streams {command}: {exc.code.name}: {exc.details}", file=sys.stderr)
        return 1
    return 0
