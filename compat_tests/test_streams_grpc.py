"""Streams over gRPC against a real node: the geo seed's Publish / Subscribe(map<topic, offset>) shape,
partitioned streams read as one subscription, offsets of every kind, consumer groups and their commits
(across reconnects and a restart), and AMQP on the same streams.
"""

from __future__ import annotations

import socket
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import grpc
import pika
import pytest

from harness.node import NodeProcess
from leveret.client import LeveretError
from leveret.streams_client import FIRST, LAST, NEXT, StreamsClient

pytestmark = pytest.mark.timeout(60)


def _wait_grpc(node: NodeProcess) -> None:
    deadline = time.monotonic() + 15
    while True:
        try:
            socket.create_connection(("127.0.0.1", node.grpc_port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    base = tmp_path_factory.mktemp("streams-grpc")
    n = NodeProcess(base / "data", base / "logs")
    n.start()
    _wait_grpc(n)
    try:
        yield n
    finally:
        n.terminate()


@pytest.fixture
def client(node: NodeProcess) -> Iterator[StreamsClient]:
    with StreamsClient(f"127.0.0.1:{node.grpc_port}") as c:
        yield c


def name(prefix: str = "s") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_geo_seed_publish_subscribe_partitioned(client: StreamsClient) -> None:
    topic = name("orders")
    info = client.create_stream(topic, partitions=4)
    assert info.partitioned and [p.stream for p in info.partitions] == [f"{topic}-{i}" for i in range(4)]
    sent: dict[str, tuple[str, str, int]] = {}
    by_key: dict[str, list[bytes]] = defaultdict(list)
    for i in range(40):
        key = f"customer-{i % 10}"
        body = f"{key}:{i}".encode()
        id_, stream, offset = client.publish(topic, body, key=key)
        sent[id_] = (body.decode(), stream, offset)
        by_key[key].append(body)
    # One key, one partition.
    for key in by_key:
        streams = {s for b, s, _ in sent.values() if b.startswith(key + ":")}
        assert len(streams) == 1, (key, streams)
    with client.subscribe({topic: FIRST}) as sub:
        got = sub.take(40)
    assert len(got) == 40
    for m in got:
        assert m.topic == topic and m.timestamp_ms > 0
        assert sent[m.id] == (m.body.decode(), m.stream, m.offset)
    # Order holds per partition (offsets increase) and therefore per key.
    per_stream: dict[str, list[int]] = defaultdict(list)
    per_key: dict[str, list[bytes]] = defaultdict(list)
    for m in got:
        per_stream[m.stream].append(m.offset)
        per_key[m.key].append(m.body)
    assert all(offsets == sorted(offsets) for offsets in per_stream.values())
    assert per_key == by_key
    # Without a key: round robin over the partitions.
    streams = [client.publish(topic, b"rr")[1] for _ in range(8)]
    assert sorted(streams) == sorted([f"{topic}-{i}" for i in range(4)] * 2)


def test_offsets_of_every_kind(client: StreamsClient) -> None:
    topic = name()
    client.create_stream(topic)
    for i in range(5):
        client.publish(topic, b"a%d" % i)
    time.sleep(0.05)
    cut_ms = int(time.time() * 1000)
    time.sleep(0.05)
    for i in range(5, 8):
        client.publish(topic, b"a%d" % i)

    def offsets(start: int, n: int, **kw: int) -> list[int]:
        with client.subscribe({topic: start}, **kw) as sub:  # type: ignore[arg-type]
            got = sub.take(n, timeout=2 if n else 0.3)
            assert sub.get(0.2) is None
        return [m.offset for m in got]

    assert offsets(FIRST, 8) == list(range(8))
    assert offsets(3, 5) == [3, 4, 5, 6, 7]
    assert offsets(LAST, 1) == [7]
    assert offsets(NEXT, 0) == []
    assert offsets(0, 3, from_timestamp_ms=cut_ms) == [5, 6, 7]
    with pytest.raises(LeveretError) as info:
        client.subscribe({topic: -7})
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(LeveretError) as info:
        client.subscribe({name("missing"): FIRST})
    assert info.value.code == grpc.StatusCode.NOT_FOUND


def test_resume_from_the_offsets_received(client: StreamsClient) -> None:
    topic = name()
    client.create_stream(topic, partitions=2)
    for i in range(10):
        client.publish(topic, b"%d" % i)
    with client.subscribe({topic: FIRST}) as sub:
        first = sub.take(4)
    # Resume each partition after the last offset seen there.
    last: dict[str, int] = {}
    for m in first:
        last[m.stream] = m.offset
    resume = {f"{topic}-{i}": last.get(f"{topic}-{i}", -1) + 1 for i in range(2)}
    with client.subscribe(resume) as sub:
        rest = sub.take(6)
    seen = {(m.stream, m.offset) for m in first + rest}
    assert len(seen) == 10
    assert {m.body for m in first + rest} == {b"%d" % i for i in range(10)}


def test_group_commit_and_resume(client: StreamsClient) -> None:
    topic = name()
    client.create_stream(topic)
    for i in range(6):
        client.publish(topic, b"%d" % i)
    with client.subscribe({topic: FIRST}, group="g") as sub:
        got = sub.take(3)
        client.commit("g", got[-1].stream, got[-1].offset)
    with client.subscribe({topic: FIRST}, group="g") as sub:
        assert [m.offset for m in sub.take(3)] == [3, 4, 5]
    # auto_commit: what was sent counts as processed.
    with client.subscribe({topic: FIRST}, group="auto", auto_commit=True) as sub:
        assert len(sub.take(6)) == 6
        time.sleep(0.2)
    info = client.get_stream(topic)
    assert dict(info.partitions[0].committed) == {"g": 2, "auto": 5}
    # Going back: commit an older offset and the group reads again from there.
    client.commit("g", topic, 0)
    with client.subscribe({topic: FIRST}, group="g") as sub:
        assert [m.offset for m in sub.take(5)] == [1, 2, 3, 4, 5]


def test_group_members_split_partitions(client: StreamsClient) -> None:
    topic = name()
    client.create_stream(topic, partitions=2)
    a = client.subscribe({topic: FIRST}, group="workers")
    b = client.subscribe({topic: FIRST}, group="workers")
    for i in range(20):
        client.publish(topic, b"%d" % i)
    got_a, got_b = a.take(10), b.take(10)
    assert a.get(0.3) is None and b.get(0.1) is None
    assert {m.stream for m in got_a} == {f"{topic}-0"}
    assert {m.stream for m in got_b} == {f"{topic}-1"}
    a.close()
    b.close()


def test_amqp_and_grpc_share_streams(client: StreamsClient, node: NodeProcess) -> None:
    topic = name()
    client.create_stream(topic, partitions=3)
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        for i in range(6):
            ch.basic_publish(topic, f"k{i}", b"amqp-%d" % i)  # the x-partition exchange picks the partition
        _, stream, offset = client.publish(topic, b"grpc", key="k1")
        with client.subscribe({topic: FIRST}) as sub:
            got = sub.take(7)
        assert sorted(m.body for m in got) == sorted([b"amqp-%d" % i for i in range(6)] + [b"grpc"])
        assert {m.key for m in got if m.body in (b"amqp-1", b"grpc")} == {"k1"}
        assert len({m.stream for m in got if m.key == "k1"}) == 1  # same key, same partition, either protocol
        seen: list[tuple[bytes, int]] = []
        ch.basic_qos(prefetch_count=10)
        ch.basic_consume(stream, lambda c, m, p, b: seen.append((b, p.headers["x-stream-offset"])),
                         arguments={"x-stream-offset": offset})
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.05)
        assert seen[0] == (b"grpc", offset)
    finally:
        conn.close()


def test_delete_and_refusals(client: StreamsClient, node: NodeProcess) -> None:
    topic = name()
    client.create_stream(topic, partitions=2, max_age="1h", max_bytes=10_000)
    client.publish(topic, b"x")
    with pytest.raises(LeveretError) as info:
        client.create_stream(topic, partitions=2)
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(LeveretError) as info:
        client.create_stream(topic, partitions=3, exist_ok=True)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(LeveretError) as info:
        client.create_stream(name(), max_age="forever")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    sub = client.subscribe({topic: NEXT})
    assert client.delete_stream(topic) == 1
    with pytest.raises(LeveretError) as info:
        while sub.get(5) is not None:
            pass
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(LeveretError) as info:
        client.get_stream(topic)
    assert info.value.code == grpc.StatusCode.NOT_FOUND


def test_group_offset_survives_restart(tmp_path: Path) -> None:
    node = NodeProcess(tmp_path / "data", tmp_path / "logs")
    node.start()
    _wait_grpc(node)
    topic = name()
    try:
        with StreamsClient(f"127.0.0.1:{node.grpc_port}") as c:
            c.create_stream(topic, partitions=2)
            for i in range(10):
                c.publish(topic, b"%d" % i, key=f"k{i}")
            with c.subscribe({topic: FIRST}, group="g") as sub:
                got = sub.take(10)
            # The group processed the first two messages of each partition.
            committed: dict[str, int] = {}
            for m in got:
                seen = [x for x in got if x.stream == m.stream]
                committed[m.stream] = seen[min(1, len(seen) - 1)].offset
            for stream, offset in committed.items():
                c.commit("g", stream, offset)
        assert node.terminate() == 0
        node.start()
        _wait_grpc(node)
        with StreamsClient(f"127.0.0.1:{node.grpc_port}") as c:
            info = c.get_stream(topic)
            assert {p.stream: p.committed["g"] for p in info.partitions if "g" in p.committed} == committed
            with c.subscribe({topic: FIRST}, group="g") as sub:
                rest = sub.take(10, timeout=1)
            assert rest
            expected = {(p.stream, o) for p in info.partitions
                        for o in range(committed.get(p.stream, -1) + 1, p.next_offset)}
            assert {(m.stream, m.offset) for m in rest} == expected
    finally:
        node.cleanup()


def test_cli_creates_shows_and_deletes(node: NodeProcess, client: StreamsClient) -> None:
    import json
    import subprocess

    from harness.node import REPO_ROOT, _python, node_env

    topic = name("cli")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([_python(), "-m", "leveret", "streams", "--grpc", f"127.0.0.1:{node.grpc_port}", *args],
                              cwd=REPO_ROOT, env=node_env(), capture_output=True, text=True, timeout=60)

    made = cli("create", topic, "--partitions", "3", "--max-age", "7D")
    assert made.returncode == 0, made.stderr
    assert [p["stream"] for p in json.loads(made.stdout)["partitions"]] == [f"{topic}-{i}" for i in range(3)]
    client.publish(topic, b"x", key="a")
    shown = json.loads(cli("info", topic).stdout)
    assert shown["partitioned"] and sum(int(p["messages"]) for p in shown["partitions"]) == 1
    again = cli("create", topic, "--partitions", "4", "--exist-ok")
    assert again.returncode == 1 and "FAILED_PRECONDITION" in again.stderr
    gone = cli("delete", topic)
    assert gone.returncode == 0 and "1 messages dropped" in gone.stdout
    assert cli("info", topic).returncode == 1


def test_example_stream_reader_resumes(node: NodeProcess, client: StreamsClient) -> None:
    import subprocess

    from harness.node import REPO_ROOT, _python, node_env

    topic = name("example")
    client.create_stream(topic, partitions=2)
    for i in range(6):
        client.publish(topic, b"order-%d" % i, key=f"c{i}")

    def reader(count: int) -> list[str]:
        done = subprocess.run(
            [_python(), str(REPO_ROOT / "examples" / "stream_reader.py"), "--target", f"127.0.0.1:{node.grpc_port}",
             "--topic", topic, "--group", "ex", "--count", str(count), "--idle-timeout", "3"],
            cwd=REPO_ROOT, env=node_env(), capture_output=True, text=True, timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return [line.rsplit(" ", 1)[1] for line in done.stdout.splitlines() if "@" in line]

    first = reader(4)
    rest = reader(2)
    assert len(first) == 4 and len(rest) == 2
    assert sorted(first + rest) == [f"order-{i}" for i in range(6)]
