"""``leveret cluster status|drain``: read and steer a cluster through etcd (coordination/etcd_admin.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from leveret.node.regions import regions_of


def add_parser(sub: Any) -> None:
    p = sub.add_parser("cluster", help="inspect or steer a cluster (etcd)",
                       description="Inspect or steer a Leveret cluster through its etcd metadata.")
    csub = p.add_subparsers(dest="cluster_command", metavar="ACTION")
    for name, text in (("status", "print nodes, regions, queue counts and owners"),
                       ("drain", "ask a live node to hand its queues to the others")):
        a = csub.add_parser(name, help=text, description=text)
        a.add_argument("--etcd", default=None, help="etcd endpoints (env LEVERET_ETCD)")
        a.add_argument("--cluster", default=None, help="cluster name (env LEVERET_CLUSTER, default leveret)")
        a.add_argument("--config", default=None, help="TOML config file, as for serve")
        if name == "status":
            a.add_argument("--json", action="store_true", help="print JSON")
        else:
            a.add_argument("node", help="node id, as in `leveret cluster status`")
            a.add_argument("--wait", type=float, default=30.0, help="seconds to wait until it owns no queue")


def _settings(args: argparse.Namespace) -> tuple[list[str], str]:
    from leveret.node.config import load

    cfg = load(args.config, {"etcd": args.etcd, "cluster": args.cluster})
    endpoints = [e.strip() for e in cfg.etcd.split(",") if e.strip()]
    if not endpoints:
        raise SystemExit("leveret cluster: give --etcd ENDPOINTS (or LEVERET_ETCD)")
    return endpoints, cfg.cluster


async def _client(endpoints: list[str]) -> Any:
    from coordination.etcd_client import EtcdTLS, etcd_client
    from coordination.etcd_session import endpoint
    from leveret.node.config import load

    # etcd's TLS files and login, as a node reads them (LEVERET_ETCD_* or the LEVERET_CONFIG file).
    cfg = load(None, {})
    tls = EtcdTLS.from_files(cfg.etcd_cacert, cfg.etcd_cert, cfg.etcd_key)
    errors = []
    for url in endpoints:
        host, port = endpoint(url)
        client = etcd_client(host, port, 5, tls, cfg.etcd_user, cfg.etcd_password)
        try:
            await asyncio.wait_for(client.status(), 5)
            return client
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{url}: {exc}")
            await client.close()
    raise SystemExit("leveret cluster: cannot reach etcd: " + "; ".join(errors))


async def snapshot(endpoints: list[str], cluster: str) -> dict[str, Any]:
    from coordination.etcd_admin import status

    client = await _client(endpoints)
    try:
        snap = await status(client, cluster)
    finally:
        await client.close()
    return {"nodes": snap["nodes"], "regions": regions_of(snap["nodes"]), "queues": snap["queues"]}


def _print_table(snap: dict[str, Any]) -> None:
    # Grouped by region: placement keeps a queue in its declaring node's region (docs/notes/region.md).
    by_region: dict[str, list[dict[str, Any]]] = {}
    for n in snap["nodes"]:
        by_region.setdefault(n["region"], []).append(n)
    for summary in snap["regions"]:
        region = summary["region"]
        print(f"region {region or '(none)'}: {len(summary['nodes'])} node(s), {summary['live']} taking queues, "
              f"{summary['queues']} queue(s) owned")
        print(f"  {'node':<24} {'amqp':<22} {'grpc':<22} queues")
        for n in by_region.get(region, []):
            flag = " (draining)" if n["draining"] else ""
            print(f"  {n['id']:<24} {n['amqp']:<22} {n['grpc']:<22} {n['queues']}{flag}")
    print()
    print(f"{'vhost':<10} {'queue':<32} {'owner':<24} {'region':<12} {'epoch':>8} durable")
    for q in snap["queues"]:
        region = q["region"] if q["region"] is not None else "-"
        print(f"{q['vhost']:<10} {q['name']:<32} {q['owner'] or '(none)':<24} {region or '(none)':<12} "
              f"{q['epoch']:>8} {'yes' if q['durable'] else 'no'}")


async def drain(endpoints: list[str], cluster: str, node: str, wait: float) -> int:
    from coordination.etcd_admin import request_drain

    client = await _client(endpoints)
    try:
        if not await request_drain(client, cluster, node):
            print(f"leveret cluster drain: no live node {node!r} in cluster {cluster!r}", file=sys.stderr)
            return 1
    finally:
        await client.close()
    deadline = asyncio.get_running_loop().time() + wait
    while True:
        snap = await snapshot(endpoints, cluster)
        left = [q for q in snap["queues"] if q["owner"] == node and q["durable"] and not q["exclusive"]]
        if not left:
            print(f"node {node} owns no durable queue now")
            return 0
        if asyncio.get_running_loop().time() > deadline:
            print(f"node {node} still owns {len(left)} queue(s) after {wait:.0f}s", file=sys.stderr)
            return 1
        await asyncio.sleep(0.5)


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.cluster_command not in ("status", "drain"):
        parser.parse_args(["cluster", "--help"])
        return 2
    endpoints, cluster = _settings(args)
    if args.cluster_command == "status":
        snap = asyncio.run(snapshot(endpoints, cluster))
        if args.json:
            print(json.dumps(snap, indent=2))
        else:
            _print_table(snap)
        return 0
    return asyncio.run(drain(endpoints, cluster, args.node, args.wait))
