"""Behaviours the client libraries' own integration suites rely on (aiormq, aio-pika,
kombu, pika), each checked against RabbitMQ 3.10 first (LEVERET_TEST_AMQP_URL)."""

from __future__ import annotations

from collections.abc import Callable

import pika
import pytest
from pamqp import commands

from compat_tests.raw_amqp import RawAMQP
from compat_tests.util import Names

pytestmark = pytest.mark.timeout(30)


def test_unbind_of_missing_queue_and_exchange_succeeds(connection: pika.BlockingConnection, names: Names) -> None:
    # aio-pika's RPC.close() unbinds an auto-delete queue that is already gone.
    ch = connection.channel()
    ch.queue_unbind(names.queue(), "amq.direct", "k")
    ch.queue_unbind("does-not-exist-" + names.queue(), "amq.direct", "k")
    ch.exchange_unbind("does-not-exist-" + names.exchange(), "amq.fanout", "k")
    ch.exchange_unbind("amq.fanout", "does-not-exist-" + names.exchange(), "k")
    assert ch.is_open


def test_queue_delete_ok_comes_before_cancel_of_own_consumer(raw: Callable[[], RawAMQP], names: Names) -> None:
    # kombu's test_ack_from_another_thread: delete-ok first, then basic.cancel.
    client = raw()
    client.handshake()
    client.open_channel(1)
    queue = names.queue()
    client.rpc(commands.Queue.Declare(queue=queue))
    client.rpc(commands.Basic.Consume(queue=queue, consumer_tag="c1"))
    client.send(commands.Queue.Delete(queue=queue), channel=1)
    frames = [client.read_frame()[1] for _ in range(2)]
    assert isinstance(frames[0], commands.Queue.DeleteOk), frames
    assert isinstance(frames[1], commands.Basic.Cancel) and frames[1].consumer_tag == "c1", frames


def test_channel_numbers_above_channel_max_are_fine(raw: Callable[[], RawAMQP]) -> None:
    # aiormq opens channel 65535 with the default channel_max.
    client = raw()
    client.handshake()
    client.open_channel(65535)
    client.rpc(commands.Basic.Qos(prefetch_count=1), channel=65535)


def test_update_secret_is_accepted(raw: Callable[[], RawAMQP]) -> None:
    client = raw()
    client.handshake()
    client.send(commands.Connection.UpdateSecret(new_secret="guest", reason="rotation"))
    client.expect(commands.Connection.UpdateSecretOk)
    client.open_channel(1)
