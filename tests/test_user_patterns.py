"""User-supplied regular expressions run in linear time and unsupported ones are refused (issue #26, item 10).

``^(a+)+$`` against 27 ``a``s and ``!`` took Python's ``re`` 3.3 s (doubling per
character) and stalled the event loop; RE2 answers in microseconds. Every way a
pattern comes in is tried: permissions, topic permissions, policies, operator
policies and the management API's listing filter.
"""

from __future__ import annotations

import time

import pytest

from core.engine import access
from core.engine.broker import Broker, Permission
from core.model import patterns
from core.model.policy import Policy, PolicyError
from leveret.http import listing
from leveret.http.api_admin import check_regex, policy_from_json
from leveret.http.errors import HttpError

EVIL = "^(a+)+$"
VICTIM = "a" * 27 + "!"  # 2**27 backtracking paths for a backtracking engine
FAST = 0.05  # seconds; a backtracking engine needs seconds (3.3 s measured) for VICTIM


def _timed(fn: object, *args: object) -> tuple[object, float]:
    t = time.perf_counter()
    result = fn(*args)  # type: ignore[operator]
    return result, time.perf_counter() - t


def test_a_catastrophic_pattern_is_linear_in_every_place_a_user_can_put_one() -> None:
    broker = Broker()
    user = broker.add_user("u", "pw", vhosts={"/"})
    user.permissions["/"] = Permission(EVIL, EVIL, EVIL)
    user.topic_permissions["/"] = {"amq.topic": (EVIL, EVIL)}
    broker.user_changed("u")
    g = broker.access.grants("u", "/")
    checks = [
        (g.allowed, "configure", VICTIM),
        (g.allowed, "write", VICTIM + "x"),
        (g.topic_allowed, "write", "amq.topic", VICTIM),
        (Policy.create("/", "p", EVIL, {"max-length": 1}).applies_to, "queue", VICTIM),
        (Policy.create("/", "o", EVIL, {"max-length": 1}, operator=True).applies_to, "queue", VICTIM),
        (listing.apply, [{"name": VICTIM}], {"name": EVIL, "use_regex": "true"}),
    ]
    for fn, *args in checks:
        result, took = _timed(fn, *args)
        assert not result, (fn, args)
        assert took < FAST, f"{fn} took {took:.3f}s"
    # The same patterns still match what they should.
    assert g.allowed("read", "aaa") and patterns.search(EVIL, "a" * 10_000)
    assert access._matches("", "") and not access._matches("", "x")  # RabbitMQ's "" is "^$"


@pytest.mark.parametrize(("pattern", "why"), [
    (r"(a)\1", "backreferences are not supported"),
    (r"foo(?=bar)", "lookaround assertions are not supported"),
    (r"(?<!x)y", "lookaround assertions are not supported"),
])
def test_a_pattern_re2_cannot_run_is_refused_with_the_reason(pattern: str, why: str) -> None:
    with pytest.raises(patterns.PatternError, match=why):
        patterns.check(pattern)
    with pytest.raises(HttpError) as info:  # permissions and topic permissions (HTTP, definitions)
        check_regex(pattern, "configure")
    assert info.value.status == 400 and why in info.value.reason
    with pytest.raises(HttpError) as info:  # listing filters
        listing.apply([{"name": "x"}], {"name": pattern, "use_regex": "true"})
    assert info.value.status == 400 and why in info.value.reason
    with pytest.raises(PolicyError, match=why):
        Policy.create("/", "p", pattern, {"max-length": 1})
    with pytest.raises(HttpError) as info:
        policy_from_json("/", "p", {"pattern": pattern, "definition": {"max-length": 1}})
    assert info.value.status == 400 and why in info.value.reason


def test_a_stored_pattern_re2_cannot_compile_allows_nothing() -> None:
    """A permission stored before patterns were checked with RE2: RabbitMQ's rule for a bad regex."""
    broker = Broker()
    user = broker.add_user("u", "pw", vhosts={"/"})
    user.permissions["/"] = Permission(r"(a)\1", ".*", ".*")
    broker.user_changed("u")
    g = broker.access.grants("u", "/")
    assert not g.allowed("configure", "aa") and g.allowed("write", "aa")
