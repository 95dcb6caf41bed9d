"""Dead-letter exchanges: reasons, routing, x-death history and cycle detection."""

from __future__ import annotations

import asyncio
import datetime
import time
from typing import Any

import aio_pika
import pika
import pytest

from compat_tests.util import BlockingChannel, Names, sync

pytestmark = pytest.mark.timeout(30)

TTL_MS = 200
PAST_TTL = 0.5


def _get(ch: BlockingChannel, queue: str, timeout: float = 3.0) -> tuple[Any, pika.BasicProperties, bytes]:
    """basic.get (auto-ack) until a message arrives; dead-lettering is asynchronous."""
    deadline = time.monotonic() + timeout
    while True:
        method, props, body = ch.basic_get(queue, auto_ack=True)
        if method is not None:
            return method, props, body
        assert time.monotonic() < deadline, f"nothing arrived in {queue} within {timeout}s"
        time.sleep(0.02)


def _get_manual(ch: BlockingChannel, queue: str, timeout: float = 3.0) -> tuple[Any, pika.BasicProperties, bytes]:
    deadline = time.monotonic() + timeout
    while True:
        method, props, body = ch.basic_get(queue, auto_ack=False)
        if method is not None:
            return method, props, body
        assert time.monotonic() < deadline, f"nothing arrived in {queue} within {timeout}s"
        time.sleep(0.02)


def _count(ch: BlockingChannel, queue: str) -> int:
    return ch.queue_declare(queue, passive=True).method.message_count


def _check_death(
    entry: dict[str, Any], *, reason: str, queue: str, exchange: str, routing_keys: list[str], count: int = 1
) -> None:
    assert entry["count"] == count
    assert entry["reason"] == reason
    assert entry["queue"] == queue
    assert entry["exchange"] == exchange
    assert entry["routing-keys"] == routing_keys
    when = entry["time"]
    assert isinstance(when, datetime.datetime)
    assert abs(when.timestamp() - time.time()) < 60


def _dlx_pair(ch: BlockingChannel, names: Names, **extra: Any) -> tuple[str, str]:
    """A queue dead-lettering through the default exchange into a second queue."""
    dlq = names.queue("compat.dlq")
    ch.queue_declare(dlq)
    queue = names.queue()
    arguments: dict[str, Any] = {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq}
    arguments.update(extra)
    ch.queue_declare(queue, arguments=arguments)
    return queue, dlq


# ------------------------------------------------------------------ reasons
def test_reject_without_requeue_dead_letters(channel: BlockingChannel, names: Names) -> None:
    dlx = names.exchange()
    channel.exchange_declare(dlx, "fanout")
    dlq = names.queue("compat.dlq")
    channel.queue_declare(dlq)
    channel.queue_bind(dlq, dlx)
    queue = names.queue()
    channel.queue_declare(queue, arguments={"x-dead-letter-exchange": dlx})
    channel.basic_publish("", queue, b"reject me", pika.BasicProperties(headers={"app": "v"}, message_id="m1"))
    method, _props, _body = _get_manual(channel, queue)
    channel.basic_reject(method.delivery_tag, requeue=False)
    method, props, body = _get(channel, dlq)
    assert body == b"reject me"
    assert method.exchange == dlx
    assert method.routing_key == queue  # the original routing key
    assert props.message_id == "m1"
    headers = props.headers
    assert headers["app"] == "v"
    assert len(headers["x-death"]) == 1
    _check_death(headers["x-death"][0], reason="rejected", queue=queue, exchange="", routing_keys=[queue])
    assert headers["x-first-death-reason"] == "rejected"
    assert headers["x-first-death-queue"] == queue
    assert headers["x-first-death-exchange"] == ""
    assert _count(channel, queue) == 0


def test_nack_without_requeue_dead_letters(channel: BlockingChannel, names: Names) -> None:
    source = names.exchange()
    channel.exchange_declare(source, "direct")
    dlx = names.exchange()
    channel.exchange_declare(dlx, "direct")
    dlq = names.queue("compat.dlq")
    channel.queue_declare(dlq)
    channel.queue_bind(dlq, dlx, routing_key="orig.key")
    queue = names.queue()
    channel.queue_declare(queue, arguments={"x-dead-letter-exchange": dlx})
    channel.queue_bind(queue, source, routing_key="orig.key")
    for i in range(3):
        channel.basic_publish(source, "orig.key", f"n{i}".encode())
    tags = [_get_manual(channel, queue)[0].delivery_tag for _ in range(3)]
    channel.basic_nack(tags[-1], multiple=True, requeue=False)
    got = []
    for _ in range(3):
        method, props, body = _get(channel, dlq)
        assert method.routing_key == "orig.key"
        _check_death(
            props.headers["x-death"][0], reason="rejected", queue=queue, exchange=source, routing_keys=["orig.key"]
        )
        assert props.headers["x-first-death-exchange"] == source
        got.append(body)
    assert got == [b"n0", b"n1", b"n2"]


def test_requeue_true_does_not_dead_letter(channel: BlockingChannel, names: Names) -> None:
    queue, dlq = _dlx_pair(channel, names)
    channel.basic_publish("", queue, b"back")
    method, _props, _body = _get_manual(channel, queue)
    channel.basic_reject(method.delivery_tag, requeue=True)
    sync(channel)
    assert _count(channel, queue) == 1
    assert _count(channel, dlq) == 0


def test_expired_by_queue_ttl_dead_letters(channel: BlockingChannel, names: Names) -> None:
    queue, dlq = _dlx_pair(channel, names, **{"x-message-ttl": TTL_MS})
    channel.basic_publish("", queue, b"too late")
    # no consumer and no basic.get on the source queue: expiry is proactive
    method, props, body = _get(channel, dlq)
    assert body == b"too late"
    assert method.routing_key == dlq
    death = props.headers["x-death"][0]
    _check_death(death, reason="expired", queue=queue, exchange="", routing_keys=[queue])
    assert "original-expiration" not in death
    assert props.headers["x-first-death-reason"] == "expired"


def test_expired_by_message_ttl_keeps_original_expiration(channel: BlockingChannel, names: Names) -> None:
    queue, dlq = _dlx_pair(channel, names)
    channel.basic_publish("", queue, b"per-message", pika.BasicProperties(expiration=str(TTL_MS)))
    _method, props, _body = _get(channel, dlq)
    death = props.headers["x-death"][0]
    _check_death(death, reason="expired", queue=queue, exchange="", routing_keys=[queue])
    assert death["original-expiration"] == str(TTL_MS)
    assert props.expiration is None  # removed so it does not expire again in the DLQ


def test_maxlen_drop_head_dead_letters(channel: BlockingChannel, names: Names) -> None:
    queue, dlq = _dlx_pair(channel, names, **{"x-max-length": 2})
    for i in range(4):
        channel.basic_publish("", queue, f"m{i}".encode())
    sync(channel)
    got = []
    for _ in range(2):
        _method, props, body = _get(channel, dlq)
        _check_death(props.headers["x-death"][0], reason="maxlen", queue=queue, exchange="", routing_keys=[queue])
        got.append(body)
    assert got == [b"m0", b"m1"]
    assert [channel.basic_get(queue, auto_ack=True)[2] for _ in range(2)] == [b"m2", b"m3"]


def test_dead_letter_routing_key_overrides(channel: BlockingChannel, names: Names) -> None:
    dlx = names.exchange()
    channel.exchange_declare(dlx, "direct")
    dlq = names.queue("compat.dlq")
    channel.queue_declare(dlq)
    channel.queue_bind(dlq, dlx, routing_key="dead")
    stray = names.queue("compat.stray")
    channel.queue_declare(stray)
    queue = names.queue()
    channel.queue_bind(stray, dlx, routing_key=queue)  # would match the original key
    channel.queue_declare(queue, arguments={"x-dead-letter-exchange": dlx, "x-dead-letter-routing-key": "dead"})
    channel.basic_publish("", queue, b"rerouted")
    method, _props, _body = _get_manual(channel, queue)
    channel.basic_nack(method.delivery_tag, requeue=False)
    method, props, body = _get(channel, dlq)
    assert body == b"rerouted"
    assert method.routing_key == "dead"
    assert props.headers["x-death"][0]["routing-keys"] == [queue]
    assert _count(channel, stray) == 0


def test_dead_letter_to_default_exchange(channel: BlockingChannel, names: Names) -> None:
    queue, dlq = _dlx_pair(channel, names)
    channel.basic_publish("", queue, b"to default")
    method, _props, _body = _get_manual(channel, queue)
    channel.basic_reject(method.delivery_tag, requeue=False)
    method, props, body = _get(channel, dlq)
    assert body == b"to default"
    assert method.exchange == ""
    assert method.routing_key == dlq
    assert props.headers["x-death"][0]["queue"] == queue


def test_missing_dead_letter_exchange_drops(channel: BlockingChannel, names: Names) -> None:
    queue = names.queue()
    channel.queue_declare(queue, arguments={"x-dead-letter-exchange": names("compat.nowhere")})
    channel.basic_publish("", queue, b"lost")
    method, _props, _body = _get_manual(channel, queue)
    channel.basic_reject(method.delivery_tag, requeue=False)
    sync(channel)
    assert _count(channel, queue) == 0


# ------------------------------------------------------------- x-death count
def test_death_count_increments_two_queue_loop(channel: BlockingChannel, names: Names) -> None:
    qa = names.queue("compat.qa")
    qb = names.queue("compat.qb")
    channel.queue_declare(qa, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": qb})
    channel.queue_declare(qb, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": qa})
    channel.basic_publish("", qa, b"ping-pong")
    for hop in (qa, qb, qa):
        method, _props, _body = _get_manual(channel, hop)
        channel.basic_reject(method.delivery_tag, requeue=False)
    _method, props, body = _get(channel, qb)
    assert body == b"ping-pong"
    deaths = props.headers["x-death"]
    assert len(deaths) == 2
    # newest first: the entry for qa was updated last
    assert deaths[0]["queue"] == qa and deaths[0]["reason"] == "rejected" and deaths[0]["count"] == 2
    assert deaths[1]["queue"] == qb and deaths[1]["reason"] == "rejected" and deaths[1]["count"] == 1
    assert deaths[0]["exchange"] == "" and deaths[0]["routing-keys"] == [qa]
    assert deaths[1]["exchange"] == "" and deaths[1]["routing-keys"] == [qb]
    assert props.headers["x-first-death-queue"] == qa
    assert props.headers["x-first-death-reason"] == "rejected"
    assert props.headers["x-first-death-exchange"] == ""


def test_death_count_increments_self_loop_with_rejection(channel: BlockingChannel, names: Names) -> None:
    queue = names.queue()
    channel.queue_declare(queue, arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": queue})
    channel.basic_publish("", queue, b"again")
    for expected in (None, 1, 2, 3):
        method, props, _body = _get_manual(channel, queue)
        if expected is None:
            assert not (props.headers or {}).get("x-death")
        else:
            deaths = props.headers["x-death"]
            assert len(deaths) == 1
            assert deaths[0]["count"] == expected
            assert deaths[0]["reason"] == "rejected"
        channel.basic_reject(method.delivery_tag, requeue=False)
    sync(channel)


def test_expiry_cycle_is_dropped(channel: BlockingChannel, names: Names) -> None:
    """queue A (ttl) -> dlx -> A and an observer: A drops it, the observer gets it once."""
    dlx = names.exchange()
    channel.exchange_declare(dlx, "fanout")
    observer = names.queue("compat.observer")
    channel.queue_declare(observer)
    channel.queue_bind(observer, dlx)
    queue = names.queue()
    channel.queue_declare(queue, arguments={"x-message-ttl": 100, "x-dead-letter-exchange": dlx})
    channel.queue_bind(queue, dlx)
    channel.basic_publish("", queue, b"spin?")
    _method, props, body = _get(channel, observer)
    assert body == b"spin?"
    assert props.headers["x-death"][0]["reason"] == "expired"
    # several TTLs later nothing came back around
    for _ in range(5):
        time.sleep(0.15)
        assert _count(channel, queue) == 0
        assert _count(channel, observer) == 0


def test_self_expiry_cycle_via_default_exchange_is_dropped(channel: BlockingChannel, names: Names) -> None:
    queue = names.queue()
    channel.queue_declare(
        queue, arguments={"x-message-ttl": 100, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": queue}
    )
    channel.basic_publish("", queue, b"spin?")
    sync(channel)
    assert _count(channel, queue) == 1
    time.sleep(0.3)
    for _ in range(4):
        assert channel.basic_get(queue, auto_ack=True)[0] is None
        time.sleep(0.1)


# ------------------------------------------------------------------ aio-pika
async def test_dead_letter_aio_pika(amqp_url: str, names: Names) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        ch = await connection.channel()
        dlx = await ch.declare_exchange(names.exchange(), aio_pika.ExchangeType.TOPIC)
        dlq = await ch.declare_queue(names.queue("compat.dlq"))
        await dlq.bind(dlx, routing_key="#")
        source = await ch.declare_queue(
            names.queue(), arguments={"x-dead-letter-exchange": dlx.name, "x-max-length": 5}
        )
        await ch.default_exchange.publish(
            aio_pika.Message(b"aio", headers={"trace": "t1"}), routing_key=source.name
        )
        message = await source.get(timeout=5)
        assert message is not None
        await message.nack(requeue=False)
        dead = None
        for _ in range(100):
            dead = await dlq.get(fail=False)
            if dead is not None:
                break
            await asyncio.sleep(0.02)
        assert dead is not None
        await dead.ack()
        assert dead.body == b"aio"
        assert dead.exchange == dlx.name
        assert dead.routing_key == source.name
        headers: dict[str, Any] = dict(dead.headers)
        assert headers["trace"] == "t1"
        deaths = headers["x-death"]
        assert isinstance(deaths, list) and len(deaths) == 1
        death: dict[str, Any] = deaths[0]
        assert death["count"] == 1
        assert death["reason"] == "rejected"
        assert death["queue"] == source.name
        assert death["exchange"] == ""
        assert list(death["routing-keys"]) == [source.name]
        assert isinstance(death["time"], datetime.datetime)
        assert headers["x-first-death-reason"] == "rejected"
        assert headers["x-first-death-queue"] == source.name
        assert headers["x-first-death-exchange"] == ""
    finally:
        await connection.close()


async def test_ttl_dead_letter_aio_pika(amqp_url: str, names: Names) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        ch = await connection.channel()
        dlq = await ch.declare_queue(names.queue("compat.dlq"))
        source = await ch.declare_queue(
            names.queue(),
            arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq.name, "x-message-ttl": TTL_MS},
        )
        got: asyncio.Queue[aio_pika.abc.AbstractIncomingMessage] = asyncio.Queue()
        await dlq.consume(got.put, no_ack=True)
        await ch.default_exchange.publish(aio_pika.Message(b"late"), routing_key=source.name)
        dead = await asyncio.wait_for(got.get(), 5)
        assert dead.body == b"late"
        headers: dict[str, Any] = dict(dead.headers)
        assert headers["x-death"][0]["reason"] == "expired"
        assert headers["x-first-death-queue"] == source.name
    finally:
        await connection.close()
