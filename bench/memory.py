"""Broker memory from /proc: RSS of a process plus its descendants, and PID discovery."""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def rss_kb(pid: int) -> int:
    """VmRSS of one process in KiB (0 if it has none, e.g. a zombie)."""
    for line in (PROC / str(pid) / "status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may contain spaces/parens; fields resume after the last ')'.
        ppid = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def descendants(pid: int) -> list[int]:
    """``pid`` followed by all its descendants."""
    children = _children_map()
    out, stack = [], [pid]
    while stack:
        current = stack.pop()
        out.append(current)
        stack.extend(children.get(current, []))
    return out


def tree_rss_kb(pid: int) -> int:
    """RSS of ``pid`` and all its descendants (RabbitMQ's beam.smp runs erl_child_setup etc.)."""
    total = 0
    for p in descendants(pid):
        try:
            total += rss_kb(p)
        except OSError:
            continue
    return total


def _listen_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rpartition(":")[2], 16) == port:  # 0A = LISTEN
                inodes.add(inode)
    return inodes


def pid_listening_on(port: int) -> int | None:
    """The PID owning the TCP listener on ``port`` (needs permission to read other processes' fds)."""
    wanted = {f"socket:[{inode}]" for inode in _listen_inodes(port)}
    if not wanted:
        return None
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) in wanted:
                    return int(entry.name)
        except OSError:
            continue
    return None
