"""Password storage and the login throttle on a real node (docs/SECURITY.md).

A user stored the old way (PBKDF2 with one iteration, the records of earlier
Leveret versions) logs in with pika; the node re-writes its record as argon2id
in the store. Failed logins from one address make every later check from it
wait longer, the right password's too, and it still gets in.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pika
import pika.exceptions
import pytest

from core.ports.store import UserRecord
from harness.node import NodeProcess
from persistence.sqlite import SQLiteStore


def _records(data: Path) -> dict[str, UserRecord]:
    async def go() -> list[UserRecord]:
        store = SQLiteStore(str(data / "leveret.sqlite3"))
        await store.open()
        try:
            return await store.load_users()
        finally:
            await store.close()

    return {r.name: r for r in asyncio.run(go())}


@pytest.fixture(scope="module")
def node() -> Iterator[NodeProcess]:
    root = Path(tempfile.mkdtemp(prefix="leveret-passwords-"))
    data = root / "data"
    data.mkdir(parents=True)
    salt = b"0123456789abcdef"
    legacy = UserRecord("legacy", salt, hashlib.pbkdf2_hmac("sha256", b"old-pass", salt, 1), [], ["/"])

    async def seed() -> None:
        store = SQLiteStore(str(data / "leveret.sqlite3"))
        await store.open()
        await store.save_user(legacy)
        await store.close()

    asyncio.run(seed())
    n = NodeProcess(data, root / "logs")
    n.start()
    yield n
    n.terminate()
    shutil.rmtree(root, ignore_errors=True)


def _connect(node: NodeProcess, user: str, password: str) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", node.amqp_port, credentials=pika.PlainCredentials(user, password), connection_attempts=1,
        blocked_connection_timeout=30, socket_timeout=30))


def test_an_old_record_is_rehashed_as_argon2id_on_login(node: NodeProcess) -> None:
    assert len(_records(node.data_dir)["legacy"].salt) == 16
    with _connect(node, "legacy", "old-pass"):
        pass
    deadline = time.monotonic() + 10
    while not (record := _records(node.data_dir)["legacy"]).password_hash.startswith(b"$argon2id$"):
        assert time.monotonic() < deadline, "the record was not upgraded"
        time.sleep(0.1)
    assert record.salt == b"" and b"old-pass" not in record.password_hash
    with _connect(node, "legacy", "old-pass"):  # and the new record verifies
        pass
    assert "old-pass" not in node.stderr_tail(10**7)  # no secret in the log


def test_failed_logins_slow_down_every_later_check_and_the_right_password_gets_in(node: NodeProcess) -> None:
    waits = []
    for _ in range(5):
        started = time.monotonic()
        with pytest.raises(pika.exceptions.ProbableAuthenticationError):
            _connect(node, "guest", "a guess")
        waits.append(time.monotonic() - started)
    # 0, 0, 0.1, 0.2, 0.4 s of delay before each check, on top of the round trips
    assert waits[4] - waits[0] > 0.3, waits
    started = time.monotonic()
    with _connect(node, "guest", "guest"):
        pass
    # The check itself waits (0.8 s after five failures), the right password's too: a guesser
    # that only waited for refusals saw the right password answered at once (issue #26, item 12).
    assert time.monotonic() - started > 0.6, "the right password was checked at once"
