"""Channel features behind the advertised capabilities and queue arguments, over the sans-IO
connection: transactions, direct reply-to, consumer priorities, x-overflow nacks, dead-lettering.
"""

from __future__ import annotations

from typing import Any

import pytest
from pamqp import commands

from core.engine.broker import Broker
from core.model.clock import ManualScheduler
from harness.brokers import local_broker
from tests.amqp_client import Client, assemble, connected, publish_bytes
from tests.test_connection_sm import bodies, channel_close, of_type

REPLY_TO = "amq.rabbitmq.reply-to"


@pytest.fixture
def broker() -> Broker:
    return local_broker(scheduler=ManualScheduler())


@pytest.fixture
def client(broker: Broker) -> Client:
    return connected(broker)


def get_all(client: Client, queue: str, channel: int = 1) -> list[bytes]:
    out = []
    while True:
        deliveries, others = assemble(client.call(channel, commands.Basic.Get(queue=queue, no_ack=True)))
        if not deliveries:
            assert of_type(others, commands.Basic.GetEmpty), others
            return out
        out.append(deliveries[0].body)


# ----------------------------------------------------------------- transactions


def test_tx_publish_visible_only_after_commit(broker: Broker, client: Client) -> None:
    client.declare_queue(1, "q")
    client.expect(1, commands.Tx.Select(), commands.Tx.SelectOk)
    client.publish(1, b"a", routing_key="q")
    client.publish(1, b"b", routing_key="q", chunk=1)
    assert broker.vhosts["/"].queues["q"].message_count == 0
    client.expect(1, commands.Tx.Commit(), commands.Tx.CommitOk)
    assert get_all(client, "q") == [b"a", b"b"]


def test_tx_rollback_discards_publishes(client: Client) -> None:
    client.declare_queue(1, "q")
    client.expect(1, commands.Tx.Select(), commands.Tx.SelectOk)
    client.publish(1, b"dropped", routing_key="q")
    client.expect(1, commands.Tx.Rollback(), commands.Tx.RollbackOk)
    client.publish(1, b"kept", routing_key="q")
    client.expect(1, commands.Tx.Commit(), commands.Tx.CommitOk)
    assert get_all(client, "q") == [b"kept"]


def test_tx_acks_apply_at_commit_and_rollback_keeps_them_unacked(broker: Broker) -> None:
    c = connected(broker, channels=(1, 2))
    c.declare_queue(1, "q")
    c.send_raw(b"".join(publish_bytes(2, b"m%d" % i, routing_key="q") for i in range(3)))
    c.expect(1, commands.Tx.Select(), commands.Tx.SelectOk)
    for _ in range(3):
        c.call(1, commands.Basic.Get(queue="q"))
    c.send(1, commands.Basic.Ack(delivery_tag=1))
    c.expect(1, commands.Tx.Rollback(), commands.Tx.RollbackOk)
    # Rolled back: tag 1 is unacked again (not requeued), so it can be acked now.
    c.send(1, commands.Basic.Ack(delivery_tag=2, multiple=True))
    c.send(1, commands.Basic.Reject(delivery_tag=3, requeue=True))
    q = broker.vhosts["/"].queues["q"]
    assert (q.message_count, q.default.unacked) == (0, 3)
    c.expect(1, commands.Tx.Commit(), commands.Tx.CommitOk)
    assert (q.message_count, q.default.unacked) == (1, 0)


def test_tx_channel_close_rolls_back(broker: Broker, client: Client) -> None:
    client.declare_queue(1, "q")
    client.expect(1, commands.Tx.Select(), commands.Tx.SelectOk)
    client.publish(1, b"never", routing_key="q")
    client.expect(1, commands.Channel.Close(reply_code=200, reply_text="", class_id=0, method_id=0),
                  commands.Channel.CloseOk)
    assert broker.vhosts["/"].queues["q"].message_count == 0


def test_tx_mandatory_return_at_commit(client: Client) -> None:
    client.expect(1, commands.Tx.Select(), commands.Tx.SelectOk)
    client.publish(1, b"nowhere", exchange="amq.direct", routing_key="none", mandatory=True)
    assert client.read() == []
    frames = client.call(1, commands.Tx.Commit())
    assert [type(v).__name__ for _, v in frames] == ["Return", "ContentHeader", "ContentBody", "CommitOk"]


@pytest.mark.parametrize(
    "first, second, text",
    [
        (commands.Tx.Select(), commands.Confirm.Select(),
         "PRECONDITION_FAILED - cannot switch from tx to confirm mode"),
        (commands.Confirm.Select(), commands.Tx.Select(),
         "PRECONDITION_FAILED - cannot switch from confirm to tx mode"),
    ],
)
def test_tx_and_confirm_do_not_mix(client: Client, first: Any, second: Any, text: str) -> None:
    client.call(1, first)
    close = channel_close(client.call(1, second), 1)
    assert (close.reply_code, close.reply_text) == (406, text)


@pytest.mark.parametrize("method", [commands.Tx.Commit(), commands.Tx.Rollback()])
def test_tx_commit_without_select_406(client: Client, method: Any) -> None:
    close = channel_close(client.call(1, method), 1)
    assert (close.reply_code, close.reply_text) == (406, "PRECONDITION_FAILED - channel is not transactional")


# ---------------------------------------------------------------- direct reply-to


def test_direct_reply_to_round_trip(broker: Broker) -> None:
    requester = connected(broker)
    server = connected(broker)
    server.declare_queue(1, "rpc")
    server.consume(1, "rpc", tag="srv", no_ack=True)
    requester.consume(1, REPLY_TO, tag="replies", no_ack=True)
    requester.publish(1, b"ping", routing_key="rpc",
                      properties=commands.Basic.Properties(reply_to=REPLY_TO, correlation_id="c1"))
    (request,), _ = assemble(server.read())
    address = request.properties.reply_to
    assert address.startswith(REPLY_TO + ".") and len(address) > len(REPLY_TO) + 8
    assert request.properties.correlation_id == "c1"
    server.publish(1, b"pong", routing_key=address, properties=commands.Basic.Properties(correlation_id="c1"))
    (reply,), _ = assemble(requester.read())
    assert reply.body == b"pong"
    assert reply.method.consumer_tag == "replies"
    assert (reply.method.exchange, reply.method.routing_key) == ("", address)
    assert reply.properties.correlation_id == "c1"
    # Once the requester's channel is gone, the address routes nowhere.
    requester.expect(1, commands.Channel.Close(reply_code=200, reply_text="", class_id=0, method_id=0),
                     commands.Channel.CloseOk)
    server.publish(1, b"late", routing_key=address, mandatory=True)
    returns = of_type(server.read(), commands.Basic.Return)
    assert [r.reply_code for r in returns] == [312]


def test_direct_reply_to_requires_no_ack(client: Client) -> None:
    close = channel_close(client.call(1, commands.Basic.Consume(queue=REPLY_TO, no_ack=False)), 1)
    assert (close.reply_code, close.reply_text) == (406, "PRECONDITION_FAILED - reply consumer cannot acknowledge")


def test_direct_reply_to_publish_without_consumer(client: Client) -> None:
    client.declare_queue(1, "rpc")
    client.publish(1, b"x", routing_key="rpc", properties=commands.Basic.Properties(reply_to=REPLY_TO))
    close = channel_close(client.read(), 1)
    assert (close.reply_code, close.reply_text) == (406, "PRECONDITION_FAILED - fast reply consumer does not exist")


def test_direct_reply_to_cancel(client: Client) -> None:
    client.consume(1, REPLY_TO, tag="r", no_ack=True)
    client.expect(1, commands.Basic.Cancel(consumer_tag="r"), commands.Basic.CancelOk)
    client.declare_queue(1, "rpc")
    client.publish(1, b"x", routing_key="rpc", properties=commands.Basic.Properties(reply_to=REPLY_TO))
    assert channel_close(client.read(), 1).reply_code == 406


def test_direct_reply_to_declare(broker: Broker) -> None:
    requester = connected(broker)
    server = connected(broker, channels=(1, 2, 3))
    ok = server.expect(1, commands.Queue.Declare(queue=REPLY_TO, passive=True), commands.Queue.DeclareOk)
    assert (ok.queue, ok.message_count, ok.consumer_count) == (REPLY_TO, 0, 1)
    requester.consume(1, REPLY_TO, tag="r", no_ack=True)
    requester.declare_queue(1, "rpc")
    requester.publish(1, b"x", routing_key="rpc", properties=commands.Basic.Properties(reply_to=REPLY_TO))
    (request,), _ = assemble(server.call(2, commands.Basic.Get(queue="rpc", no_ack=True)))
    address = request.properties.reply_to
    server.expect(2, commands.Queue.Declare(queue=address, passive=True), commands.Queue.DeclareOk)
    close = channel_close(server.call(3, commands.Queue.Declare(queue=REPLY_TO + ".bogus", passive=True)), 3)
    assert close.reply_code == 404


# ------------------------------------------------------------ consumer priorities


def test_consumer_priority_over_amqp(broker: Broker) -> None:
    c = connected(broker, channels=(1, 2))
    c.declare_queue(1, "q")
    c.expect(1, commands.Basic.Qos(prefetch_count=1), commands.Basic.QosOk)
    c.consume(1, "q", tag="low", arguments={"x-priority": 1})
    c.consume(2, "q", tag="high", arguments={"x-priority": 5}, no_ack=True)
    c.send_raw(b"".join(publish_bytes(1, b"m%d" % i, routing_key="q") for i in range(3)))
    deliveries, _ = assemble(c.read())
    assert [d.method.consumer_tag for d in deliveries] == ["high"] * 3


def test_consumer_priority_must_be_integer(client: Client) -> None:
    client.declare_queue(1, "q")
    frames = client.call(1, commands.Basic.Consume(queue="q", arguments={"x-priority": "high"}))
    assert channel_close(frames, 1).reply_code == 406


# ----------------------------------------------------------- x-overflow / dead letters


def test_reject_publish_nacks_with_confirms(client: Client) -> None:
    client.declare_queue(1, "q", arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
    client.expect(1, commands.Confirm.Select(), commands.Confirm.SelectOk)
    client.send_raw(b"".join(publish_bytes(1, b"m%d" % i, routing_key="q") for i in range(3)))
    confirms = [(type(v).__name__, v.delivery_tag) for _, v in client.read()]
    assert confirms == [("Ack", 1), ("Nack", 2), ("Nack", 3)]
    assert get_all(client, "q") == [b"m0"]


def test_nack_without_requeue_dead_letters_with_x_death(client: Client) -> None:
    client.declare_queue(1, "dlq")
    client.declare_queue(1, "work", arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": "dlq"})
    client.publish(1, b"poison", routing_key="work", properties=commands.Basic.Properties(headers={"k": "v"}))
    client.call(1, commands.Basic.Get(queue="work"))
    client.send(1, commands.Basic.Nack(delivery_tag=1, requeue=False))
    (dead,), _ = assemble(client.call(1, commands.Basic.Get(queue="dlq", no_ack=True)))
    assert dead.body == b"poison"
    assert (dead.method.exchange, dead.method.routing_key) == ("", "dlq")
    headers = dead.properties.headers
    assert headers["k"] == "v"
    (death,) = headers["x-death"]
    assert (death["reason"], death["queue"], death["count"], death["routing-keys"]) == ("rejected", "work", 1, ["work"])


def test_expired_message_dead_lettered_over_amqp(broker: Broker, client: Client) -> None:
    clock = broker.scheduler
    assert isinstance(clock, ManualScheduler)
    client.declare_queue(1, "dlq")
    client.declare_queue(1, "ttl", arguments={"x-message-ttl": 100, "x-dead-letter-exchange": "",
                                              "x-dead-letter-routing-key": "dlq"})
    client.publish(1, b"slow", routing_key="ttl")
    clock.advance(0.2)
    assert get_all(client, "ttl") == []
    (dead,), _ = assemble(client.call(1, commands.Basic.Get(queue="dlq", no_ack=True)))
    assert dead.properties.headers["x-death"][0]["reason"] == "expired"
    assert bodies([dead]) == [b"slow"]
