"""Policy definitions as the management API stores them, for the engine to apply.

The management API (leveret/http/) validates and keeps RabbitMQ-style policies
here, one dict per vhost (``VirtualHost.policies`` and
``VirtualHost.operator_policies``, keyed by name); whatever applies them to
queues and exchanges reads those dicts and registers in
``VirtualHost.on_policies_changed`` to hear of a change. Nothing here decides
what a policy does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

APPLY_TO = ("queues", "exchanges", "all", "classic_queues", "quorum_queues", "streams")


@dataclass(frozen=True)
class PolicyDefinition:
    name: str
    vhost: str
    pattern: str  # a regular expression matched (re.search) against queue/exchange names
    definition: dict[str, Any] = field(default_factory=dict)  # e.g. {"max-length": 2}
    priority: int = 0  # the highest priority among the matching policies wins
    apply_to: str = "all"  # one of APPLY_TO

    def as_json(self, operator: bool = False) -> dict[str, Any]:
        """RabbitMQ's JSON form (``/api/policies`` and the definitions file)."""
        return {"vhost": self.vhost, "name": self.name, "pattern": self.pattern, "apply-to": self.apply_to,
                "definition": dict(self.definition), "priority": self.priority}
