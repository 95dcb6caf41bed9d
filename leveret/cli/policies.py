"""``leveret policies set|clear|list``: policies written straight to the store.

Arguments in rabbitmqctl's order (``set_policy [-p VHOST] [--priority N]
[--apply-to queues|exchanges|all] NAME PATTERN DEFINITION``). Running nodes
read the store's policies every second (leveret/node/policy_watch.py) and apply a
change to their live queues at once; a node that is down applies them at
start. ``leveret ctl set_policy`` does the same over a node's management API.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from leveret.cli.users import _store_arguments
from leveret.node.config import ConfigError, load


def add_parser(sub: Any) -> None:
    policies = sub.add_parser("policies", help="policies (set, clear, list), applied by running nodes within a second",
                              description="RabbitMQ-style policies kept in the store (see docs/METRICS.md).")
    actions = policies.add_subparsers(dest="policies_command", metavar="ACTION")
    set_ = actions.add_parser("set", help="create or replace a policy")
    set_.add_argument("name")
    set_.add_argument("pattern", help="regular expression searched in queue/exchange names")
    set_.add_argument("definition", help='JSON object, e.g. \'{"max-length": 2}\'')
    set_.add_argument("--priority", type=int, default=0)
    set_.add_argument("--apply-to", default="all", help="queues, exchanges or all (default)")
    clear = actions.add_parser("clear", help="delete a policy")
    clear.add_argument("name")
    list_ = actions.add_parser("list", help="list policies")
    list_.add_argument("--json", action="store_true")
    for p in (set_, clear, list_):
        p.add_argument("-p", "--vhost", default="/", help="virtual host (default /)")
        p.add_argument("--operator", action="store_true", help="an operator policy (caps limits users set)")
        _store_arguments(p)


async def _run(args: argparse.Namespace, store: Any) -> int:
    from core.model.policy import Policy, PolicyError

    if args.policies_command == "set":
        try:
            definition = json.loads(args.definition)
            policy = Policy.create(args.vhost, args.name, args.pattern, definition, args.apply_to, args.priority,
                                   args.operator)
        except json.JSONDecodeError as exc:
            print(f"leveret policies: the definition is not JSON: {exc}", file=sys.stderr)
            return 2
        except PolicyError as exc:
            print(f"leveret policies: {exc}", file=sys.stderr)
            return 2
        await store.save_policy(policy)
        print(f"policy {policy.name} set on vhost {policy.vhost}")
    elif args.policies_command == "clear":
        if not await store.delete_policy(args.vhost, args.name, args.operator):
            print(f"leveret policies: no policy named {args.name!r} on vhost {args.vhost!r}", file=sys.stderr)
            return 1
        print(f"policy {args.name} cleared")
    else:
        found = [p for p in await store.load_policies() if p.vhost == args.vhost and p.operator == args.operator]
        if args.json:
            print(json.dumps([p.as_rabbitmq() for p in found], indent=2))
        else:
            for p in found:
                print(f"{p.vhost}\t{p.name}\t{p.pattern}\t{p.apply_to}\t{json.dumps(p.definition)}\t{p.priority}")
    return 0


def main(args: argparse.Namespace) -> int:
    if getattr(args, "policies_command", None) is None:
        print("leveret policies: say set, clear or list", file=sys.stderr)
        return 2
    try:
        config = load(args.config, {"data_dir": args.data_dir, "store": args.store,
                                    "postgres_dsn": args.postgres_dsn})  # fmt: skip
    except ConfigError as exc:
        print(f"leveret policies: {exc}", file=sys.stderr)
        return 2
    from core.ports.store import StoreError
    from leveret.node.wiring import make_store

    async def go() -> int:
        store = make_store(config)
        await store.open()
        try:
            return await _run(args, store)
        finally:
            await store.close()

    try:
        return asyncio.run(go())
    except StoreError as exc:
        print(f"leveret policies: {exc}", file=sys.stderr)
        return 1
