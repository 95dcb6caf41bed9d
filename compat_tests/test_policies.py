"""Policies applied live on a real node, driven with pika and ``leveret policies`` (the store-level command).

The node reads the store's policies every second (leveret/node/policy_watch.py), so
a policy written by another process reaches its live queues within about a
second; ``leveret ctl set_policy`` (the management API) goes through the same
vhost methods.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pika
import pytest

from harness.node import REPO_ROOT, NodeProcess, _python, node_env

APPLY_WITHIN = 5.0  # the node polls every second; the machine is shared and slow at times


@pytest.fixture
def node(tmp_path: Path) -> Iterator[NodeProcess]:
    n = NodeProcess(tmp_path / "data", tmp_path / "logs")
    n.start()
    try:
        yield n
    finally:
        n.terminate()
        n.cleanup()


@pytest.fixture
def channel(node: NodeProcess) -> Iterator[pika.adapters.blocking_connection.BlockingChannel]:
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    try:
        yield conn.channel()
    finally:
        if conn.is_open:
            conn.close()


def policies(node: NodeProcess, *args: str) -> None:
    out = subprocess.run([_python(), "-m", "leveret", "policies", *args, "--data-dir", str(node.data_dir)],
                         cwd=REPO_ROOT, env=node_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def set_policy(node: NodeProcess, name: str, pattern: str, definition: dict[str, object], *extra: str) -> None:
    policies(node, "set", name, pattern, json.dumps(definition), *extra)


def depth(ch: pika.adapters.blocking_connection.BlockingChannel, queue: str) -> int:
    return int(ch.queue_declare(queue, passive=True).method.message_count)


def eventually(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + APPLY_WITHIN
    while not check():
        assert time.monotonic() < deadline, f"not within {APPLY_WITHIN}s: {what}"
        time.sleep(0.1)


def publish(ch: pika.adapters.blocking_connection.BlockingChannel, queue: str, n: int, prefix: str = "m") -> None:
    for i in range(n):
        ch.basic_publish("", queue, f"{prefix}{i}".encode())


def test_max_length_policy_trims_a_live_queue(node: NodeProcess, channel: pika.adapters.blocking_connection
                                              .BlockingChannel) -> None:
    channel.queue_declare("pol-orders")
    publish(channel, "pol-orders", 5)
    assert depth(channel, "pol-orders") == 5
    set_policy(node, "two", "^pol-orders$", {"max-length": 2}, "--apply-to", "queues")
    eventually(lambda: depth(channel, "pol-orders") == 2, "the live queue trimmed to 2")
    bodies = [channel.basic_get("pol-orders", auto_ack=True)[2] for _ in range(2)]
    assert bodies == [b"m3", b"m4"]  # drop-head: the oldest went
    policies(node, "clear", "two")
    eventually(lambda: (publish(channel, "pol-orders", 4), depth(channel, "pol-orders"))[1] >= 4,
               "the limit lifted once the policy is cleared")


def test_message_ttl_policy(node: NodeProcess, channel: pika.adapters.blocking_connection.BlockingChannel) -> None:
    channel.queue_declare("pol-ttl")
    set_policy(node, "ttl", "^pol-ttl$", {"message-ttl": 200})

    def expired() -> bool:
        channel.queue_purge("pol-ttl")  # published before the policy arrived: no TTL, as in RabbitMQ
        publish(channel, "pol-ttl", 1)
        time.sleep(0.4)
        return depth(channel, "pol-ttl") == 0

    eventually(expired, "messages expire after the policy's TTL")


def test_dead_letter_policy_and_argument_beats_policy(
    node: NodeProcess, channel: pika.adapters.blocking_connection.BlockingChannel
) -> None:
    for q in ("pol-src", "pol-dead", "pol-own", "pol-own-dead"):
        channel.queue_declare(q)
    channel.queue_declare("pol-argq", arguments={"x-dead-letter-exchange": "",
                                                 "x-dead-letter-routing-key": "pol-own-dead"})
    set_policy(node, "dlx", "^pol-(src|argq)$", {"dead-letter-exchange": "", "dead-letter-routing-key": "pol-dead"})
    time.sleep(1.5)  # one poll of the store at least

    def reject_one(queue: str) -> None:
        publish(channel, queue, 1, prefix="dead-")
        method, _props, _body = channel.basic_get(queue, auto_ack=False)
        assert method is not None
        channel.basic_reject(method.delivery_tag, requeue=False)

    eventually(lambda: (reject_one("pol-src"), depth(channel, "pol-dead"))[1] >= 1,
               "a rejected message is dead-lettered by the policy")
    from_policy = depth(channel, "pol-dead")
    reject_one("pol-argq")
    eventually(lambda: depth(channel, "pol-own-dead") == 1, "the queue's own dead-letter arguments win")
    assert depth(channel, "pol-dead") == from_policy  # not also to the policy's queue


def test_operator_policy_caps_argument_and_policy(
    node: NodeProcess, channel: pika.adapters.blocking_connection.BlockingChannel
) -> None:
    channel.queue_declare("pol-capped", arguments={"x-max-length": 10})
    set_policy(node, "eight", "^pol-capped$", {"max-length": 8})
    set_policy(node, "cap", ".*", {"max-length": 3}, "--operator")
    publish(channel, "pol-capped", 6)
    eventually(lambda: depth(channel, "pol-capped") == 3, "the operator policy caps the queue at 3")
    publish(channel, "pol-capped", 6, prefix="n")
    assert depth(channel, "pol-capped") == 3


def test_policies_survive_a_restart(node: NodeProcess) -> None:
    set_policy(node, "two", "^pol-kept", {"max-length": 2})
    node.terminate()
    node.start()
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    try:
        ch = conn.channel()
        ch.queue_declare("pol-kept")
        publish(ch, "pol-kept", 5)
        assert depth(ch, "pol-kept") == 2  # applied at declare: the node loaded it at start
    finally:
        conn.close()


def test_bad_policy_is_refused_by_the_command(node: NodeProcess) -> None:
    out = subprocess.run([_python(), "-m", "leveret", "policies", "set", "bad", "([", '{"max-length": 1}',
                          "--data-dir", str(node.data_dir)], cwd=REPO_ROOT, env=node_env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert "not a regular expression" in out.stderr
    assert "Traceback" not in out.stderr
