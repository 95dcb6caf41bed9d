"""What the MQTT connections of one node share: who holds each client id, delayed wills, retained stores."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from mqtt_frontend.retained import Retained

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from core.engine.broker import Broker
    from core.model.clock import TimerHandle

log = logging.getLogger("leveret.mqtt")

Key = tuple[str, str]  # (vhost, client id)


class Sessions:
    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        # The connection serving each client id; a second CONNECT of the id takes it over.
        self.live: dict[Key, Any] = {}
        # Wills waiting for their v5 delay; a reconnect of the client id within it cancels them.
        self.delayed_wills: dict[Key, TimerHandle] = {}
        self._retained: dict[str, Retained] = {}
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

    def release(self, key: Key, conn: Any) -> None:
        if self.live.get(key) is conn:
            del self.live[key]

    def delay_will(self, key: Key, delay: float, publish: Callable[[], None]) -> None:
        def fire() -> None:
            self.delayed_wills.pop(key, None)
            publish()

        old = self.delayed_wills.pop(key, None)
        if old is not None:
            old.cancel()
        self.delayed_wills[key] = self.broker.scheduler.call_later(delay, fire)


_tasks: set[asyncio.Task[Any]] = set()


def _spawn(op: Awaitable[Any], r: Retained) -> asyncio.Task[None]:
    async def run() -> None:
        try:
            await op
        except Exception as exc:  # noqa: BLE001 - logged: retained messages are then not kept
            log.error("could not open the retained-message queue", extra={"error": f"{type(exc).__name__}: {exc}"})
        finally:
            r.opening = None

    task = asyncio.get_running_loop().create_task(run())
    _tasks.add(task)  # the loop keeps only weak references to tasks
    task.add_done_callback(_tasks.discard)
    return task
