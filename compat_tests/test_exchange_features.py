"""Exchange features: alternate exchanges, internal and auto-delete exchanges,
exchange-to-exchange bindings and the x-consistent-hash exchange."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable

import aio_pika
import aiormq.exceptions
import pika
import pika.exceptions
import pytest

from compat_tests.util import BlockingChannel, Names, channel_error, sync, wait_until

pytestmark = pytest.mark.timeout(30)


def _get_bodies(ch: BlockingChannel, queue: str) -> list[bytes]:
    bodies: list[bytes] = []
    while True:
        method, _props, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            return bodies
        bodies.append(body)


def _exchange_exists(connect: Callable[..., pika.BlockingConnection], name: str) -> bool:
    ch = connect().channel()
    try:
        ch.exchange_declare(name, passive=True)
    except pika.exceptions.ChannelClosedByBroker as exc:
        assert exc.reply_code == 404
        return False
    return True


# ------------------------------------------------------- alternate exchange
def test_alternate_exchange_takes_unroutable(channel: BlockingChannel, names: Names) -> None:
    ae = names.exchange("compat.ae")
    channel.exchange_declare(ae, "fanout")
    ae_queue = names.queue("compat.aeq")
    channel.queue_declare(ae_queue)
    channel.queue_bind(ae_queue, ae)
    main = names.exchange()
    channel.exchange_declare(main, "direct", arguments={"alternate-exchange": ae})
    routed = names.queue()
    channel.queue_declare(routed)
    channel.queue_bind(routed, main, routing_key="known")
    channel.confirm_delivery()
    channel.basic_publish(main, "known", b"routed")
    # mandatory: no basic.return (pika would raise UnroutableError) as the AE routes it
    channel.basic_publish(main, "unknown", b"to-ae", mandatory=True)
    channel.basic_publish(main, "other", b"to-ae-2")
    assert _get_bodies(channel, routed) == [b"routed"]
    method, _props, body = channel.basic_get(ae_queue, auto_ack=True)
    assert body == b"to-ae"
    assert method.exchange == main  # published to the original exchange
    assert method.routing_key == "unknown"
    assert _get_bodies(channel, ae_queue) == [b"to-ae-2"]


def test_alternate_exchange_unroutable_too_is_returned(channel: BlockingChannel, names: Names) -> None:
    ae = names.exchange("compat.ae")
    channel.exchange_declare(ae, "direct")
    ae_queue = names.queue("compat.aeq")
    channel.queue_declare(ae_queue)
    channel.queue_bind(ae_queue, ae, routing_key="only-this")
    main = names.exchange()
    channel.exchange_declare(main, "direct", arguments={"alternate-exchange": ae})
    channel.confirm_delivery()
    channel.basic_publish(main, "only-this", b"via-ae", mandatory=True)
    with pytest.raises(pika.exceptions.UnroutableError):
        channel.basic_publish(main, "nowhere", b"lost", mandatory=True)
    assert _get_bodies(channel, ae_queue) == [b"via-ae"]


def test_alternate_exchange_missing_is_harmless(channel: BlockingChannel, names: Names) -> None:
    main = names.exchange()
    channel.exchange_declare(main, "fanout", arguments={"alternate-exchange": names("compat.missing")})
    channel.confirm_delivery()
    with pytest.raises(pika.exceptions.UnroutableError):
        channel.basic_publish(main, "", b"lost", mandatory=True)
    channel.basic_publish(main, "", b"lost-quietly")


async def test_alternate_exchange_aio_pika(amqp_url: str, names: Names) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        ch = await connection.channel(publisher_confirms=True, on_return_raises=True)
        ae = await ch.declare_exchange(names.exchange("compat.ae"), aio_pika.ExchangeType.FANOUT)
        ae_queue = await ch.declare_queue(names.queue("compat.aeq"))
        await ae_queue.bind(ae)
        main = await ch.declare_exchange(
            names.exchange(), aio_pika.ExchangeType.TOPIC, arguments={"alternate-exchange": ae.name}
        )
        await main.publish(aio_pika.Message(b"aio-ae"), routing_key="no.binding", mandatory=True)
        message = await ae_queue.get(timeout=5, no_ack=True)
        assert message is not None and message.body == b"aio-ae"
        assert message.routing_key == "no.binding"
    finally:
        await connection.close()


# ----------------------------------------------------------- internal
def test_internal_exchange_reached_via_binding_only(channel: BlockingChannel, names: Names) -> None:
    internal = names.exchange("compat.internal")
    channel.exchange_declare(internal, "fanout", internal=True)
    front = names.exchange("compat.front")
    channel.exchange_declare(front, "direct")
    channel.exchange_bind(destination=internal, source=front, routing_key="in")
    queue = names.queue()
    channel.queue_declare(queue)
    channel.queue_bind(queue, internal)
    channel.basic_publish(front, "in", b"through")
    channel.basic_publish(front, "out", b"not-bound")
    sync(channel)
    assert _get_bodies(channel, queue) == [b"through"]
    with channel_error(403, "internal"):
        channel.basic_publish(internal, "", b"direct")
        sync(channel)


async def test_internal_exchange_publish_refused_aio_pika(amqp_url: str, names: Names) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        ch = await connection.channel()
        internal = await ch.declare_exchange(names.exchange("compat.internal"), aio_pika.ExchangeType.FANOUT,
                                             internal=True)
        # aio-pika refuses this client-side (ValueError), so publish through the aiormq channel
        underlay = await ch.get_underlay_channel()
        with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
            await underlay.basic_publish(b"no", exchange=internal.name, routing_key="")
            await underlay.exchange_declare(internal.name, passive=True)  # the publish closed the channel
    finally:
        await connection.close()


# ---------------------------------------------------------- auto-delete
def test_auto_delete_exchange_goes_with_last_unbind(
    connect: Callable[..., pika.BlockingConnection], channel: BlockingChannel, names: Names
) -> None:
    exchange = names.exchange()
    channel.exchange_declare(exchange, "direct", auto_delete=True)
    q1 = names.queue()
    q2 = names.queue()
    channel.queue_declare(q1)
    channel.queue_declare(q2)
    # declared but never bound: it stays
    assert _exchange_exists(connect, exchange)
    channel.queue_bind(q1, exchange, routing_key="a")
    channel.queue_bind(q2, exchange, routing_key="b")
    channel.queue_unbind(q1, exchange, routing_key="a")
    assert _exchange_exists(connect, exchange)
    channel.queue_unbind(q2, exchange, routing_key="b")
    assert not _exchange_exists(connect, exchange)


def test_auto_delete_exchange_goes_when_bound_queue_deleted(
    connect: Callable[..., pika.BlockingConnection], channel: BlockingChannel, names: Names
) -> None:
    exchange = names.exchange()
    channel.exchange_declare(exchange, "fanout", auto_delete=True)
    queue = names.queue()
    channel.queue_declare(queue)
    channel.queue_bind(queue, exchange)
    channel.queue_delete(queue)
    assert not _exchange_exists(connect, exchange)


def test_auto_delete_exchange_goes_with_last_exchange_binding(
    connect: Callable[..., pika.BlockingConnection], channel: BlockingChannel, names: Names
) -> None:
    source = names.exchange()
    channel.exchange_declare(source, "fanout", auto_delete=True)
    dest = names.exchange()
    channel.exchange_declare(dest, "fanout")
    channel.exchange_bind(destination=dest, source=source)
    channel.exchange_unbind(destination=dest, source=source)
    assert not _exchange_exists(connect, source)
    assert _exchange_exists(connect, dest)


# ---------------------------------------------------- exchange to exchange
def test_exchange_chain_and_unbind(channel: BlockingChannel, names: Names) -> None:
    x1 = names.exchange("compat.x1")
    x2 = names.exchange("compat.x2")
    x3 = names.exchange("compat.x3")
    channel.exchange_declare(x1, "topic")
    channel.exchange_declare(x2, "direct")
    channel.exchange_declare(x3, "fanout")
    channel.exchange_bind(destination=x2, source=x1, routing_key="a.*")
    channel.exchange_bind(destination=x3, source=x2, routing_key="a.b")
    queue = names.queue()
    channel.queue_declare(queue)
    channel.queue_bind(queue, x3)
    channel.confirm_delivery()
    channel.basic_publish(x1, "a.b", b"hop-hop", mandatory=True)
    with pytest.raises(pika.exceptions.UnroutableError):
        channel.basic_publish(x1, "a.c", b"stops-at-x2", mandatory=True)
    with pytest.raises(pika.exceptions.UnroutableError):
        channel.basic_publish(x1, "b.b", b"stops-at-x1", mandatory=True)
    method, _props, body = channel.basic_get(queue, auto_ack=True)
    assert body == b"hop-hop"
    assert method.exchange == x1
    assert method.routing_key == "a.b"
    channel.exchange_unbind(destination=x3, source=x2, routing_key="a.b")
    with pytest.raises(pika.exceptions.UnroutableError):
        channel.basic_publish(x1, "a.b", b"cut", mandatory=True)
    assert _get_bodies(channel, queue) == []


def test_exchange_binding_cycle_delivers_once(channel: BlockingChannel, names: Names) -> None:
    x1 = names.exchange("compat.x1")
    x2 = names.exchange("compat.x2")
    channel.exchange_declare(x1, "fanout")
    channel.exchange_declare(x2, "fanout")
    channel.exchange_bind(destination=x2, source=x1)
    channel.exchange_bind(destination=x1, source=x2)
    queue = names.queue()
    channel.queue_declare(queue)
    channel.queue_bind(queue, x1)
    channel.queue_bind(queue, x2)
    channel.basic_publish(x1, "", b"once")
    channel.basic_publish(x2, "", b"twice?")
    sync(channel)
    assert _get_bodies(channel, queue) == [b"once", b"twice?"]


def test_exchange_delete_removes_its_bindings(channel: BlockingChannel, names: Names) -> None:
    x1 = names.exchange("compat.x1")
    x2 = names.exchange("compat.x2")
    channel.exchange_declare(x1, "fanout")
    channel.exchange_declare(x2, "fanout")
    channel.exchange_bind(destination=x2, source=x1)
    queue = names.queue()
    channel.queue_declare(queue)
    channel.queue_bind(queue, x2)
    channel.exchange_delete(x2)
    channel.exchange_declare(x2, "fanout")  # same name, fresh, unbound
    channel.queue_bind(queue, x2)
    channel.confirm_delivery()
    with pytest.raises(pika.exceptions.UnroutableError):
        channel.basic_publish(x1, "", b"old-binding-gone", mandatory=True)


async def test_exchange_to_exchange_aio_pika(amqp_url: str, names: Names) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        ch = await connection.channel()
        src = await ch.declare_exchange(names.exchange("compat.src"), aio_pika.ExchangeType.TOPIC)
        dst = await ch.declare_exchange(names.exchange("compat.dst"), aio_pika.ExchangeType.HEADERS)
        await dst.bind(src, routing_key="#")
        queue = await ch.declare_queue(names.queue())
        await queue.bind(dst, arguments={"x-match": "all", "kind": "event"})
        await src.publish(aio_pika.Message(b"matched", headers={"kind": "event"}), routing_key="any.key")
        await src.publish(aio_pika.Message(b"skipped", headers={"kind": "other"}), routing_key="any.key")
        message = await queue.get(timeout=5, no_ack=True)
        assert message is not None and message.body == b"matched"
        await dst.unbind(src, routing_key="#")
        await src.publish(aio_pika.Message(b"after-unbind", headers={"kind": "event"}), routing_key="k")
        await asyncio.sleep(0.1)
        assert await queue.get(fail=False) is None
    finally:
        await connection.close()


# ------------------------------------------------------ consistent hash
def _consume_routing_keys(
    connection: pika.BlockingConnection, ch: BlockingChannel, queues: list[str], total: int
) -> dict[str, list[str]]:
    got: dict[str, list[str]] = defaultdict(list)
    received = 0

    def make(queue: str) -> Callable[..., None]:
        def on_message(c: BlockingChannel, method: pika.spec.Basic.Deliver, props: object, body: bytes) -> None:
            nonlocal received
            got[queue].append(method.routing_key)
            received += 1

        return on_message

    tags = [ch.basic_consume(q, make(q), auto_ack=True) for q in queues]
    assert wait_until(connection, lambda: received >= total, timeout=15), f"got {received} of {total}"
    for tag in tags:
        ch.basic_cancel(tag)
    assert received == total
    return got


def test_consistent_hash_spreads_and_is_stable(
    connection: pika.BlockingConnection, channel: BlockingChannel, names: Names
) -> None:
    exchange = names.exchange("compat.hash")
    channel.exchange_declare(exchange, "x-consistent-hash")
    queues = [names.queue(f"compat.hash{i}") for i in range(4)]
    for q in queues:
        channel.queue_declare(q)
        channel.queue_bind(q, exchange, routing_key="1")
    rng = random.Random(20240611)
    keys = [f"key-{rng.getrandbits(64):016x}" for _ in range(2000)]
    repeated = [f"sticky-{i}" for i in range(20)]
    channel.confirm_delivery()
    for key in keys:
        channel.basic_publish(exchange, key, b"")
    for _ in range(5):
        for key in repeated:
            channel.basic_publish(exchange, key, b"")
    got = _consume_routing_keys(connection, channel, queues, len(keys) + 5 * len(repeated))

    where: dict[str, set[str]] = defaultdict(set)
    for queue, routing_keys in got.items():
        for key in routing_keys:
            where[key].add(queue)
    # every key always lands on the same queue
    assert all(len(qs) == 1 for qs in where.values()), {k: v for k, v in where.items() if len(v) > 1}
    counts = Counter(next(iter(where[key])) for key in keys)
    assert set(counts) == set(queues), counts
    for queue in queues:
        share = counts[queue] / len(keys)
        assert 0.10 <= share <= 0.40, f"{queue} got {share:.1%}: {counts}"
    for key in repeated:
        assert len(where[key]) == 1


def test_consistent_hash_unbound_queue_gets_nothing(channel: BlockingChannel, names: Names) -> None:
    exchange = names.exchange("compat.hash")
    channel.exchange_declare(exchange, "x-consistent-hash")
    q1 = names.queue()
    q2 = names.queue()
    channel.queue_declare(q1)
    channel.queue_declare(q2)
    channel.queue_bind(q1, exchange, routing_key="1")
    channel.queue_bind(q2, exchange, routing_key="1")
    channel.queue_unbind(q2, exchange, routing_key="1")
    for i in range(50):
        channel.basic_publish(exchange, f"k{i}", b"")
    sync(channel)
    deadline = time.monotonic() + 3
    while channel.queue_declare(q1, passive=True).method.message_count < 50 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert channel.queue_declare(q1, passive=True).method.message_count == 50
    assert channel.queue_declare(q2, passive=True).method.message_count == 0


async def test_consistent_hash_aio_pika(amqp_url: str, names: Names) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        ch = await connection.channel(publisher_confirms=True)
        exchange = await ch.declare_exchange(names.exchange("compat.hash"), "x-consistent-hash")
        queues = [await ch.declare_queue(names.queue(f"compat.hash{i}")) for i in range(2)]
        for q in queues:
            await q.bind(exchange, routing_key="1")
        for i in range(200):
            await exchange.publish(aio_pika.Message(b""), routing_key=f"aio-{i}")
        counts = [
            int((await ch.declare_queue(q.name, passive=True)).declaration_result.message_count or 0) for q in queues
        ]
        assert sum(counts) == 200
        assert all(c >= 40 for c in counts), counts
    finally:
        await connection.close()
