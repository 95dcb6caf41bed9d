"""A short run of the chaos suite (bench/chaos.py) and its fault-injecting proxy.

The full run (``python -m bench.chaos --cycles 100``) is not part of the test
suite; this smoke run is: three nodes, real etcd and Postgres, one kill -9 and
one SIGSTOP past the lease under confirmed load, and zero violations.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from bench import chaos
from bench.chaos_proxy import Proxy, owner_pid
from harness.etcd import skip_or_fail_without_etcd


def test_chaos_smoke_kill_and_stop() -> None:
    skip_or_fail_without_etcd()
    args = chaos.parse(["--cycles", "2", "--faults", "kill,stop", "--round-robin", "--seed", "7",
                        "--duration-per-cycle", "3", "--rate", "30"])
    result, text = chaos.run(args)
    assert result.total == 0, text
    assert "| kill | 1 |" in text and "| stop | 1 |" in text, text
    assert result.figures["confirmed"] > 100, text
    assert result.figures["serving_spans"] >= 6, text  # the checker saw the queues' owners in the logs


async def _echo_server() -> tuple[asyncio.Server, int]:
    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(100):
            w.write(data)
            await w.drain()
        w.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _roundtrip(r: asyncio.StreamReader, w: asyncio.StreamWriter, data: bytes, timeout: float) -> bytes:
    w.write(data)
    await w.drain()
    return await asyncio.wait_for(r.readexactly(len(data)), timeout)


@pytest.mark.asyncio
async def test_proxy_blackhole_holds_bytes_until_healed_and_reset_closes() -> None:
    server, port = await _echo_server()
    proxy = Proxy("test", port, {os.getpid()})
    await proxy.start()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await _roundtrip(r, w, b"one", 5) == b"one"
        proxy.cut("blackhole", {os.getpid() + 10_000_000})  # another process's connections: ours flow
        assert await _roundtrip(r, w, b"two", 5) == b"two"
        proxy.cut("blackhole", {os.getpid()})
        with pytest.raises(asyncio.TimeoutError):
            await _roundtrip(r, w, b"three", 1.0)
        proxy.heal()
        assert await asyncio.wait_for(r.readexactly(5), 5) == b"three"  # held, then delivered
        proxy.cut("reset")
        assert await asyncio.wait_for(r.read(10), 5) == b""  # closed
        r2, _w2 = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await asyncio.wait_for(r2.read(10), 5) == b""  # new connections refused too
    finally:
        await proxy.close()
        server.close()


@pytest.mark.asyncio
async def test_owner_pid_finds_the_process_behind_a_loopback_connection() -> None:
    server, port = await _echo_server()
    try:
        _r, w = await asyncio.open_connection("127.0.0.1", port)
        src = w.get_extra_info("sockname")[1]
        assert owner_pid(src, port, {os.getpid()}) == os.getpid()
        assert owner_pid(src, port, {1}) is None
        w.close()
        await w.wait_closed()
        await asyncio.sleep(0.1)  # the echo handler sees the close and ends
    finally:
        server.close()
