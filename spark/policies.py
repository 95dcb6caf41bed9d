"""Retention policies: parsing, and the effective limits of each queue.

A queue's limits come from its own arguments (``x-message-ttl``, ``x-max-age``,
``x-max-length``, ``x-max-length-bytes``) and from every named policy whose
pattern matches the queue name (``re.search``, as RabbitMQ's policy patterns).
When several sources set the same limit, the strictest (smallest) wins; a queue
is archived when any matching policy asks for it. Per-message expiry
(``expires_at``) applies to every queue. Pure Python: no Spark here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from core.model.fieldtable import FieldTableError, decode_table

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([YMDdhmsw]?)\s*$")
_DURATION_UNITS = {
    "": 1.0,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
    "d": 86400.0,
    "D": 86400.0,
    "w": 7 * 86400.0,
    "M": 30 * 86400.0,
    "Y": 365 * 86400.0,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKMGTP]?i?)[bB]?\s*$")
_SIZE_UNITS = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}


class PolicyError(ValueError):
    """A policy or a limit that does not parse."""


def parse_duration(text: str) -> float:
    """Seconds in ``7d``, ``1h``, ``30m``, ``45s``, ``2w``, ``1M`` (30 days), ``1Y`` (365 days) or a bare number."""
    m = _DURATION.match(str(text))
    if not m:
        raise PolicyError(f"not a duration: {text!r} (use e.g. 7d, 12h, 30m, 45s, 2w, 1M, 1Y)")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


def parse_size(text: str) -> int:
    """Bytes in ``10GB`` (10**10), ``512MiB`` (2**29), ``100kB``, ``4096``."""
    m = _SIZE.match(str(text))
    if not m:
        raise PolicyError(f"not a size: {text!r} (use e.g. 10GB, 512MiB, 100kB, 4096)")
    number, unit = float(m.group(1)), m.group(2)
    if unit.endswith("i"):
        scale = 1024 ** {"k": 1, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5}[unit[0]]
    else:
        scale = _SIZE_UNITS[unit]
    return int(number * scale)


def format_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


@dataclass
class NamedPolicy:
    name: str
    pattern: str
    max_age_seconds: float | None = None
    max_bytes: int | None = None
    max_length: int | None = None
    archive: bool = False
    created_at: float = 0.0

    def __post_init__(self) -> None:
        try:
            self.compiled = re.compile(self.pattern)
        except re.error as exc:
            raise PolicyError(f"policy {self.name!r}: pattern {self.pattern!r} is not a regular expression: {exc}")
        for what in ("max_age_seconds", "max_bytes", "max_length"):
            value = getattr(self, what)
            if value is not None and value < 0:
                raise PolicyError(f"policy {self.name!r}: {what} must not be negative")

    def matches(self, queue: str) -> bool:
        return self.compiled.search(queue) is not None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "pattern": self.pattern,
            "max_age_seconds": self.max_age_seconds,
            "max_bytes": self.max_bytes,
            "max_length": self.max_length,
            "archive": self.archive,
            "created_at": self.created_at,
        }


@dataclass
class QueueLimits:
    """What retention enforces on one queue; ``sources`` names where each limit came from."""

    vhost: str
    queue: str
    max_age_seconds: float | None = None
    max_bytes: int | None = None
    max_length: int | None = None
    archive: bool = False
    sources: dict[str, str] = field(default_factory=dict)
    policies: list[str] = field(default_factory=list)

    def tighten(self, limit: str, value: float | int | None, source: str) -> None:
        if value is None:
            return
        current = getattr(self, limit)
        if current is None or value < current:
            setattr(self, limit, value)
            self.sources[limit] = source


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (bytes, str)):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def queue_argument_limits(arguments: dict[str, Any]) -> dict[str, float | int]:
    """The retention limits a queue's own arguments set (unusable values are ignored)."""
    out: dict[str, float | int] = {}
    ttl = _number(arguments.get("x-message-ttl"))
    if ttl is not None and ttl >= 0:
        out["max_age_seconds"] = ttl / 1000.0
    max_age = arguments.get("x-max-age")
    if max_age is not None:
        if isinstance(max_age, bytes):
            max_age = max_age.decode("utf-8", "replace")
        try:
            age = parse_duration(str(max_age))
        except PolicyError:
            age = None
        if age is not None and ("max_age_seconds" not in out or age < out["max_age_seconds"]):
            out["max_age_seconds"] = age
    length = _number(arguments.get("x-max-length"))
    if length is not None and length >= 0:
        out["max_length"] = int(length)
    size = _number(arguments.get("x-max-length-bytes"))
    if size is not None and size >= 0:
        out["max_bytes"] = int(size)
    return out


def decode_arguments(raw: bytes | memoryview | None) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        return decode_table(bytes(raw))[0]
    except FieldTableError:
        return {}


def effective_limits(
    queues: dict[tuple[str, str], dict[str, Any]], policies: list[NamedPolicy]
) -> dict[tuple[str, str], QueueLimits]:
    """Limits of every queue in ``queues`` ((vhost, name) -> decoded arguments)."""
    out: dict[tuple[str, str], QueueLimits] = {}
    for (vhost, name), arguments in sorted(queues.items()):
        limits = QueueLimits(vhost, name)
        for limit, value in queue_argument_limits(arguments).items():
            limits.tighten(limit, value, "queue arguments")
        for policy in sorted(policies, key=lambda p: p.name):
            if not policy.matches(name):
                continue
            limits.policies.append(policy.name)
            limits.tighten("max_age_seconds", policy.max_age_seconds, f"policy {policy.name}")
            limits.tighten("max_bytes", policy.max_bytes, f"policy {policy.name}")
            limits.tighten("max_length", policy.max_length, f"policy {policy.name}")
            limits.archive = limits.archive or policy.archive
        out[(vhost, name)] = limits
    return out
