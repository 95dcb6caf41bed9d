"""Result types shared by scenarios, the runner and the report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class Metric:
    name: str
    value: float
    unit: str
    better: Literal["higher", "lower"] = "higher"


@dataclass(frozen=True)
class RunOptions:
    duration: float = 5.0
    warmup: float = 1.0
    idle_connections: int = 500

    @property
    def hard_timeout(self) -> float:
        """Upper bound for one scenario on one broker, setup and teardown included."""
        return 2 * (self.warmup + self.duration) + 60.0


class Skipped(Exception):
    """The scenario can't run against this broker (not reachable, no --pid, ...)."""


@dataclass
class Outcome:
    status: Literal["ok", "skipped", "error"]
    metrics: list[Metric] = field(default_factory=list)
    reason: str = ""
    notes: dict[str, object] = field(default_factory=dict)
