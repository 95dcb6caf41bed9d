"""What the MQTT connections of one node share: who holds each client id, delayed wills, retained stores.

A client id is held on this node by ``live`` (a second CONNECT here takes it over at once) and in a
cluster by the coordinator's hold ``mqtt/<vhost>/<client id>``, taken at every CONNECT whoever held it
(``take_hold``: the last take wins). Every node hears every take (``on_hold_taken``) with its
revision; a node whose live connection for that id took its hold at a lower revision closes it, as
RabbitMQ closes the first connection of a client id connected twice anywhere in the cluster.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from core.model.tasks import spawn
from mqtt_frontend.retained import Retained

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from core.engine.broker import Broker
    from core.model.clock import TimerHandle

log = logging.getLogger("leveret.mqtt")

Key = tuple[str, str]  # (vhost, client id)
HOLD = "mqtt"  # the kind of the coordinator's named hold of a client id


class Sessions:
    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        # The connection serving each client id; a second CONNECT of the id takes it over.
        self.live: dict[Key, Any] = {}
        # Wills waiting for their v5 delay; a reconnect of the client id within it cancels them.
        self.delayed_wills: dict[Key, TimerHandle] = {}
        self._retained: dict[str, Retained] = {}
        # The revision of the cluster hold each live connection took (absent while the take is in flight),
        # and the newest take by another node seen meanwhile (compared when ours is answered).
        self.hold_revisions: dict[Key, int] = {}
        self._foreign_takes: dict[Key, int] = {}
        self._watching = False
        # rabbitmq_auth_attempts_total{protocol="mqtt"} and its _succeeded/_failed (RabbitMQ 3.10's series).
        self.auth_attempts = 0
        self.auth_failed = 0

    def retained(self, vhost_name: str) -> Retained:
        r = self._retained.get(vhost_name)
        if r is None:
            r = self._retained[vhost_name] = Retained(self.broker, self.broker.vhosts[vhost_name])
            op = r.open()
            if not hasattr(op, "value"):  # not Immediate: the store answers later
                r.opening = _spawn(op, r)
        return r

    def claim(self, key: Key, conn: Any) -> Any:
        """``conn`` now holds ``key``; the connection that held it before (to be disconnected), if any."""
        old = self.live.get(key)
        self.live[key] = conn
        timer = self.delayed_wills.pop(key, None)
        if timer is not None:
            timer.cancel()
        return old if old is not conn else None

    def release(self, key: Key, conn: Any) -> bool:
        """``conn`` is gone: True when it held ``key`` (then its cluster hold is to be released too)."""
        if self.live.get(key) is conn:
            del self.live[key]
            self.hold_revisions.pop(key, None)
            self._foreign_takes.pop(key, None)
            return True
        return False

    def watch_holds(self) -> None:
        """Hear the client-id takes of every node (once the node's coordinator is the cluster's)."""
        if not self._watching:
            self._watching = True
            self.broker.coordinator.on_hold_taken(HOLD, self._hold_taken)

    def held(self, key: Key, conn: Any, revision: int) -> bool:
        """``conn``'s take was answered at ``revision``: False when another node took the id since."""
        if self.live.get(key) is not conn:
            return True
        self.hold_revisions[key] = revision
        return self._foreign_takes.pop(key, 0) <= revision

    def _hold_taken(self, vhost: str, client_id: str, holder: str, revision: int) -> None:
        if holder == self.broker.node_id:
            return
        key = (vhost, client_id)
        conn = self.live.get(key)
        if conn is None:
            return
        mine = self.hold_revisions.get(key)
        if mine is None:  # our own take is in flight: decided when it is answered (held)
            self._foreign_takes[key] = max(self._foreign_takes.get(key, 0), revision)
        elif revision > mine:
            log.info("MQTT client id taken over on another node",
                     extra={"client_id": client_id, "vhost": vhost, "node": holder})
            conn.taken_over()

    def delay_will(self, key: Key, delay: float, publish: Callable[[], None]) -> None:
        def fire() -> None:
            self.delayed_wills.pop(key, None)
            publish()

        old = self.delayed_wills.pop(key, None)
        if old is not None:
            old.cancel()
        self.delayed_wills[key] = self.broker.scheduler.call_later(delay, fire)


_tasks: set[asyncio.Task[Any]] = set()


def _spawn(op: Awaitable[Any], r: Retained) -> asyncio.Task[Any]:
    async def run() -> None:
        try:
            await op
        except Exception as exc:  # noqa: BLE001 - logged: retained messages are then not kept
            log.error("could not open the retained-message queue", extra={"error": f"{type(exc).__name__}: {exc}"})
        finally:
            r.opening = None

    return spawn(run(), _tasks)
