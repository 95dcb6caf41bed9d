"""Flow control: a queue that falls behind its consumers holds back the publishers feeding it.

One event loop serves every connection, so a publisher that writes as fast
as TCP allows takes the CPU the consumers' acks need: before this module a
flooding publisher got 130k publishes/s accepted while its consumer got
2.6-4k msg/s (py-spy: 78 % of the node's samples in the publish path, 0.7 %
in acks, 0.5 % in deliveries; docs/notes/flow.md). RabbitMQ's credit flow
stops reading such a publisher; this is the equivalent for one loop.

The policy, per queue (its default channel, the one AMQP consumers share):

* **behind**: the queue has consumers and ``FLOW_HIGH`` or more ready
  messages. Every publisher that then pushes a message into it is *held*
  (``Publisher.hold``): its front end stops reading its input, so TCP slows
  the producer. A queue without consumers never holds anyone: a backlog is
  what it is for.
* **caught up**: the ready count falls to ``FLOW_LOW``, the consumers leave,
  the queue is purged or deleted: every held publisher is released.
* **stalled**: consumers that are merely slow are not the loop's fault. While
  publishers are held, the queue checks every ``CHECK_S`` that its consumers
  drained at least ``MIN_DRAIN`` messages; if not (a consumer that stopped
  acking, or takes a second per message), it releases them and accepts at
  full speed, like a queue without consumers, until it next gets down to
  ``FLOW_LOW``. So flow control only throttles producers to consumers that
  are fast but starved of CPU, which is what RabbitMQ's credit flow does too.

Which publisher pushes is known without threading it through every
routing call: the front end sets it with ``publishing(p)`` around the input
it processes (one loop, no threads: a plain module variable is enough).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from core.engine.queue import QueueChannel
    from core.model.clock import TimerHandle

# Ready messages (with consumers) at which publishers are held, and at which
# they are let go. HIGH is ~10 socket reads of a flooding publisher (256 KiB,
# ~800 messages of 256 B each), so one read never crosses it twice; LOW keeps
# a full prefetch window (1000) and more ready, so consumers never wait for
# a publisher that was just released (its next read comes one loop turn
# later). Measured with bench flood (docs/notes/flow.md).
FLOW_HIGH = 8192
FLOW_LOW = 2048
# Held publishers are let go if the consumers drained fewer than MIN_DRAIN
# messages in CHECK_S (< 1,280 msg/s): such consumers are slow by themselves,
# and holding producers to their pace is not flow control's job.
CHECK_S = 0.2
MIN_DRAIN = 256


class Publisher(Protocol):
    """What flow control holds back: an AMQP connection, a gRPC push, a forwarded batch."""

    def hold(self, gate: QueueFlow) -> None:
        """``gate``'s queue is behind: stop taking input until ``release(gate)``."""
        ...

    def release(self, gate: QueueFlow) -> None: ...


_current: Publisher | None = None


@contextmanager
def publishing(publisher: Publisher | None) -> Iterator[None]:
    """Messages pushed into queues inside this block come from ``publisher``."""
    global _current
    previous, _current = _current, publisher
    try:
        yield
    finally:
        _current = previous


def current() -> Publisher | None:
    return _current


def swap(publisher: Publisher | None) -> Publisher | None:
    """Set the current publisher, returning the previous one (``publishing`` without a generator)."""
    global _current
    previous, _current = _current, publisher
    return previous


class QueueFlow:
    """One queue channel's flow state and the publishers it holds."""

    __slots__ = ("qch", "behind", "stalled", "held", "_mark", "_timer")

    def __init__(self, qch: QueueChannel) -> None:
        self.qch = qch
        self.behind = False
        self.stalled = False
        self.held: dict[int, Publisher] = {}
        self._mark = 0
        self._timer: TimerHandle | None = None

    def over_high(self) -> None:
        """A message was queued with the ready count at or above FLOW_HIGH and consumers present."""
        if self.stalled:
            return
        if not self.behind:
            self.behind = True
            self._arm()
        publisher = _current
        if publisher is not None and id(publisher) not in self.held:
            self.held[id(publisher)] = publisher
            publisher.hold(self)

    def at_low(self) -> None:
        """The ready count fell to FLOW_LOW (or the consumers left): the queue caught up."""
        self.stalled = False
        if self.behind:
            self.behind = False
            self._release_all()

    def forget(self, publisher: Publisher) -> None:
        """``publisher`` is gone (its connection closed): drop it without calling it."""
        self.held.pop(id(publisher), None)

    def _release_all(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        held, self.held = self.held, {}
        for publisher in held.values():
            publisher.release(self)

    def _arm(self) -> None:
        self._mark = len(self.qch.ready)
        self._timer = self.qch.queue.scheduler.call_later(CHECK_S, self._check)

    def _check(self) -> None:
        self._timer = None
        if not self.behind:
            return
        now = len(self.qch.ready)
        if self._mark - now < MIN_DRAIN:
            # The consumers are slow by themselves: accept at full speed until caught up.
            self.behind = False
            self.stalled = True
            self._release_all()
            return
        self._arm()


class HeldCall:
    """A publisher that answers later rather than reading a socket: a gRPC push, a forwarded batch.

    Its async caller pushes under ``publishing(call)``, then, when ``held``,
    sets ``on_free`` and waits for it before answering or taking more input,
    so the client (or the forwarding node, through its gRPC stream window)
    slows down.
    """

    __slots__ = ("gates", "on_free")

    def __init__(self) -> None:
        self.gates: set[int] = set()
        self.on_free: Callable[[], None] | None = None

    @property
    def held(self) -> bool:
        return bool(self.gates)

    def hold(self, gate: QueueFlow) -> None:
        self.gates.add(id(gate))

    def release(self, gate: QueueFlow) -> None:
        self.gates.discard(id(gate))
        if not self.gates and self.on_free is not None:
            on_free, self.on_free = self.on_free, None
            on_free()


async def released(call: HeldCall) -> None:
    """Wait until no queue holds ``call`` (an asyncio caller: gRPC, the owner side of forwarding)."""
    if call.held:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def free() -> None:
            if not done.done():
                done.set_result(None)

        call.on_free = free
        await done
