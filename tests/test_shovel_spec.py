"""Shovel parameters: validation (what the management API refuses with 400), defaults, URIs as aiormq takes them."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from core.model.errors import AccessRefused
from leveret.links.shovel.spec import ShovelError, client_uri, parse, redact

BASE: dict[str, Any] = {"src-uri": "amqp://", "src-queue": "q", "dest-uri": "amqp://h/"}


def test_defaults_are_rabbitmqs() -> None:
    spec = parse("/", "s", BASE)
    assert (spec.ack_mode, spec.prefetch, spec.reconnect_delay, spec.delete_after, spec.forward_headers) == \
        ("on-confirm", 1000, 5.0, None, False)
    assert spec.src_uris == ("amqp://",) and spec.dest_uris == ("amqp://h/",)
    assert parse("/", "s", {**BASE, "src-queue": None, "src-exchange": "x"}).src_exchange_key == "#"


def test_older_spellings_and_lists() -> None:
    spec = parse("/", "s", {**BASE, "prefetch-count": 7, "delete-after": 3, "add-forward-headers": True,
                            "dest-uri": ["amqp://a/", "amqp://b/"]})
    assert (spec.prefetch, spec.delete_after, spec.forward_headers, spec.dest_uris) == \
        (7, 3, True, ("amqp://a/", "amqp://b/"))
    assert parse("/", "s", {**BASE, "src-delete-after": "queue-length"}).delete_after == "queue-length"
    assert parse("/", "s", {**BASE, "src-delete-after": "never"}).delete_after is None


def test_publish_properties_map_to_pamqp_names() -> None:
    spec = parse("/", "s", {**BASE, "dest-publish-properties": {"type": "t", "timestamp": 10, "app_id": "a"}})
    assert dict(spec.publish_properties) == {"message_type": "t", "timestamp": datetime.fromtimestamp(10, UTC),
                                             "app_id": "a"}


@pytest.mark.parametrize(("change", "reason"), [
    ({"src-uri": None}, "src-uri"),
    ({"src-uri": []}, "src-uri"),
    ({"dest-uri": "http://h/"}, "amqp"),
    ({"src-queue": None}, "exactly one of src-queue"),
    ({"src-exchange": "x"}, "exactly one of src-queue"),
    ({"dest-queue": "a", "dest-exchange": "b"}, "at most one"),
    ({"ack-mode": "later"}, "ack-mode"),
    ({"src-prefetch-count": 0}, "src-prefetch-count"),
    ({"reconnect-delay": "soon"}, "reconnect-delay"),
    ({"src-delete-after": 0}, "src-delete-after"),
    ({"src-delete-after": True}, "src-delete-after"),
    ({"src-queue": None, "src-exchange": "x", "src-delete-after": "queue-length"}, "needs a src-queue"),
    ({"dest-add-forward-headers": "yes"}, "true or false"),
    ({"dest-publish-properties": {"colour": "red"}}, "unknown properties"),
    ({"src-queue-args": []}, "JSON object"),
    ({"src-protocol": "amqp10"}, "amqp091"),
    ({"surprise": 1}, "unknown shovel keys"),
])
def test_bad_definitions_are_refused_with_the_reason(change: dict[str, Any], reason: str) -> None:
    value = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    with pytest.raises(ShovelError, match=reason):
        parse("/", "s", value)


def test_not_an_object() -> None:
    with pytest.raises(ShovelError, match="JSON object"):
        parse("/", "s", ["amqp://"])


def test_client_uri_local_node_and_rabbitmq_tls_parameters() -> None:
    # A URI without a host is this node, entered as the parameter's owner: never guest, nor the URI's user.
    assert client_uri("amqp://", 5999, ("bob", "tok/en")) == "amqp://bob:tok%2Fen@127.0.0.1:5999"
    assert client_uri("amqp://u:p@/%2F", 5999, ("bob", "t")) == "amqp://bob:t@127.0.0.1:5999/%2F"
    with pytest.raises(ValueError, match="owner"):
        client_uri("amqp:///%2F", 5999)
    assert client_uri("amqps://u:p@h:5671/v?cacertfile=/ca.pem&verify=verify_none&heartbeat=10&x=1", 1) == \
        "amqps://u:p@h:5671/v?cafile=%2Fca.pem&no_verify_ssl=1&heartbeat=10"


def test_redact_hides_the_password_only() -> None:
    assert redact("amqp://u:secret@h:1/v") == "amqp://u:***@h:1/v"
    assert redact("amqp://h/") == "amqp://h/"


def test_a_direct_uri_acts_as_the_owner_with_its_rights() -> None:
    from core.engine.broker import Broker
    from leveret.links import identity

    b = Broker()
    b.add_vhost("A")
    b.add_user("pm", "pw", tags=("policymaker",), vhosts={"A"})
    assert parse("A", "s", {**BASE, "user": "pm"}).owner == "pm"
    assert identity.stamped(b, {"src-uri": "amqp://", "user": "guest"}, b.users["pm"])["user"] == "pm"
    assert identity.stamped(b, {"user": "pm"}, b.users["guest"])["user"] == "pm"  # an administrator's import
    with pytest.raises(identity.LinkForbidden, match="user 'pm' may not access vhost '/'"):
        identity.check_set(b, "pm", ["amqp:///%2F"], "guest")
    with pytest.raises(identity.LinkForbidden, match="default user 'guest'"):
        identity.check_set(b, "pm", ["amqp://guest:guest@127.0.0.1:5672/A"], "guest")
    identity.check_set(b, "pm", ["amqp:///A", "amqp://guest:guest@elsewhere/A"], "guest")
    identity.check_set(b, "guest", ["amqp://guest:guest@localhost/%2F"], "guest")  # an administrator may
    assert identity.credentials(b, "pm", "amqp:///A") == ("pm", b.link_token)
    assert identity.credentials(b, "pm", "amqp://u:p@h/") is None
    b.delete_user("pm")
    with pytest.raises(PermissionError, match="no longer exists"):
        identity.credentials(b, "pm", "amqp:///A")
    with pytest.raises(PermissionError, match="no owner"):
        identity.credentials(b, None, "amqp://")
    # The link token logs in as any existing user, from loopback only.
    assert b.authenticate("guest", b.link_token, "127.0.0.1").name == "guest"
    with pytest.raises(AccessRefused):
        b.authenticate("guest", b.link_token, "10.0.0.1")
