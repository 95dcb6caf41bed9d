"""Loopback-only is a list of user names, RabbitMQ's ``loopback_users`` (issue #26, item 5).

Not a flag on the stored record: a re-created or imported ``guest`` is loopback-only too, and a
``--default-user`` with another name logs in from anywhere (as RabbitMQ's RABBITMQ_DEFAULT_USER).
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import fields
from pathlib import Path

import pytest

from core.engine.broker import Broker, User
from core.model.errors import AccessRefused
from leveret.cli.main import build_parser
from leveret.node.config import NodeConfig, load

REMOTE = "10.1.2.3"


def _refused_remotely(broker: Broker, name: str, password: str) -> bool:
    try:
        broker.authenticate(name, password, REMOTE)
    except AccessRefused as exc:
        assert "can only connect via localhost" in exc.text
        return True
    return False


def test_a_default_user_not_named_guest_logs_in_from_anywhere() -> None:
    broker = Broker(default_user=("admin", "s3cret"))
    assert not _refused_remotely(broker, "admin", "s3cret")
    assert broker.authenticate("admin", "s3cret", "127.0.0.1").name == "admin"


def test_guest_is_loopback_only_however_its_record_was_made() -> None:
    broker = Broker()
    assert _refused_remotely(broker, "guest", "guest")
    broker.put_user(User.create("guest", "new", vhosts={"/"}))  # deleted and re-created: no flag on it
    assert _refused_remotely(broker, "guest", "new")
    salt = b"\x01\x02\x03\x04"  # imported from RabbitMQ definitions
    broker.put_user(User.from_rabbit_hash("guest", base64.b64encode(salt + hashlib.sha256(salt + b"pw").digest())
                                          .decode(), vhosts={"/"}))
    assert _refused_remotely(broker, "guest", "pw")
    assert broker.authenticate("guest", "pw", "::1").name == "guest"
    with pytest.raises(AccessRefused, match="localhost"):
        broker.authenticate_external("guest", REMOTE)


def test_the_list_decides_not_the_record() -> None:
    broker = Broker(loopback_users=frozenset({"ops"}))
    broker.add_user("ops", "pw", vhosts={"/"}, loopback_only=False)
    broker.add_user("app", "pw", vhosts={"/"}, loopback_only=True)  # an old record's flag: ignored
    assert _refused_remotely(broker, "ops", "pw")
    assert not _refused_remotely(broker, "app", "pw")
    assert not _refused_remotely(broker, "guest", "guest")  # not in this node's list
    assert not _refused_remotely(Broker(loopback_users=frozenset()), "guest", "guest")


def test_loopback_users_from_flag_environment_and_config_file(tmp_path: Path) -> None:
    assert load(None, {}, environ={}).loopback_user_names == {"guest"}
    args = build_parser().parse_args(["serve", "--loopback-users", "guest, ops"])
    overrides = {f.name: getattr(args, f.name) for f in fields(NodeConfig)}
    assert load(None, overrides, environ={}).loopback_user_names == {"guest", "ops"}
    assert load(None, {}, environ={"LEVERET_LOOPBACK_USERS": ""}).loopback_user_names == set()
    f = tmp_path / "leveret.toml"
    f.write_text('[leveret]\nloopback_users = ["guest", "monitor"]\n')
    assert load(str(f), {}, environ={}).loopback_user_names == {"guest", "monitor"}
