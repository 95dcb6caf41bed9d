"""The one publish path (core/engine/publish.py): when an outcome is settled, and with what answer.

Real parts: SQLite stores with their group committers, and for the remote case
two in-process brokers forwarding over real gRPC (as tests/test_forwarding.py).
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from pamqp import commands, frame

from core.cluster import internal_pb2_grpc as pb_grpc
from core.cluster.auth import PeerAuth
from core.cluster.link import Peers
from core.cluster.remote import QueueRemote
from core.cluster.service import NodeService
from core.durable.durability import Durability
from core.durable.group_commit import GroupCommitter
from core.engine import publish
from core.engine.broker import Broker
from core.engine.queue import Queue
from core.model import properties
from core.model.message import Message
from harness.brokers import local_broker
from persistence.sqlite import SQLiteStore
from tests.amqp_client import connected

PERSISTENT = properties.encode({"delivery_mode": 2})
TRANSIENT = properties.encode({"delivery_mode": 1})
STREAM = {"x-queue-type": "stream"}


async def _durable_broker(path: Path, node_id: str) -> tuple[Broker, GroupCommitter, SQLiteStore]:
    store = SQLiteStore(str(path))
    await store.open()
    committer = GroupCommitter(store)
    broker = Broker(node_id=node_id)
    await Durability(store, committer).restore(broker)
    broker.committer = committer
    return broker, committer, store


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[tuple[Broker, GroupCommitter, SQLiteStore]]:
    broker, committer, store = await _durable_broker(tmp_path / "a.sqlite3", "a")
    try:
        yield broker, committer, store
    finally:
        await committer.drain()
        await store.close()


async def _declared(broker: Broker, committer: GroupCommitter, name: str, **arguments: Any) -> Queue:
    q = broker.vhosts["/"].declare_queue(name, None, durable=True, arguments=arguments)
    await committer.drain()  # the queue and its epoch are stored
    return q


def _send(broker: Broker, routing_key: str, props: bytes, exchange: str = "") -> publish.Outcome:
    vh = broker.vhosts["/"]
    x = vh.exchanges[exchange] if exchange else None
    return publish.publish(broker, vh, x, Message(exchange, routing_key, props, b"body"))


async def test_stream_confirms_after_its_commit_for_every_delivery_mode(node: Any) -> None:
    broker, committer, store = node
    await _declared(broker, committer, "s", **STREAM)
    for props in (TRANSIENT, PERSISTENT):
        outcome = _send(broker, "s", props)
        assert outcome.routed and outcome.accepted
        assert not outcome.settled, "a stream's publish must wait for the commit"
        assert await asyncio.wait_for(outcome.wait(), 5) is True
        assert outcome.settled and outcome.error is None
    assert len(await store.load_range("/", "s", 0, None, 10)) == 2


async def test_classic_queue_confirms_persistent_after_commit_and_transient_at_once(node: Any) -> None:
    broker, committer, store = node
    await _declared(broker, committer, "q")
    transient = _send(broker, "q", TRANSIENT)
    assert transient.settled and transient.ok  # not stored: nothing to wait for
    persistent = _send(broker, "q", PERSISTENT)
    assert not persistent.settled
    seen: list[bool] = []
    persistent.on_settled(seen.append)
    await committer.drain()
    assert seen == [True] and persistent.settled
    assert [m.offset for m in await store.load_messages("/", "q")] == [1]


async def test_failed_commit_fails_the_outcome(node: Any) -> None:
    broker, committer, store = node
    q = await _declared(broker, committer, "q")
    assert q.storage is not None
    await store.claim("/", "q", q.storage.epoch + 1)  # another owner took the queue: our writes are fenced
    outcome = _send(broker, "q", PERSISTENT)
    assert await asyncio.wait_for(outcome.wait(), 5) is False
    assert outcome.error is not None and "store did not commit" in outcome.error


async def test_refusal_is_final_and_unrouted_is_settled(node: Any) -> None:
    broker, committer, _ = node
    await _declared(broker, committer, "full", **{"x-max-length": 1, "x-overflow": "reject-publish"})
    assert _send(broker, "full", TRANSIENT).settled
    refused = _send(broker, "full", PERSISTENT)
    assert refused.settled and not refused.accepted and not refused.ok and refused.routed
    unrouted = _send(broker, "nowhere", PERSISTENT)
    assert unrouted.settled and unrouted.ok and not unrouted.routed


async def test_untracked_publish_registers_nothing(node: Any) -> None:
    broker, committer, _ = node
    await _declared(broker, committer, "q")
    vh = broker.vhosts["/"]
    outcome = publish.publish(broker, vh, None, Message("", "q", PERSISTENT, b"x"), track=False)
    assert outcome is publish.ROUTED


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[tuple[Broker, GroupCommitter, Broker, GroupCommitter]]:
    """Node a (a local durable queue, a stream owned by b) and node b (the stream's owner), each with a store."""
    a, commit_a, store_a = await _durable_broker(tmp_path / "a.sqlite3", "a")
    b, commit_b, store_b = await _durable_broker(tmp_path / "b.sqlite3", "b")
    await _declared(b, commit_b, "s", **STREAM)
    s_on_a = a.vhosts["/"].declare_queue("s", None, durable=True, arguments=STREAM)
    s_on_a.storage = None  # another node owns it: as the coordinator leaves such a queue here

    async def owned(vhost: str, queue: str) -> Queue | None:
        q = b.vhosts[vhost].queues.get(queue)
        return q if q is not None and q.remote is None else None

    auth = PeerAuth(secret=b"a test cluster secret")
    server = grpc.aio.server(interceptors=[auth.server_interceptor()])  # as the cluster port's (auth.py)
    pb_grpc.add_NodeServicer_to_server(NodeService(b, owned, auth), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    peers = Peers(lambda n: f"127.0.0.1:{port}" if n == "b" else None, lambda n: None, auth)
    s_on_a.remote = QueueRemote(s_on_a, peers, "b")
    await _declared(a, commit_a, "local")
    vh = a.vhosts["/"]
    vh.declare_exchange("fan", "fanout", durable=True)
    vh.bind("fan", s_on_a, "", {})
    vh.bind("fan", vh.queues["local"], "", {})
    try:
        yield a, commit_a, b, commit_b
    finally:
        await peers.close()
        await server.stop(0)
        for c, st in ((commit_a, store_a), (commit_b, store_b)):
            await c.drain()
            await st.close()


async def test_forwarded_and_local_settle_together(cluster: Any) -> None:
    a, commit_a, b, _ = cluster
    outcome = _send(a, "", TRANSIENT, exchange="fan")
    # A transient message: the local classic queue does not store it, but the remote stream does,
    # so the outcome waits for the owner's answer, which comes after its commit.
    assert not outcome.settled
    assert await asyncio.wait_for(outcome.wait(), 5) is True
    assert b.vhosts["/"].queues["s"].next_offset == 1
    both = _send(a, "", PERSISTENT, exchange="fan")
    answers: list[bool] = []
    both.on_settled(answers.append)
    assert await asyncio.wait_for(both.wait(), 5) is True
    assert answers == [True]
    assert a.vhosts["/"].queues["local"].message_count == 2


async def test_owner_refusal_fails_the_outcome(cluster: Any) -> None:
    a, _, b, commit_b = cluster
    await _declared(b, commit_b, "full", **{"x-max-length": 0, "x-overflow": "reject-publish"})
    full_on_a = a.vhosts["/"].declare_queue("full", None, durable=False)
    full_on_a.remote = QueueRemote(full_on_a, a.vhosts["/"].queues["s"].remote.peers, "b")
    outcome = _send(a, "full", PERSISTENT)
    assert await asyncio.wait_for(outcome.wait(), 5) is False
    assert outcome.error is not None and "owner" in outcome.error


# -- the AMQP front end: refused at the door, without sockets -------------------------------------


def _bad_header(body: bytes, table: bytes) -> bytes:
    """A content header whose headers table is ``table`` (flags: headers + delivery mode 2)."""
    payload = struct.pack(">HHQH", 60, 0, len(body), 0x2000 | 0x1000) + table + b"\x02"
    return struct.pack(">BHI", 2, 1, len(payload)) + payload + b"\xce"


def _body_frame(body: bytes) -> bytes:
    return struct.pack(">BHI", 3, 1, len(body)) + body + b"\xce"


UNKNOWN_TAG = b"\x00\x00\x00\x04\x01kZ\x00"


@pytest.mark.parametrize("split", [False, True], ids=["whole-publish", "frame-by-frame"])
def test_amqp_publish_with_malformed_headers_closes_only_its_connection_with_502(split: bool) -> None:
    broker = local_broker()
    bad, good = connected(broker), connected(broker)
    good.declare_queue(1, "q")
    method = frame.marshal(commands.Basic.Publish(exchange="", routing_key="q"), 1)
    if split:  # the header alone: refused before the body arrives
        bad.send_raw(method)
        bad.send_raw(_bad_header(b"x", UNKNOWN_TAG))
    else:  # method, header and body in one read: the connection's fast path
        bad.send_raw(method + _bad_header(b"x", UNKNOWN_TAG) + _body_frame(b"x"))
    closes = [v for ch, v in bad.read() if ch == 0 and isinstance(v, commands.Connection.Close)]
    assert len(closes) == 1
    close = closes[0]
    assert close.reply_code == 502 and close.reply_text.startswith("SYNTAX_ERROR - headers do not decode")
    assert broker.vhosts["/"].queues["q"].message_count == 0
    good.publish(1, b"fine", routing_key="q", properties=commands.Basic.Properties(headers={"a": {"b": [1]}}))
    assert broker.vhosts["/"].queues["q"].message_count == 1


# -- sender-selected distribution: CC and BCC route too, BCC is not delivered ------------------------------


def _headers_message(exchange: str, routing_key: str, headers: dict[str, Any]) -> Message:
    return Message(exchange, routing_key, properties.encode({"headers": headers}), b"body")


def _ready_headers(q: Queue) -> list[dict[str, Any]]:
    return [qm.message.headers for qm in q.default.ready]


def test_cc_and_bcc_route_by_every_key_and_bcc_is_taken_out() -> None:
    broker = local_broker()
    vh = broker.vhosts["/"]
    qs = {n: vh.declare_queue(n, None) for n in ("one", "two", "three", "four", "other")}
    for n in ("one", "two", "three", "four"):
        vh.bind("amq.direct", qs[n], n, {})
    m = _headers_message("amq.direct", "one", {"CC": ["two", "three"], "BCC": ["four", "one"], "k": "v"})
    outcome = publish.publish(broker, vh, vh.exchanges["amq.direct"], m)
    assert outcome.routed
    assert [q.message_count for q in qs.values()] == [1, 1, 1, 1, 0]  # "one" named twice: once
    for n in ("one", "two", "three", "four"):
        assert _ready_headers(qs[n]) == [{"CC": ["two", "three"], "k": "v"}], n


def test_cc_on_the_default_exchange_names_more_queues_and_an_unroutable_cc_changes_nothing() -> None:
    broker = local_broker()
    vh = broker.vhosts["/"]
    a, b = vh.declare_queue("a", None), vh.declare_queue("b", None)
    assert publish.publish(broker, vh, None, _headers_message("", "a", {"CC": ["b", "missing"]})).routed
    assert (a.message_count, b.message_count) == (1, 1)
    assert publish.publish(broker, vh, None, _headers_message("", "missing", {"CC": ["b"]})).routed
    assert b.message_count == 2
    assert not publish.publish(broker, vh, None, _headers_message("", "none", {"CC": ["nor-this"]})).routed


def test_cc_that_is_not_an_array_of_strings_is_no_key_and_other_headers_pay_nothing() -> None:
    broker = local_broker()
    vh = broker.vhosts["/"]
    a, b = vh.declare_queue("a", None), vh.declare_queue("b", None)
    for headers in ({"CC": "b"}, {"CC": [1, 2]}, {"ACCEPT": ["b"]}, {"x": "y"}):
        m = _headers_message("", "a", headers)
        assert publish.publish(broker, vh, None, m).routed
        assert a.default.ready[-1].message is m, headers  # the same message: nothing re-encoded
    assert (a.message_count, b.message_count) == (4, 0)


def test_sender_selected_keys_follow_exchange_bindings_and_the_alternate_only_when_none_routes() -> None:
    broker = local_broker()
    vh = broker.vhosts["/"]
    vh.declare_exchange("ae", "fanout")
    vh.declare_exchange("x", "direct", arguments={"alternate-exchange": "ae"})
    vh.declare_exchange("inner", "direct")
    q_inner, q_ae, q_x = (vh.declare_queue(n, None) for n in ("inner-q", "ae-q", "x-q"))
    vh.bind("x", vh.exchanges["inner"], "two", {})
    vh.bind("inner", q_inner, "three", {})
    vh.bind("x", q_x, "one", {})
    vh.bind("ae", q_ae, "", {})
    x = vh.exchanges["x"]
    publish.publish(broker, vh, x, _headers_message("x", "nothing", {"CC": ["two", "three"]}))
    assert (q_inner.message_count, q_ae.message_count, q_x.message_count) == (1, 0, 0)
    publish.publish(broker, vh, x, _headers_message("x", "nothing", {"CC": ["nor-this"]}))
    assert (q_inner.message_count, q_ae.message_count, q_x.message_count) == (1, 1, 0)


# -- the entry checks of a publish (core/engine/entry.py), the same for every front end ------------------


def test_entry_checks_refuse_what_every_front_end_refuses() -> None:
    from core.engine import entry
    from core.engine.broker import Permission
    from core.model.errors import AccessRefused, NotFound, PreconditionFailed

    broker = local_broker()
    broker.add_user("u", "p", vhosts={"/"})
    broker.users["u"].permissions["/"] = Permission("", "^(amq\\.default|t|internal)$", "")
    broker.users["u"].topic_permissions["/"] = {"t": ("^ok\\.", "")}
    broker.user_changed("u")
    vh = broker.vhosts["/"]
    vh.declare_exchange("t", "topic")
    vh.declare_exchange("internal", "direct", internal=True)
    g = broker.access.grants("u", "/")

    def summary(**props: Any) -> properties.PropertySummary:
        return properties.scan(properties.encode(props))

    assert entry.admit(vh, g, "u", "", "q", summary(user_id="u", expiration="1000")) is None
    with pytest.raises(PreconditionFailed, match="user_id property set to 'v'"):
        entry.admit(vh, g, "u", "", "q", summary(user_id="v"))
    with pytest.raises(PreconditionFailed, match="invalid expiration '-1'"):
        entry.admit(vh, g, "u", "", "q", summary(expiration="-1"))
    assert entry.admit(vh, g, "u", "t", "ok.key", summary()) is vh.exchanges["t"]
    with pytest.raises(AccessRefused, match="topic 'no.key'"):
        entry.target(vh, g, "t", "no.key")
    with pytest.raises(AccessRefused, match="internal exchange 'internal'"):
        entry.target(vh, g, "internal", "")
    with pytest.raises(AccessRefused, match="exchange 'missing'"):  # refused before the lookup
        entry.target(vh, g, "missing", "")
    with pytest.raises(NotFound, match="no exchange 'missing'"):
        entry.target(vh, broker.access.grants("guest", "/"), "missing", "")
