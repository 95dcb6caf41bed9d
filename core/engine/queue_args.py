"""Queue arguments (``x-...``): validated once at declare, read by the engine."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from core.engine.stream_args import parse_stream_args
from core.model.errors import PreconditionFailed

OVERFLOW_MODES = ("drop-head", "reject-publish", "reject-publish-dlx")
DLX_STRATEGIES = ("at-most-once", "at-least-once")
LEADER_LOCATORS = ("client-local", "balanced")
# RabbitMQ 4's delivery limit for quorum queues that set none (3.x had none); a
# negative x-delivery-limit turns it off, as in 4.x.
QUORUM_DELIVERY_LIMIT = 20
# Arguments this node knows that RabbitMQ refuses on a quorum queue (measured with
# RabbitMQ 3.10.8: "invalid arg 'x-max-priority' for queue 'q' in vhost '/' of queue
# type rabbit_quorum_queue"); x-queue-version and x-queue-master-locator are classic-only.
NOT_FOR_QUORUM = ("x-max-priority", "x-queue-mode", "x-queue-version", "x-queue-master-locator")


@dataclass(frozen=True)
class QueueArgs:
    message_ttl: int | None = None  # ms
    expires: int | None = None  # ms of disuse before the queue is deleted
    max_length: int | None = None
    max_length_bytes: int | None = None
    overflow: str = "drop-head"
    dead_letter_exchange: str | None = None
    dead_letter_routing_key: str | None = None
    max_priority: int | None = None
    single_active_consumer: bool = False
    queue_type: str = "classic"
    max_age: float | None = None  # seconds; streams only (x-max-age)
    delivery_limit: int | None = None  # a message returned more often than this is dead-lettered
    # Quorum queues (docs/AMQP.md "Quorum queues"): at-least-once keeps a dead-lettered
    # message until a queue has taken it; the leader locator and group size are accepted
    # (the shared store replicates, and a cluster places queues through its coordinator).
    dead_letter_strategy: str = "at-most-once"
    leader_locator: str | None = None
    initial_group_size: int | None = None

    @property
    def quorum(self) -> bool:
        return self.queue_type == "quorum"
    lazy: bool = False  # x-queue-mode lazy (or the queue-mode policy): pages from the first message


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "long"
    if isinstance(value, (str, bytes)):
        return "longstr"
    return type(value).__name__


def parse_queue_args(arguments: dict[str, Any], queue: str, vhost: str) -> QueueArgs:
    """Validate ``arguments`` as RabbitMQ does; unknown ``x-`` arguments are refused."""

    def invalid(key: str, why: str) -> PreconditionFailed:
        return PreconditionFailed(f"invalid arg '{key}' for queue '{queue}' in vhost '{vhost}': {why}")

    def integer(key: str, minimum: int) -> int | None:
        if key not in arguments:
            return None
        value = arguments[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid(key, f"{{unacceptable_type,{_type_name(value)}}}")
        if value < minimum:
            raise invalid(key, f"{{value_negative,{value}}}" if value < 0 else f"{{value_zero,{value}}}")
        return value

    def string(key: str) -> str | None:
        if key not in arguments:
            return None
        value = arguments[key]
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if not isinstance(value, str):
            raise invalid(key, f"{{unacceptable_type,{_type_name(value)}}}")
        return value

    queue_type = string("x-queue-type") or "classic"
    if queue_type == "stream":
        sa = parse_stream_args(arguments, queue, vhost)
        return QueueArgs(max_length_bytes=sa.max_bytes, max_age=sa.max_age, queue_type="stream")
    for key in arguments:
        if key.startswith("x-") and key not in KNOWN:
            raise PreconditionFailed(
                f"unsupported queue argument '{key}' for queue '{queue}' in vhost '{vhost}': "
                "this node does not implement it, so it refuses the declaration rather than ignore it"
            )
    if queue_type == "quorum":
        for key in NOT_FOR_QUORUM:
            if key in arguments:
                raise PreconditionFailed(f"invalid arg '{key}' for queue '{queue}' in vhost '{vhost}' "
                                         "of queue type rabbit_quorum_queue")
    elif queue_type == "classic":
        for key in QUORUM_ONLY:
            if key in arguments:
                raise PreconditionFailed(f"invalid arg '{key}' for queue '{queue}' in vhost '{vhost}' "
                                         "of queue type rabbit_classic_queue")
    overflow = string("x-overflow") or "drop-head"
    if overflow not in OVERFLOW_MODES:
        raise invalid("x-overflow", f"{{unacceptable_value,{overflow}}}")
    max_priority = integer("x-max-priority", 0)
    if max_priority is not None and max_priority > 255:
        raise invalid("x-max-priority", f"{{value_too_large,{max_priority},255}}")
    sac = arguments.get("x-single-active-consumer", False)
    if not isinstance(sac, bool):
        raise invalid("x-single-active-consumer", f"{{unacceptable_type,{_type_name(sac)}}}")
    if queue_type not in ("classic", "quorum"):
        raise invalid("x-queue-type", f"queue type '{queue_type}' is not supported by this node "
                                      "(classic, quorum and stream)")
    strategy = string("x-dead-letter-strategy") or "at-most-once"
    if strategy not in DLX_STRATEGIES:
        raise invalid("x-dead-letter-strategy", "invalid_dlx_strategy")
    locator = string("x-queue-leader-locator")
    if locator is not None and locator not in LEADER_LOCATORS:
        raise invalid("x-queue-leader-locator", "invalid_queue_locator_arg")
    delivery_limit: int | None
    if queue_type == "quorum" and isinstance(arguments.get("x-delivery-limit"), int) \
            and not isinstance(arguments["x-delivery-limit"], bool) and arguments["x-delivery-limit"] < 0:
        delivery_limit = -1  # RabbitMQ 4: a negative limit means none (quorum_args resolves it)
    else:
        delivery_limit = integer("x-delivery-limit", 0)
    dlrk = string("x-dead-letter-routing-key")
    dlx = string("x-dead-letter-exchange")
    if dlrk is not None and dlx is None:
        raise PreconditionFailed(
            f"invalid arg 'x-dead-letter-routing-key' for queue '{queue}' in vhost '{vhost}': "
            "x-dead-letter-routing-key requires x-dead-letter-exchange"
        )
    return QueueArgs(
        message_ttl=integer("x-message-ttl", 0),
        expires=integer("x-expires", 1),
        max_length=integer("x-max-length", 0),
        max_length_bytes=integer("x-max-length-bytes", 0),
        overflow=overflow,
        dead_letter_exchange=dlx,
        dead_letter_routing_key=dlrk,
        max_priority=max_priority,
        single_active_consumer=sac,
        queue_type=queue_type,
        delivery_limit=delivery_limit,
        dead_letter_strategy=strategy,
        leader_locator=locator,
        initial_group_size=integer("x-quorum-initial-group-size", 1),
        lazy=_queue_mode(string("x-queue-mode"), invalid),
    )


def quorum_args(args: QueueArgs) -> QueueArgs:
    """What a quorum queue enforces once its arguments and policies are combined.

    RabbitMQ 4's default delivery limit (20) where neither set one, none where the
    limit is negative; ``reject-publish-dlx`` acts as ``drop-head`` (RabbitMQ logs
    "invalid overflow strategy" and uses its default); ``at-least-once``
    dead-lettering needs ``reject-publish`` overflow, else it is at-most-once, as
    RabbitMQ falls back.
    """
    if not args.quorum:
        return args
    changes: dict[str, Any] = {}
    if args.delivery_limit is None:
        changes["delivery_limit"] = QUORUM_DELIVERY_LIMIT
    elif args.delivery_limit < 0:
        changes["delivery_limit"] = None
    if args.overflow == "reject-publish-dlx":
        changes["overflow"] = "drop-head"
    if args.dead_letter_strategy == "at-least-once" and (args.overflow != "reject-publish"
                                                          or args.dead_letter_exchange is None):
        changes["dead_letter_strategy"] = "at-most-once"
    return dataclasses.replace(args, **changes) if changes else args


def _queue_mode(mode: str | None, invalid: Any) -> bool:
    """x-queue-mode: default or lazy, as RabbitMQ 3.x (lazy: paged from the first message)."""
    if mode is None or mode == "default":
        return False
    if mode == "lazy":
        return True
    raise invalid("x-queue-mode", f"{{unacceptable_value,{mode}}}")


KNOWN = frozenset(
    {
        "x-message-ttl",
        "x-expires",
        "x-max-length",
        "x-max-length-bytes",
        "x-overflow",
        "x-dead-letter-exchange",
        "x-dead-letter-routing-key",
        "x-max-priority",
        "x-single-active-consumer",
        "x-queue-type",
        "x-delivery-limit",
        "x-dead-letter-strategy",
        "x-queue-leader-locator",
        "x-quorum-initial-group-size",
        "x-queue-mode",  # lazy pages from the first message (core/engine/paging.py)
        # Storage hints with no meaning here; accepted because RabbitMQ tooling sets them routinely.
        "x-queue-master-locator",
        "x-queue-version",
    }
)
# Quorum-only arguments RabbitMQ 3.10.8 refuses on a classic queue ("... of queue type
# rabbit_classic_queue"). It refuses x-delivery-limit too; this node keeps accepting
# that one on classic queues (it enforced it there before quorum queues existed).
QUORUM_ONLY = ("x-dead-letter-strategy", "x-queue-leader-locator", "x-quorum-initial-group-size")


def check_quorum_declare(queue: str, vhost: str, durable: bool, exclusive: bool, auto_delete: bool) -> None:
    """A quorum queue is durable, not exclusive, not auto-delete: RabbitMQ's 406 texts (3.10.8)."""
    for prop, bad in (("non-durable", not durable), ("exclusive-owner", exclusive), ("auto-delete", auto_delete)):
        if bad:
            raise PreconditionFailed(f"invalid property '{prop}' for queue '{queue}' in vhost '{vhost}'")
