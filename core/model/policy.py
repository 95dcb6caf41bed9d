"""Policies as RabbitMQ defines them: a name, a pattern, what they apply to, a priority, a definition.

One notion of policy for the whole product: the engine applies them to live
queues and exchanges (core/engine/policy.py), the stores keep them (table
``policies``), and the Spark retention job reads the same records
(spark/policies.py). This module is plain data and validation, with no
engine in it, so the retention job may import it.

Validation follows RabbitMQ's: unknown definition keys, values of the wrong
type and patterns that are not regular expressions are refused
(``PolicyError``, a 400 over HTTP); nothing is half-applied.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from core.model import patterns

APPLY_TO = ("queues", "exchanges", "all", "classic_queues", "streams")
OVERFLOW_MODES = ("drop-head", "reject-publish", "reject-publish-dlx")
# RabbitMQ's stream max-age: a number and one of Y, M, D, h, m, s.
_MAX_AGE = re.compile(r"^(\d+)([YMDhms])$")
_AGE_UNITS = {"Y": 365 * 86400, "M": 30 * 86400, "D": 86400, "h": 3600, "m": 60, "s": 1}


class PolicyError(ValueError):
    """A policy that cannot be accepted; the text says why, for the person who wrote it."""


def _non_negative(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PolicyError(f"{key}: {value!r} is not a non-negative integer")


def _positive(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PolicyError(f"{key}: {value!r} is not a positive integer")


def _text(key: str, value: Any) -> None:
    if not isinstance(value, str):
        raise PolicyError(f"{key}: {value!r} is not a string")


def _overflow(key: str, value: Any) -> None:
    if value not in OVERFLOW_MODES:
        raise PolicyError(f"{key}: {value!r} is not one of {', '.join(OVERFLOW_MODES)}")


def _queue_mode(key: str, value: Any) -> None:
    if value not in ("default", "lazy"):
        raise PolicyError(f"{key}: {value!r} is not default or lazy")


def _max_age(key: str, value: Any) -> None:
    if not isinstance(value, str) or not _MAX_AGE.match(value):
        raise PolicyError(f"{key}: {value!r} is not a duration such as 7D, 12h, 30m, 45s, 1M or 1Y")


def _dlx_strategy(key: str, value: Any) -> None:
    if value not in ("at-most-once", "at-least-once"):
        raise PolicyError(f"{key}: {value!r} is not at-most-once or at-least-once")


def _boolean(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise PolicyError(f"{key}: {value!r} is not true or false")


# Definition keys: what each accepts. "archive" is Leveret's (the retention job
# archives what it removes to Parquet); the others are RabbitMQ's.
DEFINITION_KEYS: dict[str, Callable[[str, Any], None]] = {
    "message-ttl": _non_negative,
    "expires": _positive,
    "max-length": _non_negative,
    "max-length-bytes": _non_negative,
    "overflow": _overflow,
    "dead-letter-exchange": _text,
    "dead-letter-routing-key": _text,
    "dead-letter-strategy": _dlx_strategy,
    "delivery-limit": _non_negative,
    "alternate-exchange": _text,
    "queue-mode": _queue_mode,
    "max-age": _max_age,
    "stream-max-segment-size-bytes": _non_negative,
    "archive": _boolean,
    # Exchange federation (leveret/links/federation/): an upstream's name, or a set's ("all": every upstream).
    "federation-upstream": _text,
    "federation-upstream-set": _text,
}
# What an operator policy may set (RabbitMQ's list, less its quorum-only memory keys):
# limits, where the smallest of operator policy, policy and queue argument wins.
OPERATOR_KEYS = frozenset({"message-ttl", "expires", "max-length", "max-length-bytes", "delivery-limit"})
EXCHANGE_KEYS = frozenset({"alternate-exchange", "federation-upstream", "federation-upstream-set"})


def max_age_seconds(text: str) -> int:
    """Seconds in RabbitMQ's max-age format (``7D``; M is 30 days, Y 365)."""
    m = _MAX_AGE.match(text)
    if not m:
        raise PolicyError(f"max-age: {text!r} is not a duration such as 7D, 12h, 30m, 45s")
    return int(m.group(1)) * _AGE_UNITS[m.group(2)]


@dataclass(frozen=True)
class Policy:
    """A (user or operator) policy of one vhost. Build with ``Policy.create`` to validate."""

    vhost: str
    name: str
    pattern: str
    definition: dict[str, Any] = field(default_factory=dict, hash=False)
    apply_to: str = "all"
    priority: int = 0
    operator: bool = False  # an operator policy (caps what users and their policies set)

    @classmethod
    def create(cls, vhost: str, name: str, pattern: str, definition: dict[str, Any], apply_to: str = "all",
               priority: int = 0, operator: bool = False) -> Policy:
        kind = "operator policy" if operator else "policy"
        if not name:
            raise PolicyError(f"{kind}: the name must not be empty")
        if not isinstance(pattern, str):
            raise PolicyError(f"{kind} '{name}': pattern {pattern!r} is not a string")
        try:
            patterns.check(pattern)
        except patterns.PatternError as exc:
            raise PolicyError(f"{kind} '{name}': pattern {pattern!r} is {exc}") from exc
        if apply_to not in APPLY_TO:
            raise PolicyError(f"{kind} '{name}': apply-to {apply_to!r} is not one of {', '.join(APPLY_TO)}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise PolicyError(f"{kind} '{name}': priority {priority!r} is not an integer")
        if not isinstance(definition, dict) or not definition:
            raise PolicyError(f"{kind} '{name}': the definition must be a non-empty object")
        allowed = OPERATOR_KEYS if operator else DEFINITION_KEYS.keys()
        for key, value in definition.items():
            if key not in allowed:
                raise PolicyError(f"{kind} '{name}': {key!r} is not recognised; accepted: {', '.join(sorted(allowed))}")
            DEFINITION_KEYS[key](key, value)
        if "federation-upstream" in definition and "federation-upstream-set" in definition:
            # RabbitMQ's rabbit_federation_parameters:validate_policy refuses both at once.
            raise PolicyError(f"{kind} '{name}': cannot specify federation-upstream and federation-upstream-set "
                              "together")
        if "dead-letter-routing-key" in definition and "dead-letter-exchange" not in definition:
            raise PolicyError(f"{kind} '{name}': dead-letter-routing-key needs dead-letter-exchange")
        if operator and apply_to not in ("queues", "classic_queues", "streams"):
            apply_to = "queues"  # operator policies only ever apply to queues, as in RabbitMQ
        return cls(vhost, name, pattern, dict(definition), apply_to, priority, operator)

    def applies_to(self, kind: str, name: str, stream: bool = False) -> bool:
        """Does it apply to the ``kind`` ("queue" or "exchange") called ``name``?"""
        a = self.apply_to
        if kind == "exchange":
            if a not in ("exchanges", "all"):
                return False
        elif a == "exchanges" or (a == "classic_queues" and stream) or (a == "streams" and not stream):
            return False
        return patterns.search(self.pattern, name)  # RE2, linear time; compiled once (cached)

    def as_rabbitmq(self) -> dict[str, Any]:
        """The JSON object of RabbitMQ's management API and definitions files."""
        return {"vhost": self.vhost, "name": self.name, "pattern": self.pattern, "apply-to": self.apply_to,
                "definition": dict(self.definition), "priority": self.priority}


def select(policies: Iterable[Policy], kind: str, name: str, stream: bool = False) -> Policy | None:
    """The one policy that applies, as RabbitMQ picks it: the highest priority (then the first name)."""
    best: Policy | None = None
    for p in policies:
        if p.applies_to(kind, name, stream) and (
            best is None or p.priority > best.priority or (p.priority == best.priority and p.name < best.name)
        ):
            best = p
    return best
