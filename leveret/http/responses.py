"""The few response shapes the management API answers with."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(data, separators=(",", ":")), status=status,
                        content_type="application/json")


def no_content() -> web.Response:
    return web.Response(status=204)


def created(existed: bool) -> web.Response:
    """RabbitMQ answers a PUT with 201 when it created the object, 204 when it was there."""
    return web.Response(status=204 if existed else 201)
