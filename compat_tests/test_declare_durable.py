"""Durable declarations are stored before they are answered (a real node process, SQLite).

Before the single-node coordinator (coordination/local.py), ``declare-ok``
went out before the topology write committed, and those writes trailed at
about 800 a second: 300 durable queues declared with pika and a kill -9 right
after the last ``declare-ok`` left 57 after the restart, and 50,000 declared
then SIGTERM left 10,038 (shutdown gave up on pending writes after 10 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest
from pamqp import commands, frame
from pamqp.heartbeat import Heartbeat

from harness.node import NodeProcess

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[NodeProcess]:
    n = NodeProcess(tmp_path / "data", tmp_path / "logs")
    try:
        yield n
    finally:
        n.cleanup()


@contextlib.contextmanager
def channel(node: NodeProcess) -> Iterator[Any]:
    params = pika.URLParameters(node.url)
    params.socket_timeout = 15
    conn = pika.BlockingConnection(params)
    try:
        yield conn.channel()
    finally:
        if conn.is_open:
            with contextlib.suppress(pika.exceptions.AMQPError):
                conn.close()


def test_every_answered_declaration_survives_kill_9(node: NodeProcess) -> None:
    """Exchanges, queues and bindings declared one after another; kill -9 right after the last answer."""
    node.start()
    tag = uuid.uuid4().hex[:8]
    exchanges = [f"x.{tag}.{i}" for i in range(30)]
    queues = [f"q.{tag}.{i}" for i in range(300)]
    with channel(node) as ch:
        for i, x in enumerate(exchanges):
            ch.exchange_declare(x, "topic" if i % 2 else "direct", durable=True)
        for i in range(1, len(exchanges)):  # exchange-to-exchange: x.i -> x.0
            ch.exchange_bind(destination=exchanges[0], source=exchanges[i], routing_key="#" if i % 2 else "e2e")
        for i, q in enumerate(queues):
            ch.queue_declare(q, durable=True)
            ch.queue_bind(q, exchanges[i % len(exchanges)], routing_key=f"rk.{i}")
        node.kill()  # right after the last bind-ok
    node.start()
    with channel(node) as ch:
        for x in exchanges:
            ch.exchange_declare(x, passive=True)
        for q in queues:
            ch.queue_declare(q, passive=True)
        # Every binding routes: a mandatory publish would come back (UnroutableError) without it.
        ch.confirm_delivery()
        for i in range(len(queues)):
            ch.basic_publish(exchanges[i % len(exchanges)], f"rk.{i}", b"probe", mandatory=True)
        counts = {q: ch.queue_declare(q, passive=True).method.message_count for q in queues}
        # The exchange-to-exchange bindings: "e2e" sent to every x.i (i >= 1) reaches x.0 through its
        # binding ("#" on the topic ones, "e2e" on the direct ones), and x.0 (direct) hands it to the probe.
        probe = f"probe.{tag}"
        ch.queue_declare(probe, exclusive=True)
        ch.queue_bind(probe, exchanges[0], routing_key="e2e")
        for i in range(1, len(exchanges)):
            ch.basic_publish(exchanges[i], "e2e", b"via", mandatory=True)
        via = ch.queue_declare(probe, passive=True).method.message_count
    assert all(n >= 1 for n in counts.values()), [q for q, n in counts.items() if n < 1]
    assert via == len(exchanges) - 1


# -- 50,000 durable queues, pipelined over a few raw connections -----------------------------------
class Declarer:
    """One raw AMQP connection that pipelines queue.declare and counts the answers."""

    def __init__(self) -> None:
        self._buf = bytearray()

    async def open(self, port: int) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", port)
        self.writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.writer.write(b"AMQP\x00\x00\x09\x01")
        await self._expect(commands.Connection.Start)
        self.writer.write(frame.marshal(commands.Connection.StartOk(
            client_properties={"product": "leveret-declare-tests"}, mechanism="PLAIN",
            response="\0guest\0guest"), 0))  # fmt: skip
        tune = await self._expect(commands.Connection.Tune)
        self.writer.write(frame.marshal(commands.Connection.TuneOk(channel_max=tune.channel_max,
                                                                  frame_max=tune.frame_max, heartbeat=0), 0))
        self.writer.write(frame.marshal(commands.Connection.Open(virtual_host="/"), 0))
        await self._expect(commands.Connection.OpenOk)
        self.writer.write(frame.marshal(commands.Channel.Open(), 1))
        await self._expect(commands.Channel.OpenOk)

    async def _read(self) -> Any:
        while True:
            if len(self._buf) >= 8:
                (size,) = struct.unpack_from(">I", self._buf, 3)
                if len(self._buf) >= size + 8:
                    raw = bytes(self._buf[: size + 8])
                    del self._buf[: size + 8]
                    return frame.unmarshal(raw)[2]
            data = await self.reader.read(1 << 16)
            if not data:
                raise ConnectionError("the node closed the connection")
            self._buf += data

    async def _expect(self, kind: type[Any]) -> Any:
        while True:
            value = await asyncio.wait_for(self._read(), 30)
            if not isinstance(value, Heartbeat):
                assert isinstance(value, kind), value
                return value

    async def declare(self, names: list[str], passive: bool = False) -> int:
        """Send every declare at once, then read the answers; the number of declare-oks."""
        self.writer.write(b"".join(
            frame.marshal(commands.Queue.Declare(queue=n, durable=True, passive=passive), 1) for n in names))
        for n in names:
            ok = await self._expect(commands.Queue.DeclareOk)
            assert ok.queue == n
        return len(names)

    def close(self) -> None:
        self.writer.close()


async def _declare_all(port: int, names: list[str], connections: int, passive: bool = False) -> float:
    declarers = [Declarer() for _ in range(connections)]
    await asyncio.gather(*(d.open(port) for d in declarers))
    started = time.monotonic()
    done = await asyncio.gather(*(d.declare(names[i::connections], passive) for i, d in enumerate(declarers)))
    elapsed = time.monotonic() - started
    for d in declarers:
        d.close()
    assert sum(done) == len(names)
    return elapsed


def test_fifty_thousand_durable_queues_survive_sigterm(node: NodeProcess) -> None:
    """Grouped topology writes: 50,000 declarations take seconds; SIGTERM drops none of them."""
    node.start()
    names = [f"many.{i:05d}" for i in range(50_000)]
    elapsed = asyncio.run(_declare_all(node.amqp_port, names, connections=50))
    print(f"\n50,000 durable queue declarations over 50 connections: {elapsed:.1f} s "
          f"({len(names) / elapsed:,.0f}/s)")
    assert node.terminate() == 0, node.stderr_tail()
    started = time.monotonic()
    node.start()
    restart = time.monotonic() - started
    # Passive: a 404 closes the channel, so a missing queue fails the read above.
    asyncio.run(_declare_all(node.amqp_port, names, connections=10, passive=True))
    print(f"restart with 50,000 durable queues: {restart:.1f} s")
