"""Mutated MQTT sessions fed to the state machine: never an internal error, never a hold on the engine.

The long form over sockets is bench/fuzz_mqtt.py.
"""

from __future__ import annotations

import logging
import random

import pytest

from harness import mqtt_fuzzing
from harness.brokers import local_broker
from mqtt_frontend.connection import MqttConnection, MqttSettings
from mqtt_frontend.sessions import Sessions

CASES = 1500


@pytest.mark.parametrize("seed", range(3))
def test_mutated_sessions_never_raise_an_internal_error(seed: int, caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(seed)
    broker = local_broker()
    sessions = Sessions(broker)
    seeds = mqtt_fuzzing.sessions()
    closed = 0
    with caplog.at_level(logging.WARNING, logger="leveret.mqtt"):
        for i in range(CASES):
            conn = MqttConnection(broker, sessions, MqttSettings(max_packet_size=1 << 20), now=0.0,
                                  peer=("127.0.0.1", i))
            for piece in mqtt_fuzzing.chunks(rng, mqtt_fuzzing.mutate(rng, rng.choice(seeds))):
                conn.receive_data(piece)
                conn.data_to_send()
            conn.tick(1000.0)  # past every keep-alive: every connection ends
            closed += conn.should_close
            conn.connection_lost()
    assert closed == CASES
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors[0].getMessage() + str(errors[0].exc_info)
    vhost = broker.vhosts["/"]
    # Every session that could end did; what remains are persistent sessions and the retained queue.
    for q in vhost.queues.values():
        assert q.default.unacked == 0, q.name
        assert not q.default.consumers, q.name
    assert not sessions.live
