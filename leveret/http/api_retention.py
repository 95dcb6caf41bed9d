"""The last retention run's report and chart, for the console (Leveret's own API, under /api/leveret/).

A scheduled run (leveret/node/retention_schedule.py) writes
``<data-dir>/retention/last-report.json`` and the chart beside it
(``last-report.png``, spark/report_chart.py); these handlers serve them as
they are. No report yet is an empty answer, not an error: a node with no
retention schedule never has one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from leveret.http.errors import not_found

if TYPE_CHECKING:
    from leveret.http.routing import Router
    from leveret.http.server import Call

# A report lists every queue; a file larger than this is not one the job wrote.
MAX_REPORT_BYTES = 16 * 1024 * 1024


def register(r: Router) -> None:
    r.add("leveret/retention", GET=(last_report, "monitoring"))
    r.add("leveret/retention/chart.png", GET=(last_chart, "monitoring"))


def _report_path(call: Call) -> Path:
    return Path(call.node.config.data_dir) / "retention" / "last-report.json"


async def last_report(call: Call) -> dict[str, Any]:
    path = _report_path(call)
    try:
        if path.stat().st_size > MAX_REPORT_BYTES:
            raise not_found(f"{path} is larger than a retention report can be")
        report = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {"report": None, "chart": False}
    except (OSError, ValueError) as exc:
        raise not_found(f"the last retention report cannot be read: {exc}") from None
    return {"report": report, "chart": path.with_suffix(".png").is_file()}


async def last_chart(call: Call) -> web.Response:
    try:
        data = _report_path(call).with_suffix(".png").read_bytes()
    except OSError:
        raise not_found("no retention chart yet: no scheduled run has finished on this node") from None
    return web.Response(body=data, content_type="image/png", headers={"Cache-Control": "no-store"})
