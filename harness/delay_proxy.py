"""A TCP proxy on 127.0.0.1 that adds a fixed delay each way: a slow (inter-region) link for tests.

Every chunk read from one side is written to the other ``delay`` seconds after
it arrived, in order, without holding back what follows (a queue per
direction, stamped at arrival): the link has latency, not a smaller
bandwidth. A round trip through it costs ``2 * delay`` more than direct.

The proxies run on one event loop in a daemon thread (``DelayLinks``), so a
synchronous test can use them; each proxy's target port may be given as a
function, read at each new connection, for a node whose port is only known
once it (re)starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from types import TracebackType

from harness.ports import free_port

CHUNK = 65536


class DelayProxy:
    """127.0.0.1:port -> 127.0.0.1:target(), ``delay`` seconds each way."""

    def __init__(self, target: int | Callable[[], int], delay: float) -> None:
        self.target = target if callable(target) else (lambda: target)
        self.delay = delay
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.transport.abort()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", self.target()), 5.0)
        except (OSError, TimeoutError):
            writer.transport.abort()  # the target is down: the client sees a refused/reset connection
            return
        self._writers |= {writer, up_writer}
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    with contextlib.suppress(OSError):
                        dst.write_eof()
                    return
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                dst.write(data)
                await dst.drain()

        sender = asyncio.get_running_loop().create_task(deliver())
        try:
            while True:
                data = await src.read(CHUNK)
                queue.put_nowait((time.monotonic() + self.delay, data))
                if not data:
                    break
            await sender
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            sender.cancel()
            dst.transport.abort()  # one side gone: the other goes too, as a broken link would


class DelayLinks:
    """The event loop (a daemon thread) that runs every DelayProxy of a test; a context manager."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.proxies: list[DelayProxy] = []
        self._thread = threading.Thread(target=self.loop.run_forever, name="delay-links", daemon=True)

    def __enter__(self) -> DelayLinks:
        self._thread.start()
        return self

    def __exit__(self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def add(self, target: int | Callable[[], int], delay: float) -> DelayProxy:
        """A started proxy to ``target`` (a port, or a function giving it) adding ``delay`` s each way."""
        proxy = DelayProxy(target, delay)
        asyncio.run_coroutine_threadsafe(proxy.start(), self.loop).result(10)
        self.proxies.append(proxy)
        return proxy

    def close(self) -> None:
        if not self._thread.is_alive():
            return

        async def stop() -> None:
            for p in self.proxies:
                await p.close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
