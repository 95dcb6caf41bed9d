"""Producer and consumer processes for the throughput scenarios.

The client runs as separate processes so publishing and consuming each get
their own interpreter (and, CPU permitting, their own core).  The protocol
with the parent over a ``Pipe``: child sends ``("ready", None)`` once set
up, parent replies ``("go", start_at, end_at)`` in ``time.monotonic()``
seconds (system-wide on Linux), child sends ``("done", info)`` or
``("error", text)``.  Consumers publish progress in a shared array so the
producer can pace itself and the parent can sample delivered counts at
exact instants.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection as Pipe
from typing import Any

from bench import loop
from bench.codec import encode_publish
from bench.connection import Connection
from bench.ops import confirm_select, consume, open_channel, qos
from bench.target import BrokerUrl

# How often consumers publish their delivered counts to shared memory.
PROGRESS_INTERVAL = 0.001


@dataclass(frozen=True)
class PublishSpec:
    url: BrokerUrl
    exchange: str
    # Cycled in order; reach[i] lists the queue indexes routing_keys[i] is delivered to.
    routing_keys: tuple[str, ...]
    reach: tuple[tuple[int, ...], ...]
    body_size: int
    delivery_mode: int | None
    batch: int  # messages per socket write
    max_backlog: int  # per queue: published-but-not-yet-delivered cap; 0: unpaced (the flood scenarios)
    confirm_window: int  # 0: no publisher confirms
    published_counter: int = -1  # >= 0: publish the count written so far in counters[published_counter]


@dataclass(frozen=True)
class ConsumeSpec:
    url: BrokerUrl
    queues: tuple[str, ...]
    first_counter: int  # this process owns counters[first_counter : first_counter + len(queues)]
    prefetch: int
    ack_every: int  # 0: no-ack consumer
    read_interval: float = 0.002  # see Connection.read_interval


Counters = Any  # multiprocessing RawArray('q'); untyped in typeshed


def _sleep_until(deadline: float) -> Awaitable[None]:
    return asyncio.sleep(max(0.0, deadline - time.monotonic()))


async def _await_go(pipe: Pipe) -> tuple[float, float]:
    pipe.send(("ready", None))
    msg = await asyncio.get_running_loop().run_in_executor(None, pipe.recv)
    if msg[0] != "go":
        raise RuntimeError(f"parent aborted: {msg!r}")
    return float(msg[1]), float(msg[2])


def _run_child(body: Callable[[], Awaitable[dict[str, Any]]], pipe: Pipe) -> None:
    try:
        info = loop.run(_as_coro(body))
    except BaseException as exc:  # report everything: the parent shows it as the scenario error
        pipe.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"))
    else:
        pipe.send(("done", info))
    finally:
        pipe.close()


async def _as_coro(body: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    return await body()


def producer_main(spec: PublishSpec, counters: Counters, pipe: Pipe) -> None:
    _run_child(lambda: _produce(spec, counters, pipe), pipe)


def consumer_main(spec: ConsumeSpec, counters: Counters, pipe: Pipe) -> None:
    _run_child(lambda: _consume(spec, counters, pipe), pipe)


async def _produce(spec: PublishSpec, counters: Counters, pipe: Pipe) -> dict[str, Any]:
    conn = await Connection.open(spec.url)
    ch = await open_channel(conn)
    if spec.confirm_window:
        await confirm_select(conn, ch)
    body = bytes(i & 0xFF for i in range(spec.body_size))
    one_cycle = b"".join(
        encode_publish(ch, spec.exchange, key, body, delivery_mode=spec.delivery_mode, frame_max=conn.frame_max)
        for key in spec.routing_keys
    )
    # A block is whole cycles of the routing keys, so per-queue expected
    # deliveries per block are fixed and pacing needs no per-message work.
    reps = max(1, spec.batch // len(spec.routing_keys))
    block = one_cycle * reps
    per_block = len(spec.routing_keys) * reps
    queue_ids = sorted({q for reach in spec.reach for q in reach})
    expect_per_block = {q: reps * sum(q in reach for reach in spec.reach) for q in queue_ids}
    expected = dict.fromkeys(queue_ids, 0)
    start_at, end_at = await _await_go(pipe)
    await _sleep_until(start_at)

    published = 0
    backlog_waits = 0
    confirms = conn.scanner.confirms
    while time.monotonic() < end_at:
        if spec.max_backlog and any(expected[q] - counters[q] > spec.max_backlog for q in queue_ids):
            backlog_waits += 1
            await asyncio.sleep(PROGRESS_INTERVAL)
            continue
        if spec.confirm_window and published + per_block - confirms.confirmed > spec.confirm_window:
            try:
                await conn.wait_confirmed(
                    published + per_block - spec.confirm_window, timeout=max(0.001, end_at - time.monotonic())
                )
            except TimeoutError:
                break
            continue
        conn.write(block)
        published += per_block
        for q in queue_ids:
            expected[q] += expect_per_block[q]
        if spec.published_counter >= 0:
            counters[spec.published_counter] = published
        await conn.drain()
        # Yield every block so acks/confirms/closes from the broker get read.
        await asyncio.sleep(0)
    info = {
        "published": published,
        "confirmed": confirms.confirmed,
        "nacked": confirms.nacked,
        "backlog_waits": backlog_waits,
        "expected_per_queue": [expected.get(q, 0) for q in range(len(counters))],
    }
    await conn.close()
    return info


async def _consume(spec: ConsumeSpec, counters: Counters, pipe: Pipe) -> dict[str, Any]:
    conns: list[Connection] = []
    try:
        for queue in spec.queues:
            conn = await Connection.open(spec.url)
            conns.append(conn)
            conn.read_interval = spec.read_interval
            ch = await open_channel(conn)
            await qos(conn, ch, spec.prefetch)
            await consume(conn, ch, queue, ack_every=spec.ack_every)
        _, end_at = await _await_go(pipe)
        first = spec.first_counter
        while time.monotonic() < end_at:
            for i, conn in enumerate(conns):
                if conn.error is not None:
                    raise conn.error
                counters[first + i] = conn.scanner.deliveries
            await asyncio.sleep(PROGRESS_INTERVAL)
        return {"delivered": [c.scanner.deliveries for c in conns]}
    finally:
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)
