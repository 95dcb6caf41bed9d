"""``leveret users ...`` and ``leveret vhosts ...``: durable users and vhosts, written through the coordinator.

The records are written as a node writes them (coordination/metadata.py, the
coordinator's metadata side): to the store, which a single node reads at
start (core.durable.durability), so it picks up a change when it restarts;
and in a cluster (``--etcd``, as for ``serve``) to etcd too, where every
running node's watch applies it at once (a user added, replaced or deleted; a
vhost added); nodes only seed etcd with what it lacks, so without ``--etcd`` a
cluster would keep the old record. Every command takes the store options of
``serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import TYPE_CHECKING, Any

from leveret.node.config import ConfigError, load

if TYPE_CHECKING:
    from coordination.metadata import StoredMetadata


def _store_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML config file, as for serve (env LEVERET_CONFIG)")
    parser.add_argument("--data-dir", default=None, help="directory of the embedded store (sqlite)")
    parser.add_argument("--store", default=None, choices=["sqlite", "postgres"], help="message store")
    parser.add_argument("--postgres-dsn", default=None, help="Postgres connection string for --store postgres")
    parser.add_argument("--etcd", default=None, help="cluster mode: etcd endpoints, to apply it on running nodes")
    parser.add_argument("--cluster", default=None, help="cluster name (default leveret)")


def add_parsers(sub: Any) -> None:
    users = sub.add_parser("users", help="durable users (add, delete, list)",
                           description="Users in the store of a node that is not running (set-up before the first "
                           "start); for a running node use `leveret ctl add_user|delete_user|list_users`, which "
                           "applies at once.")  # fmt: skip
    actions = users.add_subparsers(dest="users_command", metavar="ACTION")
    add = actions.add_parser("add", help="create or replace a user")
    add.add_argument("name")
    add.add_argument("--password", required=True)
    add.add_argument("--tag", action="append", default=[], dest="tags", help="e.g. administrator (repeatable)")
    add.add_argument("--vhost", action="append", default=[], dest="vhosts",
                     help="a vhost the user may open (repeatable; none by default)")  # fmt: skip
    add.add_argument("--loopback-only", action="store_true",
                     help="ignored: loopback-only users are the node's --loopback-users list (default guest)")
    delete = actions.add_parser("delete", help="delete a user")
    delete.add_argument("name")
    list_ = actions.add_parser("list", help="list users")
    list_.add_argument("--json", action="store_true")
    for p in (add, delete, list_):
        _store_arguments(p)

    vhosts = sub.add_parser("vhosts", help="durable virtual hosts (add, delete, list)",
                            description="Vhosts in the store of a node that is not running (set-up before the first "
                            "start); for a running node use `leveret ctl add_vhost|delete_vhost|list_vhosts`."
                            )  # fmt: skip
    vactions = vhosts.add_subparsers(dest="vhosts_command", metavar="ACTION")
    vadd = vactions.add_parser("add", help="create a vhost")
    vadd.add_argument("name")
    vdelete = vactions.add_parser("delete", help="delete a vhost and everything stored in it")
    vdelete.add_argument("name")
    vlist = vactions.add_parser("list", help="list vhosts")
    vlist.add_argument("--json", action="store_true")
    for p in (vadd, vdelete, vlist):
        _store_arguments(p)


async def _users(args: argparse.Namespace, store: Any, metadata: StoredMetadata) -> int:
    from core.engine.broker import User
    from leveret.node import passwords

    passwords.install()  # the record a node writes too: argon2id (core/engine/passwords.py)

    if args.users_command == "add":
        u = User.create(args.name, args.password, tags=tuple(sorted(set(args.tags))), vhosts=set(args.vhosts),
                        loopback_only=args.loopback_only)
        await metadata.save_user(u)
        print(f"user {args.name} saved")
    elif args.users_command == "delete":
        if not await metadata.delete_user(args.name):
            print(f"leveret users: no user named {args.name!r}", file=sys.stderr)
            return 1
        print(f"user {args.name} deleted")
    else:
        users = await store.load_users()
        if args.json:
            print(json.dumps([{"name": u.name, "tags": u.tags, "vhosts": u.vhosts, "loopback_only": u.loopback_only}
                              for u in users], indent=2))  # fmt: skip
        else:
            for u in users:
                print(f"{u.name}\ttags={','.join(u.tags) or '-'}\tvhosts={','.join(u.vhosts) or '-'}")
    return 0


async def _vhosts(args: argparse.Namespace, store: Any, metadata: StoredMetadata) -> int:
    if args.vhosts_command == "add":
        await metadata.save_vhost(args.name)
        print(f"vhost {args.name} saved")
    elif args.vhosts_command == "delete":
        if not await metadata.delete_vhost(args.name):  # running nodes drop it when they restart
            print(f"leveret vhosts: no vhost named {args.name!r}", file=sys.stderr)
            return 1
        print(f"vhost {args.name} deleted")
    else:
        names = await store.load_vhosts()
        print(json.dumps(names) if args.json else "\n".join(names))
    return 0


def main(args: argparse.Namespace) -> int:
    group = args.command
    action = getattr(args, f"{group}_command", None)
    if action is None:
        print(f"leveret {group}: say add, delete or list", file=sys.stderr)
        return 2
    try:
        config = load(args.config, {"data_dir": args.data_dir, "store": args.store,
                                    "postgres_dsn": args.postgres_dsn, "etcd": getattr(args, "etcd", None),
                                    "cluster": getattr(args, "cluster", None)})  # fmt: skip
    except ConfigError as exc:
        print(f"leveret {group}: {exc}", file=sys.stderr)
        return 2
    from core.ports.store import StoreError
    from leveret.node.wiring import make_store

    async def go() -> int:
        from coordination.metadata import StoredMetadata
        from core.engine.broker import Broker

        store = make_store(config)
        await store.open()
        client: Any = None
        try:
            # No node runs here: the coordinator's metadata side on a broker of its own, writing the
            # store and, with --etcd, the cluster's records.
            metadata = StoredMetadata(Broker(default_user=None), store)
            if config.etcd and action != "list":
                from coordination.etcd_records import EtcdRecords
                from coordination.keys import Layout
                from leveret.cli.cluster import _client

                endpoints = [e.strip() for e in config.etcd.split(",") if e.strip()]
                client = await _client(endpoints)
                metadata.shared = EtcdRecords(lambda: client, Layout(config.cluster))
            return await (_users(args, store, metadata) if group == "users" else _vhosts(args, store, metadata))
        finally:
            if client is not None:
                await client.close()
            await store.close()

    try:
        return asyncio.run(go())
    except StoreError as exc:
        print(f"leveret {group}: {exc}", file=sys.stderr)
        return 1
