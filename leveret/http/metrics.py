"""The Prometheus endpoint (``--prometheus-port``, default 15692), served by aiohttp.

Paths as rabbitmq_prometheus: ``/metrics`` (aggregated), ``/metrics/per-object``
(a series per queue), ``/metrics/detailed?family=F&vhost=V`` (only the named
families, ``rabbitmq_detailed_`` prefix). The families are built at scrape time
from the node (leveret/http/metric_families.py); a scrape of 10,000 queues is
one pass over them on the event loop.
"""

from __future__ import annotations

import logging
import ssl
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from leveret.http import metric_families as mf

if TYPE_CHECKING:
    from leveret.node.wiring import Node

log = logging.getLogger("leveret.metrics")


def make_app(node: Node) -> web.Application:
    def render(view: mf.View) -> web.Response:
        body = generate_latest(mf.registry(node, view))
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def metrics(_request: web.Request) -> web.Response:
        return render(mf.AGGREGATED)

    async def per_object(_request: web.Request) -> web.Response:
        return render(mf.PER_OBJECT)

    async def detailed(request: web.Request) -> web.Response:
        families = request.query.getall("family", [])
        unknown = sorted(set(families) - set(mf.DETAILED_FAMILIES))
        if unknown:
            log.info("metrics: unknown family asked for", extra={"families": unknown})
            raise web.HTTPBadRequest(
                text=f"unknown metric family {', '.join(unknown)}; this node serves: "
                f"{', '.join(mf.DETAILED_FAMILIES)}\n")
        # No family: nothing, as rabbitmq_prometheus (the caller says what it wants).
        return render(mf.detailed(families, request.query.getall("vhost", [])))

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/metrics/per-object", per_object)
    app.router.add_get("/metrics/detailed", detailed)
    return app


class MetricsServer:
    """The listener; ``port`` is the bound one (0 asks the OS for a free port)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> None:
        """Listen on ``host:port``; HTTPS only when ``ssl_context`` is given (--http-tls)."""
        runner = web.AppRunner(make_app(self.node), access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
        await site.start()
        self._runner = runner
        server = site._server  # noqa: SLF001 - aiohttp exposes the bound port only here
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
