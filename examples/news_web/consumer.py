"""The news consumer page: the news of the topics it subscribed to, live, and a comment box for each item.

    python -m examples.news_web.consumer --grpc 127.0.0.1:50051 --port 8082 --topics sports,tech

At start it creates one channel per topic on the queue ``news-web`` (a channel
sees every message pushed after it was created whose topic matches; a topic
may be an AMQP pattern such as ``sport*`` or ``#``). Each item arrives on the
page by server-sent events, without a reload. A comment is pushed to the queue
``news-web-comments``, where the pusher page reads it.
"""

from __future__ import annotations

import argparse
import json
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

MAX_COMMENT = 1000


async def comment(request: web.Request) -> web.Response:
    data = await request.json() if request.content_type == "application/json" else dict(await request.post())
    text = str(data.get("comment", "")).strip()
    news_id, headline = str(data.get("news_id", "")), str(data.get("headline", ""))
    topic = str(data.get("topic", "")) or "unknown"
    if not text or len(text) > MAX_COMMENT or not news_id:
        return web.json_response({"error": f"a comment of 1-{MAX_COMMENT} characters on a news item is needed"},
                                 status=400)
    item = {"news_id": news_id, "headline": headline[:200], "comment": text, "reader": request.app["reader"],
            "commented_at": time.time()}
    try:
        await request.app["client"].push(COMMENTS_QUEUE, json.dumps(item).encode(), topic=topic)
    except LeveretError as exc:
        return web.json_response({"error": f"the broker refused the comment: {exc}"}, status=502)
    return web.json_response({"ok": True})


async def config(request: web.Request) -> web.Response:
    return web.json_response({"topics": request.app["topics"], "reader": request.app["reader"]})


async def events(request: web.Request) -> web.StreamResponse:
    return await request.app["news"].stream(request)


async def _close(feed: Feed) -> None:
    feed.close()


def make_app(args: argparse.Namespace) -> web.Application:
    app = web.Application()
    app["page"] = "consumer.html"
    app["news"] = Feed()
    app["topics"] = [t.strip() for t in args.topics.split(",") if t.strip()]
    app["reader"] = args.reader

    async def connect(app: web.Application) -> AsyncIterator[None]:
        client = AsyncClient(args.grpc, username=args.username, password=args.password)
        app["client"] = client
        await ensure_queue(client, NEWS_QUEUE)
        await ensure_queue(client, COMMENTS_QUEUE)
        async with follow(client, NEWS_QUEUE, app["topics"], app["news"]):
            yield
        await client.close()

    app.cleanup_ctx.append(connect)
    app.on_shutdown.append(lambda app: _close(app["news"]))
    app.router.add_get("/", page)
    app.router.add_get("/config", config)
    app.router.add_post("/comment", comment)
    app.router.add_get("/events", events)
    return app


def main(argv: list[str] | None = None) -> None:
    def extra(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--topics", default="sports,tech",
                            help="comma-separated topics (or AMQP patterns) to follow (default %(default)s)")
        parser.add_argument("--reader", default="reader", help="the name shown with this page's comments")

    args = parse_args("News consumer page", 8082, extra, argv)
    if not [t for t in args.topics.split(",") if t.strip()]:
        raise SystemExit("--topics: at least one topic")
    serve(make_app(args), args, "news consumer")


if __name__ == "__main__":
    main()
