"""RabbitMQ's permission model over AMQP (pika): every row of the access-control table.

Users, vhosts and permissions are set through the management API, so the same
suite runs against a RabbitMQ: ``LEVERET_TEST_MGMT_URL=http://guest:guest@host:15672``
and ``LEVERET_TEST_AMQP_URL=amqp://guest:guest@host:5672/`` (compat_tests/mgmt_http.py).

The user ``u`` holds configure ``^(cfg|all)\\.``, write ``^(w|all)\\.``, read
``^(r|all)\\.`` in a fresh vhost, so each name grants exactly the permissions its
prefix says; an administrator made the resources the user only uses.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

import pika
import pika.exceptions
import pytest

from compat_tests.mgmt_http import Mgmt, q, start_mgmt
from compat_tests.util import BlockingChannel, assert_reply, channel_error

pytestmark = pytest.mark.timeout(60)

PASSWORD = "perm-secret"
CONFIGURE, WRITE, READ = r"^(cfg|all)\.", r"^(w|all)\.", r"^(r|all)\."


@dataclass
class Env:
    mgmt: Mgmt
    vhost: str
    user: str

    def params(self, user: str | None = None, password: str = PASSWORD, vhost: str | None = None) -> pika.URLParameters:
        parts = urlsplit(self.mgmt.amqp_url)
        v = quote(self.vhost if vhost is None else vhost, safe="")
        return pika.URLParameters(f"amqp://{user or self.user}:{password}@{parts.hostname}:{parts.port or 5672}/{v}"
                                  "?heartbeat=0&connection_attempts=1")

    def admin_params(self) -> pika.URLParameters:
        parts = urlsplit(self.mgmt.amqp_url)
        return pika.URLParameters(f"amqp://{parts.username or 'guest'}:{parts.password or 'guest'}@{parts.hostname}:"
                                  f"{parts.port or 5672}/{quote(self.vhost, safe='')}?heartbeat=0")

    def add_user(self, name: str, configure: str | None, write: str = "", read: str = "") -> None:
        self.mgmt.ok("PUT", f"/api/users/{q(name)}", {"password": PASSWORD, "tags": ""})
        if configure is not None:
            self.set_permissions(name, configure, write, read)

    def set_permissions(self, name: str, configure: str, write: str, read: str) -> None:
        self.mgmt.ok("PUT", f"/api/permissions/{q(self.vhost)}/{q(name)}",
                     {"configure": configure, "write": write, "read": read})


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def mgmt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mgmt]:
    yield from start_mgmt(tmp_path_factory.mktemp("perms"))


@pytest.fixture(scope="module")
def env(mgmt: Mgmt) -> Iterator[Env]:
    vhost, user = _unique("perm-vh"), _unique("perm-u")
    mgmt.ok("PUT", f"/api/vhosts/{q(vhost)}")
    mgmt.ok("PUT", f"/api/permissions/{q(vhost)}/{q(mgmt.username)}", {"configure": ".*", "write": ".*", "read": ".*"})
    e = Env(mgmt, vhost, user)
    e.add_user(user, CONFIGURE, WRITE, READ)
    # What the user uses but may not make: made by the administrator.
    with pika.BlockingConnection(e.admin_params()) as conn:
        ch = conn.channel()
        for x in ("w.x", "r.x", "all.x", "none.x"):
            ch.exchange_declare(x, "direct")
        ch.exchange_declare("all.topic", "topic")
        for name in ("w.q", "r.q", "all.q", "none.q"):
            ch.queue_declare(name)
    yield e
    for name in (user,):
        mgmt.request("DELETE", f"/api/users/{q(name)}")
    mgmt.request("DELETE", f"/api/vhosts/{q(vhost)}")


@pytest.fixture
def connect(env: Env) -> Iterator[Callable[..., pika.BlockingConnection]]:
    opened: list[pika.BlockingConnection] = []

    def factory(**kw: Any) -> pika.BlockingConnection:
        conn = pika.BlockingConnection(env.params(**kw))
        opened.append(conn)
        return conn

    yield factory
    for conn in opened:
        try:
            if conn.is_open:
                conn.close()
        except pika.exceptions.AMQPError:
            pass  # a test deleted its user: the broker closed it first


@pytest.fixture
def ch(connect: Callable[..., pika.BlockingConnection]) -> BlockingChannel:
    return connect().channel()


def refused(env: Env, kind: str, name: str, user: str | None = None) -> str:
    """RabbitMQ's text (rabbit_access_control: "access to ~s refused for user '~s'")."""
    return f"access to {kind} '{name}' in vhost '{env.vhost}' refused for user '{user or env.user}'"


# -- vhost access ----------------------------------------------------------------
def test_user_without_permissions_cannot_open_the_vhost(env: Env) -> None:
    other = _unique("perm-none")
    env.add_user(other, None)
    try:
        with pytest.raises(pika.exceptions.AMQPConnectionError) as info:
            pika.BlockingConnection(env.params(user=other))
        # pika wraps the 530 close in ProbableAccessDeniedError / ConnectionClosedByBroker.
        text = str(info.value)
        assert "530" in text or "NOT_ALLOWED" in text or "access" in text.lower(), text
    finally:
        env.mgmt.request("DELETE", f"/api/users/{q(other)}")


# -- queue.declare ----------------------------------------------------------------
def test_queue_declare_needs_configure(env: Env, ch: BlockingChannel) -> None:
    ch.queue_declare("cfg.q1", auto_delete=True)
    with channel_error(403, refused(env, "queue", "w.q1")):
        ch.queue_declare("w.q1")


def test_server_named_queue_is_checked_under_its_generated_name(env: Env, ch: BlockingChannel) -> None:
    with channel_error(403, "access to queue 'amq.gen-"):
        ch.queue_declare("", exclusive=True)


def test_passive_queue_declare_needs_nothing(env: Env, ch: BlockingChannel) -> None:
    assert ch.queue_declare("none.q", passive=True).method.queue == "none.q"


def test_queue_declare_with_dlx_needs_write_on_it_and_read_on_the_queue(env: Env,
                                                                       ch: BlockingChannel) -> None:
    ch.queue_declare("all.dlq", auto_delete=True, arguments={"x-dead-letter-exchange": "w.x"})
    ch.queue_declare("all.dlq-default", auto_delete=True, arguments={"x-dead-letter-exchange": "all.dead"})


def test_queue_declare_with_dlx_refused_without_write_on_the_dlx(env: Env, ch: BlockingChannel) -> None:
    with channel_error(403, refused(env, "exchange", "r.x")):
        ch.queue_declare("all.dlq2", arguments={"x-dead-letter-exchange": "r.x"})


def test_queue_declare_with_dlx_refused_without_read_on_the_queue(env: Env, ch: BlockingChannel) -> None:
    with channel_error(403, refused(env, "queue", "cfg.dlq")):
        ch.queue_declare("cfg.dlq", arguments={"x-dead-letter-exchange": "w.x"})


# -- queue.delete -----------------------------------------------------------------
def test_queue_delete_needs_configure(env: Env, ch: BlockingChannel) -> None:
    ch.queue_declare("cfg.del")
    ch.queue_delete("cfg.del")
    with channel_error(403, refused(env, "queue", "w.q")):
        ch.queue_delete("w.q")


# -- exchange.declare / delete ------------------------------------------------------
def test_exchange_declare_needs_configure(env: Env, ch: BlockingChannel) -> None:
    ch.exchange_declare("cfg.x1", "fanout", auto_delete=True)
    with channel_error(403, refused(env, "exchange", "w.x1")):
        ch.exchange_declare("w.x1", "fanout")


def test_passive_exchange_declare_needs_nothing(env: Env, ch: BlockingChannel) -> None:
    ch.exchange_declare("none.x", "direct", passive=True)


def test_exchange_declare_with_ae_needs_write_on_it_and_read_on_the_exchange(env: Env,
                                                                            ch: BlockingChannel) -> None:
    ch.exchange_declare("all.ae", "direct", auto_delete=True, arguments={"alternate-exchange": "w.x"})


def test_exchange_declare_with_ae_refused_without_write_on_the_ae(env: Env, ch: BlockingChannel) -> None:
    with channel_error(403, refused(env, "exchange", "r.x")):
        ch.exchange_declare("all.ae2", "direct", arguments={"alternate-exchange": "r.x"})


def test_exchange_declare_with_ae_refused_without_read_on_the_exchange(env: Env, ch: BlockingChannel) -> None:
    with channel_error(403, refused(env, "exchange", "cfg.ae")):
        ch.exchange_declare("cfg.ae", "direct", arguments={"alternate-exchange": "w.x"})


def test_exchange_delete_needs_configure(env: Env, ch: BlockingChannel) -> None:
    ch.exchange_declare("cfg.xdel", "fanout")
    ch.exchange_delete("cfg.xdel")
    with channel_error(403, refused(env, "exchange", "w.x")):
        ch.exchange_delete("w.x")


# -- queue.bind / unbind --------------------------------------------------------------
def test_queue_bind_needs_write_on_queue_and_read_on_exchange(env: Env, ch: BlockingChannel) -> None:
    ch.queue_bind("w.q", "r.x", "k")
    ch.queue_unbind("w.q", "r.x", "k")


def test_queue_bind_refused_without_write_on_the_queue(env: Env, ch: BlockingChannel) -> None:
    with channel_error(403, refused(env, "queue", "r.q")):
        ch.queue_bind("r.q", "r.x", "k")


def test_queue_bind_refused_without_read_on_the_exchange(env: Env, ch: BlockingChannel) -> None:
    with channel_error(403, refused(env, "exchange", "w.x")):
        ch.queue_bind("w.q", "w.x", "k")


def test_queue_unbind_refused_without_write_on_the_queue(env: Env, ch: BlockingChannel) -> None:
    with channel_error(403, refused(env, "queue", "r.q")):
        ch.queue_unbind("r.q", "r.x", "k")


def test_queue_unbind_refused_without_read_on_the_exchange(env: Env, ch: BlockingChannel) -> None:
    with channel_error(403, refused(env, "exchange", "w.x")):
        ch.queue_unbind("w.q", "w.x", "k")


# -- exchange.bind / unbind -----------------------------------------------------------
def test_exchange_bind_needs_write_on_destination_and_read_on_source(env: Env, ch: BlockingChannel) -> None:
    ch.exchange_bind(destination="w.x", source="r.x", routing_key="k")
    ch.exchange_unbind(destination="w.x", source="r.x", routing_key="k")


def test_exchange_bind_refused_without_write_on_the_destination(env: Env, ch: BlockingChannel) -> None:
    with channel_error(403, refused(env, "exchange", "r.x")):
        ch.exchange_bind(destination="r.x", source="r.x", routing_key="k")


def test_exchange_bind_refused_without_read_on_the_source(env: Env, ch: BlockingChannel) -> None:
    with channel_error(403, refused(env, "exchange", "w.x")):
        ch.exchange_bind(destination="w.x", source="w.x", routing_key="k")


def test_exchange_unbind_refused_without_write_on_the_destination(env: Env, ch: BlockingChannel) -> None:
    with channel_error(403, refused(env, "exchange", "none.x")):
        ch.exchange_unbind(destination="none.x", source="r.x", routing_key="k")


def test_exchange_unbind_refused_without_read_on_the_source(env: Env, ch: BlockingChannel) -> None:
    with channel_error(403, refused(env, "exchange", "none.x")):
        ch.exchange_unbind(destination="w.x", source="none.x", routing_key="k")


# -- basic.publish -----------------------------------------------------------------------
def test_publish_needs_write_on_the_exchange(env: Env, ch: BlockingChannel) -> None:
    ch.confirm_delivery()
    ch.basic_publish("w.x", "k", b"m")
    with channel_error(403, refused(env, "exchange", "r.x")):
        ch.basic_publish("r.x", "k", b"m")


def test_publish_to_default_exchange_is_write_on_amq_default(env: Env, ch: BlockingChannel,
                                                             connect: Callable[..., pika.BlockingConnection]) -> None:
    ch.confirm_delivery()
    with channel_error(403, refused(env, "exchange", "amq.default")):
        ch.basic_publish("", "all.q", b"m")
    other = _unique("perm-def")
    env.add_user(other, "", r"^amq\.default$", "")
    try:
        och = connect(user=other).channel()
        och.confirm_delivery()
        och.basic_publish("", "all.q", b"m")
    finally:
        env.mgmt.request("DELETE", f"/api/users/{q(other)}")


# -- basic.get / basic.consume / queue.purge ---------------------------------------------
def test_get_needs_read_on_the_queue(env: Env, ch: BlockingChannel) -> None:
    ch.basic_get("r.q", auto_ack=True)
    with channel_error(403, refused(env, "queue", "w.q")):
        ch.basic_get("w.q", auto_ack=True)


def test_consume_needs_read_on_the_queue(env: Env, ch: BlockingChannel) -> None:
    tag = ch.basic_consume("r.q", lambda *a: None)
    ch.basic_cancel(tag)
    with channel_error(403, refused(env, "queue", "w.q")):
        ch.basic_consume("w.q", lambda *a: None)


def test_purge_needs_read_on_the_queue(env: Env, ch: BlockingChannel) -> None:
    ch.queue_purge("r.q")
    with channel_error(403, refused(env, "queue", "w.q")):
        ch.queue_purge("w.q")


def test_refusal_comes_before_not_found(env: Env, ch: BlockingChannel) -> None:
    """RabbitMQ checks the permission before it looks the queue up: 403, not 404."""
    with channel_error(403, refused(env, "queue", "w.missing")):
        ch.basic_get("w.missing")


# -- regex semantics -----------------------------------------------------------------------
def test_regexes_are_unanchored_and_empty_means_nothing(env: Env,
                                                        connect: Callable[..., pika.BlockingConnection]) -> None:
    other = _unique("perm-loose")
    env.add_user(other, "cfg", "", "")
    try:
        och = connect(user=other).channel()
        och.queue_declare("x-cfg-y", auto_delete=True)  # "cfg" matches inside: re:run is a search
        och.confirm_delivery()
        with channel_error(403, refused(env, "exchange", "all.x", other)):
            och.basic_publish("all.x", "k", b"m")  # write "": nothing
    finally:
        env.mgmt.request("DELETE", f"/api/users/{q(other)}")


# -- topic permissions -------------------------------------------------------------------
@pytest.fixture
def topic_user(env: Env) -> Iterator[str]:
    other = _unique("perm-topic")
    env.add_user(other, ".*", ".*", ".*")
    env.mgmt.ok("PUT", f"/api/topic-permissions/{q(env.vhost)}/{q(other)}",
                {"exchange": "all.topic", "write": r"^pub\.", "read": r"^sub\."})
    yield other
    env.mgmt.request("DELETE", f"/api/users/{q(other)}")


def test_topic_write_permission_on_publish(env: Env, topic_user: str,
                                           connect: Callable[..., pika.BlockingConnection]) -> None:
    och = connect(user=topic_user).channel()
    och.confirm_delivery()
    och.basic_publish("all.topic", "pub.a", b"m")
    och.basic_publish("w.x", "anything", b"m")  # a direct exchange: no topic check
    with channel_error(403, f"access to topic 'x.a' in exchange 'all.topic' in vhost '{env.vhost}' "
                            f"refused for user '{topic_user}'"):
        och.basic_publish("all.topic", "x.a", b"m")


def test_topic_read_permission_on_bind(env: Env, topic_user: str,
                                       connect: Callable[..., pika.BlockingConnection]) -> None:
    och = connect(user=topic_user).channel()
    och.queue_bind("all.q", "all.topic", "sub.#")
    och.queue_unbind("all.q", "all.topic", "sub.#")
    with channel_error(403, f"access to topic 'pub.#' in exchange 'all.topic' in vhost '{env.vhost}' "
                            f"refused for user '{topic_user}'"):
        och.queue_bind("all.q", "all.topic", "pub.#")


# -- changes apply to open connections ------------------------------------------------------
def test_permission_change_applies_to_an_open_connection(env: Env,
                                                         connect: Callable[..., pika.BlockingConnection]) -> None:
    other = _unique("perm-live")
    env.add_user(other, ".*", ".*", ".*")
    try:
        och = connect(user=other).channel()
        och.queue_declare("w.live", auto_delete=True)
        env.set_permissions(other, "^$", ".*", ".*")
        time.sleep(0.2)  # a cluster's watch; a single node applies it before the HTTP answer
        with channel_error(403, refused(env, "queue", "w.live2", other)):
            och.queue_declare("w.live2")
    finally:
        env.mgmt.request("DELETE", f"/api/users/{q(other)}")


def test_deleted_users_connections_are_closed(env: Env, connect: Callable[..., pika.BlockingConnection]) -> None:
    """As RabbitMQ 3.10.8 (checked): 320 CONNECTION_FORCED - user 'u' is deleted."""
    other = _unique("perm-gone")
    env.add_user(other, ".*", ".*", ".*")
    conn = connect(user=other)
    och = conn.channel()
    env.mgmt.ok("DELETE", f"/api/users/{q(other)}")
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as info:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.2)
        och.queue_declare("all.after")
    assert_reply(info.value, 320, f"user '{other}' is deleted")


# -- the management API checks the same rows, answering as RabbitMQ's does ------------------
def test_management_api_checks_what_amqp_checks(env: Env) -> None:
    other = _unique("perm-http")
    env.mgmt.ok("PUT", f"/api/users/{q(other)}", {"password": PASSWORD, "tags": "management"})
    env.set_permissions(other, CONFIGURE, WRITE, READ)
    v = q(env.vhost)
    try:
        user = env.mgmt.as_user(other, PASSWORD)
        assert user.request("PUT", f"/api/queues/{v}/cfg.h", {"durable": False}).status in (201, 204)
        assert user.request("DELETE", f"/api/queues/{v}/cfg.h").status == 204
        # RabbitMQ 3.10.8: 401 not_authorised "Access refused." for declare, delete, purge, bind.
        for method, path, body in [
            ("PUT", f"/api/queues/{v}/w.h", {"durable": False}),
            ("DELETE", f"/api/queues/{v}/w.q", None),
            ("DELETE", f"/api/queues/{v}/w.q/contents", None),
            ("PUT", f"/api/exchanges/{v}/w.y", {"type": "direct"}),
            ("DELETE", f"/api/exchanges/{v}/w.x", None),
            ("POST", f"/api/bindings/{v}/e/w.x/q/w.q", {"routing_key": "k"}),
            ("POST", f"/api/bindings/{v}/e/r.x/q/r.q", {"routing_key": "k"}),
        ]:
            r = user.request(method, path, body)
            assert (r.status, r.body) == (401, {"error": "not_authorised", "reason": "Access refused."}), \
                (method, path, r)
        r = user.request("POST", f"/api/queues/{v}/w.q/get", {"count": 1, "ackmode": "ack_requeue_true",
                                                            "encoding": "auto"})
        assert r.status == 401 and r.body["reason"] == "ACCESS_REFUSED - " + refused(env, "queue", "w.q", other)
        r = user.request("POST", f"/api/exchanges/{v}/r.x/publish", {"routing_key": "k", "payload": "m",
                                                                    "payload_encoding": "string", "properties": {}})
        assert r.status == 400 and r.body["reason"] == "403 ACCESS_REFUSED - " + refused(env, "exchange", "r.x",
                                                                                          other)
        r = user.request("POST", f"/api/exchanges/{v}/w.x/publish", {"routing_key": "k", "payload": "m",
                                                                    "payload_encoding": "string", "properties": {}})
        assert r.status == 200, r
    finally:
        env.mgmt.request("DELETE", f"/api/users/{q(other)}")


def test_binding_the_default_exchange_is_refused_before_permissions(env: Env, ch: BlockingChannel) -> None:
    with channel_error(403, "operation not permitted on the default exchange"):
        ch.queue_bind("w.q", "", "k")
