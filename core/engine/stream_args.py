"""Stream queue arguments and consumer offset specifications, validated as RabbitMQ does.

A stream (``x-queue-type: stream``) accepts only the arguments that mean
something for an append-only log: retention (``x-max-age``,
``x-max-length-bytes``) and storage hints. Classic-queue arguments (TTL,
dead-lettering, max-length, priorities...) change semantics a stream does not
have, so they are refused with 406 rather than silently ignored.
"""

from __future__ import annotations

import datetime
import re
import time
from dataclasses import dataclass
from typing import Any

from core.model.errors import PreconditionFailed

# RabbitMQ's x-max-age units (rabbit_amqqueue:check_max_age): Y, M, D, h, m, s.
_UNITS = {"Y": 365 * 86400, "M": 30 * 86400, "D": 86400, "h": 3600, "m": 60, "s": 1}
_AGE = re.compile(r"^(\d+)([YMDhms])$")

# RabbitMQ refuses segments larger than 3 GB (?MAX_STREAM_MAX_SEGMENT_SIZE).
MAX_SEGMENT_SIZE = 3_000_000_000

STREAM_ARGUMENTS = frozenset(
    {
        "x-queue-type",
        "x-max-age",
        "x-max-length-bytes",
        # Storage and placement hints: meaningful for RabbitMQ's segment files and
        # replicas, not for this node's log; accepted because tooling sets them.
        "x-stream-max-segment-size-bytes",
        "x-initial-cluster-size",
        "x-queue-leader-locator",
    }
)


def parse_age(value: Any) -> float | None:
    """``"7D"``, ``"1h"``, ``"30s"`` -> seconds; None when malformed."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if not isinstance(value, str):
        return None
    m = _AGE.match(value)
    if m is None:
        return None
    return int(m.group(1)) * _UNITS[m.group(2)]


@dataclass(frozen=True)
class StreamArgs:
    max_age: float | None = None  # seconds
    max_bytes: int | None = None


def parse_stream_args(arguments: dict[str, Any], queue: str, vhost: str) -> StreamArgs:
    def invalid(key: str, why: str) -> PreconditionFailed:
        return PreconditionFailed(f"invalid arg '{key}' for queue '{queue}' in vhost '{vhost}': {why}")

    for key in arguments:
        if key.startswith("x-") and key not in STREAM_ARGUMENTS:
            raise PreconditionFailed(
                f"invalid arg '{key}' for queue '{queue}' in vhost '{vhost}': not supported by stream queues "
                f"(a stream keeps messages until x-max-age / x-max-length-bytes retention removes them)"
            )
    max_age = None
    if "x-max-age" in arguments:
        max_age = parse_age(arguments["x-max-age"])
        if max_age is None or max_age <= 0:
            raise invalid("x-max-age", f"{arguments['x-max-age']!r}: use a positive number and a unit "
                                       "Y, M, D, h, m or s, e.g. '7D' or '30s'")
    max_bytes = None
    for key in ("x-max-length-bytes", "x-stream-max-segment-size-bytes", "x-initial-cluster-size"):
        if key in arguments:
            value = arguments[key]
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise invalid(key, f"{value!r}: expected a positive integer")
            if key == "x-max-length-bytes":
                max_bytes = value
            if key == "x-stream-max-segment-size-bytes" and value > MAX_SEGMENT_SIZE:
                raise PreconditionFailed("Exceeded max value for x-stream-max-segment-size-bytes")
    return StreamArgs(max_age=max_age, max_bytes=max_bytes)


def check_stream_declare(queue: str, vhost: str, durable: bool, exclusive: bool, auto_delete: bool) -> None:
    """A stream is always durable, never exclusive or auto-delete (406 otherwise, as RabbitMQ)."""
    for prop, bad in (("exclusive", exclusive), ("auto-delete", auto_delete), ("non-durable", not durable)):
        if bad:
            raise PreconditionFailed(
                f"invalid property '{prop}' for queue '{queue}' in vhost '{vhost}': stream queues are "
                "durable, non-exclusive and not auto-delete"
            )


# -- where a reader starts ------------------------------------------------------
@dataclass(frozen=True)
class OffsetSpec:
    """``kind``: first, last, next, offset (``value`` = offset) or timestamp (``value`` = seconds)."""

    kind: str
    value: float = 0

    def describe(self) -> str:
        return self.kind if self.kind in ("first", "last", "next") else f"{self.kind} {self.value}"


FIRST = OffsetSpec("first")
LAST = OffsetSpec("last")
NEXT = OffsetSpec("next")


def parse_offset(value: Any, now: float | None = None) -> OffsetSpec:
    """An ``x-stream-offset`` consumer argument, as RabbitMQ's parse_offset_arg reads it.

    Absent: next. ``first``/``last``/``next``; an integer offset; an AMQP
    timestamp (seconds); an interval string such as ``1h`` (that long ago).
    """
    if value is None:
        return NEXT
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, bool):
        raise _bad_offset(value)
    if isinstance(value, datetime.datetime):
        return OffsetSpec("timestamp", value.timestamp())
    if isinstance(value, int):
        if value < 0:
            raise _bad_offset(value)
        return OffsetSpec("offset", value)
    if isinstance(value, str):
        if value in ("first", "last", "next"):
            return OffsetSpec(value)
        age = parse_age(value)
        if age is not None:
            return OffsetSpec("timestamp", (time.time() if now is None else now) - age)
    raise _bad_offset(value)


def _bad_offset(value: Any) -> PreconditionFailed:
    return PreconditionFailed(
        f"invalid arg 'x-stream-offset': {value!r}; use 'first', 'last', 'next', a non-negative offset, "
        "a timestamp, or an interval such as '1h'"
    )


# A Leveret extension: a named consumer group (committed offset, one active member).
GROUP_ARGUMENT = "x-stream-consumer-group"


def parse_consumer(arguments: dict[str, Any]) -> tuple[OffsetSpec, str | None]:
    """Where a stream consumer starts and the group it joins, from its basic.consume arguments."""
    spec = parse_offset(arguments.get("x-stream-offset"))
    group = arguments.get(GROUP_ARGUMENT)
    if isinstance(group, bytes):
        group = group.decode("utf-8", "replace")
    if group is not None and (not isinstance(group, str) or not group):
        raise PreconditionFailed(f"invalid arg '{GROUP_ARGUMENT}': {group!r}; expected a non-empty string")
    return spec, group


# How a node that does not own a stream asks the owner for a reader (core/cluster/stream_proxy.py):
# the consumer's own arguments plus these, which only nodes send to each other.
_FROM_TIMESTAMP = "x-leveret-from-timestamp"  # seconds, a float (an AMQP timestamp has whole seconds)
_COMMIT_ON_SETTLE = "x-leveret-commit-on-settle"


def reader_arguments(spec: OffsetSpec, group: str | None, commit_on_settle: bool = True) -> dict[str, Any]:
    """The arguments that make ``parse_reader`` on the owner give back ``spec``, ``group`` and the commit mode."""
    args: dict[str, Any] = {_COMMIT_ON_SETTLE: commit_on_settle}
    if spec.kind == "timestamp":
        args[_FROM_TIMESTAMP] = float(spec.value)
    elif spec.kind == "offset":
        args["x-stream-offset"] = int(spec.value)
    else:
        args["x-stream-offset"] = spec.kind
    if group is not None:
        args[GROUP_ARGUMENT] = group
    return args


def parse_reader(arguments: dict[str, Any]) -> tuple[OffsetSpec, str | None, bool]:
    """Where a proxied reader starts, its group, and whether settling commits the group's offset."""
    spec, group = parse_consumer(arguments)
    at = arguments.get(_FROM_TIMESTAMP)
    if isinstance(at, (int, float)) and not isinstance(at, bool):
        spec = OffsetSpec("timestamp", float(at))
    return spec, group, arguments.get(_COMMIT_ON_SETTLE, True) is not False
