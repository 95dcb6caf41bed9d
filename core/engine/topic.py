"""AMQP topic pattern matching: ``*`` is exactly one word, ``#`` zero or more."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=4096)
def _split(text: str) -> tuple[str, ...]:
    # As in RabbitMQ, the empty key has no words at all (so "#" matches it, "*" not).
    return tuple(text.split(".")) if text else ()


def topic_matches(pattern: str, routing_key: str) -> bool:
    """True when ``routing_key`` matches the binding ``pattern``."""
    if "#" not in pattern and "*" not in pattern:
        return pattern == routing_key
    return _match(_split(pattern), 0, _split(routing_key), 0)


def _match(pat: tuple[str, ...], i: int, words: tuple[str, ...], j: int) -> bool:
    while i < len(pat):
        p = pat[i]
        if p == "#":
            # Collapse runs of '#', then try every split point for the rest.
            while i + 1 < len(pat) and pat[i + 1] == "#":
                i += 1
            if i + 1 == len(pat):
                return True
            return any(_match(pat, i + 1, words, k) for k in range(j, len(words) + 1))
        if j >= len(words):
            return False
        if p != "*" and p != words[j]:
            return False
        i += 1
        j += 1
    return j == len(words)
