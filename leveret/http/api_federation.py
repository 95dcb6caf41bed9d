"""/api/federation-links (leveret/links/federation/) and RabbitMQ's settable ``/api/cluster-name``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from leveret.http import api_shovels, listing
from leveret.http.api_admin import cluster_name_of
from leveret.http.errors import bad_request
from leveret.http.responses import no_content

if TYPE_CHECKING:
    from leveret.http.routing import Router
    from leveret.http.server import Call


def register(r: Router) -> None:
    r.add("federation-links", GET=(links, "monitoring"))
    r.add("federation-links/{vhost}", GET=(links, "monitoring"))
    r.add("cluster-name", GET=(cluster_name, "management"), PUT=(cluster_name_put, "administrator"))


async def cluster_name(call: Call) -> dict[str, Any]:
    return {"name": cluster_name_of(call)}


async def cluster_name_put(call: Call) -> Any:
    """Stored as RabbitMQ's global parameter ``cluster_name``: every node of the cluster reads it."""
    from leveret.links.federation.manager import CLUSTER_NAME, GLOBAL

    body = await call.body(frozenset({"name"}))
    name = body.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request("name must be a non-empty string")
    if call.node.federation is None:
        raise bad_request("this node keeps no runtime parameters (no store)")
    await api_shovels.set_parameter(call, "", GLOBAL, CLUSTER_NAME, name)
    return no_content()


async def links(call: Call) -> Any:
    manager = call.node.federation
    if manager is None:
        return listing.apply([], call.query)
    names = {call.vhost().name} if "vhost" in call.params else {vh.name for vh in call.visible_vhosts()}
    return listing.apply(await manager.status(names), call.query)
