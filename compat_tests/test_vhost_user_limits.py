"""RabbitMQ's vhost limits (max-connections, max-queues) and user limits (max-connections, max-channels).

Set with ``leveret ctl`` and the management API; enforced over AMQP with RabbitMQ
3.10.8's codes and texts. Runs against a RabbitMQ too (LEVERET_TEST_MGMT_URL and
LEVERET_TEST_AMQP_URL, compat_tests/mgmt_http.py): ``leveret ctl`` speaks only the
management API.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from urllib.parse import quote, urlsplit

import pika
import pika.exceptions
import pytest

from compat_tests.mgmt_http import Mgmt, q, start_mgmt
from compat_tests.test_management_cli import ctl
from compat_tests.util import assert_reply, channel_error

pytestmark = pytest.mark.timeout(60)
PASSWORD = "limit-secret"


@pytest.fixture(scope="module")
def mgmt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mgmt]:
    yield from start_mgmt(tmp_path_factory.mktemp("limits"))


@pytest.fixture
def vhost(mgmt: Mgmt) -> Iterator[str]:
    name = f"lim-{uuid.uuid4().hex[:8]}"
    mgmt.ok("PUT", f"/api/vhosts/{q(name)}")
    mgmt.ok("PUT", f"/api/permissions/{q(name)}/{q(mgmt.username)}", {"configure": ".*", "write": ".*", "read": ".*"})
    yield name
    mgmt.request("DELETE", f"/api/vhosts/{q(name)}")


@pytest.fixture
def user(mgmt: Mgmt, vhost: str) -> Iterator[str]:
    name = f"lim-u-{uuid.uuid4().hex[:8]}"
    mgmt.ok("PUT", f"/api/users/{q(name)}", {"password": PASSWORD, "tags": ""})
    mgmt.ok("PUT", f"/api/permissions/{q(vhost)}/{q(name)}", {"configure": ".*", "write": ".*", "read": ".*"})
    yield name
    mgmt.request("DELETE", f"/api/users/{q(name)}")


def params(mgmt: Mgmt, vhost: str, user: str | None = None) -> pika.URLParameters:
    parts = urlsplit(mgmt.amqp_url)
    cred = f"{user}:{PASSWORD}" if user else f"{parts.username or 'guest'}:{parts.password or 'guest'}"
    return pika.URLParameters(f"amqp://{cred}@{parts.hostname}:{parts.port or 5672}/{quote(vhost, safe='')}"
                              "?heartbeat=0&connection_attempts=1")


def refused_open(p: pika.URLParameters) -> str:
    """The text of the 530 a connection.open got (pika wraps it in ProbableAccessDeniedError)."""
    with pytest.raises(pika.exceptions.AMQPConnectionError) as info:
        pika.BlockingConnection(p)
    return str(info.value)


def test_vhost_max_connections(mgmt: Mgmt, vhost: str) -> None:
    ctl(mgmt, "set_vhost_limits", "-p", vhost, '{"max-connections": 1}')
    assert mgmt.get(f"/api/vhost-limits/{q(vhost)}") == [{"vhost": vhost, "value": {"max-connections": 1}}]
    first = pika.BlockingConnection(params(mgmt, vhost))
    try:
        text = refused_open(params(mgmt, vhost))
        assert "530" in text and f"access to vhost '{vhost}' refused for user '{mgmt.username}': " \
                                 "connection limit (1) is reached" in text, text
        ctl(mgmt, "clear_vhost_limits", "-p", vhost)
        assert mgmt.get(f"/api/vhost-limits/{q(vhost)}") == []
        pika.BlockingConnection(params(mgmt, vhost)).close()
    finally:
        first.close()


def test_negative_limit_is_no_limit(mgmt: Mgmt, vhost: str) -> None:
    mgmt.ok("PUT", f"/api/vhost-limits/{q(vhost)}/max-connections", {"value": -1})
    conns = [pika.BlockingConnection(params(mgmt, vhost)) for _ in range(2)]
    for c in conns:
        c.close()


def test_vhost_max_queues(mgmt: Mgmt, vhost: str) -> None:
    mgmt.ok("PUT", f"/api/vhost-limits/{q(vhost)}/max-queues", {"value": 1})
    with pika.BlockingConnection(params(mgmt, vhost)) as conn:
        ch = conn.channel()
        ch.queue_declare("q1")
        ch.queue_declare("q1")  # redeclaring what exists is not a new queue
        with channel_error(406, f"cannot declare queue 'q2': queue limit in vhost '{vhost}' (1) is reached"):
            ch.queue_declare("q2")


def test_user_max_connections(mgmt: Mgmt, vhost: str, user: str) -> None:
    ctl(mgmt, "set_user_limits", user, '{"max-connections": 0}')
    assert mgmt.get(f"/api/user-limits/{q(user)}") == [{"user": user, "value": {"max-connections": 0}}]
    text = refused_open(params(mgmt, vhost, user))
    assert "530" in text and f"connection refused for user '{user}': user connection limit (0) is reached" in text
    ctl(mgmt, "clear_user_limits", user, "all")
    assert mgmt.get(f"/api/user-limits/{q(user)}") == []
    pika.BlockingConnection(params(mgmt, vhost, user)).close()


def test_user_max_channels(mgmt: Mgmt, vhost: str, user: str) -> None:
    mgmt.ok("PUT", f"/api/user-limits/{q(user)}/max-channels", {"value": 1})
    conn = pika.BlockingConnection(params(mgmt, vhost, user))
    conn.channel()
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as info:
        conn.channel()
    assert_reply(info.value, 530, f"number of channels opened for user '{user}' has reached the maximum "
                                  "allowed user limit of (1)")


def test_limits_api_refuses_what_rabbitmq_refuses(mgmt: Mgmt, vhost: str, user: str) -> None:
    assert mgmt.request("PUT", f"/api/vhost-limits/{q(vhost)}/max-bogus", {"value": 1}).status == 400
    assert mgmt.request("PUT", f"/api/vhost-limits/{q(vhost)}/max-queues", {"value": "x"}).status == 400
    assert mgmt.request("PUT", f"/api/user-limits/{q(user)}/max-bogus", {"value": 1}).status == 400
    assert mgmt.request("PUT", "/api/user-limits/no-such-user-xyz/max-channels", {"value": 1}).status == 400
    assert mgmt.request("GET", "/api/user-limits/no-such-user-xyz").status == 404
    assert mgmt.request("DELETE", f"/api/vhost-limits/{q(vhost)}/max-connections").status == 204
    monitor = f"lim-plain-{uuid.uuid4().hex[:6]}"
    mgmt.ok("PUT", f"/api/users/{q(monitor)}", {"password": PASSWORD, "tags": "management"})
    try:
        plain = mgmt.as_user(monitor, PASSWORD)
        assert plain.request("PUT", f"/api/vhost-limits/{q(vhost)}/max-queues", {"value": 1}).status == 401
    finally:
        mgmt.request("DELETE", f"/api/users/{q(monitor)}")


def test_definitions_carry_limits_as_rabbitmq_exports_them(mgmt: Mgmt, vhost: str, user: str) -> None:
    """RabbitMQ 3.10.8 exports a user's limits on the user and a vhost's as a vhost-limits parameter."""
    mgmt.ok("PUT", f"/api/vhost-limits/{q(vhost)}/max-queues", {"value": 7})
    mgmt.ok("PUT", f"/api/user-limits/{q(user)}/max-channels", {"value": 4})
    exported = mgmt.get("/api/definitions")
    key, entry = next((k, u) for k in ("users", "leveret_users") for u in exported.get(k, []) if u["name"] == user)
    assert entry["limits"] == {"max-channels": 4}
    param = [p for p in exported["parameters"] if p["vhost"] == vhost and p["component"] == "vhost-limits"]
    assert param == [{"vhost": vhost, "component": "vhost-limits", "name": "limits", "value": {"max-queues": 7}}]
    mgmt.ok("DELETE", f"/api/vhost-limits/{q(vhost)}/max-queues")
    mgmt.ok("DELETE", f"/api/user-limits/{q(user)}/max-channels")
    mgmt.ok("POST", "/api/definitions", {key: [entry], "parameters": param})
    assert mgmt.get(f"/api/vhost-limits/{q(vhost)}") == [{"vhost": vhost, "value": {"max-queues": 7}}]
    assert mgmt.get(f"/api/user-limits/{q(user)}") == [{"user": user, "value": {"max-channels": 4}}]


def test_limits_come_before_the_vhost_access_check(mgmt: Mgmt, vhost: str) -> None:
    """RabbitMQ 3.10.8's order at connection.open: vhost limit, user limit, then the vhost access check."""
    name = f"lim-none-{uuid.uuid4().hex[:6]}"
    mgmt.ok("PUT", f"/api/users/{q(name)}", {"password": PASSWORD, "tags": ""})  # no permission in vhost
    try:
        mgmt.ok("PUT", f"/api/user-limits/{q(name)}/max-connections", {"value": 0})
        mgmt.ok("PUT", f"/api/vhost-limits/{q(vhost)}/max-connections", {"value": 0})
        assert "access to vhost" in refused_open(params(mgmt, vhost, name))
        mgmt.ok("DELETE", f"/api/vhost-limits/{q(vhost)}/max-connections")
        assert "user connection limit (0)" in refused_open(params(mgmt, vhost, name))
        mgmt.ok("DELETE", f"/api/user-limits/{q(name)}/max-connections")
        text = refused_open(params(mgmt, vhost, name))
        assert f"access to vhost '{vhost}' refused for user '{name}'" in text and "limit" not in text
    finally:
        mgmt.request("DELETE", f"/api/users/{q(name)}")
