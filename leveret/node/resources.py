"""What the node holds in memory, and how much disk its data dir has left: the alarms' inputs.

The memory alarm counts what grows with the messages a node holds, not RSS
(CPython rarely gives freed memory back, so an alarm on RSS would never clear):

- message bodies queued in memory (ready in classic queues, a stream's newest);
- the per-message index: every message held (ready or unacknowledged) costs
  ``MESSAGE_BYTES`` beyond its body (measured; the queues' paging budget counts it
  too: core/engine/paging.py), one on disk ``PAGED_INDEX_BYTES``;
- bodies partly received on AMQP channels (a 128 MiB body counts as it arrives);
- AMQP connection buffers (unparsed input, output not yet written).

The disk alarm, as RabbitMQ's ``disk_free_limit``: free space of the data
dir's file system below the limit blocks publishers.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from core.engine.paging import MESSAGE_BYTES, PAGED_INDEX_BYTES, PagedReady
from core.engine.stream import StreamQueue

if TYPE_CHECKING:
    from core.engine.broker import Broker

DEFAULT_DISK_FREE_LIMIT = "50MB"  # RabbitMQ's default, 50,000,000 bytes

_UNITS = {"": 1, "k": 1024, "kib": 1024, "kb": 1000, "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
          "g": 1024**3, "gib": 1024**3, "gb": 1000**3, "t": 1024**4, "tib": 1024**4, "tb": 1000**4}
_ABSOLUTE = re.compile(r"^\s*(\d+)\s*([a-zA-Z]*)\s*$")
_RELATIVE = re.compile(r"^\s*(?:\{\s*mem_relative\s*,\s*|mem_relative\s*[:=]\s*)([0-9.]+)\s*\}?\s*$")


@dataclass(frozen=True)
class MemoryUse:
    bodies: int
    index: int
    partial_and_buffers: int

    @property
    def total(self) -> int:
        return self.bodies + self.index + self.partial_and_buffers


class Holder(Protocol):
    """A front end's server: what its connections hold in buffers (AMQP, MQTT)."""

    def held_bytes(self) -> int: ...


def memory_use(broker: Broker, *front_ends: Holder | None) -> MemoryUse:
    bodies = 0
    messages = 0
    index_paged = 0
    for vh in broker.vhosts.values():
        for q in vh.queues.values():
            for ch in q.channels:
                # Paged queues (core/engine/paging.py) hold only their window's bodies and
                # index here; a message on disk costs PAGED_INDEX_BYTES of memory.
                bodies += ch.memory_bytes
                ready = ch.ready
                paged = ready.paged if type(ready) is PagedReady else 0
                messages += len(ready) - paged + ch.unacked
                index_paged += paged
            if isinstance(q, StreamQueue):
                bodies += q.mem_bytes  # a stream's retained newest bodies (core/engine/stream.py)
    held = sum(f.held_bytes() for f in front_ends if f is not None)
    return MemoryUse(bodies, messages * MESSAGE_BYTES + index_paged * PAGED_INDEX_BYTES, held)


def rss_bytes() -> int:
    """This process's resident memory (0 where /proc cannot say)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def open_fds() -> int:
    """File descriptors this process holds (0 where /proc cannot say)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def parse_disk_free_limit(text: str, total_memory: int) -> int:
    """RabbitMQ's disk_free_limit: bytes with an optional unit (``50MB``, ``2GiB``, ``1000000``),
    or relative to RAM (``mem_relative:1.5`` or ``{mem_relative,1.5}``)."""
    m = _RELATIVE.match(text)
    if m:
        return int(float(m.group(1)) * total_memory)
    m = _ABSOLUTE.match(text)
    if m and m.group(2).lower() in _UNITS:
        return int(m.group(1)) * _UNITS[m.group(2).lower()]
    raise ValueError(f"--disk-free-limit: {text!r} is not bytes (50MB, 2GiB, 1000000) or mem_relative:RATIO")


def disk_free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def total_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
