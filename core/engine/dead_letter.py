"""Dead-lettering: the republished copy of a message and its x-death history.

Follows RabbitMQ 3.x: the newest x-death entry first, one entry per
(queue, reason) whose count grows, x-first-death-* set once, the expiration
property removed (kept as ``original-expiration``), and a message dropped
rather than dead-lettered around a cycle that no client rejection broke.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any

from core.model import properties
from core.model.message import Message

if TYPE_CHECKING:
    from core.engine.queue import Queue

REJECTED = "rejected"


def make_dead_lettered(message: Message, queue: Queue, reason: str, now: float, dlx: str) -> Message:
    props = properties.decode(message.props)
    headers: dict[str, Any] = dict(props.get("headers") or {})
    deaths: list[Any] = list(headers.get("x-death") or [])
    routing_keys = [message.routing_key]
    when = datetime.datetime.fromtimestamp(int(now), tz=datetime.UTC)
    for i, entry in enumerate(deaths):
        if isinstance(entry, dict) and entry.get("queue") == queue.name and entry.get("reason") == reason:
            updated = dict(entry)
            updated["count"] = int(updated.get("count", 0)) + 1
            updated["time"] = when
            deaths.pop(i)
            deaths.insert(0, updated)
            break
    else:
        entry = {
            "count": 1,
            "reason": reason,
            "queue": queue.name,
            "time": when,
            "exchange": message.exchange,
            "routing-keys": routing_keys,
        }
        if props.get("expiration") is not None:
            entry["original-expiration"] = props["expiration"]
        deaths.insert(0, entry)
    headers["x-death"] = deaths
    if queue.args.quorum:
        # The count a quorum queue added on redelivery is not part of the dead-lettered
        # copy (RabbitMQ 3.10.8 drops it too).
        headers.pop("x-delivery-count", None)
    headers.setdefault("x-first-death-reason", reason)
    headers.setdefault("x-first-death-queue", queue.name)
    headers.setdefault("x-first-death-exchange", message.exchange)
    props["headers"] = headers
    props.pop("expiration", None)
    routing_key = queue.args.dead_letter_routing_key or message.routing_key
    dead = Message(dlx, routing_key, properties.encode(props), message.body, node=message.node)
    return dead


def is_cycle(target_queue: str, headers: dict[str, Any]) -> bool:
    """Would dead-lettering to ``target_queue`` close a fully automatic loop?"""
    deaths = headers.get("x-death") or []
    for entry in deaths:
        if not isinstance(entry, dict):
            continue
        if entry.get("reason") == REJECTED:
            return False
        if entry.get("queue") == target_queue:
            return True
    return False
