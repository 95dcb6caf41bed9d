"""``leveret``: the command line."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from leveret import __version__
from leveret.node.config import HELP, ConfigError, NodeConfig, load, validate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="leveret",
        description="Leveret, an AMQP 0-9-1 message broker. Every option is also read from a TOML "
        "config file (--config) and from LEVERET_<OPTION> environment variables "
        "(e.g. LEVERET_AMQP_PORT); flags win over the environment, which wins over the file.",
    )
    parser.add_argument("--version", action="version", version=f"leveret {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="run a broker node",
        description="Run a broker node: AMQP on --bind:--amqp-port with an embedded store in --data-dir.",
    )
    serve.add_argument("--config", metavar="FILE", help="TOML config file (env LEVERET_CONFIG)")
    defaults = NodeConfig()
    for f in fields(NodeConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if f.type in (bool, "bool"):
            serve.add_argument(flag, dest=f.name, default=None, action="store_const", const=True,
                               help=f"{HELP[f.name]} (env LEVERET_{f.name.upper()}=true)")
            continue
        serve.add_argument(
            flag,
            dest=f.name,
            default=None,
            metavar=f.name.upper(),
            help=f"{HELP[f.name]} (default {default!r}; env LEVERET_{f.name.upper()})",
        )
    from leveret.cli import retention

    retention.add_parser(sub)
    from leveret.cli import cluster

    cluster.add_parser(sub)
    from leveret.cli import streams

    streams.add_parser(sub)
    from leveret.cli import users

    users.add_parsers(sub)
    from leveret.cli import tls

    tls.add_parser(sub)
    from leveret.cli import ctl

    ctl.add_parser(sub)
    from leveret.cli import policies

    policies.add_parser(sub)
    from leveret.cli import diagnostics

    diagnostics.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    from leveret.cli.ctl import _hoist_options

    args = parser.parse_args(_hoist_options(list(sys.argv[1:] if argv is None else argv)))
    if args.command == "ctl":
        from leveret.cli import ctl

        return ctl.main(args)
    if args.command == "retention":
        from leveret.cli import retention

        return retention.main(args, parser)
    if args.command == "cluster":
        from leveret.cli import cluster

        try:
            return cluster.main(args, parser)
        except ConfigError as exc:
            print(f"leveret: {exc}", file=sys.stderr)
            return 2
    if args.command == "streams":
        from leveret.cli import streams

        return streams.main(args, parser)
    if args.command == "tls":
        from leveret.cli import tls

        return tls.main(args)
    if args.command == "diagnostics":
        from leveret.cli import diagnostics

        return diagnostics.main(args)
    if args.command == "policies":
        from leveret.cli import policies

        return policies.main(args)
    if args.command in ("users", "vhosts"):
        from leveret.cli import users

        return users.main(args)
    if args.command != "serve":
        parser.print_help()
        return 2
    overrides = {f.name: getattr(args, f.name) for f in fields(NodeConfig)}
    try:
        config = load(args.config, overrides)
        validate(config)
    except ConfigError as exc:
        print(f"leveret: {exc}", file=sys.stderr)
        return 2
    from leveret.node import logs
    from leveret.node import wiring as node

    logs.setup(config.log_level, config.log_format)
    from core.ports.coordinator import ClusterStartError
    from core.ports.store import StoreError

    try:
        node.run(config)
    except StoreError as exc:
        print(f"leveret: cannot open the message store: {exc}", file=sys.stderr)
        return 1
    except ClusterStartError as exc:
        print(f"leveret: cannot join the cluster: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"leveret: cannot serve on {config.bind}:{config.amqp_port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0
