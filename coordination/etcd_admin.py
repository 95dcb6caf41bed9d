"""What ``leveret cluster status|drain`` reads and writes in etcd, for a process that is not a node.

The keys are coordination/keys.py's; the CLI (leveret/cli/cluster.py) only
prints what these give and never builds a key itself.
"""

from __future__ import annotations

from typing import Any

from coordination.keys import Layout, loads


async def status(client: Any, cluster: str) -> dict[str, Any]:
    """The live nodes (region, addresses, queues owned, draining) and every queue with its owner and epoch."""
    layout = Layout(cluster)
    items = await client.get_prefix(layout.prefix.encode())
    nodes: dict[str, dict[str, Any]] = {}
    queues: dict[tuple[str, str], dict[str, Any]] = {}
    owners: dict[tuple[str, str], tuple[str, int]] = {}
    for kv in items:
        key = layout.parse(kv.key)
        if key is None:
            continue
        if key.section == "nodes":
            nodes[key.parts[0]] = loads(kv.value)
        elif key.section == "queues":
            queues[(key.parts[0], key.parts[1])] = loads(kv.value)
        elif key.section == "owners":
            owners[(key.parts[0], key.parts[1])] = (kv.value.decode(), kv.create_revision)
    counts = {n: 0 for n in nodes}
    for node, _ in owners.values():
        counts[node] = counts.get(node, 0) + 1
    return {
        "nodes": [
            {"id": n, "region": v.get("region", ""), "amqp": v.get("amqp", ""), "grpc": v.get("grpc", ""),
             "queues": counts.get(n, 0), "draining": bool(v.get("draining", False))}
            for n, v in sorted(nodes.items())
        ],
        "queues": [
            {"vhost": vq[0], "name": vq[1], "owner": owners.get(vq, ("", 0))[0] or None,
             "epoch": owners.get(vq, ("", 0))[1], "durable": bool(meta.get("durable")),
             "exclusive": bool(meta.get("exclusive")), "region": meta.get("region")}
            for vq, meta in sorted(queues.items())
        ],
    }


async def request_drain(client: Any, cluster: str, node: str) -> bool:
    """Ask the live ``node`` to hand its queues over (its watch sees the key); False when no such node is live."""
    layout = Layout(cluster)
    if await client.get(layout.node(node)) is None:
        return False
    await client.put(layout.drain(node), b"{}")
    return True
