"""Flow control: a publisher that writes as fast as TCP allows must not starve the consumers (issue 14).

The publisher is the client of the issue: pre-encoded ``basic.publish``
frames (256 B bodies, no confirms) written in 256 KiB blocks with
``sendall`` as fast as the socket takes them. The consumer is pika at
prefetch 1000, acking ``multiple`` every 100. Not timed: the test counts
what the consumer got against what the socket accepted over a fixed run.
Before flow control the consumer got ~3 % (2.6-4k of 115-153k msg/s); with
it, the broker reads the publisher only as fast as its queue drains.
These tests run against any broker (LEVERET_TEST_AMQP_URL), RabbitMQ too.
"""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlparse

import pika
import pytest
from pamqp import commands, frame, header
from pamqp.body import ContentBody

from compat_tests.raw_amqp import RawAMQP
from compat_tests.util import unique_name

pytestmark = pytest.mark.timeout(60)

RUN_S = 5.0
BLOCK = 256 * 1024
# The consumer must get at least this share of what the publisher's socket took.
# Measured: 0.8-0.95 with flow control (the rest is in socket buffers and the
# queue's FLOW_HIGH allowance), 0.03 without.
MIN_SHARE = 0.5


class Flooder(threading.Thread):
    """Writes 256 KiB blocks of publishes until told to stop; counts what the socket took."""

    def __init__(self, host: str, port: int, queue: str) -> None:
        super().__init__(daemon=True)
        self.raw = RawAMQP(host, port, timeout=30)
        self.raw.handshake()
        self.raw.open_channel(1)
        one = (
            frame.marshal(commands.Basic.Publish(exchange="", routing_key=queue), 1)
            + frame.marshal(header.ContentHeader(0, 256, commands.Basic.Properties(delivery_mode=1)), 1)
            + frame.marshal(ContentBody(b"f" * 256), 1)
        )
        self.per_block = BLOCK // len(one)
        self.block = one * self.per_block
        self.sent = 0  # messages the socket accepted
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        sock = self.raw.sock
        sock.settimeout(None)
        try:
            while not self.stop.is_set():
                sock.sendall(self.block)
                self.sent += self.per_block
        except OSError as exc:
            if not self.stop.is_set():
                self.error = exc

    def close(self) -> None:
        self.stop.set()
        self.raw.sock.shutdown(socket.SHUT_RDWR)  # unblocks a sendall held back by flow control
        self.join(timeout=10)
        self.raw.close_socket()


def _consume_for(channel: pika.adapters.blocking_connection.BlockingChannel, queue: str, seconds: float) -> int:
    got = 0
    unacked = 0

    def on_message(ch: object, method: pika.spec.Basic.Deliver, _props: object, _body: bytes) -> None:
        nonlocal got, unacked
        got += 1
        unacked += 1
        if unacked >= 100:
            channel.basic_ack(method.delivery_tag, multiple=True)
            unacked = 0

    channel.basic_qos(prefetch_count=1000)
    channel.basic_consume(queue, on_message)
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        channel.connection.process_data_events(time_limit=min(0.05, left))
    return got


def test_flooding_publisher_does_not_starve_its_consumer(amqp_url: str) -> None:
    url = urlparse(amqp_url)
    queue = unique_name("flood")
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        ch = conn.channel()
        ch.queue_declare(queue, auto_delete=True)
        flooder = Flooder(url.hostname or "127.0.0.1", url.port or 5672, queue)
        flooder.start()
        try:
            got = _consume_for(ch, queue, RUN_S)
            sent = flooder.sent
        finally:
            flooder.close()
        assert flooder.error is None, flooder.error
        assert sent > 0
        share = got / sent
        assert share >= MIN_SHARE, f"the consumer got {got} of {sent} published ({share:.1%})"
    finally:
        conn.close()


def test_queue_without_consumers_takes_a_flood_at_full_speed(amqp_url: str) -> None:
    """No consumer, nothing to keep up with: the backlog grows past flow control's mark."""
    url = urlparse(amqp_url)
    queue = unique_name("flood-idle")
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        ch = conn.channel()
        ch.queue_declare(queue, auto_delete=False)
        flooder = Flooder(url.hostname or "127.0.0.1", url.port or 5672, queue)
        flooder.start()
        try:
            deadline = time.monotonic() + 15
            depth = 0
            while time.monotonic() < deadline and depth < 50_000:
                time.sleep(0.2)
                depth = ch.queue_declare(queue, passive=True).method.message_count
        finally:
            flooder.close()
        assert depth >= 50_000, f"only {depth} messages queued in 15 s without consumers"
        ch.queue_delete(queue)
    finally:
        conn.close()


def test_consumer_that_stops_acking_does_not_hold_the_publisher(amqp_url: str) -> None:
    """A stalled consumer is not starved: the queue takes the flood as if it had none."""
    url = urlparse(amqp_url)
    queue = unique_name("flood-stalled")
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        ch = conn.channel()
        ch.queue_declare(queue, auto_delete=False)
        ch.basic_qos(prefetch_count=10)
        ch.basic_consume(queue, lambda *_: None)  # takes 10, never acks
        flooder = Flooder(url.hostname or "127.0.0.1", url.port or 5672, queue)
        flooder.start()
        try:
            deadline = time.monotonic() + 15
            depth = 0
            while time.monotonic() < deadline and depth < 50_000:
                conn.process_data_events(time_limit=0.2)
                probe = pika.BlockingConnection(pika.URLParameters(amqp_url))
                try:
                    depth = probe.channel().queue_declare(queue, passive=True).method.message_count
                finally:
                    probe.close()
        finally:
            flooder.close()
        assert depth >= 50_000, f"only {depth} messages queued in 15 s behind a stalled consumer"
        ch.queue_delete(queue)
    finally:
        conn.close()
