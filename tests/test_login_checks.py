"""Password checks off the event loop, delayed before the check, at one cost (issue #26, item 12).

compat_tests/test_hostile_clients.py runs the same attacks over AMQP and HTTP against a node.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import statistics
import time

import pytest

from core.engine import login_throttle, passwords
from core.engine.broker import Broker, User
from core.model.errors import AccessRefused

HOST = "10.9.8.7"


def _cost(record: tuple[bytes, bytes] | None) -> float:
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        passwords.check(record, "wrong")
        runs.append(time.perf_counter() - t)
    return statistics.median(runs)


def test_every_kind_of_record_and_an_unknown_user_cost_one_kdf_check() -> None:
    """No timing difference: an imported RabbitMQ SHA-256 record took a microsecond (6,763
    guesses/s over HTTP) where argon2id takes ~26 ms, and told the kind of record apart."""
    salt = b"\x01\x02\x03\x04"
    rabbit = User.from_rabbit_hash("r", base64.b64encode(salt + hashlib.sha256(salt + b"pw").digest()).decode())
    legacy_salt = b"0123456789abcdef"
    legacy = (legacy_salt, hashlib.pbkdf2_hmac("sha256", b"pw", legacy_salt, 1))
    argon = User.create("a", "pw")
    costs = {"argon2id": _cost((argon.salt, argon.password_hash)), "unknown user": _cost(None),
             "rabbitmq sha256": _cost((rabbit.salt, rabbit.password_hash)), "first records": _cost(legacy)}
    assert max(costs.values()) < 3 * min(costs.values()), costs
    assert passwords.check((rabbit.salt, rabbit.password_hash), "pw") == (True, True)
    assert passwords.check(None, "pw") == (False, False)


async def test_logins_run_the_kdf_off_the_event_loop() -> None:
    """20 wrong logins from 20 addresses at once: the loop keeps turning (it stalled 25 ms a check)."""
    broker = Broker()
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    started = time.perf_counter()
    results = await asyncio.gather(*(broker.login("guest", f"guess {i}", f"10.0.0.{i}") for i in range(20)),
                                   return_exceptions=True)
    checks = time.perf_counter() - started
    stop.set()
    await tick
    assert all(isinstance(r, AccessRefused) for r in results), results
    assert max(gaps) < max(0.1, checks / 5), (max(gaps), checks)  # the loop never waited for the checks
    assert (await broker.login("guest", "guest", "127.0.0.1")).name == "guest"


async def test_the_delay_comes_before_the_check_for_a_right_password_too() -> None:
    broker = Broker()
    for i in range(4):  # delays before each: 0, 0, 0.1, 0.2
        with pytest.raises(AccessRefused):
            await broker.login("guest", f"guess {i}", HOST)
    assert broker.login_throttle.failures(HOST) == 4
    broker.loopback_users = frozenset()
    started = time.perf_counter()
    assert (await broker.login("guest", "guest", HOST)).name == "guest"
    assert time.perf_counter() - started >= 0.4  # delay(4): the answer does not tell right from wrong early


async def test_parallel_guesses_from_one_address_wait_their_turns() -> None:
    """Thirty guesses at once, the right one last: before, all were checked at once and the right
    one answered at once (found in 1.8 s). Now they take turns and each turn waits the delay."""
    broker = Broker()
    broker.loopback_users = frozenset()
    candidates = [f"guess {i}" for i in range(29)] + ["guest"]
    tasks = [asyncio.create_task(broker.login("guest", p, HOST)) for p in candidates]
    done, pending = await asyncio.wait(tasks, timeout=2.0)
    assert tasks[-1] in pending, "the right password was found within 2 s"
    assert len(done) <= 12, len(done)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def test_an_address_may_hold_only_so_many_handshakes() -> None:
    throttle = login_throttle.LoginThrottle(handshakes_per_host=3)
    assert all(throttle.handshake_started(HOST) for _ in range(3))
    assert not throttle.handshake_started(HOST)
    assert throttle.handshake_started("10.0.0.1")  # another address is not affected
    throttle.handshake_ended(HOST)
    assert throttle.handshake_started(HOST)
    assert throttle.handshake_started(None)  # in-process callers
