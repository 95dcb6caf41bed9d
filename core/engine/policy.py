"""What policies do to a queue's arguments: RabbitMQ's precedence rules.

For a queue, the policy of the highest priority that matches it, and the
operator policy likewise, combine with the queue's own ``x-`` arguments:

- limits (message-ttl, expires, max-length, max-length-bytes, delivery-limit,
  a stream's max-age): the smallest of argument, policy and operator policy
  (RabbitMQ's ``args_policy_lookup`` with ``min``), so an operator policy caps
  both and a queue may ask for less than its policy, never more;
- everything else (overflow, dead-letter-exchange, dead-letter-routing-key):
  the queue's argument if it has one, else the policy's (``res_arg``).

For an exchange, only ``alternate-exchange``: the exchange's argument wins.

A policy with Leveret's ``archive: true`` asks the retention job to archive
what its limits remove, so the node leaves those limits (message-ttl,
max-length, max-length-bytes, max-age) to the job: were the node to drop the
messages first, nothing would be archived. The job removes them from the live
queue through its retention requests (leveret/node/retention_watch.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from core.engine.queue_args import QueueArgs
from core.model.policy import Policy, max_age_seconds

# definition key -> (QueueArgs field, the x- argument of the same meaning)
_LIMITS = {
    "message-ttl": ("message_ttl", "x-message-ttl"),
    "expires": ("expires", "x-expires"),
    "max-length": ("max_length", "x-max-length"),
    "max-length-bytes": ("max_length_bytes", "x-max-length-bytes"),
    "delivery-limit": ("delivery_limit", "x-delivery-limit"),
}
_ARGUMENT_WINS = {
    "overflow": ("overflow", "x-overflow"),
    "dead-letter-exchange": ("dead_letter_exchange", "x-dead-letter-exchange"),
    "dead-letter-routing-key": ("dead_letter_routing_key", "x-dead-letter-routing-key"),
    "dead-letter-strategy": ("dead_letter_strategy", "x-dead-letter-strategy"),  # quorum queues only
}
_STREAM_LIMITS = ("max-length-bytes",)  # and max-age, in seconds
_RETENTION_LIMITS = frozenset({"message-ttl", "max-length", "max-length-bytes", "max-age"})


def effective_queue_args(
    parsed: QueueArgs, arguments: dict[str, Any], policy: Policy | None, operator: Policy | None
) -> QueueArgs:
    """``parsed`` (from the queue's own arguments) with the policies applied."""
    if policy is None and operator is None:
        return parsed
    changes: dict[str, Any] = {}
    stream = parsed.queue_type == "stream"
    for source in (policy, operator):
        if source is None:
            continue
        d = source.definition
        archived = d.get("archive") is True
        for key, (attr, _arg) in _LIMITS.items():
            if archived and key in _RETENTION_LIMITS:
                continue
            if key in d and (not stream or key in _STREAM_LIMITS):
                current = changes.get(attr, getattr(parsed, attr))
                if current is None or d[key] < current:
                    changes[attr] = d[key]
        if stream and "max-age" in d and not archived:
            age = float(max_age_seconds(d["max-age"]))
            current_age = changes.get("max_age", parsed.max_age)
            if current_age is None or age < current_age:
                changes["max_age"] = age
    if policy is not None and not stream:
        d = policy.definition
        for key, (attr, arg) in _ARGUMENT_WINS.items():
            if key in d and arg not in arguments:
                changes[attr] = d[key]
        if "queue-mode" in d and "x-queue-mode" not in arguments:
            changes["lazy"] = d["queue-mode"] == "lazy"  # the argument wins, as in RabbitMQ
    return dataclasses.replace(parsed, **changes) if changes else parsed


def effective_alternate(arguments: dict[str, Any], policy: Policy | None) -> str | None:
    """An exchange's alternate exchange: its own argument, else its policy's."""
    own = arguments.get("alternate-exchange")
    if isinstance(own, bytes):
        own = own.decode("utf-8", "replace")
    if isinstance(own, str):
        return own
    if policy is not None:
        value = policy.definition.get("alternate-exchange")
        return value if isinstance(value, str) else None
    return None


def effective_definition(policy: Policy | None, operator: Policy | None) -> dict[str, Any]:
    """RabbitMQ's ``effective_policy_definition`` of a queue: the policy's keys, capped by the operator policy's."""
    out: dict[str, Any] = dict(policy.definition) if policy is not None else {}
    if operator is not None:
        for key, value in operator.definition.items():
            out[key] = min(out[key], value) if key in out else value
    return out
