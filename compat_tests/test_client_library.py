"""leveret.client as a library: typed, plain dataclasses, the same surface sync and async, and
subscriptions that survive a restart of their node (a real node process, restarted on the same ports)."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.resources
import inspect
import select
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.node import REPO_ROOT, NodeProcess, node_env
from leveret.client import AsyncClient, AsyncSubscriber, ChannelInfo, Client, LeveretError, QueueInfo, Subscriber

WAIT = 30.0


class SamePortsNode(NodeProcess):
    """Restarts on the ports it had: a client keeps its target across the restart."""

    def spawn(self) -> None:
        if not self.amqp_port:
            super().spawn()  # the first start: fresh free ports
            return
        self.starts += 1
        self.stderr_path = self.log_dir / f"node-{self.starts}.stderr"
        with open(self.log_dir / f"node-{self.starts}.stdout", "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(self.command(), cwd=REPO_ROOT, stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL, env=node_env())

    def restart(self) -> None:
        self.terminate()
        self.start()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[SamePortsNode]:
    n = SamePortsNode(tmp_path / "data", tmp_path / "logs")
    n.start()
    try:
        yield n
    finally:
        n.cleanup()


def test_typed_package_and_the_same_surface() -> None:
    assert (importlib.resources.files("leveret") / "py.typed").is_file()
    for sync, async_ in ((Client, AsyncClient), (Subscriber, AsyncSubscriber)):
        sync_names = {n for n in dir(sync) if not n.startswith("_")}
        async_names = {n for n in dir(async_) if not n.startswith("_")}
        assert sync_names - async_names == set(), f"{async_.__name__} lacks {sync_names - async_names}"
        for name in sync_names & {"create_queue", "list_queues", "list_channels", "subscribe", "push", "ack"}:
            assert (list(inspect.signature(getattr(sync, name)).parameters)
                    == list(inspect.signature(getattr(async_, name)).parameters)), name
    assert hasattr(AsyncSubscriber, "__aenter__") and hasattr(AsyncSubscriber, "fileno")


def test_dataclasses_and_resubscribe_after_restart_sync(node: SamePortsNode) -> None:
    target = f"127.0.0.1:{node.grpc_port}"
    with Client(target) as c:
        info = c.create_queue("lib-q", durable=True, exist_ok=True)
        assert isinstance(info, QueueInfo) and dataclasses.is_dataclass(info) and info.durable
        assert [q.name for q in c.list_queues()] == ["lib-q"]
        (default,) = c.list_channels("lib-q")
        assert isinstance(default, ChannelInfo) and default.id == "lib-q/" and default.kind in ("auto", "none")
        sub = c.subscribe("lib-q/", prefetch=10)
        c.push("lib-q", b"before")
        m = sub.get(timeout=WAIT)
        assert m is not None and m.content == b"before"
        readable, _, _ = select.select([sub], [], [], 0)
        assert not readable  # nothing pending
        sub.ack(m)

        node.restart()
        deadline = time.monotonic() + WAIT
        while True:
            try:
                c.push("lib-q", b"after")
                break
            except LeveretError:  # the client's channel reconnects on its own; retry until it has
                assert time.monotonic() < deadline, node.stderr_tail()
                time.sleep(0.2)
        m = sub.get(timeout=WAIT)
        assert m is not None and m.content == b"after", node.stderr_tail()
        assert sub.resubscribed == 1
        sub.ack(m)
        sub.close()


async def test_resubscribe_after_restart_async(node: SamePortsNode) -> None:
    async with AsyncClient(f"127.0.0.1:{node.grpc_port}") as c:
        await c.create_queue("alib-q", durable=True, exist_ok=True)
        assert all(isinstance(q, QueueInfo) for q in await c.list_queues())
        async with await c.subscribe("alib-q/", prefetch=10) as sub:
            await c.push("alib-q", b"before")
            m = await sub.get(timeout=WAIT)
            assert m is not None and m.content == b"before"
            await sub.ack(m)
            await asyncio.get_running_loop().run_in_executor(None, node.restart)
            deadline = time.monotonic() + WAIT
            while True:
                try:
                    await c.push("alib-q", b"after")
                    break
                except LeveretError:
                    assert time.monotonic() < deadline, node.stderr_tail()
                    await asyncio.sleep(0.2)
            readable = asyncio.Event()
            asyncio.get_running_loop().add_reader(sub.fileno(), readable.set)
            try:
                await asyncio.wait_for(readable.wait(), WAIT)  # fileno() turns readable when it arrives
            finally:
                asyncio.get_running_loop().remove_reader(sub.fileno())
            m = await sub.get(timeout=WAIT)
            assert m is not None and m.content == b"after"
            assert sub.resubscribed == 1
            await sub.ack(m)


def test_no_resubscription_when_asked_for_none(node: SamePortsNode) -> None:
    with Client(f"127.0.0.1:{node.grpc_port}") as c:
        c.create_queue("lib-once", durable=True, exist_ok=True)
        sub = c.subscribe("lib-once/", resubscribe_for=0)
        node.restart()
        with pytest.raises(LeveretError):
            while sub.get(timeout=WAIT) is not None:
                pass
        assert sub.resubscribed == 0
