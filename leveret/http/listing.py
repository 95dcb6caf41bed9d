"""Filtering, sorting, paging and ``columns=`` of list endpoints, as RabbitMQ's management API does.

``?name=x&use_regex=true`` filters on ``name`` (substring, or regular
expression); ``sort=field.sub`` and ``sort_reverse=true`` order; ``page`` and
``page_size`` (default 100, at most 500) turn the answer into
``{"items": [...], "page", "page_size", "page_count", "item_count",
"filtered_count", "total_count"}``; ``columns=a,b.c`` keeps only those
(dotted) fields of each item.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core.model import patterns
from leveret.http.errors import bad_request

MAX_PAGE_SIZE = 500


def _flag(query: Mapping[str, str], name: str) -> bool:
    return query.get(name, "false").lower() == "true"


def _int(query: Mapping[str, str], name: str, default: int) -> int:
    raw = query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise bad_request(f"{name} must be an integer, got {raw!r}") from None
    if value < 1:
        raise bad_request(f"{name} must be at least 1, got {value}")
    return value


def _get(item: Mapping[str, Any], dotted: str) -> Any:
    value: Any = item
    for part in dotted.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value


def _sort_key(value: Any) -> tuple[int, Any]:
    # Missing values first, then numbers, then everything else as text (never a TypeError).
    if value is None:
        return (0, 0)
    if isinstance(value, bool):
        return (1, int(value))
    if isinstance(value, (int, float)):
        return (1, value)
    return (2, str(value))


def keep_columns(item: Mapping[str, Any], columns: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for col in columns:
        parts = col.split(".")
        value: Any = item
        for part in parts:
            if not isinstance(value, Mapping) or part not in value:
                value = _MISSING
                break
            value = value[part]
        if value is _MISSING:
            continue
        target = out
        for part in parts[:-1]:
            target = target.setdefault(part, {})
        target[parts[-1]] = value
    return out


_MISSING = object()


def name_filter(query: Mapping[str, str]) -> patterns.Pattern | str | None:
    name = query.get("name")
    if not name:
        return None
    if _flag(query, "use_regex"):
        try:
            return patterns.compile_pattern(name)  # RE2: linear time whatever the pattern
        except patterns.PatternError as exc:
            raise bad_request(f"invalid regular expression {name!r}: {exc}") from None
    return name


def apply(items: list[dict[str, Any]], query: Mapping[str, str], default_sort: str | None = "name") -> Any:
    """The answer to a list request: a list, or a page object when ``page`` is given."""
    total = len(items)
    wanted = name_filter(query)
    if isinstance(wanted, str):
        items = [i for i in items if wanted in str(i.get("name", ""))]
    elif wanted is not None:
        items = [i for i in items if wanted.search(str(i.get("name", "")))]
    sort = query.get("sort") or default_sort
    if sort:
        items.sort(key=lambda i: _sort_key(_get(i, sort)), reverse=_flag(query, "sort_reverse"))
    elif _flag(query, "sort_reverse"):
        items.reverse()
    columns = [c for c in query.get("columns", "").split(",") if c]
    if "page" not in query:
        return [keep_columns(i, columns) for i in items] if columns else items
    page = _int(query, "page", 1)
    size = _int(query, "page_size", 100)
    if size > MAX_PAGE_SIZE:
        raise bad_request(f"page_size must be at most {MAX_PAGE_SIZE}, got {size}")
    filtered = len(items)
    page_count = max(1, -(-filtered // size))
    if page > page_count:
        raise bad_request(f"page {page} is past the last page ({page_count})")
    chunk = items[(page - 1) * size : page * size]
    if columns:
        chunk = [keep_columns(i, columns) for i in chunk]
    return {"filtered_count": filtered, "item_count": len(chunk), "items": chunk, "page": page,
            "page_count": page_count, "page_size": size, "total_count": total}
