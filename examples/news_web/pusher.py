"""The news pusher page: a form that pushes a headline to the news queue, and the readers' comments, live.

    python -m examples.news_web.pusher --grpc 127.0.0.1:50051 --port 8081

Each headline is pushed over gRPC (``leveret_client``) to the queue
``news-web`` with its topic (``sports``, ``tech``, ...) as the message's topic;
consumer pages see the topics they subscribed to. Comments come back on the
queue ``news-web-comments`` and appear under "Comments" without a reload.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import AsyncIterator

from aiohttp import web

from examples.news_web.common import (
    COMMENTS_QUEUE,
    NEWS_QUEUE,
    Feed,
    ensure_queue,
    follow,
    page,
    parse_args,
    serve,
)
from leveret_client import AsyncClient, LeveretError

TOPIC = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
MAX_HEADLINE, MAX_BODY = 200, 5000


async def push(request: web.Request) -> web.Response:
    data = await request.json() if request.content_type == "application/json" else dict(await request.post())
    topic = str(data.get("topic", "")).strip().lower()
    headline = str(data.get("headline", "")).strip()
    body = str(data.get("body", "")).strip()
    if not TOPIC.match(topic):
        return web.json_response({"error": "topic: lower-case letters, digits, - or _ (e.g. sports)"}, status=400)
    if not headline or len(headline) > MAX_HEADLINE or len(body) > MAX_BODY:
        return web.json_response({"error": f"a headline of 1-{MAX_HEADLINE} characters and a body of at most "
                                           f"{MAX_BODY} are needed"}, status=400)
    item = {"headline": headline, "body": body, "pushed_at": time.time()}
    try:
        message_id = await request.app["client"].push(NEWS_QUEUE, json.dumps(item).encode(), topic=topic)
    except LeveretError as exc:
        return web.json_response({"error": f"the broker refused the push: {exc}"}, status=502)
    return web.json_response({"id": message_id, "topic": topic})


async def events(request: web.Request) -> web.StreamResponse:
    return await request.app["comments"].stream(request)


async def _close(feed: Feed) -> None:
    feed.close()


def make_app(args: argparse.Namespace) -> web.Application:
    app = web.Application()
    app["page"] = "pusher.html"
    app["comments"] = Feed()

    async def connect(app: web.Application) -> AsyncIterator[None]:
        client = AsyncClient(args.grpc, username=args.username, password=args.password)
        app["client"] = client
        await ensure_queue(client, NEWS_QUEUE)
        await ensure_queue(client, COMMENTS_QUEUE)
        async with follow(client, COMMENTS_QUEUE, [""], app["comments"]):
            yield
        await client.close()

    app.cleanup_ctx.append(connect)
    app.on_shutdown.append(lambda app: _close(app["comments"]))
    app.router.add_get("/", page)
    app.router.add_post("/push", push)
    app.router.add_get("/events", events)
    return app


def main(argv: list[str] | None = None) -> None:
    args = parse_args("News pusher page", 8081, argv=argv)
    serve(make_app(args), args, "news pusher")


if __name__ == "__main__":
    main()
