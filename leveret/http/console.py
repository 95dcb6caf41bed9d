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
# The console is never framed (clickjacking) and its page runs only its own script and style files:
# no inline script or style, no other origin; blob: for the retention chart it fetches with credentials.
SECURITY_HEADERS = {
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' blob:; "
                                "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
                                "frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
}


async def _index(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(STATIC / "index.html", headers={"Content-Type": "text/html; charset=utf-8",
                                                            "Cache-Control": "no-cache", **SECURITY_HEADERS})


async def _asset(request: web.Request) -> web.StreamResponse:
    name = request.match_info["file"]
    if name not in FILES:
        raise web.HTTPNotFound()
    return web.FileResponse(STATIC / name, headers={"Content-Type": FILES[name], "Cache-Control": "no-cache",
                                                    **SECURITY_HEADERS})


def register(app: web.Application) -> None:
    app.router.add_get("/", _index)
    app.router.add_get("/console/{file}", _asset)
