"""Small shared helpers for the compatibility tests."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pika
import pika.exceptions
import pytest
from pika.adapters.blocking_connection import BlockingChannel

__all__ = [
    "BlockingChannel",
    "Names",
    "assert_reply",
    "channel_error",
    "connection_error",
    "drain",
    "run_ioloop",
    "sync",
    "unique_name",
    "wait_until",
]


def assert_reply(exc: BaseException, code: int, text: str | None = None) -> None:
    """Check a broker close: exact reply code, reply text contains ``text``."""
    reply_code = getattr(exc, "reply_code", None)
    reply_text = getattr(exc, "reply_text", "")
    assert reply_code == code, f"expected reply code {code}, got {reply_code} ({reply_text!r})"
    if text is not None:
        assert text in reply_text, f"expected {text!r} in reply text {reply_text!r}"


@contextmanager
def channel_error(code: int, text: str | None = None) -> Iterator[None]:
    """The block must fail with a pika channel close ``code`` from the broker."""
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as info:
        yield
    assert_reply(info.value, code, text)


@contextmanager
def connection_error(code: int, text: str | None = None) -> Iterator[None]:
    """The block must fail with a pika connection close ``code`` from the broker."""
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as info:
        yield
    assert_reply(info.value, code, text)


def sync(ch: BlockingChannel) -> None:
    """Round-trip on ``ch`` so the broker has processed earlier async methods.

    An async method (basic.publish, basic.ack...) that makes the broker close
    the channel only surfaces on the next synchronous call.
    """
    ch.exchange_declare("amq.direct", passive=True)


def drain(conn: pika.BlockingConnection, seconds: float) -> None:
    """Let ``conn`` process I/O (deliveries, callbacks) for ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        conn.process_data_events(time_limit=min(remaining, 0.1))


def run_ioloop(conn: pika.SelectConnection, timeout: float) -> None:
    """Run a SelectConnection's ioloop until it is stopped or ``timeout``.

    Makes sure the connection is closed and the ioloop (and its internal
    wake-up socket pair) is released afterwards.
    """
    conn.ioloop.call_later(timeout, conn.ioloop.stop)
    try:
        conn.ioloop.start()
        if not (conn.is_closed or conn.is_closing):
            conn.close()
        if not conn.is_closed:
            conn.ioloop.call_later(5, conn.ioloop.stop)
            conn.ioloop.start()
    finally:
        conn.ioloop.close()


def wait_until(
    conn: pika.BlockingConnection,
    predicate: Callable[[], bool],
    timeout: float = 5.0,
) -> bool:
    """Process I/O on ``conn`` until ``predicate()`` holds or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        conn.process_data_events(time_limit=0.05)
    return True


def unique_name(prefix: str = "compat") -> str:
    """A name that no other test (or concurrent test run) will use."""
    return f"{prefix}.{uuid.uuid4().hex}"


class Names:
    """Hands out unique names and deletes the entities at teardown."""

    def __init__(self) -> None:
        self.queues: list[str] = []
        self.exchanges: list[str] = []

    def __call__(self, prefix: str = "compat") -> str:
        return unique_name(prefix)

    def queue(self, prefix: str = "compat.q") -> str:
        name = unique_name(prefix)
        self.queues.append(name)
        return name

    def exchange(self, prefix: str = "compat.x") -> str:
        name = unique_name(prefix)
        self.exchanges.append(name)
        return name

    def cleanup(self, url: str) -> None:
        if not self.queues and not self.exchanges:
            return
        conn = pika.BlockingConnection(pika.URLParameters(url))
        try:
            ch = conn.channel()
            for kind, names in (("queue", self.queues), ("exchange", self.exchanges)):
                for name in names:
                    try:
                        if kind == "queue":
                            ch.queue_delete(name)
                        else:
                            ch.exchange_delete(name)
                    except pika.exceptions.ChannelClosed:
                        ch = conn.channel()
        finally:
            if conn.is_open:
                conn.close()
