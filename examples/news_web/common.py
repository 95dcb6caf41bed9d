"""What both pages share: options, the gRPC client, a live feed (server-sent events) fed by a subscription.

Each page is an aiohttp program. It holds one ``leveret_client.AsyncClient``;
what a subscription delivers is acked, remembered (the last ``HISTORY`` items,
so a page opened later sees them) and sent to every open ``/events`` stream
as a server-sent event. The browser side is ``EventSource``, which reconnects
by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from leveret_client import AsyncClient, AsyncSubscriber, LeveretError, Message

NEWS_QUEUE = "news-web"
COMMENTS_QUEUE = "news-web-comments"
HISTORY = 50
STATIC = Path(__file__).resolve().parent / "static"
# The default channel of each queue keeps every message until someone consumes it
# (docs/GRPC.md); these pages read only filtered channels, so the queues are capped.
QUEUE_MAX_LENGTH = 1000

log = logging.getLogger("news_web")


def parse_args(description: str, port: int, extra: Callable[[argparse.ArgumentParser], None] | None = None,
               argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--grpc", default=os.environ.get("LEVERET_GRPC", "127.0.0.1:50051"),
                        help="Leveret's gRPC address (env LEVERET_GRPC; default %(default)s)")
    parser.add_argument("--username", default="guest")
    parser.add_argument("--password", default="guest")
    parser.add_argument("--host", default="127.0.0.1", help="address the page is served on (default %(default)s)")
    parser.add_argument("--port", type=int, default=port, help="HTTP port of the page (default %(default)s)")
    if extra is not None:
        extra(parser)
    return parser.parse_args(argv)


class Feed:
    """Items from one subscription, remembered and pushed to every open event stream."""

    def __init__(self) -> None:
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self.listeners: set[asyncio.Queue[dict[str, Any]]] = set()

    def close(self) -> None:
        """Shutdown: every open stream ends (else aiohttp waits for them)."""
        for q in self.listeners:
            q.put_nowait({})

    def publish(self, item: dict[str, Any]) -> None:
        self.history.append(item)
        for q in self.listeners:
            q.put_nowait(item)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """``GET /events``: the history, then each new item, as server-sent events."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.listeners.add(q)
        try:
            for item in list(self.history):
                await resp.write(_event(item))
            while True:
                try:
                    item = await asyncio.wait_for(q.get(), 15)
                except TimeoutError:
                    await resp.write(b": keep-alive\n\n")  # proxies close idle streams
                    continue
                if not item:
                    break  # closing
                await resp.write(_event(item))
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.listeners.discard(q)
        return resp


def _event(item: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(item)}\n\n".encode()


async def ensure_queue(client: AsyncClient, name: str) -> None:
    await client.create_queue(name, exist_ok=True, max_length=QUEUE_MAX_LENGTH)


@contextlib.asynccontextmanager
async def follow(client: AsyncClient, queue: str, topics: list[str], feed: Feed) -> AsyncIterator[None]:
    """Subscribe a new channel per topic filter; each message is decoded (JSON), acked and fed to ``feed``."""
    channels = [await client.create_channel(queue, topic=topic) for topic in topics]
    subs: list[AsyncSubscriber] = [await client.subscribe(ch, prefetch=100) for ch in channels]

    async def read(sub: AsyncSubscriber) -> None:
        async for message in sub:
            item = decode(message)
            if item is not None:
                feed.publish(item)
            await sub.ack(message)

    tasks = [asyncio.get_running_loop().create_task(read(s)) for s in subs]
    try:
        yield
    finally:
        for t in tasks:
            t.cancel()
        for s in subs:
            await s.close()
        for ch in channels:
            with contextlib.suppress(LeveretError):
                await client.delete_channel(ch)


def decode(message: Message) -> dict[str, Any] | None:
    try:
        item = json.loads(message.content)
    except ValueError:
        log.warning("not JSON, skipped: %r", message.content[:80])
        return None
    if not isinstance(item, dict):
        return None
    item["topic"] = message.topic
    item["id"] = message.id
    return item


async def page(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / request.app["page"])


def serve(app: web.Application, args: argparse.Namespace, what: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    app.router.add_static("/static/", STATIC)
    print(f"{what} on http://{args.host}:{args.port}/ (Leveret gRPC at {args.grpc})", flush=True)
    # The event streams end at shutdown (Feed.close); what is left gets 2 s, not aiohttp's 60.
    web.run_app(app, host=args.host, port=args.port, print=None, shutdown_timeout=2)
