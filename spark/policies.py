"""Retention's view of the policies: parsing, and the effective limits of each queue.

There is one notion of policy (core/model/policy.py, table ``policies``): the
node applies them to live queues, and this job reads the same rows. A queue's
limits come from its own arguments (``x-message-ttl``, ``x-max-age``,
``x-max-length``, ``x-max-length-bytes``), from the one policy that applies to
it (the highest priority whose pattern matches, as RabbitMQ picks it) and from
the one operator policy likewise; the smallest value wins, as on the node.
For retention a policy's ``message-ttl`` and ``max-age`` are both a maximum
age; ``archive`` (Leveret's key) asks for removed messages to be archived.
Per-message expiry (``expires_at``) applies to every queue. Pure Python: no
Spark here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from core.model.fieldtable import FieldTableError, decode_table
from core.model.policy import Policy, max_age_seconds, select

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
    """A policy as retention reads it (``to_policy``/``from_policy`` convert from and to the shared record)."""

    name: str
    pattern: str
    max_age_seconds: float | None = None
    max_bytes: int | None = None
    max_length: int | None = None
    archive: bool = False
    created_at: float = 0.0
    vhost: str = "/"
    priority: int = 0
    apply_to: str = "queues"
    operator: bool = False

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

    def to_policy(self) -> Policy:
        """The shared record (validated): what ``leveret retention policy set`` stores."""
        definition: dict[str, Any] = {"archive": self.archive}
        if self.max_age_seconds is not None:
            # RabbitMQ's max-age takes whole units: seconds, at least one.
            definition["max-age"] = f"{max(1, round(self.max_age_seconds))}s"
        if self.max_bytes is not None:
            definition["max-length-bytes"] = self.max_bytes
        if self.max_length is not None:
            definition["max-length"] = self.max_length
        try:
            return Policy.create(self.vhost, self.name, self.pattern, definition, self.apply_to, self.priority,
                                 self.operator)
        except ValueError as exc:
            raise PolicyError(str(exc)) from exc

    @classmethod
    def from_policy(cls, p: Policy, created_at: float = 0.0) -> NamedPolicy:
        d = p.definition
        ages: list[float] = []
        if isinstance(d.get("max-age"), str):
            try:
                ages.append(float(max_age_seconds(d["max-age"])))
            except ValueError:
                pass
        ttl = _number(d.get("message-ttl"))
        if ttl is not None and ttl >= 0:
            ages.append(ttl / 1000.0)
        size = _number(d.get("max-length-bytes"))
        length = _number(d.get("max-length"))
        return cls(p.name, p.pattern, min(ages) if ages else None, None if size is None else int(size),
                   None if length is None else int(length), d.get("archive") is True, created_at, p.vhost,
                   p.priority, p.apply_to, p.operator)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "pattern": self.pattern,
            "max_age_seconds": self.max_age_seconds,
            "max_bytes": self.max_bytes,
            "max_length": self.max_length,
            "archive": self.archive,
            "created_at": self.created_at,
            "vhost": self.vhost,
            "priority": self.priority,
            "apply_to": self.apply_to,
            "operator": self.operator,
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
    """Limits of every queue in ``queues`` ((vhost, name) -> decoded arguments), as the node applies them:
    the queue's arguments, its one policy and its one operator policy, the smallest limit winning."""
    shared = {id(p): p for p in policies}
    records = {id(p): _record(p) for p in policies}
    out: dict[tuple[str, str], QueueLimits] = {}
    for (vhost, name), arguments in sorted(queues.items()):
        limits = QueueLimits(vhost, name)
        for limit, value in queue_argument_limits(arguments).items():
            limits.tighten(limit, value, "queue arguments")
        stream = _text(arguments.get("x-queue-type")) == "stream"
        for operator in (False, True):
            candidates = [r for key, r in records.items() if r.vhost == vhost and r.operator == operator]
            chosen = select(candidates, "queue", name, stream)
            if chosen is None:
                continue
            policy = next(shared[key] for key, r in records.items() if r is chosen)
            source = f"operator policy {policy.name}" if operator else f"policy {policy.name}"
            limits.policies.append(policy.name)
            limits.tighten("max_age_seconds", policy.max_age_seconds, source)
            limits.tighten("max_bytes", policy.max_bytes, source)
            limits.tighten("max_length", policy.max_length, source)
            limits.archive = limits.archive or policy.archive
        out[(vhost, name)] = limits
    return out


def _record(p: NamedPolicy) -> Policy:
    """For matching only: the shared record without validating the definition again."""
    return Policy(p.vhost, p.name, p.pattern, {}, p.apply_to, p.priority, p.operator)


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None
