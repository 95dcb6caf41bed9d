"""The web console: static HTML, CSS and JavaScript served at ``/`` (no build step, no CDN).

The page logs in with the management API's basic auth (the browser keeps the
credentials in sessionStorage for the tab) and draws everything from the
API's JSON, so the console can do nothing the API would not let that user do.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

STATIC = Path(__file__).with_name("console")
FILES = {"console.js": "application/javascript", "console.css": "text/css"}


async def _index(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(STATIC / "index.html", headers={"Content-Type": "text/html; charset=utf-8",
                                                            "Cache-Control": "no-cache"})


async def _asset(request: web.Request) -> web.StreamResponse:
    name = request.match_info["file"]
    if name not in FILES:
        raise web.HTTPNotFound()
    return web.FileResponse(STATIC / name, headers={"Content-Type": FILES[name], "Cache-Control": "no-cache"})


def register(app: web.Application) -> None:
    app.router.add_get("/", _index)
    app.router.add_get("/console/{file}", _asset)
