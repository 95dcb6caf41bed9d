"""Configuration precedence: defaults < TOML file < LEVERET_* environment < flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from leveret.cli.main import build_parser
from leveret.node.config import ConfigError, NodeConfig, load, validate


def test_defaults() -> None:
    cfg = load(None, {}, environ={})
    assert (cfg.bind, cfg.amqp_port, cfg.grpc_port, cfg.data_dir) == ("127.0.0.1", 5672, 50051, "./leveret-data")


def test_file_then_env_then_flags(tmp_path: Path) -> None:
    f = tmp_path / "leveret.toml"
    f.write_text('[leveret]\namqp_port = 6000\ngrpc-port = 6001\nnode_id = "from-file"\ndata_dir = "/tmp/a"\n')
    cfg = load(str(f), {}, environ={})
    assert (cfg.amqp_port, cfg.grpc_port, cfg.node_id) == (6000, 6001, "from-file")
    cfg = load(str(f), {}, environ={"LEVERET_AMQP_PORT": "7000", "LEVERET_NODE_ID": "from-env"})
    assert (cfg.amqp_port, cfg.grpc_port, cfg.node_id) == (7000, 6001, "from-env")
    cfg = load(str(f), {"amqp_port": "8000", "node_id": None}, environ={"LEVERET_AMQP_PORT": "7000"})
    assert (cfg.amqp_port, cfg.node_id, cfg.data_dir) == (8000, "from-file", "/tmp/a")


def test_config_file_from_environment(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("amqp_port = 6100\n")
    assert load(None, {}, environ={"LEVERET_CONFIG": str(f)}).amqp_port == 6100


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("amqp_port = 'x'\n", "must be an integer"),
        ("bogus = 1\n", "unknown option"),
        ("amqp_port = \n", "not valid TOML"),
    ],
)
def test_bad_file_is_a_clear_error(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load(str(f), {}, environ={})


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load("/nonexistent/leveret.toml", {}, environ={})


def test_bad_environment_value() -> None:
    with pytest.raises(ConfigError, match="LEVERET_AMQP_PORT"):
        load(None, {}, environ={"LEVERET_AMQP_PORT": "many"})


def test_every_option_has_a_flag_and_help() -> None:
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    text = serve.format_help()
    for name in NodeConfig.__dataclass_fields__:
        assert "--" + name.replace("_", "-") in text
        assert "LEVERET_" + name.upper() in text


def test_body_store_threshold_is_a_size_or_off() -> None:
    assert load(None, {"body_store_threshold": 0}, environ={}).body_store_threshold == 0
    assert load(None, {}, environ={"LEVERET_BODY_STORE_THRESHOLD": "4096"}).body_store_threshold == 4096
    with pytest.raises(ConfigError, match="--body-store-threshold must be 0"):
        validate(load(None, {"body_store_threshold": -1}, environ={}))
