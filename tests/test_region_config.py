"""Region-related node options: the cluster port default and --advertise-cluster-remote."""

from __future__ import annotations

import pytest

from leveret.node.config import ConfigError, NodeConfig, load, validate


def test_cluster_port_default_is_not_rabbitmqs_distribution_port() -> None:
    port = NodeConfig().cluster_port
    assert port == 27672
    # RabbitMQ's distribution port is its AMQP port + 20000 (25672 by default, 25673 for a second one on 5673).
    assert not 25_000 <= port < 26_000
    assert port < 32_768  # below Linux's default ephemeral range


@pytest.mark.parametrize("value", ["10.1.2.3:27672", "[::1]:27672", "gw.example:443"])
def test_advertise_cluster_remote_accepts_host_port(value: str) -> None:
    cfg = load(None, {"advertise_cluster_remote": value}, environ={})
    validate(cfg)
    assert cfg.advertise_cluster_remote == value


@pytest.mark.parametrize("value", ["10.1.2.3", ":27672", "host:", "host:port", "host:70000"])
def test_advertise_cluster_remote_refuses_what_is_not_host_port(value: str) -> None:
    cfg = load(None, {"advertise_cluster_remote": value}, environ={})
    with pytest.raises(ConfigError, match="--advertise-cluster-remote must be HOST:PORT"):
        validate(cfg)
