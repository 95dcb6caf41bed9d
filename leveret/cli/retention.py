"""``leveret retention ...``: named policies, the Spark retention job, replay from the archive.

The work lives in ``spark/`` (docs/RETENTION.md); this module is the command line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from leveret.node.config import ConfigError


def _store_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML config file, as for serve (env LEVERET_CONFIG)")
    parser.add_argument("--data-dir", default=None, help="directory of the embedded store (sqlite)")
    parser.add_argument("--store", default=None, choices=["sqlite", "postgres"], help="message store")
    parser.add_argument("--postgres-dsn", default=None, help="Postgres connection string for --store postgres")


def add_parser(sub: Any) -> None:
    """Add the ``retention`` command group to the CLI's subparsers."""
    from spark.retention_job import add_run_arguments

    retention = sub.add_parser(
        "retention",
        help="retention policies, the retention job (Spark) and replay from its archive",
        description="Retention of the message backup: named policies, the Spark job that applies them, "
        "and replay of archived messages (docs/RETENTION.md).",
    )
    group = retention.add_subparsers(dest="retention_command", metavar="ACTION")

    policy = group.add_parser("policy", help="named retention policies (set, list, delete)")
    actions = policy.add_subparsers(dest="policy_command", metavar="ACTION")
    set_ = actions.add_parser("set", help="create or replace a policy")
    set_.add_argument("name")
    set_.add_argument("--pattern", required=True, help="regular expression searched in queue names")
    set_.add_argument("--max-age", default=None, help="e.g. 7d, 12h, 30m")
    set_.add_argument("--max-bytes", default=None, help="e.g. 10GB, 512MiB")
    set_.add_argument("--max-length", type=int, default=None, help="keep the newest N messages")
    set_.add_argument("--archive", action="store_true", help="archive removed messages to Parquet")
    _store_arguments(set_)
    list_ = actions.add_parser("list", help="list policies")
    list_.add_argument("--json", action="store_true", help="print JSON")
    _store_arguments(list_)
    delete = actions.add_parser("delete", help="delete a policy")
    delete.add_argument("name")
    _store_arguments(delete)

    run = group.add_parser("run", help="run the retention job on Spark")
    add_run_arguments(run)

    replay = group.add_parser("replay", help="publish archived messages back through a broker")
    replay.add_argument("--archive-dir", required=True)
    replay.add_argument("--queue", required=True, help="the archived queue to replay")
    replay.add_argument("--vhost", default="/", help="its vhost (default /)")
    replay.add_argument("--since", default=None, help="enqueued at or after (Unix seconds or ISO 8601)")
    replay.add_argument("--until", default=None, help="enqueued before (Unix seconds or ISO 8601)")
    replay.add_argument("--to-exchange", required=True, help="exchange to publish to ('' is the default exchange)")
    replay.add_argument("--routing-key", default=None, help="routing key (default: each message's own)")
    replay.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/", help="broker URL")
    replay.add_argument("--master", default="local[*]", help="Spark master used to read the archive")


def backend_from_args(args: argparse.Namespace) -> Any:
    """The store of the node's configuration (file, environment, flags), as ``leveret serve`` reads it."""
    from leveret.node.config import load
    from spark.backend import Backend

    overrides = {"data_dir": args.data_dir, "store": args.store, "postgres_dsn": args.postgres_dsn}
    config = load(args.config, overrides)
    return Backend(config.store, data_dir=config.data_dir, dsn=config.postgres_dsn)


def run_from_args(args: argparse.Namespace, spark: Any = None) -> int:
    """``leveret retention run``: the job on the store of the node's configuration."""
    from spark.retention_job import run_from_args as run_job

    try:
        backend = backend_from_args(args)
    except ConfigError as exc:
        print(f"leveret retention: {exc}", file=sys.stderr)
        return 2
    return run_job(args, spark, backend)


def _backend(args: argparse.Namespace) -> Any:
    backend = backend_from_args(args)
    backend.connect()
    return backend


def _policy(args: argparse.Namespace) -> int:
    from spark.backend import BackendError
    from spark.policies import NamedPolicy, PolicyError, format_bytes, format_duration, parse_duration, parse_size

    if args.policy_command is None:
        print("leveret retention policy: say set, list or delete", file=sys.stderr)
        return 2
    try:
        backend = _backend(args)
    except (ConfigError, BackendError) as exc:
        print(f"leveret retention: {exc}", file=sys.stderr)
        return 2
    try:
        if args.policy_command == "set":
            try:
                policy = NamedPolicy(
                    args.name,
                    args.pattern,
                    None if args.max_age is None else parse_duration(args.max_age),
                    None if args.max_bytes is None else parse_size(args.max_bytes),
                    args.max_length,
                    args.archive,
                    time.time(),
                )
            except PolicyError as exc:
                print(f"leveret retention: {exc}", file=sys.stderr)
                return 2
            try:
                backend.set_policy(policy)
            except PolicyError as exc:
                print(f"leveret retention: {exc}", file=sys.stderr)
                return 2
            print(f"policy {policy.name} set")
        elif args.policy_command == "list":
            policies = backend.policies()
            if args.json:
                print(json.dumps([p.as_dict() for p in policies], indent=2))
            else:
                print(f"{'name':<20} {'pattern':<24} {'max-age':>8} {'max-bytes':>10} {'max-length':>10} archive")
                for p in policies:
                    print(
                        f"{p.name:<20} {p.pattern:<24} {format_duration(p.max_age_seconds):>8}"
                        f" {format_bytes(p.max_bytes) if p.max_bytes is not None else '-':>10}"
                        f" {p.max_length if p.max_length is not None else '-':>10} {'yes' if p.archive else 'no'}"
                    )
        else:
            if not backend.delete_policy(args.name):
                print(f"leveret retention: no policy named {args.name!r}", file=sys.stderr)
                return 1
            print(f"policy {args.name} deleted")
    finally:
        backend.close()
    return 0


def _replay(args: argparse.Namespace) -> int:
    from spark.replay import parse_time, replay
    from spark.retention_job import build_session

    try:
        since, until = parse_time(args.since), parse_time(args.until)
    except ValueError as exc:
        print(f"leveret retention replay: {exc}", file=sys.stderr)
        return 2

    def say(line: str) -> None:
        print(f"retention: {line}", file=sys.stderr, flush=True)

    import pika.exceptions

    say(f"starting Spark ({args.master}) to read {args.archive_dir}")
    spark = build_session(args.master, "leveret-replay")
    try:
        sent = replay(
            spark, args.archive_dir, args.queue, args.to_exchange, url=args.url, vhost=args.vhost,
            routing_key=args.routing_key, since=since, until=until, progress=say,
        )  # fmt: skip
    except pika.exceptions.AMQPError as exc:
        print(f"leveret retention replay: the broker refused: {exc!r}", file=sys.stderr)
        return 1
    finally:
        spark.stop()
    print(f"replayed {sent} message(s)")
    return 0


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    command = getattr(args, "retention_command", None)
    if command == "policy":
        return _policy(args)
    if command == "run":
        return run_from_args(args)
    if command == "replay":
        return _replay(args)
    print("leveret retention: say policy, run or replay (see leveret retention --help)", file=sys.stderr)
    return 2
