"""A consistent copy of the embedded store, and putting one back into an empty data directory.

``snapshot`` runs on the store's one worker thread (``SQLiteStore.backup``), so no commit, body write,
segment removal or compaction happens while it works: SQLite's online backup API copies the database
(what the WAL holds included), then each body segment the *copy* references is copied up to the end
the copy records. Segments are append-only below that end, but an emptied one is recycled (renamed
and overwritten), which is why the copy is made before any other write instead of beside them; the
price is that commits wait while the segments are copied (docs/OPERATIONS.md).

The result is one uncompressed tar: ``leveret.sqlite3``, ``bodies/<segment>.seg`` and
``BACKUP.json`` (the manifest: format, schema versions, message count, segment sizes). ``restore``
checks a backup directory against its manifest and copies it into a data directory that holds
nothing yet; the node opening it recovers as after a clean stop.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sqlite3
import tarfile
import time
from pathlib import Path
from typing import Any, BinaryIO

from persistence.bodystore import segment_name

FORMAT = 1
DB_NAME = "leveret.sqlite3"
MANIFEST = "BACKUP.json"
BODIES = "bodies"


class BackupError(Exception):
    """A backup that cannot be made or restored; the text says why."""


def snapshot(db: sqlite3.Connection, data_dir: Path, out: BinaryIO) -> dict[str, Any]:
    """Write the tar of a consistent copy of the store open as ``db`` (in ``data_dir``) to ``out``;
    the manifest. Call it on the store's worker thread."""
    staging = data_dir / f".backup-{time.time_ns()}.sqlite3"
    try:
        copy = sqlite3.connect(staging)
        try:
            db.backup(copy)
            manifest = _describe(copy)
        finally:
            copy.close()
        with tarfile.open(fileobj=out, mode="w|") as tar:
            tar.add(staging, arcname=DB_NAME)
            for name, size in manifest["segments"].items():
                info = tarfile.TarInfo(f"{BODIES}/{name}")
                info.size, info.mtime, info.mode = size, int(time.time()), 0o640
                with open(data_dir / BODIES / name, "rb") as segment:
                    if segment.seek(0, io.SEEK_END) < size:
                        raise BackupError(f"segment {name} is shorter than the {size} bytes the store records")
                    segment.seek(0)
                    tar.addfile(info, segment)  # exactly ``size`` bytes: what the copy references
            raw = json.dumps(manifest, indent=2).encode()
            info = tarfile.TarInfo(MANIFEST)
            info.size, info.mtime, info.mode = len(raw), int(time.time()), 0o640
            tar.addfile(info, io.BytesIO(raw))
    finally:
        staging.unlink(missing_ok=True)
    return manifest


def _describe(db: sqlite3.Connection) -> dict[str, Any]:
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    segments: dict[str, int] = {}
    if "body_segments" in tables:
        segments = {segment_name(seg): end for seg, end in
                    db.execute("SELECT segment, end_position FROM body_segments ORDER BY segment") if end > 0}
    return {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "schema_versions": [v for (v,) in db.execute("SELECT version FROM schema_migrations ORDER BY version")],
        "messages": db.execute("SELECT count(*) FROM messages").fetchone()[0],
        "queues": db.execute("SELECT count(*) FROM queues").fetchone()[0],
        "segments": segments,
    }


def extract(stream: BinaryIO, directory: Path) -> dict[str, Any]:
    """Unpack a backup tar read from ``stream`` into ``directory`` (empty or new); its manifest."""
    _must_be_empty(directory, "backup directory")
    directory.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        tar.extractall(directory, filter="data")
    return check(directory)


def check(directory: Path) -> dict[str, Any]:
    """The manifest of the backup in ``directory``, once every file it names is there at its size."""
    try:
        manifest: dict[str, Any] = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        raise BackupError(f"{directory} holds no {MANIFEST}: not a Leveret backup (or an unfinished one)") from None
    except ValueError as exc:
        raise BackupError(f"{directory / MANIFEST} is not JSON: {exc}") from None
    if manifest.get("format") != FORMAT:
        raise BackupError(f"backup format {manifest.get('format')!r}; this version reads format {FORMAT}")
    if not (directory / DB_NAME).is_file():
        raise BackupError(f"{directory} has no {DB_NAME}")
    for name, size in manifest["segments"].items():
        path = directory / BODIES / name
        if not path.is_file() or path.stat().st_size != size:
            raise BackupError(f"{path}: missing or not the {size} bytes the manifest records")
    db = sqlite3.connect(f"file:{directory / DB_NAME}?mode=ro", uri=True)
    try:
        if db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
            raise BackupError(f"{directory / DB_NAME} fails SQLite's quick_check")
    finally:
        db.close()
    return manifest


def restore(directory: Path, data_dir: Path) -> dict[str, Any]:
    """Copy the backup in ``directory`` into ``data_dir``, which must hold nothing; the manifest."""
    manifest = check(directory)
    _must_be_empty(data_dir, "data directory")
    (data_dir / BODIES).mkdir(parents=True, exist_ok=True)
    for name in manifest["segments"]:
        shutil.copyfile(directory / BODIES / name, data_dir / BODIES / name)
    # The database last: a data dir with a database and missing segments would open with missing bodies.
    shutil.copyfile(directory / DB_NAME, data_dir / f".{DB_NAME}.restoring")
    (data_dir / f".{DB_NAME}.restoring").rename(data_dir / DB_NAME)
    os.sync()  # on disk before the operator starts a node on it
    return manifest


def _must_be_empty(directory: Path, what: str) -> None:
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise BackupError(f"the {what} {directory} is not empty")
