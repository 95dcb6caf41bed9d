"""gRPC checks credentials before it takes a request's body (issue #26 item 15; core/grpc_api/auth_first.py).

Four unauthenticated 120 MiB ``Push`` calls used to take a node from ~160 to
~900 MiB of RSS before each was refused. The node's peak RSS (``VmHWM``) must
now stay near its resting size while they are refused.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from bench.hostile import unauthenticated_pushes
from compat_tests.mgmt_http import Mgmt, wait_http
from harness.node import NodeProcess
from leveret.node.grpc_server import MAX_CONCURRENT_STREAMS
from leveret_client.proto import leveret_pb2 as pb
from leveret_client.proto import leveret_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(180)
BIG = 120 * 1024 * 1024
OPTIONS = [("grpc.max_send_message_length", 256 * 1024 * 1024),
           ("grpc.max_receive_message_length", 256 * 1024 * 1024)]
GUEST = (("username", "guest"), ("password", "guest"))


@pytest.fixture(scope="module")
def node() -> Iterator[NodeProcess]:
    root = Path(tempfile.mkdtemp(prefix="leveret-grpc-auth-"))
    n = NodeProcess(root / "data", root / "logs")
    n.start()
    yield n
    if n.running():
        n.terminate()
    shutil.rmtree(root, ignore_errors=True)


def _status(pid: int, field: str) -> int:
    """A /proc/<pid>/status size field (VmRSS, VmHWM) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) // 1024
    raise AssertionError(f"no {field} for {pid}")


def _code(call: object) -> grpc.StatusCode:
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_unauthenticated_large_pushes_are_refused_before_their_body_is_read(node: NodeProcess) -> None:
    target = f"127.0.0.1:{node.grpc_port}"
    with grpc.insecure_channel(target) as channel:  # warm: the first calls' allocations are not the attack's
        pb_grpc.BrokerStub(channel).CreateQueue(pb.CreateQueueRequest(name="big", exist_ok=True), metadata=GUEST,
                                                timeout=10)
    rest, rest_peak = _status(node.pid, "VmRSS"), _status(node.pid, "VmHWM")
    codes = unauthenticated_pushes(node.grpc_port, 4, BIG)  # none, a user alone, a wrong password
    peak = _status(node.pid, "VmHWM")
    print(f"\nnode RSS at rest {rest} MiB (peak so far {rest_peak}), peak during 4 unauthenticated 120 MiB "
          f"pushes {peak} MiB")
    assert codes == ["UNAUTHENTICATED"] * 4
    assert peak - rest < 64, f"the node took {peak - rest} MiB for refused calls"


def test_credentials_that_stop_working_take_the_checked_path_again(node: NodeProcess) -> None:
    """Pushes with credentials that logged in skip the detour; a password change ends that at once."""
    mgmt = Mgmt(f"http://127.0.0.1:{node.management_port}", "guest", "guest", node.url, leveret=True)
    wait_http(mgmt)
    mgmt.ok("PUT", "/api/users/pusher", {"password": "old", "tags": ""})
    mgmt.ok("PUT", "/api/permissions/%2F/pusher", {"configure": ".*", "write": ".*", "read": ".*"})
    old = (("username", "pusher"), ("password", "old"))
    with grpc.insecure_channel(f"127.0.0.1:{node.grpc_port}", options=OPTIONS) as channel:
        stub = pb_grpc.BrokerStub(channel)
        stub.CreateQueue(pb.CreateQueueRequest(name="pushed", exist_ok=True), metadata=old, timeout=10)
        stub.Push(pb.PushRequest(queue="pushed", content=b"ok"), metadata=old, timeout=10)
        mgmt.ok("PUT", "/api/users/pusher", {"password": "new", "tags": ""})
        before = _status(node.pid, "VmHWM")
        assert _code(lambda: stub.Push(pb.PushRequest(queue="pushed", content=b"\x00" * BIG), metadata=old,
                                       timeout=60)) == grpc.StatusCode.UNAUTHENTICATED
        assert _status(node.pid, "VmHWM") - before < 64


def test_administrative_calls_have_a_small_receive_limit(node: NodeProcess) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{node.grpc_port}", options=OPTIONS) as channel:
        stub = pb_grpc.BrokerStub(channel)
        huge = pb.CreateQueueRequest(name="q" * (5 * 1024 * 1024))
        try:
            stub.CreateQueue(huge, metadata=GUEST, timeout=30)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
            assert "over this call's limit" in (exc.details() or "")
        else:
            raise AssertionError("a 5 MiB CreateQueue was taken")
        # Pushes take the node's message size; answers as before.
        stub.CreateQueue(pb.CreateQueueRequest(name="sized", exist_ok=True), metadata=GUEST, timeout=10)
        stub.Push(pb.PushRequest(queue="sized", content=b"x" * (8 * 1024 * 1024)), metadata=GUEST, timeout=30)


def test_concurrent_streams_per_connection_are_bounded(node: NodeProcess) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{node.grpc_port}") as channel:
        stub = pb_grpc.BrokerStub(channel)
        watches = [stub.WatchCluster(pb.WatchClusterRequest(), metadata=GUEST) for _ in range(MAX_CONCURRENT_STREAMS)]
        try:
            for w in watches[:1]:
                next(iter(w))
            # Every stream of this connection is taken: one more call waits for a free one.
            assert _code(lambda: stub.Nodes(pb.NodesRequest(), metadata=GUEST, timeout=2)) \
                == grpc.StatusCode.DEADLINE_EXCEEDED
            # Another connection (its own subchannel: channels to one target share one otherwise) is served.
            with grpc.insecure_channel(f"127.0.0.1:{node.grpc_port}",
                                       options=[("grpc.use_local_subchannel_pool", 1)]) as other:
                pb_grpc.BrokerStub(other).Nodes(pb.NodesRequest(), metadata=GUEST, timeout=10)
        finally:
            for w in watches:
                w.cancel()
