"""Command line: parse targets and options, run, print the table, optionally write JSON."""

from __future__ import annotations

import argparse
import sys

from bench.report import render_table, to_json, write_json
from bench.results import RunOptions
from bench.runner import run_all
from bench.scenarios import OPT_IN, SCENARIOS
from bench.target import BrokerUrl, Target, parse_named


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Run AMQP 0-9-1 scenarios against several brokers; the first --url is the subject.",
    )
    p.add_argument("--url", action="append", required=True, metavar="NAME=AMQP_URL",
                   help="broker to measure, e.g. leveret=amqp://guest:guest@127.0.0.1:5673/ (repeatable)")
    p.add_argument("--pid", action="append", default=[], metavar="NAME=PID",
                   help="broker PID for idle_conn_memory; PID may be 'auto' (owner of the URL's port)")
    p.add_argument("--scenario", action="append", choices=list(SCENARIOS), metavar="NAME",
                   help=f"scenario to run (repeatable; default all but {', '.join(sorted(OPT_IN))}): "
                        f"{', '.join(SCENARIOS)}")
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per scenario (default 5)")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before that (default 1)")
    p.add_argument("--idle-connections", type=int, default=500, help="connections for idle_conn_memory")
    p.add_argument("--repeat", type=int, default=1,
                   help="run each scenario N times per broker and keep the run least disturbed by other "
                        "processes (default 1)")
    p.add_argument("--json", metavar="PATH", help="also write results as JSON")
    return p


def parse_targets(urls: list[str], pids: list[str]) -> list[Target]:
    pid_of = dict(parse_named(p) for p in pids)
    for name, pid in pid_of.items():
        if pid != "auto" and not pid.isdigit():
            raise ValueError(f"--pid {name}={pid}: expected a number or 'auto'")
    targets: list[Target] = []
    for spec in urls:
        name, url = parse_named(spec)
        if any(t.name == name for t in targets):
            raise ValueError(f"duplicate broker name {name!r}")
        targets.append(Target(name, BrokerUrl.parse(url), pid_of.pop(name, None)))
    if pid_of:
        raise ValueError(f"--pid for unknown broker(s): {', '.join(pid_of)}")
    return targets


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        targets = parse_targets(args.url, args.pid)
    except ValueError as exc:
        parser.error(str(exc))
    if args.duration <= 0 or args.warmup < 0 or args.repeat < 1:
        parser.error("--duration must be > 0, --warmup >= 0, --repeat >= 1")
    # Always registry order: idle_conn_memory must run before the scenarios that
    # grow the broker's heap, or RSS reuses freed memory and the delta reads ~0.
    scenarios = [name for name in SCENARIOS if name in args.scenario] if args.scenario else \
        [name for name in SCENARIOS if name not in OPT_IN]
    opts = RunOptions(duration=args.duration, warmup=args.warmup, idle_connections=args.idle_connections)
    outcomes = run_all(scenarios, targets, opts, repeat=args.repeat)
    print(render_table(scenarios, targets, outcomes, opts))
    if args.json:
        write_json(args.json, to_json(scenarios, targets, outcomes, opts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
