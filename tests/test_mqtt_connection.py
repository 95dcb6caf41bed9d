"""The MQTT connection state machine, fed bytes without sockets (mqtt_frontend/connection.py)."""

from __future__ import annotations

import itertools
import logging

import pytest

from core.engine import publish
from core.engine.broker import Broker
from core.model.clock import ManualScheduler
from core.model.message import Message
from harness import mqtt_client as mc
from harness.brokers import local_broker
from mqtt_frontend import codec
from mqtt_frontend.connection import MqttConnection, MqttSettings
from mqtt_frontend.sessions import Sessions

# Each connection its own peer address: refusals are logged once per address per 10 s.
_ports = itertools.count(1)


def _peer() -> tuple[str, int]:
    n = next(_ports)
    return f"127.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}", 1883  # loopback: guest may log in


@pytest.fixture
def broker() -> Broker:
    return local_broker()


@pytest.fixture
def sessions(broker: Broker) -> Sessions:
    return Sessions(broker)


def open_conn(broker: Broker, sessions: Sessions, client_id: str = "c1", level: int = 4,
              **kwargs: object) -> MqttConnection:
    conn = MqttConnection(broker, sessions, MqttSettings(), now=0.0, peer=_peer())
    conn.receive_data(mc.connect(client_id, level=level, **kwargs))  # type: ignore[arg-type]
    got = mc.read(conn.data_to_send(), level)
    assert got[0].kind == codec.CONNACK and got[0].fields["code"] == 0, got
    return conn


def out(conn: MqttConnection) -> list[mc.Got]:
    return mc.read(conn.data_to_send(), conn.level)


def test_qos1_publish_reaches_a_subscriber_and_waits_for_its_puback(broker: Broker, sessions: Sessions) -> None:
    sub = open_conn(broker, sessions, "sub")
    sub.receive_data(mc.subscribe(1, ("a/+/c", 1)))
    assert out(sub)[0].fields["codes"] == [1]
    pub = open_conn(broker, sessions, "pub")
    pub.receive_data(mc.publish("a/b/c", b"m1", qos=1, packet_id=9))
    assert [(g.kind, g.fields["packet_id"]) for g in out(pub)] == [(codec.PUBACK, 9)]
    got = out(sub)
    assert got[0].fields["topic"] == "a/b/c" and got[0].fields["qos"] == 1 and got[0].fields["payload"] == b"m1"
    q = broker.vhosts["/"].queues["mqtt-subscription-subqos1"]
    assert q.default.unacked == 1
    sub.receive_data(mc.puback(got[0].fields["packet_id"]))
    assert q.default.unacked == 0


def test_amqp_publish_to_amq_topic_reaches_mqtt(broker: Broker, sessions: Sessions) -> None:
    sub = open_conn(broker, sessions, "sub")
    sub.receive_data(mc.subscribe(1, ("sensors/#", 0)))
    out(sub)
    vh = broker.vhosts["/"]
    publish.publish(broker, vh, vh.exchanges["amq.topic"], Message("amq.topic", "sensors.t1", b"\x00\x00", b"x"))
    got = out(sub)
    assert got[0].fields["topic"] == "sensors/t1" and got[0].fields["qos"] == 0


def test_dollar_topics_are_not_matched_by_a_leading_wildcard(broker: Broker, sessions: Sessions) -> None:
    sub = open_conn(broker, sessions, "sub")
    sub.receive_data(mc.subscribe(1, ("#", 0)))
    out(sub)
    pub = open_conn(broker, sessions, "pub")
    pub.receive_data(mc.publish("$SYS/x", b"no") + mc.publish("ok", b"yes"))
    assert [g.fields["payload"] for g in out(sub)] == [b"yes"]
    assert broker.vhosts["/"].queues["mqtt-subscription-subqos1"].message_count == 0


def test_retained_message_delivered_on_subscribe_and_cleared_by_empty_publish(broker: Broker,
                                                                               sessions: Sessions) -> None:
    pub = open_conn(broker, sessions, "pub")
    pub.receive_data(mc.publish("r/1", b"kept", qos=1, packet_id=1, retain=True))
    out(pub)
    sub = open_conn(broker, sessions, "sub")
    sub.receive_data(mc.subscribe(1, ("r/#", 1)))
    got = out(sub)
    assert got[0].kind == codec.SUBACK
    assert (got[1].fields["topic"], got[1].fields["payload"], got[1].fields["retain"]) == ("r/1", b"kept", True)
    pub.receive_data(mc.publish("r/1", b"", retain=True))
    sub2 = open_conn(broker, sessions, "sub2")
    sub2.receive_data(mc.subscribe(1, ("r/#", 1)))
    assert [g.kind for g in out(sub2)] == [codec.SUBACK]
    assert broker.vhosts["/"].queues["mqtt-retained"].message_count == 0


def test_persistent_session_keeps_messages_and_subscriptions(broker: Broker, sessions: Sessions) -> None:
    sub = open_conn(broker, sessions, "dev", clean=False)
    sub.receive_data(mc.subscribe(1, ("d/#", 1)))
    out(sub)
    sub.receive_data(mc.DISCONNECT)
    sub.connection_lost()
    q = broker.vhosts["/"].queues["mqtt-subscription-devqos1"]
    assert q.durable
    pub = open_conn(broker, sessions, "pub")
    pub.receive_data(mc.publish("d/1", b"while away", qos=1, packet_id=1))
    assert q.message_count == 1
    again = MqttConnection(broker, sessions, now=0.0)
    again.receive_data(mc.connect("dev", clean=False))
    got = out(again)
    assert got[0].fields["session_present"] is True
    assert got[1].fields["payload"] == b"while away"


def test_clean_session_queue_goes_with_the_connection(broker: Broker, sessions: Sessions) -> None:
    sub = open_conn(broker, sessions, "tmp")
    sub.receive_data(mc.subscribe(1, ("x", 0)))
    out(sub)
    assert broker.vhosts["/"].queues["mqtt-subscription-tmpqos1"].exclusive
    sub.connection_lost()
    assert "mqtt-subscription-tmpqos1" not in broker.vhosts["/"].queues


def test_unacked_delivery_is_redelivered_with_dup_after_reconnect(broker: Broker, sessions: Sessions) -> None:
    sub = open_conn(broker, sessions, "dev", clean=False)
    sub.receive_data(mc.subscribe(1, ("d", 1)))
    out(sub)
    pub = open_conn(broker, sessions, "pub")
    pub.receive_data(mc.publish("d", b"once", qos=1, packet_id=1))
    assert out(sub)[0].fields["dup"] is False
    sub.connection_lost()  # no PUBACK
    again = MqttConnection(broker, sessions, now=0.0)
    again.receive_data(mc.connect("dev", clean=False))
    got = out(again)
    assert got[1].fields["payload"] == b"once" and got[1].fields["dup"] is True


def test_same_client_id_disconnects_the_first_connection(broker: Broker, sessions: Sessions) -> None:
    first = open_conn(broker, sessions, "dup", level=5)
    second = open_conn(broker, sessions, "dup", level=5)
    got = out(first)
    assert got[0].kind == codec.DISCONNECT and got[0].fields["reason"] == codec.SESSION_TAKEN_OVER
    assert first.should_close and not second.should_close


def test_will_published_on_keep_alive_timeout_not_on_disconnect(broker: Broker, sessions: Sessions) -> None:
    watcher = open_conn(broker, sessions, "w")
    watcher.receive_data(mc.subscribe(1, ("status/#", 0)))
    out(watcher)
    will = codec.Will("status/dev", b"offline", 0, False)
    polite = open_conn(broker, sessions, "p", will=will, keep_alive=10)
    polite.receive_data(mc.DISCONNECT)
    polite.connection_lost()
    assert out(watcher) == []
    silent = open_conn(broker, sessions, "s", will=will, keep_alive=10)
    silent.tick(14.0)
    assert not silent.should_close  # 1.5 x 10 s not yet passed
    silent.tick(15.5)
    assert silent.should_close
    silent.connection_lost()
    assert [g.fields["payload"] for g in out(watcher)] == [b"offline"]


def test_pingreq(broker: Broker, sessions: Sessions) -> None:
    conn = open_conn(broker, sessions)
    conn.receive_data(mc.PINGREQ)
    assert [g.kind for g in out(conn)] == [codec.PINGRESP]


def test_bad_password_is_refused(broker: Broker, sessions: Sessions) -> None:
    conn = MqttConnection(broker, sessions, now=0.0)
    conn.receive_data(mc.connect(password=b"wrong"))
    got = out(conn)
    assert got[0].fields["code"] == 4 and conn.should_close


def test_vhost_user_login_form(broker: Broker, sessions: Sessions) -> None:
    broker.add_vhost("iot")
    broker.add_user("dev", "pw", vhosts={"iot"})
    conn = open_conn(broker, sessions, username="iot:dev", password=b"pw")
    assert conn.vhost is not None and conn.vhost.name == "iot"
    refused = MqttConnection(broker, sessions, now=0.0)
    refused.receive_data(mc.connect(username="dev", password=b"pw"))  # no access to "/"
    assert out(refused)[0].fields["code"] == 5


def test_topic_permission_refuses_publish(broker: Broker, sessions: Sessions) -> None:
    user = broker.add_user("dev", "pw", vhosts={"/"})
    user.topic_permissions = {"/": {"amq.topic": ("^allowed\\.", ".*")}}
    broker.user_changed("dev")
    conn = open_conn(broker, sessions, username="dev", password=b"pw", level=5)
    conn.receive_data(mc.publish("allowed/x", b"1", qos=1, packet_id=1, level=5)
                      + mc.publish("other/x", b"1", qos=1, packet_id=2, level=5))
    assert [g.fields["reason"] for g in out(conn)] == [0x10, codec.NOT_AUTHORIZED]  # no subscriber; refused


@pytest.mark.parametrize(("data", "level", "reason"), [
    (mc.publish("a/+", b"x", level=5), 5, codec.TOPIC_NAME_INVALID),
    (b"\x30\x04\x00\x02\xff\xfe", 5, codec.MALFORMED),
    (b"\x30\xff\xff\xff\xff\x7f", 5, codec.MALFORMED),
    (mc.connect("again"), 5, codec.PROTOCOL_ERROR),
    (b"\x82\x06\x00\x01\x00\x00\x01a", 5, codec.MALFORMED),  # a filter without its options byte
    (mc.publish("a", b"x", qos=2, packet_id=1, level=5), 5, codec.QOS_NOT_SUPPORTED),
])
def test_bad_input_closes_with_a_reason(broker: Broker, sessions: Sessions, data: bytes, level: int, reason: int,
                                        caplog: pytest.LogCaptureFixture) -> None:
    conn = open_conn(broker, sessions, level=level)
    other = open_conn(broker, sessions, "other", level=level)
    with caplog.at_level(logging.WARNING, logger="leveret.mqtt"):
        conn.receive_data(data)
    got = out(conn)
    assert conn.should_close
    assert got[-1].kind == codec.DISCONNECT and got[-1].fields["reason"] == reason
    assert len([r for r in caplog.records if r.name == "leveret.mqtt"]) == 1
    other.receive_data(mc.PINGREQ)
    assert [g.kind for g in out(other)] == [codec.PINGRESP]  # nothing else affected


def test_packet_before_connect_closes_without_answer(broker: Broker, sessions: Sessions) -> None:
    conn = MqttConnection(broker, sessions, now=0.0)
    conn.receive_data(mc.PINGREQ)
    assert conn.should_close and conn.data_to_send() == b""


def test_packet_over_the_maximum_size(broker: Broker, sessions: Sessions) -> None:
    conn = MqttConnection(broker, sessions, MqttSettings(max_packet_size=1000), now=0.0)
    conn.receive_data(mc.connect(level=5))
    out(conn)
    conn.receive_data(mc.publish("a", b"x" * 2000, level=5)[:50])  # the header says it is too big
    got = out(conn)
    assert got[0].fields["reason"] == codec.PACKET_TOO_LARGE


def test_qos2_publish_in_311_gets_the_exactly_once_handshake(broker: Broker, sessions: Sessions) -> None:
    sub = open_conn(broker, sessions, "sub")
    sub.receive_data(mc.subscribe(1, ("q2", 2)))
    assert out(sub)[0].fields["codes"] == [1]  # granted QoS 1 at most
    pub = open_conn(broker, sessions, "pub")
    pub.receive_data(mc.publish("q2", b"once", qos=2, packet_id=3))
    assert [g.kind for g in out(pub)] == [codec.PUBREC]
    pub.receive_data(mc.publish("q2", b"once", qos=2, packet_id=3, dup=True))  # resent before PUBREL
    assert [g.kind for g in out(pub)] == [codec.PUBREC]
    pub.receive_data(codec.packet(codec.PUBREL, 2, b"\x00\x03"))
    assert [g.kind for g in out(pub)] == [codec.PUBCOMP]
    assert [g.fields["payload"] for g in out(sub)] == [b"once"]  # routed once


def test_v5_topic_alias_user_properties_and_subscription_ids(broker: Broker, sessions: Sessions) -> None:
    sub = open_conn(broker, sessions, "sub", level=5)
    sub.receive_data(mc.subscribe(1, ("t/#", 1), level=5, props={"subscription_id": [42]}))
    out(sub)
    pub = open_conn(broker, sessions, "pub", level=5)
    pub.receive_data(mc.publish("t/1", b"a", level=5, props={"topic_alias": 1, "user_property": [("k", "v")],
                                                              "content_type": "text/plain"})
                     + mc.publish("", b"b", level=5, props={"topic_alias": 1}))
    got = out(sub)
    assert [g.fields["topic"] for g in got] == ["t/1", "t/1"]
    assert got[0].fields["props"]["user_property"] == [("k", "v")]
    assert got[0].fields["props"]["content_type"] == "text/plain"
    assert got[0].fields["props"]["subscription_id"] == [42]
    pub.receive_data(mc.publish("", b"c", level=5, props={"topic_alias": 2}))
    assert pub.should_close  # alias 2 never set


def test_v5_no_local(broker: Broker, sessions: Sessions) -> None:
    conn = open_conn(broker, sessions, "both", level=5)
    conn.receive_data(mc.subscribe(1, ("n", 0, 0x04), level=5))
    out(conn)
    conn.receive_data(mc.publish("n", b"mine", level=5))
    assert out(conn) == []
    other = open_conn(broker, sessions, "other", level=5)
    other.receive_data(mc.publish("n", b"theirs", level=5))
    assert [g.fields["payload"] for g in out(conn)] == [b"theirs"]


def test_v5_receive_maximum_limits_inflight_deliveries(broker: Broker, sessions: Sessions) -> None:
    sub = open_conn(broker, sessions, "sub", level=5, props={"receive_maximum": 2})
    sub.receive_data(mc.subscribe(1, ("f", 1), level=5))
    out(sub)
    pub = open_conn(broker, sessions, "pub", level=5)
    for i in range(5):
        pub.receive_data(mc.publish("f", b"%d" % i, qos=1, packet_id=i + 1, level=5))
    got = out(sub)
    assert len(got) == 2
    sub.receive_data(mc.puback(got[0].fields["packet_id"]))
    assert [g.fields["payload"] for g in out(sub)] == [b"2"]


def test_v5_shared_subscription_members_compete(broker: Broker, sessions: Sessions) -> None:
    a = open_conn(broker, sessions, "a", level=5)
    b = open_conn(broker, sessions, "b", level=5)
    for c in (a, b):
        c.receive_data(mc.subscribe(1, ("$share/g/jobs/#", 0), level=5))
        out(c)
    pub = open_conn(broker, sessions, "pub", level=5)
    for i in range(4):
        pub.receive_data(mc.publish("jobs/x", b"%d" % i, level=5))
    got_a, got_b = out(a), out(b)
    assert len(got_a) == 2 and len(got_b) == 2


def test_v5_session_expiry_makes_the_queue_durable_with_x_expires(broker: Broker, sessions: Sessions) -> None:
    conn = open_conn(broker, sessions, "e", level=5, clean=False, props={"session_expiry": 30})
    conn.receive_data(mc.subscribe(1, ("x", 1), level=5))
    out(conn)
    q = broker.vhosts["/"].queues["mqtt-subscription-eqos1"]
    assert q.durable and q.args.expires == 30_000


def test_v5_message_expiry_round_trips(broker: Broker, sessions: Sessions) -> None:
    sub = open_conn(broker, sessions, "sub", level=5)
    sub.receive_data(mc.subscribe(1, ("m", 1), level=5))
    out(sub)
    pub = open_conn(broker, sessions, "pub", level=5)
    pub.receive_data(mc.publish("m", b"x", qos=1, packet_id=1, level=5, props={"message_expiry": 60}))
    got = out(sub)
    assert 55 <= got[0].fields["props"]["message_expiry"] <= 60


def test_qos0_retained_message_is_stored_yet_delivered_at_qos0(broker: Broker, sessions: Sessions) -> None:
    pub = open_conn(broker, sessions, "pub")
    pub.receive_data(mc.publish("r0", b"light", qos=0, retain=True))
    q = broker.vhosts["/"].queues["mqtt-retained"]
    assert q.durable and [qm.message.persistent for qm in q.default.ready] == [True]
    sub = open_conn(broker, sessions, "sub")
    sub.receive_data(mc.subscribe(1, ("r0", 1)))
    got = out(sub)
    assert (got[1].fields["payload"], got[1].fields["qos"], got[1].fields["retain"]) == (b"light", 0, True)


def test_refusals_from_one_address_are_logged_once(broker: Broker, sessions: Sessions,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="leveret.mqtt"):
        for port in range(20):  # a flood opens a new port each time
            conn = MqttConnection(broker, sessions, now=0.0, peer=("127.9.9.9", 40000 + port))
            conn.receive_data(mc.connect("x") + mc.publish("a/#", b"x"))
            assert conn.should_close
    assert len([r for r in caplog.records if r.name == "leveret.mqtt"]) == 1


@pytest.fixture
def manual() -> tuple[Broker, Sessions, ManualScheduler]:
    clock = ManualScheduler()
    broker = local_broker(scheduler=clock)
    return broker, Sessions(broker), clock


def test_v5_will_delay_fires_late_and_a_reconnect_cancels_it(manual: tuple[Broker, Sessions,
                                                                          ManualScheduler]) -> None:
    broker, sessions, clock = manual
    watcher = open_conn(broker, sessions, "w")
    watcher.receive_data(mc.subscribe(1, ("st/#", 0)))
    out(watcher)
    will = codec.Will("st/dev", b"gone", 0, False, {"will_delay": 5})
    dev = open_conn(broker, sessions, "dev", level=5, will=will, props={"session_expiry": 60})
    dev.connection_lost()  # vanished
    clock.advance(4)
    assert out(watcher) == []
    clock.advance(2)
    assert [g.fields["payload"] for g in out(watcher)] == [b"gone"]
    again = open_conn(broker, sessions, "dev", level=5, will=will, props={"session_expiry": 60})
    again.connection_lost()
    open_conn(broker, sessions, "dev", level=5, props={"session_expiry": 60})  # back within the delay
    clock.advance(10)
    assert out(watcher) == []


def test_v5_session_expires_after_its_interval(manual: tuple[Broker, Sessions, ManualScheduler]) -> None:
    broker, sessions, clock = manual
    conn = open_conn(broker, sessions, "short", level=5, clean=False, props={"session_expiry": 2})
    conn.receive_data(mc.subscribe(1, ("x", 1), level=5))
    out(conn)
    conn.connection_lost()
    assert "mqtt-subscription-shortqos1" in broker.vhosts["/"].queues
    clock.advance(3)
    assert "mqtt-subscription-shortqos1" not in broker.vhosts["/"].queues


def test_v5_receive_maximum_exceeded_by_the_client(broker: Broker, sessions: Sessions) -> None:
    conn = MqttConnection(broker, sessions, MqttSettings(receive_maximum=2), now=0.0, peer=_peer())
    conn.receive_data(mc.connect(level=5))
    assert out(conn)[0].fields["props"]["receive_maximum"] == 2
    conn.receive_data(mc.publish("rm", b"1", 1, 1, level=5) + mc.publish("rm", b"2", 1, 2, level=5))
    assert [g.kind for g in out(conn)] == [codec.PUBACK, codec.PUBACK]  # two in flight: allowed
    # Three sent before any PUBACK could have reached the client: one over its quota.
    conn.receive_data(b"".join(mc.publish("rm", b"x", 1, i, level=5) for i in range(3, 6)))
    got = out(conn)
    assert got[-1].kind == codec.DISCONNECT and got[-1].fields["reason"] == codec.RECEIVE_MAXIMUM_EXCEEDED
    assert conn.should_close


def test_v5_will_qos2_is_refused_at_connect(broker: Broker, sessions: Sessions) -> None:
    conn = MqttConnection(broker, sessions, now=0.0, peer=_peer())
    conn.receive_data(mc.connect(level=5, will=codec.Will("w", b"x", 2, False)))
    got = out(conn)
    assert got[0].kind == codec.CONNACK and got[0].fields["code"] == codec.QOS_NOT_SUPPORTED
    assert conn.should_close


def test_vhost_connection_limit_counts_mqtt_connections(broker: Broker, sessions: Sessions) -> None:
    broker.vhost_limits["/"] = {"max-connections": 1}
    first = open_conn(broker, sessions, "one", level=5)
    second = MqttConnection(broker, sessions, now=0.0, peer=_peer())
    second.receive_data(mc.connect("two", level=5))
    assert out(second)[0].fields["code"] == codec.QUOTA_EXCEEDED
    first.connection_lost()
    open_conn(broker, sessions, "three", level=5)  # the slot is free again
