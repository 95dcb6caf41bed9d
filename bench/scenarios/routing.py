"""AMQP topic matching, used to know in advance which queues each routing key reaches."""

from __future__ import annotations


def topic_matches(pattern: str, key: str) -> bool:
    """``*`` matches exactly one word, ``#`` zero or more words."""
    return _match(pattern.split("."), key.split("."))


def _match(pat: list[str], words: list[str]) -> bool:
    if not pat:
        return not words
    head, rest = pat[0], pat[1:]
    if head == "#":
        return any(_match(rest, words[i:]) for i in range(len(words) + 1))
    if not words:
        return False
    return (head == "*" or head == words[0]) and _match(rest, words[1:])
