"""A user acts within its rights on every path (issue #26 items 2, 3, 4, 6, 7; docs/SECURITY.md).

One real node process; pika, raw gRPC stubs and plain HTTP as the clients.
"""

from __future__ import annotations

import base64
import functools
import json
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pika
import pytest

from compat_tests.mgmt_http import Mgmt, q, wait_http
from harness.node import NodeProcess
from leveret_client.proto import leveret_pb2 as pb
from leveret_client.proto import leveret_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)
VHOST = "tenant"


@pytest.fixture(scope="module")
def node() -> Iterator[NodeProcess]:
    root = Path(tempfile.mkdtemp(prefix="leveret-tenants-"))
    n = NodeProcess(root / "data", root / "logs")
    n.start()
    m = _mgmt(n)
    m.ok("PUT", f"/api/vhosts/{VHOST}")
    yield n
    if n.running():
        n.terminate()
    shutil.rmtree(root, ignore_errors=True)


def _mgmt(node: NodeProcess, user: str = "guest", password: str = "guest") -> Mgmt:
    m = Mgmt(f"http://127.0.0.1:{node.management_port}", user, password, node.url, leveret=True)
    m.node = node
    wait_http(m)
    return m


def _user(node: NodeProcess, name: str, tags: str, vhost: str = VHOST, configure: str = ".*", write: str = ".*",
          read: str = ".*") -> Mgmt:
    admin = _mgmt(node)
    admin.ok("PUT", f"/api/users/{name}", {"password": name + "-pw", "tags": tags})
    admin.ok("PUT", f"/api/permissions/{q(vhost)}/{name}", {"configure": configure, "write": write, "read": read})
    return admin.as_user(name, name + "-pw")


def _md(user: str, vhost: str = VHOST) -> tuple[tuple[str, str], ...]:
    return (("username", user), ("password", user + "-pw"), ("vhost", vhost))


def _first(method: Any, request: Any, md: Any) -> Any:
    """The first response of a server-streaming call."""
    return next(iter(method(request, metadata=md, timeout=5)))


def _code(call: Any, *args: Any) -> grpc.StatusCode:
    try:
        call(*args)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


# -- item 2: exclusive queues --------------------------------------------------------------------
def test_another_connections_exclusive_queue_is_locked_on_every_path(node: NodeProcess) -> None:
    admin = _mgmt(node)
    with pika.BlockingConnection(pika.URLParameters(node.url)) as conn:
        ch = conn.channel()
        ch.queue_declare("alice.excl", exclusive=True)
        ch.basic_publish("", "alice.excl", b"private")
        path = "/api/queues/%2F/alice.excl"
        for method, sub, body in (("POST", "/get", {"count": 1, "ackmode": "ack_requeue_false", "encoding": "auto"}),
                                  ("DELETE", "/contents", None), ("DELETE", "", None),
                                  ("POST", "/channels", {"name": "spy", "topic": ""}),
                                  ("PUT", "", {"durable": False, "auto_delete": False})):
            reply = admin.request(method, path + sub, body)
            # RabbitMQ runs these as AMQP methods and answers the channel error as 400 "405 RESOURCE_LOCKED - ...".
            assert reply.status == 400, (method, sub, reply)
            assert reply.body["reason"].startswith("405 RESOURCE_LOCKED - cannot obtain exclusive access"), reply
        assert admin.get(path)["messages"] == 1  # reading its figures stays allowed, the message is still there
        with grpc.insecure_channel(f"127.0.0.1:{node.grpc_port}") as channel:
            stub = pb_grpc.BrokerStub(channel)
            md = (("username", "guest"), ("password", "guest"))
            assert _code(_first, stub.Subscribe, pb.SubscribeRequest(channel_id="alice.excl/"), md) \
                == grpc.StatusCode.FAILED_PRECONDITION
            assert _code(lambda: stub.Push(pb.PushRequest(queue="alice.excl", content=b"x"), metadata=md,
                                           timeout=5)) == grpc.StatusCode.FAILED_PRECONDITION
        _, _, got = ch.basic_get("alice.excl", auto_ack=True)
        assert got == b"private"


# -- item 3: closing connections -------------------------------------------------------------------
def _connection_name(admin: Mgmt, user: str) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        names = [c["name"] for c in admin.get("/api/connections") if c["user"] == user]
        if names:
            return names[0]  # type: ignore[no-any-return]
        time.sleep(0.1)
    raise AssertionError(f"no connection of {user} listed")


def test_monitoring_user_reads_but_cannot_close_other_users_connections(node: NodeProcess) -> None:
    admin = _mgmt(node)
    monitor = _user(node, "mon", "monitoring")
    owner = _user(node, "owner", "management")
    params = pika.URLParameters(f"amqp://owner:owner-pw@127.0.0.1:{node.amqp_port}/{VHOST}")
    with pika.BlockingConnection(params) as conn:
        name = _connection_name(admin, "owner")
        path = "/api/connections/" + q(name)
        assert monitor.request("GET", path).status == 200
        reply = monitor.request("DELETE", path)
        assert reply.status == 401, reply
        assert reply.body["reason"] == "User not authorised to access object"
        conn.process_data_events(0.2)
        assert conn.is_open
        owner.ok("DELETE", path)  # its owner may
        with pytest.raises(pika.exceptions.ConnectionClosedByBroker):
            conn.process_data_events(5)
            conn.channel()


# -- item 6: aliveness, the gRPC oracle, WatchCluster ----------------------------------------------------
def test_aliveness_test_checks_permissions_like_any_declare(node: NodeProcess) -> None:
    narrow = _user(node, "narrow", "management", configure=r"^narrow\.")
    reply = narrow.request("GET", f"/api/aliveness-test/{VHOST}")
    assert reply.status == 401, reply
    assert "aliveness-test" not in [x["name"] for x in _mgmt(node).get(f"/api/queues/{VHOST}")]
    # An administrator without permissions in a vhost cannot create queues there either.
    admin = _mgmt(node)
    admin.ok("PUT", "/api/vhosts/noperm")
    admin.ok("DELETE", "/api/permissions/noperm/guest")  # granted to its creator
    assert admin.request("GET", "/api/aliveness-test/noperm").status == 401
    assert admin.get(f"/api/aliveness-test/{q('/')}") == {"status": "ok"}


def test_grpc_checks_permissions_before_existence(node: NodeProcess) -> None:
    _user(node, "prober", "", configure=r"^prober\.", read=r"^prober\.")
    with pika.BlockingConnection(pika.URLParameters(f"amqp://guest:guest@127.0.0.1:{node.amqp_port}/")) as c:
        _mgmt(node).ok("PUT", f"/api/permissions/{VHOST}/guest", {"configure": ".*", "write": ".*", "read": ".*"})
    with pika.BlockingConnection(pika.URLParameters(f"amqp://guest:guest@127.0.0.1:{node.amqp_port}/{VHOST}")) as c:
        c.channel().queue_declare("secret.q")
    with grpc.insecure_channel(f"127.0.0.1:{node.grpc_port}") as channel:
        stub = pb_grpc.BrokerStub(channel)
        md = _md("prober")
        for queue in ("secret.q", "no.such.q"):  # the same answer whether the queue exists or not
            assert _code(functools.partial(stub.DeleteChannel, metadata=md, timeout=5),
                         pb.DeleteChannelRequest(id=f"{queue}/x")) \
                == grpc.StatusCode.PERMISSION_DENIED, queue
            assert _code(_first, stub.Subscribe, pb.SubscribeRequest(channel_id=f"{queue}/"), md) \
                == grpc.StatusCode.PERMISSION_DENIED, queue
        streams = pb_grpc.StreamsStub(channel)
        for topic in ("secret.q", "no.such.stream"):
            request = pb.StreamSubscribeRequest(offsets={topic: pb.OFFSET_FIRST})
            assert _code(_first, streams.Subscribe, request, md) == grpc.StatusCode.PERMISSION_DENIED, topic


def test_watch_cluster_shows_only_the_vhosts_the_user_may_use(node: NodeProcess) -> None:
    _user(node, "watcher", "")
    seen: list[tuple[str, str]] = []
    with grpc.insecure_channel(f"127.0.0.1:{node.grpc_port}") as channel:
        call = pb_grpc.BrokerStub(channel).WatchCluster(pb.WatchClusterRequest(), metadata=_md("watcher"))
        events = iter(call)
        assert next(events).kind == pb.ClusterEvent.NODE_UP

        def read() -> None:
            try:
                for ev in events:
                    seen.append((ev.vhost, ev.queue))
            except grpc.RpcError:
                pass

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        with pika.BlockingConnection(pika.URLParameters(node.url)) as c:
            c.channel().queue_declare("other-tenant.q")
        with pika.BlockingConnection(pika.URLParameters(
                f"amqp://watcher:watcher-pw@127.0.0.1:{node.amqp_port}/{VHOST}")) as c:
            c.channel().queue_declare("watcher.q")
        deadline = time.monotonic() + 10
        while (VHOST, "watcher.q") not in seen and time.monotonic() < deadline:
            time.sleep(0.05)
        call.cancel()
    assert (VHOST, "watcher.q") in seen
    assert [s for s in seen if s[0] != VHOST] == [], "another vhost's queue names were shown"


# -- item 4: deleting a user or revoking a permission ends its streams --------------------------------
def _stream_ends(call: Any) -> list[Any]:
    """Read ``call`` in a thread; the list gets the status code once the stream ends."""
    out: list[Any] = []

    def run() -> None:
        try:
            for _ in call:
                pass
            out.append(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            out.append(exc.code())

    threading.Thread(target=run, daemon=True).start()
    return out


def _wait(ended: list[Any], timeout: float = 10) -> Any:
    deadline = time.monotonic() + timeout
    while not ended and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ended, "the stream did not end"
    return ended[0]


def test_deleting_a_user_ends_its_grpc_streams(node: NodeProcess) -> None:
    admin = _mgmt(node)
    _user(node, "leaver", "")
    with grpc.insecure_channel(f"127.0.0.1:{node.grpc_port}") as channel:
        stub, streams = pb_grpc.BrokerStub(channel), pb_grpc.StreamsStub(channel)
        md = _md("leaver")
        stub.CreateQueue(pb.CreateQueueRequest(name="leaver.q", exist_ok=True), metadata=md, timeout=5)
        streams.CreateStream(pb.CreateStreamRequest(name="leaver.s", exist_ok=True), metadata=md, timeout=5)
        calls = [stub.Subscribe(pb.SubscribeRequest(channel_id="leaver.q/"), metadata=md),
                 stub.WatchCluster(pb.WatchClusterRequest(), metadata=md),
                 streams.Subscribe(pb.StreamSubscribeRequest(offsets={"leaver.s": pb.OFFSET_FIRST}), metadata=md)]
        for call in calls:
            call.initial_metadata()  # in place
        ended = [_stream_ends(c) for c in calls]
        time.sleep(0.2)
        assert not any(ended)
        admin.ok("DELETE", "/api/users/leaver")
        assert [_wait(e) for e in ended] == [grpc.StatusCode.UNAUTHENTICATED] * 3
        # And what is published afterwards reaches nobody through the old streams.
        assert admin.get(f"/api/queues/{VHOST}/leaver.q")["consumers"] == 0


def test_revoking_read_permission_ends_subscriptions(node: NodeProcess) -> None:
    admin = _mgmt(node)
    _user(node, "revoked", "")
    with grpc.insecure_channel(f"127.0.0.1:{node.grpc_port}") as channel:
        stub, streams = pb_grpc.BrokerStub(channel), pb_grpc.StreamsStub(channel)
        md = _md("revoked")
        stub.CreateQueue(pb.CreateQueueRequest(name="revoked.q", exist_ok=True), metadata=md, timeout=5)
        streams.CreateStream(pb.CreateStreamRequest(name="revoked.s", exist_ok=True), metadata=md, timeout=5)
        calls = [stub.Subscribe(pb.SubscribeRequest(channel_id="revoked.q/"), metadata=md),
                 streams.Subscribe(pb.StreamSubscribeRequest(offsets={"revoked.s": pb.OFFSET_FIRST}), metadata=md)]
        watch = stub.WatchCluster(pb.WatchClusterRequest(), metadata=md)
        for call in (*calls, watch):
            call.initial_metadata()
        ended = [_stream_ends(c) for c in calls]
        watch_ended = _stream_ends(watch)
        admin.ok("PUT", f"/api/permissions/{VHOST}/revoked", {"configure": ".*", "write": ".*", "read": "^$"})
        assert [_wait(e) for e in ended] == [grpc.StatusCode.PERMISSION_DENIED] * 2
        time.sleep(0.3)
        assert not watch_ended  # still allowed into the vhost: the watch goes on
        admin.ok("DELETE", f"/api/permissions/{VHOST}/revoked")
        assert _wait(watch_ended) == grpc.StatusCode.PERMISSION_DENIED


# -- item 7: CSRF ------------------------------------------------------------------------------
def _raw(node: NodeProcess, method: str, path: str, body: bytes | None, content_type: str | None) -> int:
    token = base64.b64encode(b"guest:guest").decode()
    headers = {"Authorization": f"Basic {token}"}
    if content_type is not None:
        headers["Content-Type"] = content_type
    req = urllib.request.Request(f"http://127.0.0.1:{node.management_port}{path}", data=body, method=method,
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_state_changing_requests_need_a_json_content_type(node: NodeProcess) -> None:
    """A cross-origin page can POST text/plain, urlencoded or multipart without a CORS preflight."""
    admin = _mgmt(node)
    attack = json.dumps({"users": [{"name": "csrf-admin", "password": "x", "tags": "administrator"}]}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                         None):
        assert _raw(node, "POST", "/api/definitions", attack, content_type) == 415, content_type
        assert _raw(node, "PUT", "/api/users/csrf-admin", b'{"password": "x", "tags": "administrator"}',
                    content_type) == 415, content_type
    assert admin.request("GET", "/api/users/csrf-admin").status == 404
    # JSON (what rabbitmqadmin, `leveret ctl` and the console send) and body-less deletes work.
    assert _raw(node, "PUT", "/api/vhosts/csrf-ok", b"{}", "application/json; charset=utf-8") in (201, 204)
    assert _raw(node, "DELETE", "/api/vhosts/csrf-ok", None, None) == 204


def test_console_pages_are_not_framed_and_carry_a_content_security_policy(node: NodeProcess) -> None:
    for path in ("/", "/console/console.js"):
        with urllib.request.urlopen(f"http://127.0.0.1:{node.management_port}{path}", timeout=10) as resp:
            assert resp.headers["X-Frame-Options"] == "DENY"
            csp = resp.headers["Content-Security-Policy"]
            assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp
