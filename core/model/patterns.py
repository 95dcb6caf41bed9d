"""Regular expressions that users supply, compiled once here, matched in linear time.

Every pattern a client or operator sets (permission and topic-permission
regexes, policy and operator-policy patterns, the management API's
``use_regex`` listing filters) is compiled by this module and nothing else.
Python's ``re`` backtracks: ``^(a+)+$`` against 27 ``a``s and ``!`` took 3.3 s
of the event loop, doubling per character, and stalled every tenant. RE2
(google-re2) runs in time linear in the input for every pattern. Its syntax
has no backreferences and no lookaround; such a pattern is refused with
``PatternError``, whose text says why (the front ends answer 400 / 406).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Protocol

import re2

# Larger than any name or routing key (255 bytes) needs; bounds what one pattern may cost.
MAX_PATTERN_LENGTH = 4096


class Pattern(Protocol):
    @property
    def pattern(self) -> str: ...

    def search(self, text: str) -> Any: ...


class PatternError(ValueError):
    """A pattern RE2 cannot compile; the text says why, for the client."""


def _options() -> re2.Options:
    options = re2.Options()
    options.log_errors = False  # a client's bad pattern is its error, not a line on our stderr
    return options


_OPTIONS = _options()


@lru_cache(maxsize=4096)
def compile_pattern(pattern: str) -> Pattern:
    """``pattern`` compiled for linear-time search, or PatternError (cached: patterns repeat)."""
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise PatternError(f"pattern is longer than {MAX_PATTERN_LENGTH} characters")
    try:
        return re2.compile(pattern, _OPTIONS)  # type: ignore[no-any-return]
    except re2.error as exc:
        raise PatternError(_why(pattern, exc)) from None


def check(pattern: str) -> str:
    """``pattern`` itself when it compiles; PatternError otherwise (validation at set time)."""
    compile_pattern(pattern)
    return pattern


def search(pattern: str, text: str) -> bool:
    """Does ``pattern`` occur in ``text`` (unanchored, as RabbitMQ's ``re:run``)? A pattern that
    does not compile matches nothing (records stored before they were checked with RE2)."""
    try:
        compiled = compile_pattern(pattern)
    except PatternError:
        return False
    return compiled.search(text) is not None


def escape(text: str) -> str:
    return str(re2.escape(text))


def _why(pattern: str, exc: BaseException) -> str:
    detail = exc.args[0] if exc.args else ""
    if isinstance(detail, bytes):
        detail = detail.decode("utf-8", "replace")
    text = f"{detail or exc}"
    if any(a in pattern for a in ("(?=", "(?!", "(?<=", "(?<!")):
        hint = "lookaround assertions are not supported"
    elif "invalid escape sequence: \\" in text and text[-1:].isdigit():
        hint = "backreferences are not supported"
    else:
        hint = ""
    base = f"not a regular expression this broker accepts ({text})"
    if hint:
        base += f": {hint} (patterns run on RE2, which matches in linear time)"
    return base
