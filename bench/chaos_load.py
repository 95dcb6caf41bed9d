"""The chaos suite's clients: confirmed publishers and acking consumers, one of each per node.

Every message carries (publisher id, sequence) in its body and ``message_id``
``<publisher>-<seq>``; publishers record which sequences were confirmed (a
basic.ack, never a nack or a broken connection), consumers record every
delivery with its redelivered flag, the consumer instance (a fresh id per
connection) and the node it is connected to. Clients reconnect to their own
node after any error, with a bounded wait, until ``stop`` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field

import aio_pika
from aio_pika.abc import AbstractIncomingMessage

PUBLISH_TIMEOUT = 10.0  # a publish to a SIGSTOPped node never confirms: give up on it and reconnect
CONNECT_TIMEOUT = 5.0
RETRY_PAUSE = 0.5


@dataclass(frozen=True)
class Delivery:
    at: float  # time.time()
    consumer: str  # consumer instance: node id + connection number
    node: str  # the node the consumer is connected to
    queue: str
    publisher: str
    seq: int
    message_id: str
    redelivered: bool


@dataclass
class Record:
    """What the clients saw; appended to from the event loop only."""

    published: dict[str, int] = field(default_factory=dict)  # publisher -> publishes attempted
    confirmed: dict[tuple[str, int], tuple[str, float]] = field(default_factory=dict)  # (pub, seq) -> (queue, t)
    nacked: int = 0
    failed: int = 0  # publishes lost to a broken connection or a timeout (unconfirmed, may still arrive)
    deliveries: list[Delivery] = field(default_factory=list)
    client_errors: dict[str, int] = field(default_factory=dict)  # exception type -> count

    def error(self, exc: BaseException) -> None:
        kind = type(exc).__name__
        self.client_errors[kind] = self.client_errors.get(kind, 0) + 1


class Load:
    """Publishers and consumers for every node; ``url_of(node)`` gives a node's current AMQP URL."""

    def __init__(self, nodes: list[str], queues: list[str], url_of: object, rate: float, window: int = 20) -> None:
        self.nodes = nodes
        self.queues = queues
        self.url_of = url_of
        self.rate = rate  # messages per second per publisher
        self.window = window
        self.record = Record()
        self.stop = asyncio.Event()
        self.stop_publishing = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def _url(self, node: str) -> str:
        url = self.url_of(node)  # type: ignore[operator]
        return f"{url}?heartbeat=5&connection_timeout={CONNECT_TIMEOUT}"

    def start(self) -> None:
        for node in self.nodes:
            self._tasks.append(asyncio.ensure_future(self._publisher(node)))
            self._tasks.append(asyncio.ensure_future(self._consumer(node)))

    async def close(self) -> None:
        self.stop_publishing.set()
        self.stop.set()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t

    # -- publishers ------------------------------------------------------------------------
    async def _publisher(self, node: str) -> None:
        pub = f"p-{node}"
        seq = 0
        rec = self.record
        while not self.stop_publishing.is_set():
            conn = None
            try:
                conn = await asyncio.wait_for(aio_pika.connect(self._url(node)), CONNECT_TIMEOUT)
                channel = await conn.channel(publisher_confirms=True)
                window = asyncio.Semaphore(self.window)
                broken = asyncio.Event()
                pending: set[asyncio.Task[None]] = set()
                interval = 1.0 / self.rate
                next_at = time.monotonic()
                while not self.stop_publishing.is_set() and not broken.is_set():
                    await window.acquire()
                    seq += 1
                    queue = self.queues[seq % len(self.queues)]
                    rec.published[pub] = rec.published.get(pub, 0) + 1
                    t = asyncio.ensure_future(self._publish_one(channel, pub, seq, queue, window, broken))
                    pending.add(t)
                    t.add_done_callback(pending.discard)
                    next_at += interval
                    delay = next_at - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    else:
                        next_at = time.monotonic()
                if pending:
                    await asyncio.wait(pending, timeout=PUBLISH_TIMEOUT + 1)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any client failure: count it, reconnect
                rec.error(exc)
            finally:
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(conn.close(), 2.0)
            if not self.stop_publishing.is_set():
                await asyncio.sleep(RETRY_PAUSE)

    async def _publish_one(
        self, channel: aio_pika.abc.AbstractChannel, pub: str, seq: int, queue: str,
        window: asyncio.Semaphore, broken: asyncio.Event,
    ) -> None:  # fmt: skip
        rec = self.record
        body = json.dumps({"p": pub, "s": seq, "q": queue}).encode()
        msg = aio_pika.Message(body, message_id=f"{pub}-{seq}", delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
        try:
            await asyncio.wait_for(channel.default_exchange.publish(msg, routing_key=queue), PUBLISH_TIMEOUT)
            rec.confirmed[(pub, seq)] = (queue, time.time())
        except aio_pika.exceptions.DeliveryError:
            rec.nacked += 1
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            rec.failed += 1
            rec.error(exc)
            broken.set()
        finally:
            window.release()

    # -- consumers -------------------------------------------------------------------------
    async def _consumer(self, node: str) -> None:
        instance = 0
        rec = self.record
        while not self.stop.is_set():
            instance += 1
            consumer = f"c-{node}#{instance}"
            conn = None
            try:
                conn = await asyncio.wait_for(aio_pika.connect(self._url(node)), CONNECT_TIMEOUT)
                channel = await conn.channel()
                await channel.set_qos(prefetch_count=50)

                async def on_message(message: AbstractIncomingMessage, consumer: str = consumer) -> None:
                    body = json.loads(message.body)
                    rec.deliveries.append(Delivery(
                        time.time(), consumer, node, body["q"], body["p"], int(body["s"]),
                        message.message_id or "", bool(message.redelivered),
                    ))  # fmt: skip
                    await message.ack()

                for name in self.queues:
                    queue = await channel.get_queue(name, ensure=False)
                    await queue.consume(on_message)
                while not self.stop.is_set() and not conn.is_closed and not channel.is_closed:
                    await asyncio.sleep(0.5)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                rec.error(exc)
            finally:
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(conn.close(), 2.0)
            if not self.stop.is_set():
                await asyncio.sleep(RETRY_PAUSE)
