"""A stored policy row back into a ``core.model.policy.Policy`` (both stores and the retention job)."""

from __future__ import annotations

import json
from typing import Any

from core.model.policy import Policy


def stored_policy(vhost: str, name: str, operator: bool, pattern: str, apply_to: str, priority: int,
                  definition: str | dict[str, Any]) -> Policy:
    """The row as it was validated when written; null values (older rows) are dropped, not refused."""
    data = json.loads(definition) if isinstance(definition, str) else dict(definition)
    clean = {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else {}
    return Policy(vhost, name, pattern, clean, apply_to, priority, operator)
