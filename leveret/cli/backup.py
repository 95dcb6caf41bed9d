"""``leveret ctl backup DIR`` and ``leveret ctl restore DIR [DATA_DIR]``: the embedded store, copied.

``backup`` asks a running node (its management API, an administrator's credentials) for a consistent
copy of its store (``POST /api/leveret/backup``: SQLite's online backup, then the body segments the
copy references) and unpacks it into DIR, which must be empty or new. ``restore`` runs with no node
on the target: it checks DIR against its manifest and copies it into DATA_DIR (default: env
LEVERET_DATA_DIR, else ./leveret-data), which must hold nothing. docs/OPERATIONS.md.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from leveret.cli.ctl_args import EX_DATAERR, EX_NOPERM, EX_UNAVAILABLE, EX_USAGE
from persistence import backup

if TYPE_CHECKING:
    from leveret.cli.ctl import Client

COMMANDS = ("backup", "restore")
DEFAULT_DATA_DIR = "./leveret-data"
TIMEOUT = 3600.0  # a large store takes a while to copy and to send


class _Failed(Exception):
    """A refusal, with rabbitmqctl's exit code: bad input by default (a directory that is not empty)."""

    def __init__(self, text: str, code: int = EX_DATAERR) -> None:
        super().__init__(text)
        self.code = code


def main(client: Client, command: str, rest: list[str]) -> int:
    """Run ``command`` (one of COMMANDS) with its arguments; a failure is raised as ctl's CtlError."""
    from leveret.cli.ctl import CtlError

    try:
        if command == "backup":
            return _backup(client, rest)
        return _restore(rest)
    except _Failed as exc:
        raise CtlError(str(exc), exc.code) from None
    except backup.BackupError as exc:
        raise CtlError(str(exc), EX_DATAERR) from None
    except OSError as exc:
        raise CtlError(f"{exc.filename or ''}: {exc.strerror or exc}", EX_DATAERR) from None


def _backup(client: Client, rest: list[str]) -> int:
    if len(rest) != 1:
        raise _Failed("usage: leveret ctl backup DIR", EX_USAGE)
    target = Path(rest[0])
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise _Failed(f"the backup directory {target} is not empty")
    request = urllib.request.Request(client.base + "/api/leveret/backup", data=b"", method="POST",
                                     headers=client.headers)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            manifest = backup.extract(response, target)
    except urllib.error.HTTPError as exc:
        refused = exc.code in (401, 403)
        raise _Failed(f"POST /api/leveret/backup: {exc.code} {exc.read().decode('utf-8', 'replace')}",
                      EX_NOPERM if refused else EX_DATAERR) from None
    except urllib.error.URLError as exc:
        raise _Failed(f"cannot reach the node's management API at {client.base}: {exc.reason}",
                      EX_UNAVAILABLE) from None
    print(f"backup of {manifest['messages']} messages in {manifest['queues']} durable queues "
          f"({len(manifest['segments'])} body segments) in {target}")
    return 0


def _restore(rest: list[str]) -> int:
    if len(rest) not in (1, 2):
        raise _Failed("usage: leveret ctl restore DIR [DATA_DIR]", EX_USAGE)
    data_dir = Path(rest[1] if len(rest) == 2 else os.environ.get("LEVERET_DATA_DIR", DEFAULT_DATA_DIR))
    manifest = backup.restore(Path(rest[0]), data_dir)
    print(f"restored {manifest['messages']} messages in {manifest['queues']} durable queues into {data_dir}; "
          "start the node on it")
    return 0
