"""AMQP topic matching: ``*`` is exactly one word, ``#`` zero or more.

Both forms here are bounded by (pattern words x routing-key words), whatever
the pattern: a binding such as ``#.*.#.*.#.*.z`` must not make a publish
backtrack exponentially (issue 26, item 11: 14 times ``#.*.`` and a 30-word
key froze the node for more than 30 s with the old backtracking matcher).

- ``topic_matches`` checks one pattern against one key (the gRPC and
  management filters): a set of pattern positions is advanced word by word.
- ``TopicTrie`` holds every binding pattern of a topic exchange in a trie of
  words, as RabbitMQ's ``rabbit_exchange_type_topic`` does: a publish walks
  only the branches its words select, so its cost does not grow with the
  number of bindings, and binding or unbinding edits one path.

As in RabbitMQ, the empty routing key has no words at all (so ``#`` matches
it and ``*`` does not), and a run of ``#`` is the same as one ``#``.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


def split_words(text: str) -> list[str]:
    """The words of a routing key or pattern; the empty string has none."""
    return text.split(".") if text else []


def pattern_words(pattern: str) -> list[str]:
    """The words of a binding pattern with runs of ``#`` collapsed (``#.#`` matches what ``#`` does)."""
    words = pattern.split(".") if pattern else []
    if "#.#" not in pattern:
        return words  # no run to collapse (the usual case, checked without a loop)
    out: list[str] = []
    for w in words:
        if w == "#" and out and out[-1] == "#":
            continue
        out.append(w)
    return out


def topic_matches(pattern: str, routing_key: str) -> bool:
    """True when ``routing_key`` matches the binding ``pattern``."""
    if "#" not in pattern and "*" not in pattern:
        return pattern == routing_key
    pat = pattern_words(pattern)
    end = len(pat)
    # The pattern positions reachable after the words read so far: a position
    # before a '#' also reaches the one after it ('#' taking no more words).
    states = _closure(pat, {0})
    for w in split_words(routing_key):
        nxt: set[int] = set()
        for i in states:
            if i < end:
                p = pat[i]
                if p == "#":
                    nxt.add(i)
                elif p == "*" or p == w:
                    nxt.add(i + 1)
        if not nxt:
            return False
        states = _closure(pat, nxt)
    return end in states


def _closure(pat: list[str], states: set[int]) -> set[int]:
    # pattern_words collapsed '#' runs, so one step past each '#' is enough.
    return states | {i + 1 for i in states if i < len(pat) and pat[i] == "#"}


class _Node:
    """One trie position: children by literal word, the ``*`` and ``#`` children, and what ends here."""

    __slots__ = ("words", "star", "hash", "bound")

    def __init__(self) -> None:
        self.words: dict[str, _Node] | None = None
        self.star: _Node | None = None
        self.hash: _Node | None = None
        self.bound: dict[Hashable, object] | None = None  # binding key -> value

    def empty(self) -> bool:
        return not self.words and self.star is None and self.hash is None and not self.bound


class TopicTrie(Generic[T]):
    """Binding patterns of one topic exchange; ``match`` gives the values of every pattern a key matches."""

    __slots__ = ("_root", "_count")

    def __init__(self) -> None:
        self._root = _Node()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, pattern: str, key: Hashable, value: T) -> None:
        """Bind ``value`` under ``pattern``; ``key`` names this binding for ``remove``."""
        node = self._root
        for w in pattern_words(pattern):
            if w != "#" and w != "*":
                words = node.words
                if words is None:
                    words = node.words = {}
                child = words.get(w)
                if child is None:
                    child = words[w] = _Node()
                node = child
            elif w == "*":
                if node.star is None:
                    node.star = _Node()
                node = node.star
            else:
                if node.hash is None:
                    node.hash = _Node()
                node = node.hash
        if node.bound is None:
            node.bound = {}
        if key not in node.bound:
            self._count += 1
        node.bound[key] = value

    def remove(self, pattern: str, key: Hashable) -> bool:
        """Unbind; False when there is no such binding. Emptied nodes go: the trie stays as small as its bindings."""
        path: list[tuple[_Node, str]] = []
        node = self._root
        for w in pattern_words(pattern):
            path.append((node, w))
            if w == "#":
                child = node.hash
            elif w == "*":
                child = node.star
            else:
                child = node.words.get(w) if node.words is not None else None
            if child is None:
                return False
            node = child
        bound = node.bound
        if not bound or key not in bound:
            return False
        del bound[key]
        self._count -= 1
        if bound:
            return True
        node.bound = None
        while path and node.empty():
            parent, w = path.pop()
            if w == "#":
                parent.hash = None
            elif w == "*":
                parent.star = None
            else:
                assert parent.words is not None
                del parent.words[w]
                if not parent.words:
                    parent.words = None
            node = parent
        return True

    def clear(self) -> None:
        self._root = _Node()
        self._count = 0

    def match(self, routing_key: str) -> list[T]:
        """The values bound under every pattern ``routing_key`` matches, each value once (by identity)."""
        return self.walk(routing_key)[0]

    def walk(self, routing_key: str) -> tuple[list[T], int]:
        """``match``, and how many (node, position) steps it took: what caching the answer would save.

        Each (trie node, word position) pair is visited at most once: a node
        other than a ``#`` node is reached only from its parent one word
        earlier, and the positions a ``#`` node is entered at are remembered.
        So the walk costs at most (trie nodes x (words + 1)) steps, and
        usually just the few branches the key's words select.
        """
        words = routing_key.split(".") if routing_key else []
        n = len(words)
        found: dict[int, T] = {}
        entered: set[tuple[_Node, int]] | None = None
        stack = [(self._root, 0)]
        pop, push = stack.pop, stack.append
        steps = 0
        while stack:
            node, i = pop()
            steps += 1
            if i == n:
                if node.bound:
                    for v in node.bound.values():
                        found[id(v)] = v  # type: ignore[assignment]  # values are T by add()
            else:
                if node.words is not None:
                    child = node.words.get(words[i])
                    if child is not None:
                        push((child, i + 1))
                if node.star is not None:
                    push((node.star, i + 1))
            h = node.hash
            if h is not None:
                # '#' takes words i..j for every j: enter its node at each position once.
                if entered is None:
                    entered = set()
                for j in range(i, n + 1):
                    state = (h, j)
                    if state in entered:
                        break  # whoever entered at j also entered at every later position
                    entered.add(state)
                    push(state)
        return list(found.values()), steps
