"""A fault-injecting TCP proxy on loopback, for the chaos suite (bench/chaos.py).

Nodes reach etcd, Postgres and each other's cluster port through these proxies,
so the suite can cut a node off without root or network namespaces:

* ``blackhole``: bytes stop flowing both ways on the matching connections (they
  are held, not dropped: as TCP retransmits across a short partition, they go
  through once healed); new matching connections are accepted and held too.
* ``reset``: matching connections are closed and new ones closed at once (a
  server that is down or refuses).

A cut applies to every connection, or only to those opened by given process
ids (a node's own pid): on loopback every client is 127.0.0.1, so the proxy
finds the process behind a connection from /proc (its source port -> socket
inode -> the pid holding that inode). This is Linux only, as the suite is.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass, field

from harness.ports import free_port

CHUNK = 65536


def _socket_inode(src_port: int, dst_port: int) -> int | None:
    """The inode of the loopback socket bound to src_port and connected to dst_port."""
    want_local, want_remote = f":{src_port:04X}", f":{dst_port:04X}"
    with contextlib.suppress(OSError), open("/proc/net/tcp") as f:
        next(f, None)
        for line in f:
            parts = line.split()
            if len(parts) > 9 and parts[1].endswith(want_local) and parts[2].endswith(want_remote):
                return int(parts[9])
    return None


def owner_pid(src_port: int, dst_port: int, candidates: set[int]) -> int | None:
    """Which of ``candidates`` holds the client end of a connection from src_port to dst_port."""
    inode = _socket_inode(src_port, dst_port)
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    for pid in candidates:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                        return pid
    return None


@dataclass(eq=False)  # identity hash: connections live in a set
class _Conn:
    pid: int | None
    writers: list[asyncio.StreamWriter] = field(default_factory=list)


class Proxy:
    """127.0.0.1:port -> 127.0.0.1:target_port, with cuts. Runs on one event loop; control it from that loop
    (or through ``loop.call_soon_threadsafe``)."""

    def __init__(self, name: str, target_port: int, known_pids: set[int] | None = None) -> None:
        self.name = name
        self.target_port = target_port
        self.port = free_port()
        # Pids the proxy may attribute connections to (the nodes); None: no attribution needed.
        self.known_pids = known_pids
        self.mode = "up"
        self.cut_pids: set[int] | None = None  # None: every connection
        self._healed = asyncio.Event()
        self._healed.set()
        self._conns: set[_Conn] = set()
        self._server: asyncio.Server | None = None
        self.accepted = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.heal()
        for conn in list(self._conns):
            self._drop(conn)

    def _matches(self, conn: _Conn) -> bool:
        return self.mode != "up" and (self.cut_pids is None or conn.pid in self.cut_pids)

    def cut(self, mode: str, pids: set[int] | None = None) -> None:
        """Start a fault: ``blackhole`` or ``reset``, on every connection or those of ``pids``."""
        assert mode in ("blackhole", "reset"), mode
        self.mode, self.cut_pids = mode, pids
        self._healed.clear()
        if mode == "reset":
            for conn in [c for c in self._conns if self._matches(c)]:
                self._drop(conn)

    def heal(self) -> None:
        self.mode, self.cut_pids = "up", None
        self._healed.set()

    def _drop(self, conn: _Conn) -> None:
        for w in conn.writers:
            with contextlib.suppress(Exception):
                w.transport.abort()
        self._conns.discard(conn)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        pid = None
        if self.known_pids:
            peer = writer.get_extra_info("peername")
            pid = owner_pid(int(peer[1]), self.port, self.known_pids) if peer else None
        conn = _Conn(pid, [writer])
        self._conns.add(conn)
        try:
            while self._matches(conn):
                if self.mode == "reset":
                    return
                await self._wait_healed()
            try:
                up_reader, up_writer = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", self.target_port), 5.0
                )
            except (TimeoutError, OSError):
                return
            conn.writers.append(up_writer)
            await asyncio.gather(self._pipe(conn, reader, up_writer), self._pipe(conn, up_reader, writer))
        finally:
            self._drop(conn)

    async def _wait_healed(self) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._healed.wait(), 0.5)

    async def _pipe(self, conn: _Conn, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await src.read(CHUNK)
                if not data:
                    break
                while self._matches(conn):  # blackhole: hold the bytes until healed (reset drops conn)
                    await self._wait_healed()
                    if conn not in self._conns:
                        return
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._drop(conn)
