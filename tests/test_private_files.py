"""Data at rest (issue #26, item 9): the data directory is 0700 and every file in it 0600.

The SQLite store holds password hashes, bodies and shovel URIs with passwords; body segments
and paged-out messages hold bodies. Made with a permissive umask (022, the usual one), as a node
would, and an older store with 0644 files is tightened when it is opened.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.engine import paging
from core.model import properties
from core.model.message import Message, QueuedMessage
from core.ports.store import Batch, StoredMessage, UserRecord
from persistence.sqlite import SQLiteStore


@pytest.fixture(autouse=True)
def permissive_umask() -> Iterator[None]:
    old = os.umask(0o022)
    yield
    os.umask(old)


def _modes(root: Path) -> dict[str, int]:
    out = {".": stat.S_IMODE(root.stat().st_mode)}
    for path in root.rglob("*"):
        out[str(path.relative_to(root))] = stat.S_IMODE(path.stat().st_mode)
    return out


def _private(modes: dict[str, int], root: Path) -> list[str]:
    return [f"{name} {mode:o}" for name, mode in modes.items()
            if mode != (0o700 if (root / name).is_dir() else 0o600)]


async def test_the_store_its_wal_and_body_segments_are_private(tmp_path: Path) -> None:
    data = tmp_path / "data"
    store = SQLiteStore(str(data / "leveret.sqlite3"), body_threshold=1024)
    await store.open()
    await store.save_user(UserRecord("u", b"", b"$argon2id$...", [], ["/"]))
    epoch = await store.claim("/", "q")
    body = b"b" * 4096  # over the threshold: a body segment
    await store.commit(Batch(epochs={("/", "q"): epoch}, appends=[
        StoredMessage("/", "q", 0, "m0", "", "q", b"\x00\x00", body, 1.0, None, 0)]))
    modes = _modes(data)
    await store.close()
    assert {"leveret.sqlite3", "leveret.sqlite3-wal", "bodies"} <= modes.keys(), modes
    assert any(name.startswith("bodies/") and name != "bodies/LOCK" for name in modes), modes
    assert not _private(modes, data), _private(modes, data)


async def test_an_older_store_is_tightened_when_opened(tmp_path: Path) -> None:
    data = tmp_path / "data"
    store = SQLiteStore(str(data / "leveret.sqlite3"))
    await store.open()
    await store.close()
    os.chmod(data, 0o755)
    for path in data.iterdir():
        os.chmod(path, 0o644 if path.is_file() else 0o755)
    store = SQLiteStore(str(data / "leveret.sqlite3"))
    await store.open()
    modes = _modes(data)
    await store.close()
    assert not _private({k: v for k, v in modes.items() if not k.startswith("bodies")}, data), modes


def test_paged_out_messages_are_private(tmp_path: Path) -> None:
    directory = tmp_path / "paging"
    saved = paging.settings.directory
    paging.configure(paging.settings.queue_bytes, paging.settings.node_bytes, str(directory))
    try:
        log = paging.SegmentLog()
        log.write(QueuedMessage(Message("", "q", properties.EMPTY, b"x" * 100), 0))
        modes = _modes(directory)
        log.close()
    finally:
        paging.settings.directory = saved
    assert len(modes) >= 2 and not _private(modes, directory), modes
