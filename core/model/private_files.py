"""Files and directories only the node's user may read: what lives under the data directory.

The data directory holds password hashes, message bodies and shovel URIs with their passwords
(the SQLite store), body segments and paged-out messages. Directories are made 0700 and files
0600 whatever the process's umask, and an existing one (a store made by an older version) is
tightened when it is opened, as RabbitMQ keeps its database directory to its own user.
"""

from __future__ import annotations

import os
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` and its missing parents made (0700), and ``path`` itself set to 0700."""
    p = Path(path)
    p.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    if p.stat().st_mode & 0o777 != DIR_MODE:
        os.chmod(p, DIR_MODE)
    return p


def private_file(path: str | os.PathLike[str]) -> None:
    """Create ``path`` empty (0600) when missing, else set it to 0600: before a library (SQLite)
    creates it with its own mode. SQLite gives its -wal and -shm files the database's mode."""
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), FILE_MODE))
    tighten(path)


def tighten(path: str | os.PathLike[str]) -> None:
    """0600 for an existing file (a no-op when it is missing or already so)."""
    try:
        if os.stat(path).st_mode & 0o777 != FILE_MODE:
            os.chmod(path, FILE_MODE)
    except FileNotFoundError:
        pass


def opener(path: str, flags: int) -> int:
    """For ``open(path, mode, opener=opener)``: a new file is 0600."""
    return os.open(path, flags, FILE_MODE)
