"""``leveret users ...`` and ``leveret vhosts ...``: durable users and vhosts, written through the store.

A single node reads them at start (core.durable.durability), so it picks up a change
when it restarts. In a cluster (``--etcd``, as for ``serve``) the change is
written to etcd too, where every running node applies it at once (a user
added, replaced or deleted; a vhost added); nodes only seed etcd with what
it lacks, so without ``--etcd`` a cluster would keep the old record. Every
command takes the store options of ``serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from leveret.node.config import ConfigError, load


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
    add.add_argument("--loopback-only", action="store_true", help="accept logins from 127.0.0.1/::1 only")
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


async def _users(args: argparse.Namespace, store: Any, cluster: _Cluster | None) -> int:
    from core.engine.broker import User
    from core.ports.store import UserRecord
    from leveret.node import passwords

    passwords.install()  # the record a node writes too: argon2id (core/engine/passwords.py)

    if args.users_command == "add":
        u = User.create(args.name, args.password, tags=tuple(sorted(set(args.tags))), vhosts=set(args.vhosts),
                        loopback_only=args.loopback_only)
        await store.save_user(UserRecord(u.name, u.salt, u.password_hash, list(u.tags), sorted(u.vhosts),
                                         u.loopback_only))  # fmt: skip
        if cluster is not None:
            from coordination.keys import user_value

            await cluster.put(cluster.layout.user(args.name), user_value(u))
        print(f"user {args.name} saved")
    elif args.users_command == "delete":
        found = await store.delete_user(args.name)
        if cluster is not None:
            found = await cluster.delete(cluster.layout.user(args.name)) or found
        if not found:
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


async def _vhosts(args: argparse.Namespace, store: Any, cluster: _Cluster | None) -> int:
    if args.vhosts_command == "add":
        await store.save_vhost(args.name)
        if cluster is not None:
            await cluster.put(cluster.layout.vhost(args.name), b"{}")
        print(f"vhost {args.name} saved")
    elif args.vhosts_command == "delete":
        found = await store.delete_vhost(args.name)
        if cluster is not None:  # running nodes drop it when they restart
            found = await cluster.delete(cluster.layout.vhost(args.name)) or found
        if not found:
            print(f"leveret vhosts: no vhost named {args.name!r}", file=sys.stderr)
            return 1
        print(f"vhost {args.name} deleted")
    else:
        names = await store.load_vhosts()
        print(json.dumps(names) if args.json else "\n".join(names))
    return 0


class _Cluster:
    """The cluster's etcd, for the records every running node mirrors."""

    def __init__(self, client: Any, name: str) -> None:
        from coordination.keys import Layout

        self.client = client
        self.layout = Layout(name)

    async def put(self, key: bytes, value: bytes) -> None:
        await asyncio.wait_for(self.client.put(key, value), 10)

    async def delete(self, key: bytes) -> bool:
        return bool(await asyncio.wait_for(self.client.delete(key), 10))


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
        store = make_store(config)
        await store.open()
        cluster: _Cluster | None = None
        try:
            if config.etcd and action != "list":
                from leveret.cli.cluster import _client

                endpoints = [e.strip() for e in config.etcd.split(",") if e.strip()]
                cluster = _Cluster(await _client(endpoints), config.cluster)
            return await (_users(args, store, cluster) if group == "users" else _vhosts(args, store, cluster))
        finally:
            if cluster is not None:
                await cluster.client.close()
            await store.close()

    try:
        return asyncio.run(go())
    except StoreError as exc:
        print(f"leveret {group}: {exc}", file=sys.stderr)
        return 1
