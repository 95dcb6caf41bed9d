"""Broker CPU per message without sockets: feed the sans-IO state machines directly.

``python -m bench.inprocess [--messages N] [--profile] [--topic-bindings B]``
publishes N 256-byte messages through one Connection to a queue consumed
(manual acks, multiple every 100) on another, and prints µs per message for
the broker alone. With ``--topic-bindings B`` they go through a topic
exchange carrying B bindings ``dev.<i>.*`` to that queue, with keys that do
not repeat within 20,000 publishes (issue 25's routing case). This
is the number the hot-path work is judged by; the socket benchmarks add the
kernel and the client on top.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import time

from pamqp import body as pbody
from pamqp import commands, frame, header

from amqp_frontend.connection import Connection
from coordination.local import LocalCoordinator
from core.engine.broker import Broker


def _handshake(conn: Connection) -> None:
    conn.receive_data(b"AMQP\x00\x00\x09\x01")
    conn.receive_data(frame.marshal(commands.Connection.StartOk(
        client_properties={"capabilities": {"consumer_cancel_notify": True}},
        mechanism="PLAIN", response="\0guest\0guest", locale="en_US"), 0))
    conn.receive_data(frame.marshal(commands.Connection.TuneOk(channel_max=2047, frame_max=131072, heartbeat=0), 0))
    conn.receive_data(frame.marshal(commands.Connection.Open(virtual_host="/"), 0))
    conn.receive_data(frame.marshal(commands.Channel.Open(), 1))
    conn.data_to_send()


def run(messages: int, profile: bool, topic_bindings: int = 0) -> float:
    broker = Broker(coordinator=LocalCoordinator())
    pub, sub = Connection(broker, peer=("127.0.0.1", 1)), Connection(broker, peer=("127.0.0.1", 2))
    _handshake(pub)
    _handshake(sub)
    sub.receive_data(frame.marshal(commands.Queue.Declare(queue="bench"), 1))
    sub.receive_data(frame.marshal(commands.Basic.Qos(prefetch_count=1000), 1))
    sub.receive_data(frame.marshal(commands.Basic.Consume(queue="bench", consumer_tag="c"), 1))
    sub.data_to_send()
    body = b"x" * 256

    def publish(exchange: str, key: str) -> bytes:
        return (
            frame.marshal(commands.Basic.Publish(exchange=exchange, routing_key=key), 1)
            + frame.marshal(header.ContentHeader(0, len(body), commands.Basic.Properties()), 1)
            + frame.marshal(pbody.ContentBody(body), 1)
        )

    if topic_bindings:
        sub.receive_data(frame.marshal(commands.Exchange.Declare(exchange="bench.t", exchange_type="topic"), 1))
        for i in range(topic_bindings):
            sub.receive_data(frame.marshal(
                commands.Queue.Bind(queue="bench", exchange="bench.t", routing_key=f"dev.{i}.*"), 1))
        sub.data_to_send()
        batches = [b"".join(publish("bench.t", f"dev.{(j * 7919) % topic_bindings}.k{j}")
                            for j in range(b * 100, b * 100 + 100)) for b in range(200)]
    else:
        batches = [publish("", "bench") * 100]
    tag = 0
    gc.set_threshold(50_000, 20, 100)  # as the node does (leveret/node/wiring.py)
    prof = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if prof:
        prof.enable()
    for n in range(messages // 100):
        pub.receive_data(batches[n % len(batches)])
        pub.data_to_send()
        sub.data_to_send()
        tag += 100
        sub.receive_data(frame.marshal(commands.Basic.Ack(delivery_tag=tag, multiple=True), 1))
    if prof:
        prof.disable()
    elapsed = time.perf_counter() - start
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    return elapsed / messages * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--topic-bindings", type=int, default=0,
                        help="publish through a topic exchange with this many bindings dev.<i>.*")
    args = parser.parse_args()
    us = run(args.messages, args.profile, args.topic_bindings)
    print(f"broker cost: {us:.2f} µs/message ({1e6 / us:,.0f} msg/s on one core), publish+deliver+ack, 256 B")


if __name__ == "__main__":
    main()
