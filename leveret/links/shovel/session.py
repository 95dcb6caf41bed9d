"""What a shovel and a federation link share: an AMQP client session to another broker, retried.

Both are AMQP 0-9-1 clients (aiormq) that run inside the node, keep a state
for the management API (``starting``, ``running``, an error), reconnect after a
delay on any failure, and ack their source in coalesced ``basic.ack(multiple)``
frames. The shovel (worker.py) and the federation link
(leveret/links/federation/link.py) are what differ: what they consume and where they
put it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import aiormq

from core.model.tasks import spawn
from leveret.links.shovel.spec import client_uri

CONNECT_TIMEOUT = 30.0
CLOSE_TIMEOUT = 5.0
# aiormq logs each lost connection at warning level with a full traceback; the
# shovel and the link log one line with the reason instead (and show it in their status).
logging.getLogger("aiormq").setLevel(logging.ERROR)


async def connect(uri: str, local_port: int, login: tuple[str, str] | None = None) -> aiormq.abc.AbstractConnection:
    """``uri`` as the parameters give it (``amqp://`` with no host: this node, entered with ``login``)."""
    # A host that drops packets would otherwise keep the session "starting" for minutes.
    return await asyncio.wait_for(aiormq.connect(client_uri(uri, local_port, login)), CONNECT_TIMEOUT)


async def close(conn: aiormq.abc.AbstractConnection) -> None:
    # Closing a connection whose peer died must neither hang nor hide the error that ended the session.
    with contextlib.suppress(Exception):
        await asyncio.wait_for(conn.close(), CLOSE_TIMEOUT)


class Acks:
    """Source acks coalesced into one ``basic.ack(multiple)`` per loop turn.

    Confirms come back out of order (one task per delivery), so a tag is acked
    only once every tag below it is settled too: ``floor``. Sending one
    multiple-ack per turn instead of one frame per message halves the shovel's
    socket writes (each send cost ~70 us of the ~200 us per message it spent,
    profiled on this loaded machine).
    """

    def __init__(self, channel: aiormq.abc.AbstractChannel, failed: Callable[[BaseException], None]) -> None:
        self.channel = channel
        self.failed = failed
        self.floor = 0  # every tag <= floor is settled
        self.sent = 0  # acked at the source up to here
        self._settled: set[int] = set()
        self._scheduled = False
        self._flushing: set[asyncio.Task[Any]] = set()

    def settle(self, tag: int) -> None:
        self._settled.add(tag)
        while self.floor + 1 in self._settled:
            self.floor += 1
            self._settled.discard(self.floor)
        if self.floor > self.sent and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._spawn)

    def _spawn(self) -> None:
        spawn(self.flush(), self._flushing)

    async def flush(self) -> None:
        self._scheduled = False
        if self.floor <= self.sent:
            return
        upto, self.sent = self.floor, self.floor
        try:
            await self.channel.basic_ack(upto, multiple=True)
        except Exception as exc:  # noqa: BLE001  the session ends; unacked messages are redelivered
            self.failed(exc)


class Supervised:
    """One task run until stopped, with the state the management API shows (``_run`` is the subclass's)."""

    task_name = "session"

    def __init__(self) -> None:
        self.state = "starting"
        self.reason = ""  # the last error, shown while the session is down
        self.since = time.time()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self.task_name)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    def _set(self, state: str, reason: str = "") -> None:
        self.state, self.reason, self.since = state, reason, time.time()

    def timestamp(self) -> str:
        """When the state last changed, as RabbitMQ's status JSON writes it."""
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.since))

    async def _run(self) -> None:
        raise NotImplementedError
