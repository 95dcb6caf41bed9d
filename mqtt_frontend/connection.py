"""One MQTT connection (3.1.1 and 5.0) as a sans-IO state machine over the engine.

``receive_data(bytes)`` consumes what the socket read, ``data_to_send()``
returns what to write, ``tick(now)`` drives the keep-alive and the CONNECT
time-out, ``should_close`` says when to close after the last write, and
``connection_lost()`` ends the session's hold on the engine. As the AMQP
connection (amqp_frontend/connection.py), it never awaits: a declaration
or binding the coordinator cannot answer at once suspends the input until
it answers (``run_async``), so replies keep the order of requests.

Engine mapping (docs/MQTT.md):
- a PUBLISH is ``publish.publish`` to ``amq.topic`` with the topic turned
  into a routing key (topics.py); QoS 1 is a persistent message, and its
  PUBACK goes out when the publish's ``Outcome`` settles, like an AMQP confirm;
- a session is one queue, ``mqtt-subscription-<client id>qos1``, bound to
  ``amq.topic`` once per filter (the subscription's options ride in the
  binding's arguments, so a persistent session's subscriptions are stored
  with its bindings and come back after a restart); durable for a
  persistent session, exclusive to the connection for a clean one;
- the connection is the consumer of that queue (a ``ConsumerSink``): QoS 1
  deliveries stay unacked until PUBACK, QoS 0 ones are settled when written;
- a shared subscription ``$share/g/f`` is the queue ``mqtt-shared-g``,
  whose consumers (one per member connection) compete.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from core.engine import access, flow, publish
from core.engine.queue import Consumer
from core.model.errors import AccessRefused, BrokerError, ResourceLocked
from core.model.message import Message
from core.model.ratelog import RateLimitedLog
from core.ports.coordinator import Immediate
from mqtt_frontend import codec, mapping, topics
from mqtt_frontend.codec import PacketError, ProtocolError
from mqtt_frontend.retained import qos_of as retained_qos
from mqtt_frontend.sessions import HOLD

if TYPE_CHECKING:
    from core.engine.broker import Broker, User
    from core.engine.exchange import Exchange
    from core.engine.queue import Queue
    from core.engine.vhost import VirtualHost
    from core.model.message import QueuedMessage
    from mqtt_frontend.sessions import Sessions

log = logging.getLogger("leveret.mqtt")
# One line per peer address per 10 s for refused input (a broken client retrying in a loop).
refused_log = RateLimitedLog(log)

READ_BUDGET = 200  # packets per receive_data call, as the AMQP front end's READ_BUDGET
NO_EXPIRY = 0xFFFFFFFF
# Binding arguments that carry a subscription's options (restored with a persistent session).
ARG_FILTER, ARG_QOS, ARG_NO_LOCAL, ARG_RAP, ARG_ID = (
    "x-mqtt-filter", "x-mqtt-qos", "x-mqtt-no-local", "x-mqtt-retain-as-published", "x-mqtt-subscription-id")


@dataclass
class MqttSettings:
    vhost: str = "/"
    max_packet_size: int = 128 * 1024 * 1024  # after CONNECT; the AMQP max message size
    max_connect_size: int = 65536  # CONNECT itself (unauthenticated), as RabbitMQ's default
    receive_maximum: int = 4096  # inbound QoS 1/2 publishes awaiting their PUBACK/PUBREC
    topic_alias_maximum: int = 64
    connect_timeout: float = 10.0
    max_session_expiry: int = NO_EXPIRY
    product: str = "Leveret"


LOCKED_RETRIES = 50  # a session queue locked by the client id's previous connection: 5 s of retries
LOCKED_RETRY_S = 0.1

class State(enum.Enum):
    AWAIT_CONNECT = "await-connect"
    OPEN = "open"
    CLOSED = "closed"


@dataclass
class Sub:
    filter: str  # the MQTT filter (without the $share/group/ prefix)
    qos: int
    no_local: bool = False
    rap: bool = False
    sub_id: int = 0
    group: str | None = None

    @property
    def routing_key(self) -> str:
        return topics.to_routing_key(self.filter)

    def binding_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {ARG_FILTER: self.filter, ARG_QOS: self.qos}
        if self.no_local:
            args[ARG_NO_LOCAL] = True
        if self.rap:
            args[ARG_RAP] = True
        if self.sub_id:
            args[ARG_ID] = self.sub_id
        return args


@dataclass
class _Inbound:
    """A QoS 1/2 publish whose PUBACK/PUBREC waits for its outcome (sent in order, MQTT-4.6.0-2)."""

    packet_id: int
    kind: int  # PUBACK or PUBREC
    reason: int | None = None  # None until settled


@dataclass
class _Session:
    queue_name: str
    persistent: bool
    expiry: int  # seconds (v5); NO_EXPIRY for 3.1.1 persistent sessions
    queue: Queue | None = None
    consumer: Consumer | None = None
    delete_at_close: bool = False
    subs: dict[str, Sub] = field(default_factory=dict)  # full filter ($share/... included) -> Sub


class MqttConnection:
    def __init__(self, broker: Broker, sessions: Sessions, settings: MqttSettings | None = None,
                 peer: tuple[str, int] | None = None, now: float | None = None,
                 peer_identity: str | None = None) -> None:
        self.broker = broker
        self.sessions = sessions
        self.settings = settings or MqttSettings()
        self.peer = peer
        self.peer_identity = peer_identity
        self.state = State.AWAIT_CONNECT
        self.should_close = False
        self._buf = bytearray()
        self._out: list[bytes] = []
        self.out_bytes = 0
        self.transport_paused = False
        self.write_high_water = 4 * 1024 * 1024
        self._manual_clock = now is not None
        t = time.monotonic() if now is None else now
        self._now = t
        self.opened_at = t
        self.last_received = t
        self.level = codec.V311
        self.client_id = ""
        self.username = ""
        self.user: User | None = None
        self.vhost: VirtualHost | None = None
        self.grants: access.Grants | None = None
        self.exchange: Exchange | None = None
        self.keep_alive = 0
        self.will: codec.Will | None = None
        self.session: _Session | None = None
        self.close_reason = ""
        self.has_published = False
        self.blocked = False
        self.input_pending = False
        self.suspended = 0
        self._in_receive = False
        self._output_signalled = False
        self._lost = False
        self._connect_seen = False  # a CONNECT was parsed: refusals now answer with a CONNACK
        self._opened = False  # counted in the connection limits
        # Client -> server.
        self._inbound: deque[_Inbound] = deque()
        self._inbound_ids: dict[int, _Inbound] = {}
        self._qos2_released: set[int] = set()  # PUBREC sent, waiting for PUBREL
        self._aliases: dict[int, str] = {}
        # Server -> client.
        self.client_receive_max = 65535
        self.client_max_packet = codec.MAX_REMAINING + 5
        self._next_id = 0
        self._inflight: dict[int, tuple[QueuedMessage | None, Consumer | None]] = {}
        self._pending_retained: deque[tuple[codec.Publish, list[int]]] = deque()
        self._consumers: dict[int, tuple[Consumer, str | None]] = {}  # id(consumer) -> (it, shared group)
        self._routes: dict[tuple[str | None, str], _Route] = {}  # (group, routing key) -> what matches
        self._id_prefix = ""
        # Flow control (core/engine/flow.py): queues behind their consumers hold this publisher.
        self._held_by: dict[int, flow.QueueFlow] = {}
        # Hooks of the I/O layer.
        self.on_output: Callable[[], None] = _noop
        self.on_input_ready: Callable[[], None] = _noop
        self.run_async: Callable[[Awaitable[Any], Callable[[Any, BaseException | None], None]], None] | None = None

    # ------------------------------------------------------------------ output
    @property
    def write_blocked(self) -> bool:
        return self.transport_paused or self.out_bytes > self.write_high_water

    def write(self, data: bytes) -> None:
        self._out.append(data)
        self.out_bytes += len(data)
        if not self._output_signalled:
            self._output_signalled = True
            if not self._in_receive:
                self.on_output()

    def data_to_send(self) -> bytes:
        self._output_signalled = False
        if not self._out:
            return b""
        data = b"".join(self._out)
        self._out = []
        self.out_bytes = 0
        return data

    def set_transport_paused(self, paused: bool) -> None:
        self.transport_paused = paused
        if not paused:
            self.resume_deliveries()

    def resume_deliveries(self) -> None:
        if self.write_blocked or self.state is not State.OPEN:
            return
        self._drain_retained()
        for consumer, _ in list(self._consumers.values()):
            consumer.channel.dispatch()

    def held_bytes(self) -> int:
        return len(self._buf) + self.out_bytes

    # -------------------------------------------------------------------- flow
    @property
    def wants_read(self) -> bool:
        return not self._held_by and not self.input_pending and not self.suspended

    def hold(self, gate: flow.QueueFlow) -> None:
        self._held_by[id(gate)] = gate

    def release(self, gate: flow.QueueFlow) -> None:
        if self._held_by.pop(id(gate), None) is not None and not self._held_by:
            self.on_input_ready()

    # ------------------------------------------------------------------- input
    def receive_data(self, data: bytes, now: float | None = None) -> None:
        if self.state is State.CLOSED or self.should_close:
            return
        if now is not None:
            self._now = now
        elif not self._manual_clock:
            self._now = time.monotonic()
        if data:
            self.last_received = self._now
            self._buf += data
        self._guarded(self._process)

    def _guarded(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn``; a refusal or a bug closes this connection only (one log line)."""
        was = self._in_receive
        self._in_receive = True
        self.input_pending = False
        previous = flow.swap(self)
        try:
            fn(*args)
        except PacketError as exc:
            self._refuse(exc.reason, exc.text)
        except AccessRefused as exc:
            self._refuse(codec.NOT_AUTHORIZED, exc.text)
        except BrokerError as exc:
            self._refuse(codec.IMPLEMENTATION_SPECIFIC if exc.code != 530 else codec.NOT_AUTHORIZED, exc.text)
        except Exception:
            log.exception("internal error handling MQTT input", extra={"peer": self._peer_text()})
            self._refuse(codec.UNSPECIFIED_ERROR, "internal error; see the broker log", logged=True)
        finally:
            flow.swap(previous)
            self._in_receive = was
            self._flush_inbound()

    def _process(self) -> None:
        buf = self._buf
        pos = 0
        budget = READ_BUDGET
        try:
            while len(buf) - pos >= 2 and not self.should_close and not self.suspended:
                if self._held_by or not budget:
                    self.input_pending = not self._held_by
                    break
                budget -= 1
                got = codec.decode_remaining(buf, pos + 1)
                if got is None:
                    break
                size, start = got
                limit = self.settings.max_packet_size if self.state is State.OPEN else self.settings.max_connect_size
                if size + (start - pos) > limit:
                    raise PacketError(f"packet of {size} bytes is over the maximum of {limit}",
                                      codec.PACKET_TOO_LARGE)
                end = start + size
                if end > len(buf):
                    break
                first = buf[pos]
                body = bytes(buf[start:end])
                pos = end
                self._packet(first >> 4, first & 0x0F, body)
        finally:
            del buf[:pos]

    def _packet(self, kind: int, flags: int, body: bytes) -> None:
        if self.state is State.AWAIT_CONNECT:
            if kind != codec.CONNECT or flags:
                raise ProtocolError(f"{codec.NAMES.get(kind, kind)} before CONNECT")
            self._connect(codec.parse_connect(body))
            return
        p = codec.parse(kind, flags, body, self.level)
        if isinstance(p, codec.Publish):
            self._publish(p)
        elif isinstance(p, codec.Ack):
            self._ack(p)
        elif isinstance(p, codec.Subscribe):
            self._subscribe(p)
        elif isinstance(p, codec.Unsubscribe):
            self._unsubscribe(p)
        elif isinstance(p, codec.Disconnect):
            self._disconnect(p)
        elif isinstance(p, codec.Simple) and p.kind == codec.PINGREQ:
            self.write(codec.PINGRESP_PACKET)
        else:  # AUTH: no enhanced authentication is offered
            raise ProtocolError("AUTH without an authentication method")

    # ------------------------------------------------------------- suspension
    def _when(self, op: Awaitable[Any], then: Callable[[Any], None]) -> None:
        """Go on with ``then(result)`` once ``op`` answers; input waits meanwhile."""
        if isinstance(op, Immediate):
            then(op.value)
            return
        if self.run_async is None:
            raise BrokerError("asynchronous operation without an event loop")
        self.suspended += 1

        def done(result: Any, error: BaseException | None) -> None:
            self.suspended -= 1
            if self.state is State.CLOSED or self.should_close:
                return
            if error is None:
                self._guarded(then, result)
            else:
                self._guarded(_raise, error if isinstance(error, BrokerError)
                              else BrokerError(f"operation failed: {error}"))
            if self._out:
                self.on_output()
            if self._buf and not self.suspended:
                self.on_input_ready()

        self.run_async(op, done)

    # ----------------------------------------------------------------- CONNECT
    def _connect(self, c: codec.Connect) -> None:
        self._connect_seen = True
        level = c.level
        if level not in (3, 4, 5):
            self.level = codec.V311
            self._connack_refuse(codec.UNSUPPORTED_VERSION, f"protocol level {level}")
            return
        self.level = codec.V5 if level == 5 else codec.V311
        props = c.properties
        if props.get("auth_method"):
            self._connack_refuse(0x8C, "enhanced authentication is not supported")  # bad auth method
            return
        if self.level == codec.V5 and c.will is not None and c.will.qos > 1:
            self._connack_refuse(codec.QOS_NOT_SUPPORTED, "will QoS 2 is over the maximum QoS 1")  # MQTT-3.2.2-12
            return
        client_id = c.client_id
        assigned = False
        if not client_id:
            if not c.clean and self.level != codec.V5:
                self._connack_refuse(codec.CLIENT_ID_NOT_VALID, "empty client id with clean session 0")
                return
            client_id = "leveret-" + os.urandom(12).hex()
            assigned = True
        self.client_id = client_id
        host = self.peer[0] if self.peer else None
        # RabbitMQ's login forms: "vhost:user", else the listener's vhost.
        vhost_name = self.settings.vhost
        self.sessions.auth_attempts += 1
        if c.username is None and self.peer_identity:
            try:
                user = self.broker.authenticate_external(self.peer_identity, host)
            except AccessRefused as exc:
                self.sessions.auth_failed += 1
                self._connack_refuse(codec.BAD_CREDENTIALS, exc.text)
                return
            self._connect_as(c, user, vhost_name, client_id, assigned)
            return
        username = c.username or ""
        if ":" in username:
            vhost_name, username = username.split(":", 1)
        password = (c.password or b"").decode("utf-8", "replace")
        if self.run_async is None:  # sans-IO tests: the same check, on the caller's thread
            try:
                user = self.broker.authenticate(username, password, host)
            except AccessRefused as exc:
                self.sessions.auth_failed += 1
                self._connack_refuse(codec.BAD_CREDENTIALS, exc.text)
                return
            self._connect_as(c, user, vhost_name, client_id, assigned)
            return
        # The same check (and remembered logins) as the AMQP front end's PLAIN (Broker.login): the
        # address's turn and delay, then the KDF in the broker's threads, never on the event loop.
        # Nothing more this client sends is read meanwhile (suspended).
        self.suspended += 1
        self.run_async(self.broker.login(username, password, host),
                       lambda user, error: self._login_done(c, user, error, vhost_name, client_id, assigned))

    def _login_done(self, c: codec.Connect, user: Any, error: BaseException | None, vhost_name: str,
                    client_id: str, assigned: bool) -> None:
        self.suspended -= 1
        if self.state is State.CLOSED or self.should_close:
            return
        if isinstance(error, AccessRefused):
            self.sessions.auth_failed += 1
            self._connack_refuse(codec.BAD_CREDENTIALS, error.text)  # the throttle's delay is spent
        elif error is not None:
            log.error("MQTT login failed", exc_info=error, extra={"peer": self._host()})
            self._connack_refuse(codec.SERVER_UNAVAILABLE, "internal error; see the broker log")
        else:
            self._guarded(lambda u: self._connect_as(c, u, vhost_name, client_id, assigned), user)
        if self._out:
            self.on_output()
        if self._buf and not self.suspended and not self.should_close:
            self.on_input_ready()

    def _connect_as(self, c: codec.Connect, user: User, vhost_name: str, client_id: str,
                    assigned: bool) -> None:
        """CONNECT once the credentials are checked: vhost, limits, session."""
        props = c.properties
        vhost = self.broker.vhosts.get(vhost_name)
        if vhost is None or vhost_name not in user.vhosts:
            self._connack_refuse(codec.NOT_AUTHORIZED, f"access to vhost '{vhost_name}' refused for user "
                                                       f"'{user.name}'")
            return
        try:
            self.broker.limits.check_connection(user.name, user.limits, vhost_name,
                                                self.broker.vhost_limits.get(vhost_name, {}))
        except BrokerError as exc:
            self._connack_refuse(codec.QUOTA_EXCEEDED, exc.text)
            return
        exchange = vhost.exchanges.get(topics.EXCHANGE)
        if exchange is None:
            self._connack_refuse(codec.SERVER_UNAVAILABLE, f"no exchange '{topics.EXCHANGE}' in vhost '{vhost_name}'")
            return
        self.user = user
        self.username = user.name
        self.vhost = vhost
        self.exchange = exchange
        self.grants = self.broker.access.grants(user.name, vhost_name)
        self.keep_alive = c.keep_alive
        self.will = c.will
        if c.will is not None:
            topics.check_topic(c.will.topic)
        self.client_receive_max = props.get("receive_maximum", 65535)
        if self.client_receive_max == 0:
            raise ProtocolError("receive maximum 0")
        if props.get("maximum_packet_size") == 0:
            raise ProtocolError("maximum packet size 0")
        self.client_max_packet = props.get("maximum_packet_size", codec.MAX_REMAINING + 5)
        self._id_prefix = "mqtt-" + hashlib.sha1(f"{vhost_name}\0{client_id}".encode()).hexdigest()[:16] + "-"
        # The session: 3.1.1 clean session 0, or v5 session expiry > 0, outlives the connection.
        if self.level == codec.V5:
            expiry = min(props.get("session_expiry", 0), self.settings.max_session_expiry)
            persistent = expiry > 0
        else:
            expiry = NO_EXPIRY if not c.clean else 0
            persistent = not c.clean
        name = f"mqtt-subscription-{client_id}qos1"
        access.check(self.grants, "configure", "queue", name)
        self.broker.limits.opened(self, user.name, vhost_name)
        self._opened = True
        key = (vhost_name, client_id)
        old = self.sessions.claim(key, self)
        if old is not None:
            old.taken_over()
        self._take_hold(key)
        self.session = _Session(name, persistent, expiry)
        existing = vhost.queues.get(name)
        if existing is not None and c.clean:
            # Clean start: the old session goes (its queue, bindings and messages).
            self._when_unlocked(lambda: self.broker.coordinator.delete_queue(vhost, name, None, False, False),
                                lambda _: self._connected(False, assigned))
            return
        if existing is not None:
            self.session.queue = existing
            self.session.delete_at_close = not persistent
            self._restore_subscriptions(existing)
            self._connected(True, assigned)
            return
        self._connected(False, assigned)

    def _connack_refuse(self, reason: int, text: str) -> None:
        refused_log.warning(self._host(), "MQTT connection refused", reason=f"{reason:#x}", text=text)
        props = {"reason_string": text[:200]} if self.level == codec.V5 else None
        self.write(codec.connack(self.level, False, reason, props))
        self.close_reason = text
        self.should_close = True

    def _connected(self, session_present: bool, assigned: bool) -> None:
        self.state = State.OPEN
        props: dict[str, Any] = {}
        if self.level == codec.V5:
            props = {"receive_maximum": self.settings.receive_maximum, "maximum_qos": 1,
                     "topic_alias_maximum": self.settings.topic_alias_maximum,
                     "maximum_packet_size": min(self.settings.max_packet_size, codec.MAX_REMAINING + 5),
                     "retain_available": 1, "wildcard_available": 1, "subscription_ids_available": 1,
                     "shared_available": 1}
            if assigned:
                props["assigned_client_id"] = self.client_id
        self.write(codec.connack(self.level, session_present, codec.SUCCESS, props))
        log.info("MQTT connection opened", extra={"peer": self._peer_text(), "user": self.username,
                                                  "vhost": self.vhost.name if self.vhost else "",
                                                  "client_id": self.client_id, "protocol_level": self.level})
        if self.session is not None and self.session.queue is not None:
            self._consume_session()
        retained = self.sessions.retained(self.vhost.name if self.vhost else "/")
        if retained.opening is not None:
            # The vhost's retained queue is being declared (the first connection to this vhost):
            # nothing more is read until it is, so no retained publish finds it missing.
            self._when(retained.opening, _noop_result)

    def _restore_subscriptions(self, q: Queue) -> None:
        """A persistent session's subscriptions are its queue's bindings (with their options)."""
        assert self.exchange is not None and self.session is not None
        for b in self.exchange.bindings_to(q):
            a = b.arguments
            f = a.get(ARG_FILTER)
            if not isinstance(f, str):
                continue
            sub = Sub(f, int(a.get(ARG_QOS, 0)), bool(a.get(ARG_NO_LOCAL)), bool(a.get(ARG_RAP)),
                      int(a.get(ARG_ID, 0)))
            self.session.subs[f] = sub
        self._subs_changed()

    def taken_over(self) -> None:
        """Another connection CONNECTed with this client id: this one ends (its will goes out)."""
        if self.state is State.CLOSED or self.should_close:
            return
        self.close_reason = "session taken over"
        if self.level == codec.V5:
            self.write(codec.disconnect(codec.SESSION_TAKEN_OVER, "another connection used this client id"))
        self.should_close = True
        # Release the session now (its unacked deliveries go back first), not when the socket goes.
        self.connection_lost()
        self.on_output()

    # ----------------------------------------------------------------- PUBLISH
    def _publish(self, p: codec.Publish) -> None:
        props = p.properties
        if self.level == codec.V5:
            alias = props.get("topic_alias")
            if alias is not None:
                if alias == 0 or alias > self.settings.topic_alias_maximum:
                    raise PacketError(f"topic alias {alias} out of range", codec.TOPIC_ALIAS_INVALID)
                if p.topic:
                    self._aliases[alias] = p.topic
                else:
                    topic = self._aliases.get(alias)
                    if topic is None:
                        raise ProtocolError(f"unknown topic alias {alias}")
                    p.topic = topic
            if p.qos == 2:
                raise PacketError("QoS 2 is not supported (CONNACK said maximum QoS 1)", codec.QOS_NOT_SUPPORTED)
            if props.get("payload_format") == 1:
                try:
                    p.payload.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise PacketError("payload format indicator 1 with a payload that is not UTF-8",
                                      codec.PAYLOAD_FORMAT_INVALID) from exc
        topics.check_topic(p.topic)
        if p.qos:
            if p.qos == 2 and p.packet_id in self._qos2_released:
                self.write(codec.ack(codec.PUBREC, p.packet_id, self.level))  # a resent QoS 2 publish
                return
            if p.packet_id in self._inbound_ids:
                if p.dup:
                    return  # the first copy's PUBACK is on its way
                raise ProtocolError(f"packet identifier {p.packet_id} reused before its PUBACK")
            if len(self._inbound_ids) >= self.settings.receive_maximum:
                raise PacketError("more QoS 1 publishes in flight than the receive maximum",
                                  codec.RECEIVE_MAXIMUM_EXCEEDED)
        assert self.grants is not None and self.vhost is not None
        rk = topics.to_routing_key(p.topic)
        try:
            access.publish(self.grants, topics.EXCHANGE)
            access.check_topic(self.grants, "write", topics.EXCHANGE, rk)
        except AccessRefused as exc:
            if self.level == codec.V5 and p.qos == 1:
                refused_log.warning(self._host(), "MQTT publish refused", text=exc.text)
                entry = _Inbound(p.packet_id, codec.PUBACK, codec.NOT_AUTHORIZED)  # in order with the others
                self._inbound.append(entry)
                self._inbound_ids[p.packet_id] = entry
                return
            raise
        message = self._message(p, rk)
        outcome = self._route(p.topic, message, p.retain)
        if p.qos:
            entry = _Inbound(p.packet_id, codec.PUBACK if p.qos == 1 else codec.PUBREC)
            self._inbound.append(entry)
            self._inbound_ids[p.packet_id] = entry
            if outcome.settled:
                entry.reason = self._reason(outcome, outcome.ok)
            else:
                outcome.on_settled(lambda ok: self._settled(entry, outcome, ok))

    def _message(self, p: codec.Publish, rk: str) -> Message:
        qos = 1 if p.qos else 0
        props = p.properties
        if not props and not p.retain:
            message = Message(topics.EXCHANGE, rk, mapping.PLAIN_PROPS[qos], p.payload, mapping.PLAIN_SUMMARY[qos],
                              self.broker.node_id)
        else:
            message = Message(topics.EXCHANGE, rk, mapping.to_amqp(qos, p.retain, props), p.payload,
                              None, self.broker.node_id)
        message.id = self._id_prefix + str(message.seq)  # tells no-local subscriptions it is ours
        return message

    def _route(self, topic: str, message: Message, retain: bool) -> publish.Outcome:
        assert self.vhost is not None
        self.has_published = True
        stats = self.broker.stats
        stats.received += 1
        outcome = publish.publish(self.broker, self.vhost, self.exchange, message, message.persistent)
        if not outcome.routed:
            stats.unroutable_dropped += 1
        if retain:
            kept = self.sessions.retained(self.vhost.name).put(topic, message)
            if message.persistent and not kept.settled:
                return _Both(outcome, kept)
        return outcome

    @staticmethod
    def _reason(outcome: publish.Outcome, ok: bool) -> int:
        if not ok:
            return codec.IMPLEMENTATION_SPECIFIC
        return codec.SUCCESS if outcome.routed else 0x10  # no matching subscribers

    def _settled(self, entry: _Inbound, outcome: publish.Outcome, ok: bool) -> None:
        entry.reason = self._reason(outcome, ok)
        if self._inbound and self._inbound[0] is entry and not self._in_receive:
            self._flush_inbound()
            self.on_output()

    def _flush_inbound(self) -> None:
        """PUBACKs (PUBRECs) of settled publishes, in the order the publishes came."""
        q = self._inbound
        while q and q[0].reason is not None:
            entry = q.popleft()
            self._inbound_ids.pop(entry.packet_id, None)
            if self.should_close or self.state is State.CLOSED:
                continue
            reason = entry.reason if entry.reason is not None else codec.SUCCESS
            if entry.kind == codec.PUBREC:
                self._qos2_released.add(entry.packet_id)
            self.write(codec.ack(entry.kind, entry.packet_id, self.level, reason))

    # -------------------------------------------------------- acks from client
    def _ack(self, a: codec.Ack) -> None:
        if a.kind == codec.PUBREL:
            known = a.packet_id in self._qos2_released
            self._qos2_released.discard(a.packet_id)
            reason = codec.SUCCESS if known else codec.PACKET_ID_NOT_FOUND
            self.write(codec.ack(codec.PUBCOMP, a.packet_id, self.level, reason))
            return
        if a.kind != codec.PUBACK:
            # PUBREC/PUBCOMP answer QoS 2 deliveries, which this server never sends.
            raise ProtocolError(f"{codec.NAMES[a.kind]} for a QoS 2 delivery that was never sent")
        entry = self._inflight.pop(a.packet_id, None)
        if entry is None:
            return  # unknown id (a PUBACK after a reconnect for a message redelivered since): ignored
        qm, consumer = entry
        if qm is not None and consumer is not None:
            consumer.channel.settle(qm, consumer)
            consumer.channel.dispatch()
        self._drain_retained()

    # --------------------------------------------------------------- SUBSCRIBE
    def _subscribe(self, s: codec.Subscribe) -> None:
        assert self.session is not None and self.grants is not None
        sub_id = 0
        ids = s.properties.get("subscription_id")
        if ids:
            if len(ids) > 1 or ids[0] == 0:
                raise ProtocolError("invalid subscription identifier")
            sub_id = ids[0]
        codes: list[int] = []
        todo: list[tuple[str, Sub, bool]] = []  # (full filter, sub, new)
        for req in s.subscriptions:
            try:
                group, inner = topics.split_shared(req.filter)
                topics.check_filter(inner)
                if group is not None and req.no_local:
                    raise ProtocolError("no local on a shared subscription")
                qos = min(req.qos, 1)
                sub = Sub(inner, qos, req.no_local, req.retain_as_published, sub_id, group)
                qname = self._queue_for(sub)
                access.bind(self.grants, topics.EXCHANGE, "queue", qname)
                access.check_topic(self.grants, "read", topics.EXCHANGE, sub.routing_key)
                if group is not None:
                    access.check(self.grants, "configure", "queue", qname)
            except PacketError as exc:
                if isinstance(exc, ProtocolError) and "no local" in exc.text:
                    raise
                refused_log.warning(self._host(), "MQTT subscription refused", text=exc.text)
                codes.append(codec.TOPIC_FILTER_INVALID)
                continue
            except AccessRefused as exc:
                refused_log.warning(self._host(), "MQTT subscription refused", text=exc.text)
                codes.append(codec.NOT_AUTHORIZED)
                continue
            codes.append(qos)
            new = req.filter not in self.session.subs
            # Retain handling 0: send retained messages; 1: only for a new subscription; 2: never.
            # A shared subscription gets none (MQTT-4.8.2-5 leaves it open; RabbitMQ sends none either).
            handling = req.retain_handling
            todo.append((req.filter, sub, group is None and (handling == 0 or (handling == 1 and new))))
        self._bind_next(todo, 0, lambda: self._subscribed(s, codes, todo))

    def _queue_for(self, sub: Sub) -> str:
        assert self.session is not None
        return self.session.queue_name if sub.group is None else f"mqtt-shared-{sub.group}"

    def _bind_next(self, todo: list[tuple[str, Sub, bool]], i: int, finished: Callable[[], None]) -> None:
        """Declare what is missing, then bind each subscription in turn (one coordinator call at a time)."""
        assert self.session is not None and self.vhost is not None
        if i == len(todo):
            finished()
            return
        full, sub, _ = todo[i]
        if sub.group is None and self.session.queue is None:
            s = self.session
            args: dict[str, Any] = {}
            if s.persistent and s.expiry != NO_EXPIRY:
                args["x-expires"] = max(1, s.expiry) * 1000
            vhost = self.vhost

            def declare() -> Awaitable[Queue]:
                return self.broker.coordinator.declare_queue(vhost, s.queue_name, self, s.persistent,
                                                             not s.persistent, False, args)

            self._when_unlocked(declare, lambda q: self._declared_session(q, todo, i, finished))
            return
        if sub.group is not None and not any(g == sub.group for _, g in self._consumers.values()):
            op = self.broker.coordinator.declare_queue(self.vhost, self._queue_for(sub), None, False, False, True, {})
            self._when(op, lambda q: self._join_group(q, sub.group, todo, i, finished))
            return
        old = self.session.subs.get(full)
        qname = self._queue_for(sub)

        def bound(_: Any) -> None:
            assert self.session is not None
            self.session.subs[full] = sub
            self._subs_changed()
            self._bind_next(todo, i + 1, finished)

        def bind_new(_: Any = None) -> None:
            self._when(self.broker.coordinator.bind(self.vhost, topics.EXCHANGE, "queue", qname,  # type: ignore[arg-type]
                                                sub.routing_key, sub.binding_args(), True), bound)

        if old is not None and old.binding_args() != sub.binding_args() and old.group == sub.group:
            self._when(self.broker.coordinator.bind(self.vhost, topics.EXCHANGE, "queue", qname, old.routing_key,
                                                old.binding_args(), False), bind_new)
        else:
            bind_new()

    def _declared_session(self, q: Queue, todo: list[tuple[str, Sub, bool]], i: int,
                          finished: Callable[[], None]) -> None:
        assert self.session is not None
        self.session.queue = q
        self._consume_session()
        self._bind_next(todo, i, finished)

    def _when_unlocked(self, make: Callable[[], Awaitable[Any]], then: Callable[[Any], None], tries: int = 0) -> None:
        """``_when(make(), then)``, but while the session's queue is the exclusive queue of this client
        id's previous connection on another node (which closes, since this one took the id's hold:
        sessions.py), ask again every LOCKED_RETRY_S."""
        def answered(result: Any) -> None:
            if result is not _LOCKED:
                then(result)
                return
            if tries >= LOCKED_RETRIES:
                raise ResourceLocked("the session queue stays locked by another connection of this client id")
            self.suspended += 1
            self.broker.scheduler.call_later(LOCKED_RETRY_S, lambda: self._again(make, then, tries + 1))

        try:
            op = make()
        except BrokerError as exc:  # refused at once (a queue this node serves)
            if exc.code != ResourceLocked.code:
                raise
            answered(_LOCKED)
            return
        self._when(op if isinstance(op, Immediate) else _unless_locked(op), answered)

    def _again(self, make: Callable[[], Awaitable[Any]], then: Callable[[Any], None], tries: int) -> None:
        self.suspended -= 1
        if self.state is State.CLOSED or self.should_close:
            return
        self._guarded(self._when_unlocked, make, then, tries)
        if self._out:
            self.on_output()
        if self._buf and not self.suspended:
            self.on_input_ready()

    def _join_group(self, q: Queue, group: str | None, todo: list[tuple[str, Sub, bool]], i: int,
                    finished: Callable[[], None]) -> None:
        access.read_queue(self.grants, q.name)  # type: ignore[arg-type]
        consumer = Consumer(f"mqtt-{self.client_id}", q.default, self, no_ack=False)
        q.default.add_consumer(consumer, dispatch=False)
        self._consumers[id(consumer)] = (consumer, group)
        self._bind_next(todo, i, finished)

    def _consume_session(self) -> None:
        s = self.session
        assert s is not None and s.queue is not None and self.grants is not None
        access.read_queue(self.grants, s.queue_name)
        consumer = Consumer(f"mqtt-{self.client_id}", s.queue.default, self, no_ack=False)
        s.queue.default.add_consumer(consumer, dispatch=False)
        s.consumer = consumer
        self._consumers[id(consumer)] = (consumer, None)
        s.queue.default.dispatch()

    def _subscribed(self, s: codec.Subscribe, codes: list[int], todo: list[tuple[str, Sub, bool]]) -> None:
        self.write(codec.suback(s.packet_id, codes, self.level))
        assert self.vhost is not None
        retained = self.sessions.retained(self.vhost.name)
        for _, sub, send_retained in todo:
            if not send_retained:
                continue
            for rm in retained.matching(sub.filter):
                m = rm.message
                qos = min(sub.qos, retained_qos(m))
                expiry = None
                if rm.expires_at is not None:
                    expiry = max(1, int(rm.expires_at - time.time()))
                p = codec.Publish(rm.topic, m.body, qos, True, False,
                                  properties=mapping.to_mqtt(m, expiry) if self.level == codec.V5 else {})
                self._pending_retained.append((p, [sub.sub_id] if sub.sub_id else []))
        self._drain_retained()
        for consumer, _ in list(self._consumers.values()):
            consumer.channel.dispatch()

    def _drain_retained(self) -> None:
        while self._pending_retained and self._has_room():
            p, ids = self._pending_retained.popleft()
            if ids:
                p.properties["subscription_id"] = ids
            packet_id = 0
            if p.qos:
                packet_id = self._packet_id()
                self._inflight[packet_id] = (None, None)
            data = codec.publish(p.topic, p.payload, p.qos, True, False, packet_id, self.level, p.properties)
            if len(data) > self.client_max_packet:
                self._inflight.pop(packet_id, None)
                continue
            self.write(data)

    # ------------------------------------------------------------- UNSUBSCRIBE
    def _unsubscribe(self, u: codec.Unsubscribe) -> None:
        assert self.session is not None
        codes = []
        gone: list[Sub] = []
        self._subs_changed()
        for f in u.filters:
            sub = self.session.subs.pop(f, None)
            if sub is None:
                codes.append(codec.NO_SUBSCRIPTION_EXISTED)
            else:
                codes.append(codec.SUCCESS)
                gone.append(sub)
        self._unbind_next(gone, 0, lambda: self.write(codec.unsuback(u.packet_id, codes, self.level)))

    def _unbind_next(self, gone: list[Sub], i: int, finished: Callable[[], None]) -> None:
        assert self.session is not None and self.vhost is not None
        if i == len(gone):
            finished()
            return
        sub = gone[i]
        if sub.group is not None:
            # Other members may share the binding: leave the group, which goes with its last member.
            if not any(s.group == sub.group for s in self.session.subs.values()):
                for key, (consumer, group) in list(self._consumers.items()):
                    if group == sub.group:
                        self._drop_consumer(key, consumer)
            self._unbind_next(gone, i + 1, finished)
            return
        op = self.broker.coordinator.bind(self.vhost, topics.EXCHANGE, "queue", self.session.queue_name,
                                      sub.routing_key, sub.binding_args(), False)
        self._when(op, lambda _: self._unbind_next(gone, i + 1, finished))

    def _drop_consumer(self, key: int, consumer: Consumer) -> None:
        """Stop consuming, and put what this consumer holds unacknowledged back in its queue."""
        self._consumers.pop(key, None)
        consumer.channel.remove_consumer(consumer)
        back = [(pid, qm) for pid, (qm, c) in self._inflight.items() if c is consumer and qm is not None]
        for pid, _ in back:
            del self._inflight[pid]
        if back:
            consumer.channel.requeue([(qm, consumer) for _, qm in back])  # type: ignore[misc]

    # ------------------------------------------------------------- deliveries
    def _has_room(self) -> bool:
        return (not self.write_blocked and not self.should_close and self.state is State.OPEN
                and len(self._inflight) < self.client_receive_max)

    def has_credit(self, consumer: Consumer) -> bool:
        return self._has_room()

    def consumer_cancelled(self, consumer: Consumer) -> None:
        """The queue went away (deleted by an operator): the session's subscriptions with it."""
        entry = self._consumers.pop(id(consumer), None)
        if entry is None:
            return
        for pid in [pid for pid, (_, c) in self._inflight.items() if c is consumer]:
            del self._inflight[pid]
        self._subs_changed()
        if self.session is not None:
            if entry[1] is None:
                self.session.queue = None
                self.session.consumer = None
                self.session.subs = {k: s for k, s in self.session.subs.items() if s.group is not None}
            else:
                self.session.subs = {k: s for k, s in self.session.subs.items() if s.group != entry[1]}

    def _route_for(self, group: str | None, routing_key: str) -> _Route:
        """Which of this session's subscriptions a routing key meets (cached until they change)."""
        key = (group, routing_key)
        r = self._routes.get(key)
        if r is not None:
            return r
        assert self.session is not None
        topic = topics.to_topic(routing_key)
        every: list[Sub] = []
        for sub in self.session.subs.values():
            if sub.group == group and topics.matches(sub.filter, topic):
                every.append(sub)
        remote = [sub for sub in every if not sub.no_local]
        r = _Route(topic, codec.utf8(topic), _Match.of(every), _Match.of(remote), len(remote) != len(every))
        if len(self._routes) >= 4096:
            self._routes.clear()
        self._routes[key] = r
        return r

    def _subs_changed(self) -> None:
        self._routes.clear()

    def deliver(self, consumer: Consumer, qm: QueuedMessage) -> None:
        m = qm.message
        route = self._route_for(self._consumers[id(consumer)][1], m.routing_key)
        match = route.every
        if route.no_local and m.id.startswith(self._id_prefix):
            match = route.remote  # published by this client: not to its no-local subscriptions
        if match.qos < 0:
            consumer.channel.settle(qm, consumer)  # no subscription of this session wants it ($ topics, no local)
            return
        msg_qos = 1 if m.summary.delivery_mode == 2 else 0
        qos = match.qos if match.qos < msg_qos else msg_qos
        props: dict[str, Any] | None = None
        retain = False
        if m.props is not mapping.PLAIN_PROPS[msg_qos]:
            retain = match.rap and mapping.retain_flag(m)
            if self.level == codec.V5:
                expiry = None
                if qm.expires_at is not None:
                    expiry = max(1, int(qm.expires_at - time.time()))
                props = mapping.to_mqtt(m, expiry)
        if match.ids and self.level == codec.V5:
            if props is None:
                props = {}
            props["subscription_id"] = match.ids
        packet_id = self._packet_id() if qos else 0
        data = codec.publish(route.topic, m.body, qos, retain, qos > 0 and qm.redelivered, packet_id, self.level,
                             props, route.topic_raw)
        self.broker.stats.delivered_consume_manual_ack += 1
        if len(data) > self.client_max_packet:
            consumer.channel.settle(qm, consumer)  # over the client's maximum packet size: dropped (v5 3.1.2.11.4)
            return
        self.write(data)
        if qos:
            self._inflight[packet_id] = (qm, consumer)
        else:
            consumer.channel.settle(qm, consumer)

    def _packet_id(self) -> int:
        n = self._next_id
        while True:
            n = n % 65535 + 1
            if n not in self._inflight:
                self._next_id = n
                return n

    # -------------------------------------------------------------- DISCONNECT
    def _disconnect(self, d: codec.Disconnect) -> None:
        if self.level == codec.V5:
            expiry = d.properties.get("session_expiry")
            if expiry is not None and self.session is not None:
                if self.session.expiry == 0 and expiry:
                    raise ProtocolError("session expiry set at DISCONNECT after 0 at CONNECT")
                self.session.expiry = expiry
        if d.reason != codec.DISCONNECT_WITH_WILL:
            self.will = None  # a normal DISCONNECT discards the will (MQTT-3.14.4-3)
        self.close_reason = "client disconnected"
        self.should_close = True

    def _refuse(self, reason: int, text: str, logged: bool = False) -> None:
        """Close for bad input or a refusal: v5 says why in a DISCONNECT; one (rate-limited) log line."""
        if self.should_close or self.state is State.CLOSED:
            return
        if not logged:
            refused_log.warning(self._host(), "MQTT connection closed by server", reason=f"{reason:#x}",
                                text=text, client_id=self.client_id)
        if self.state is State.AWAIT_CONNECT and self._connect_seen:
            self.write(codec.connack(self.level, False, reason, {"reason_string": text[:200]}
                                     if self.level == codec.V5 else None))
        elif self.level == codec.V5 and self.state is State.OPEN:
            self.write(codec.disconnect(reason, text))
        self.close_reason = text
        self.should_close = True

    def close(self, reason: int = codec.SERVER_SHUTTING_DOWN, text: str = "server shutting down") -> None:
        """Server-initiated close (shutdown, a deleted user)."""
        if self.should_close or self.state is State.CLOSED:
            return
        if self.level == codec.V5 and self.state is State.OPEN:
            self.write(codec.disconnect(reason, text))
        self.close_reason = text
        self.should_close = True

    # ------------------------------------------------------------------- timers
    def tick(self, now: float) -> None:
        self._now = now
        if self.state is State.CLOSED or self.should_close:
            return
        if self.state is State.AWAIT_CONNECT:
            if now - self.opened_at > self.settings.connect_timeout and not self.suspended:
                self.close_reason = "no CONNECT in time"
                self.should_close = True
            return
        if self._held_by or self.blocked:
            self.last_received = now  # we are not reading: the silence is ours
        if self.keep_alive and now - self.last_received > 1.5 * self.keep_alive:
            self._refuse(codec.KEEP_ALIVE_TIMEOUT, f"no packet within 1.5 times the keep-alive of "
                                                   f"{self.keep_alive}s")

    # --------------------------------------------------------------- the end
    def connection_lost(self) -> None:
        """The transport is gone (or the session was taken over): settle what the session held."""
        if self._lost:
            return
        self._lost = True
        self.state = State.CLOSED
        self.should_close = True
        for gate in self._held_by.values():
            gate.forget(self)
        self._held_by.clear()
        for cid, (consumer, _) in list(self._consumers.items()):
            self._drop_consumer(cid, consumer)
        self._inflight.clear()
        if self.vhost is None:
            return
        vhost = self.vhost
        key = (vhost.name, self.client_id)
        if self.sessions.release(key, self) and self.run_async is not None:
            self.run_async(self.broker.coordinator.release(HOLD, *key), _log_hold_error)
        if self._opened:
            self.broker.limits.closed(self, self.username, vhost.name)
        s = self.session
        if s is not None:
            vhost.drop_exclusive_queues(self)  # a clean session's queue
            if s.delete_at_close or (s.persistent and s.expiry == 0):
                self._fire(self.broker.coordinator.delete_queue(vhost, s.queue_name, None, False, False))
        if self.will is not None:
            will, self.will = self.will, None
            delay = will.properties.get("will_delay", 0)
            if s is not None and s.expiry != NO_EXPIRY:
                delay = min(delay, s.expiry)
            if delay > 0:
                self.sessions.delay_will(key, delay, lambda: self._publish_will(will))
            else:
                self._publish_will(will)
        log.info("MQTT connection closed", extra={"peer": self._peer_text(), "client_id": self.client_id,
                                                  "reason": self.close_reason or "socket closed"})

    def _publish_will(self, will: codec.Will) -> None:
        if self.grants is None or self.vhost is None:
            return
        rk = topics.to_routing_key(will.topic)
        try:
            access.publish(self.grants, topics.EXCHANGE)
            access.check_topic(self.grants, "write", topics.EXCHANGE, rk)
        except AccessRefused as exc:
            refused_log.warning(self._host(), "MQTT will not published", text=exc.text)
            return
        p = codec.Publish(will.topic, will.payload, will.qos, will.retain, False, 0,
                          {k: v for k, v in will.properties.items() if k != "will_delay"})
        previous = flow.swap(None)
        try:
            self._route(will.topic, self._message(p, rk), will.retain)
        finally:
            flow.swap(previous)

    def _take_hold(self, key: tuple[str, str]) -> None:
        """The cluster's hold of the client id (sessions.py): an older connection on another node closes."""
        if self.run_async is None:
            return

        def done(revision: Any, error: BaseException | None) -> None:
            if error is not None:
                _log_hold_error(None, error)  # this node's takeover still holds; the cluster's is skipped
            elif not self.sessions.held(key, self, int(revision)):
                self.taken_over()

        self.run_async(self.broker.coordinator.take_hold(HOLD, *key), done)

    def _fire(self, op: Awaitable[Any]) -> None:
        if isinstance(op, Immediate) or self.run_async is None:
            return
        def done(_: Any, error: BaseException | None) -> None:
            if error is not None:
                log.warning("MQTT session queue not deleted", extra={"client_id": self.client_id,
                                                                     "error": str(error)})

        self.run_async(op, done)

    def _peer_text(self) -> str:
        return f"{self.peer[0]}:{self.peer[1]}" if self.peer else "-"

    def _host(self) -> str:
        """What refusals are rate-limited by: the client's address (a flood opens new ports)."""
        return self.peer[0] if self.peer else "-"


@dataclass(frozen=True)
class _Match:
    qos: int  # the highest QoS of the subscriptions that match; -1: none
    ids: list[int]
    rap: bool

    @staticmethod
    def of(subs: list[Sub]) -> _Match:
        return _Match(max((s.qos for s in subs), default=-1), [s.sub_id for s in subs if s.sub_id],
                      any(s.rap for s in subs))


@dataclass(frozen=True)
class _Route:
    topic: str
    topic_raw: bytes  # the topic as an MQTT string, encoded once
    every: _Match
    remote: _Match  # without the no-local subscriptions: for this client's own messages
    no_local: bool  # the two differ


class _Both(publish.Outcome):
    """Settled when the routed publish and the retained copy both are (a retained QoS 1 PUBACK)."""

    def __init__(self, a: publish.Outcome, b: publish.Outcome) -> None:
        super().__init__(routed=a.routed)
        self._pending = 3
        a.on_settled(lambda ok: self._answer(ok, None))
        b.on_settled(lambda ok: self._answer(ok, None))
        self._answer(True, None)


def _raise(exc: BaseException) -> None:
    raise exc


_LOCKED = object()


async def _unless_locked(op: Awaitable[Any]) -> Any:
    """``op``'s answer, or _LOCKED while another connection holds the queue exclusively (405)."""
    try:
        return await op
    except BrokerError as exc:
        if exc.code != ResourceLocked.code:  # from another node it comes as its code, not its class
            raise
        return _LOCKED


def _log_hold_error(_: Any, error: BaseException | None) -> None:
    if error is not None:
        log.warning("MQTT client id hold not changed in the cluster",
                    extra={"error": f"{type(error).__name__}: {error}"})


def _noop() -> None:
    pass


def _noop_result(_: Any) -> None:
    pass
