"""A small path router on the raw (still percent-encoded) path.

RabbitMQ's paths carry vhost names percent-encoded ("/" is ``%2F``); matching
on the decoded path would split a vhost named "/" in two. Each raw segment is
decoded only after the match.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

if TYPE_CHECKING:
    from leveret.http.server import Call

Handler = Callable[["Call"], Awaitable[Any]]

# Who may call a route, by user tag (docs/MANAGEMENT.md): "management" is any of the
# four tags; "monitoring" and "policymaker" also let administrators in.
ACCESS = ("management", "monitoring", "policymaker", "administrator")


@dataclass(frozen=True)
class Route:
    methods: dict[str, tuple[Handler, str]]  # method -> (handler, access)
    parts: tuple[str, ...]  # literal segments, or "{name}" captures


class Router:
    def __init__(self) -> None:
        self.routes: list[Route] = []

    def add(self, pattern: str, **methods: tuple[Handler, str]) -> None:
        for _, access in methods.values():
            assert access in ACCESS, access
        self.routes.append(Route(dict(methods), tuple(p for p in pattern.strip("/").split("/"))))

    def match(self, raw_path: str) -> tuple[Route, dict[str, str]] | None:
        segments = raw_path.strip("/").split("/") if raw_path.strip("/") else [""]
        for route in self.routes:
            if len(route.parts) != len(segments):
                continue
            params: dict[str, str] = {}
            for part, seg in zip(route.parts, segments, strict=True):
                if part.startswith("{"):
                    params[part[1:-1]] = unquote(seg)
                elif part != seg:
                    break
            else:
                return route, params
        return None
