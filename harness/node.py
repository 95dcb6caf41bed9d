"""Helpers for the durability tests: a node as a child process, a restartable
PostgreSQL server, and a raw asyncio publisher that tracks publisher confirms.

The node is started with ``python -m leveret serve`` on fresh free ports each
time (so a restart after ``kill -9`` never races a port still in TIME_WAIT),
on the same data directory / DSN, with its stdout and stderr in log files.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pamqp import commands, frame
from pamqp.heartbeat import Heartbeat

from harness import pg
from harness.ports import free_port, free_ports

REPO_ROOT = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT = 30.0
STOP_TIMEOUT = 30.0



def _python() -> str:
    venv_python = REPO_ROOT / ".venv" / "bin" / "python"
    return str(venv_python) if venv_python.exists() else sys.executable


# Test nodes serve no Prometheus endpoint unless a test passes --prometheus-port:
# the default port (15692) would collide between nodes of tests run in parallel.
NO_METRICS = {"LEVERET_PROMETHEUS_PORT": "0"}
# Nor MQTT listeners (1883, 8883, 15675 by default; a RabbitMQ with its MQTT plugin may hold 1883)
# unless a test passes --mqtt-port (NodeProcess(mqtt=True)).
NO_MQTT = {"LEVERET_MQTT_PORT": "0", "LEVERET_MQTT_TLS_PORT": "0", "LEVERET_MQTT_WS_PORT": "0"}


def node_env() -> dict[str, str]:
    """The environment without LEVERET_* settings, so only the flags configure the node."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("LEVERET_")}, **NO_METRICS, **NO_MQTT}


def serve_command(amqp_port: int, grpc_port: int, data_dir: Path, store_args: Sequence[str],
                  management_port: int = 0, mqtt_port: int = 0) -> list[str]:
    """``leveret serve`` on these ports; the management API and MQTT only when given a port (never the
    defaults 15672 and 1883)."""
    return [
        _python(), "-m", "leveret", "serve",
        "--bind", "127.0.0.1",
        "--amqp-port", str(amqp_port),
        "--grpc-port", str(grpc_port),
        "--management-port", str(management_port),
        "--mqtt-port", str(mqtt_port),
        "--mqtt-tls-port", "0",
        "--mqtt-ws-port", "0",
        "--data-dir", str(data_dir),
        "--log-format", "json",
        *store_args,
    ]  # fmt: skip


class NodeProcess:
    """One Leveret node on a data directory (and store), started and stopped as a process."""

    def __init__(self, data_dir: Path, log_dir: Path, store_args: Sequence[str] = (), mqtt: bool = False) -> None:
        self.mqtt = mqtt
        self.mqtt_port = 0
        self.data_dir = data_dir
        self.log_dir = log_dir
        self.store_args = list(store_args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.amqp_port = 0
        self.grpc_port = 0
        self.management_port = 0
        self.starts = 0
        self.stderr_path = log_dir / "node-0.stderr"

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.amqp_port}/"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    name = "leveret node"
    extra_env: dict[str, str] = {}  # noqa: RUF012 - replaced, never mutated: what a subclass adds (libfaketime)

    def command(self) -> list[str]:
        return serve_command(self.amqp_port, self.grpc_port, self.data_dir, self.store_args, self.management_port,
                             self.mqtt_port)

    def spawn(self) -> None:
        """Start the process on fresh ports without waiting for it (see wait_ready)."""
        assert self.proc is None or self.proc.poll() is not None, f"{self.name} already running"
        self.starts += 1
        self.amqp_port, self.grpc_port, self.management_port = free_ports(3)
        if self.mqtt:
            self.mqtt_port = free_port()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.stderr_path = self.log_dir / f"node-{self.starts}.stderr"
        with open(self.log_dir / f"node-{self.starts}.stdout", "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                self.command(), cwd=REPO_ROOT, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                env={**node_env(), **self.extra_env},
            )

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> None:
        """Until the AMQP port (and the MQTT one, when it has one) accepts connections; AssertionError
        with the log when the node exits or stalls. The node opens its listeners one after another, so
        the AMQP port answering does not mean the MQTT one does yet."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        for port in (self.amqp_port, self.mqtt_port if self.mqtt else 0):
            while port:
                if self.proc.poll() is not None:
                    raise AssertionError(
                        f"{self.name} exited with {self.proc.returncode} during start-up:\n{self.stderr_tail()}"
                    )
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"{self.name} did not listen on {port} within {timeout:.0f}s:\n{self.stderr_tail()}"
                    )
                time.sleep(0.05)

    def start(self) -> None:
        self.spawn()
        self.wait_ready()

    def send_kill(self) -> None:
        """SIGKILL without waiting (safe to call from an event loop)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)

    def kill(self) -> None:
        """kill -9 and reap."""
        assert self.proc is not None
        self.send_kill()
        self.proc.wait(STOP_TIMEOUT)

    def terminate(self) -> int:
        """SIGTERM (graceful stop); the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(STOP_TIMEOUT)

    def restart_after_kill(self) -> None:
        self.kill()
        self.start()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stderr_tail(self, chars: int = 4000) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT)


# -- a PostgreSQL server that can be stopped and started again on the same port --------------


class RestartablePostgres:
    """Like harness.pg.throwaway_postgres, but the server can be stopped and restarted
    on the same data directory and port while a node keeps its DSN."""

    def __init__(self) -> None:
        self.pg_dir: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self._popen_user: dict[str, Any] = {}

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def create(self) -> None:
        """initdb and a first start (skips the test when no server can run here)."""
        import pytest

        reason = pg.postgres_unavailable()
        if reason:
            pytest.skip(reason)
        self._popen_user = pg._as_service_user()
        self.pg_dir = Path(tempfile.mkdtemp(prefix="leveret-pg-restartable-"))
        if self._popen_user:
            os.chown(self.pg_dir, self._popen_user["user"], self._popen_user["group"])
        os.chmod(self.pg_dir, 0o700)
        initdb = subprocess.run(
            [str(pg.PG_BIN / "initdb"), "-D", str(self.pg_dir / "data"), "-A", "trust", "-U", "postgres",
             "--no-sync", "--no-locale", "-E", "UTF8"],
            cwd=self.pg_dir, env=pg._env(self.pg_dir), stdin=subprocess.DEVNULL, capture_output=True,
            timeout=120, **self._popen_user,
        )  # fmt: skip
        if initdb.returncode != 0:
            out = (initdb.stdout + initdb.stderr).decode(errors="replace")[-3000:]
            raise RuntimeError(f"initdb failed with exit code {initdb.returncode}:\n{out}")
        for _attempt in range(3):
            self.port = free_port()
            if self.start(raise_on_failure=False):
                return
        raise RuntimeError(f"postgres did not start; its log ends with:\n{self.log_tail()}")

    def start(self, raise_on_failure: bool = True) -> bool:
        assert self.pg_dir is not None
        assert self.proc is None or self.proc.poll() is not None
        with open(self.pg_dir / "postgres.log", "ab") as log:
            self.proc = subprocess.Popen(
                [str(pg.PG_BIN / "postgres"), "-D", str(self.pg_dir / "data"), "-p", str(self.port),
                 "-k", str(self.pg_dir), "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off",
                 "-c", "synchronous_commit=off", "-c", "full_page_writes=off", "-c", "max_connections=100"],
                cwd=self.pg_dir, env=pg._env(self.pg_dir), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, **self._popen_user,
            )  # fmt: skip
        deadline = time.monotonic() + pg.START_TIMEOUT
        while time.monotonic() < deadline and self.proc.poll() is None:
            if pg._accepts(self.dsn):
                return True
            time.sleep(0.05)
        pg._stop(self.proc)
        if raise_on_failure:
            raise RuntimeError(f"postgres did not restart on port {self.port}; log:\n{self.log_tail()}")
        return False

    def stop(self) -> None:
        """Fast shutdown (SIGINT): clients are disconnected, the port is closed."""
        if self.proc is not None:
            pg._stop(self.proc)

    def log_tail(self) -> str:
        if self.pg_dir is None:
            return ""
        try:
            return (self.pg_dir / "postgres.log").read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def close(self) -> None:
        self.stop()
        if self.pg_dir is not None:
            shutil.rmtree(self.pg_dir, ignore_errors=True)


# -- a raw asyncio publisher with precise confirm tracking --------------------------------------

_FRAME_END = b"\xce"
_METHOD_HEAD = struct.Struct(">BHI")
_PUBLISH_METHOD = struct.Struct(">HHH")  # class 60, method 40, reserved-1
_CONTENT_HEADER = struct.Struct(">HHQH")  # class 60, weight 0, body size, property flags
_DELIVERY_MODE_FLAG = 0x1000


def _shortstr(value: str) -> bytes:
    raw = value.encode()
    return bytes([len(raw)]) + raw


class ConnectionLost(Exception):
    pass


class ConfirmingPublisher:
    """One connection, one channel in confirm mode; publishes with hand-built frames.

    ``status[seq]`` is None (waiting), True (basic.ack) or False (basic.nack),
    for every publish sequence number (= delivery tag) from 1. Acks and nacks
    with ``multiple=true`` settle every waiting tag up to theirs. A settlement of
    a tag that was never published, or a second settlement of a tag by a
    single (multiple=false) ack/nack, is recorded in ``anomalies``.
    """

    def __init__(self) -> None:
        self.status: list[bool | None] = [None]  # index 0 unused
        self.lowest_waiting = 1
        self.settled = 0
        self.anomalies: list[str] = []
        self.close_reason: str | None = None
        self.closed = asyncio.Event()
        self._progress = asyncio.Event()
        self._buf = bytearray()
        self._out: list[bytes] = []
        self._reader_task: asyncio.Task[None] | None = None
        self.frame_max = 131072
        self.channel = 1

    # -- connection ------------------------------------------------------------------
    async def open(self, host: str, port: int, user: str = "guest", password: str = "guest") -> None:
        self.reader, self.writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.writer.write(b"AMQP\x00\x00\x09\x01")
        await self._expect(commands.Connection.Start)
        self._send(commands.Connection.StartOk(
            client_properties={"product": "leveret-durability-tests",
                               "capabilities": {"publisher_confirms": True, "basic.nack": True}},
            mechanism="PLAIN", response=f"\0{user}\0{password}"), 0)  # fmt: skip
        tune = await self._expect(commands.Connection.Tune)
        self.frame_max = min(self.frame_max, tune.frame_max or self.frame_max)
        self._send(commands.Connection.TuneOk(channel_max=tune.channel_max, frame_max=self.frame_max, heartbeat=0), 0)
        self._send(commands.Connection.Open(virtual_host="/"), 0)
        await self._expect(commands.Connection.OpenOk)
        self._send(commands.Channel.Open(), self.channel)
        await self._expect(commands.Channel.OpenOk)
        self._send(commands.Confirm.Select(), self.channel)
        await self._expect(commands.Confirm.SelectOk)
        self._reader_task = asyncio.get_running_loop().create_task(self._read_loop())

    def _send(self, method: Any, channel: int) -> None:
        self.writer.write(frame.marshal(method, channel))

    async def _read_frame(self) -> tuple[int, Any]:
        while True:
            if len(self._buf) >= 8:
                (size,) = struct.unpack_from(">I", self._buf, 3)
                if len(self._buf) >= size + 8:
                    raw = bytes(self._buf[: size + 8])
                    del self._buf[: size + 8]
                    _consumed, channel, value = frame.unmarshal(raw)
                    return channel, value
            data = await self.reader.read(65536)
            if not data:
                raise ConnectionLost("peer closed the connection")
            self._buf += data

    async def _expect(self, kind: type[Any]) -> Any:
        while True:
            _channel, value = await asyncio.wait_for(self._read_frame(), 15)
            if isinstance(value, Heartbeat):
                continue
            if not isinstance(value, kind):
                raise AssertionError(f"expected {kind.__name__}, got {value!r}")
            return value

    async def _read_loop(self) -> None:
        try:
            while True:
                _channel, value = await self._read_frame()
                if isinstance(value, commands.Basic.Ack):
                    self._settle(value.delivery_tag, value.multiple, True)
                elif isinstance(value, commands.Basic.Nack):
                    self._settle(value.delivery_tag, value.multiple, False)
                elif isinstance(value, commands.Connection.Close | commands.Channel.Close):
                    self.close_reason = f"{type(value).__name__} {value.reply_code} {value.reply_text}"
                    return
                elif isinstance(value, commands.Connection.CloseOk):
                    self.close_reason = self.close_reason or "closed by the client"
                    return
                elif isinstance(value, Heartbeat):
                    continue
                else:
                    self.anomalies.append(f"unexpected frame {value!r}")
        except (ConnectionLost, OSError) as exc:
            self.close_reason = self.close_reason or f"connection lost: {exc!r}"
        finally:
            self.closed.set()
            self._progress.set()

    def _settle(self, tag: int, multiple: bool, ok: bool) -> None:
        status = self.status
        if tag >= len(status) or tag < 1:
            self.anomalies.append(f"{'ack' if ok else 'nack'} of unpublished tag {tag}")
            return
        if multiple:
            for seq in range(self.lowest_waiting, tag + 1):
                if status[seq] is None:
                    status[seq] = ok
                    self.settled += 1
        elif status[tag] is None:
            status[tag] = ok
            self.settled += 1
        else:
            self.anomalies.append(f"tag {tag} settled twice ({status[tag]} then {ok})")
        while self.lowest_waiting < len(status) and status[self.lowest_waiting] is not None:
            self.lowest_waiting += 1
        self._progress.set()

    # -- publishing ------------------------------------------------------------------------
    @property
    def published(self) -> int:
        return len(self.status) - 1

    @property
    def outstanding(self) -> int:
        return self.published - self.settled

    def publish(self, exchange: str, routing_key: str, body: bytes, delivery_mode: int = 2) -> int:
        """Queue one publish for the next flush(); returns its sequence number."""
        payload = _PUBLISH_METHOD.pack(60, 40, 0) + _shortstr(exchange) + _shortstr(routing_key) + b"\x00"
        props = bytes([delivery_mode])
        header = _CONTENT_HEADER.pack(60, 0, len(body), _DELIVERY_MODE_FLAG) + props
        ch = self.channel
        self._out.append(
            _METHOD_HEAD.pack(1, ch, len(payload)) + payload + _FRAME_END
            + _METHOD_HEAD.pack(2, ch, len(header)) + header + _FRAME_END
        )  # fmt: skip
        step = self.frame_max - 8  # bodies larger than a frame go in several body frames
        for at in range(0, len(body), step):
            chunk = body[at:at + step]
            self._out.append(_METHOD_HEAD.pack(3, ch, len(chunk)) + chunk + _FRAME_END)
        self.status.append(None)
        return self.published

    async def flush(self) -> None:
        """Write what publish() queued; ConnectionLost when the node is gone."""
        if not self._out:
            return
        data, self._out = b"".join(self._out), []
        if self.closed.is_set():
            raise ConnectionLost(self.close_reason or "closed")
        try:
            self.writer.write(data)
            await self.writer.drain()
        except (ConnectionError, OSError) as exc:
            raise ConnectionLost(repr(exc)) from exc

    async def wait_progress(self, timeout: float) -> None:
        self._progress.clear()
        try:
            await asyncio.wait_for(self._progress.wait(), timeout)
        except TimeoutError:
            pass

    async def wait_settled(self, upto: int, timeout: float) -> bool:
        """Wait until every tag up to ``upto`` is settled (or the connection closed)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self.lowest_waiting <= upto and not self.closed.is_set():
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return False
            await self.wait_progress(remaining)
        return self.lowest_waiting > upto

    async def wait_closed(self, timeout: float) -> None:
        if self._reader_task is not None:
            await asyncio.wait_for(asyncio.shield(self._reader_task), timeout)

    async def close(self) -> None:
        if not self.closed.is_set():
            try:
                self._send(commands.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0), 0)
                await asyncio.wait_for(self.writer.drain(), 5)
            except (OSError, TimeoutError):
                pass
        self.writer.close()
        try:
            await asyncio.wait_for(self.writer.wait_closed(), 5)
        except (OSError, TimeoutError):
            pass
        if self._reader_task is not None and not self._reader_task.done():
            self._reader_task.cancel()
            try:
                await self._reader_task
            except (asyncio.CancelledError, Exception):
                pass

    def acked(self) -> set[int]:
        return {seq for seq, ok in enumerate(self.status) if ok is True}

    def nacked(self) -> set[int]:
        return {seq for seq, ok in enumerate(self.status) if ok is False}
