"""Structured logs: one JSON object a line (or key=value for a terminal)."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extras = " ".join(
            f"{k}={v}" for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")
        )
        ts = time.strftime("%H:%M:%S", time.localtime(record.created))
        line = f"{ts} {record.levelname:<7} {record.name}: {record.getMessage()}" + (f"  {extras}" if extras else "")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup(level: str = "info", fmt: str = "auto") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "auto":
        fmt = "text" if sys.stderr.isatty() else "json"
    handler.setFormatter(JSONFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    install_rate_limit(root)


# ----------------------------------------------------------- rate limiting
# The 14-minute fuzzing run wrote 548 MB of logs: every refused
# connection its own warning, every internal error a whole traceback. A kind
# of line (logger, message template, level) now gets LINES_PER_WINDOW lines per
# window; the rest are counted and the count is reported once the window ends.
# A traceback is printed once per kind (exception type and where it was
# raised) per TRACEBACK_WINDOW; repeats become one line with the error's text.
WINDOW = 10.0
LINES_PER_WINDOW = 20
TRACEBACK_WINDOW = 60.0

Kind = tuple[str, str, int, str]


class _Window:
    __slots__ = ("started", "passed", "suppressed", "example")

    def __init__(self, started: float) -> None:
        self.started = started
        self.passed = 0
        self.suppressed = 0
        self.example = ""


class RateLimit(logging.Filter):
    """A handler filter: bounded lines per kind, tracebacks once per kind per interval."""

    def __init__(self, window: float = WINDOW, lines: int = LINES_PER_WINDOW,
                 traceback_window: float = TRACEBACK_WINDOW, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window = window
        self.lines = lines
        self.traceback_window = traceback_window
        self.clock = clock
        self._windows: dict[Kind, _Window] = {}
        self._tracebacks: dict[tuple[str, str], float] = {}
        self._next_report = 0.0
        self._reporting = False
        self.suppressed_total = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if self._reporting or record.levelno < logging.INFO:
            return True
        now = self.clock()
        if now >= self._next_report:
            self._report(now)
        if record.exc_info and record.exc_info[1] is not None:
            self._limit_traceback(record, now)
        msg = record.msg if isinstance(record.msg, str) else type(record.msg).__name__
        kind: Kind = (record.name, msg, record.levelno, getattr(record, "error_kind", ""))
        w = self._windows.get(kind)
        if w is None or now - w.started >= self.window:
            pending = w.suppressed if w is not None else 0
            w = self._windows[kind] = _Window(now)
            if pending:
                record.suppressed_before = pending  # reported on the next line of its kind
        if w.passed >= self.lines:
            w.suppressed += 1
            w.example = record.getMessage()
            self.suppressed_total += 1
            return False
        w.passed += 1
        return True

    def flush(self) -> None:
        """Report every pending suppressed count now (at shutdown)."""
        self._report(float("inf"))

    def _limit_traceback(self, record: logging.LogRecord, now: float) -> None:
        assert record.exc_info is not None
        exc_type, exc, tb = record.exc_info
        where = ""
        while tb is not None:
            where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
            tb = tb.tb_next
        name = exc_type.__name__ if exc_type is not None else "?"
        key = (name, where)
        record.error_kind = f"{name} at {where}"
        last = self._tracebacks.get(key)
        if last is not None and now - last < self.traceback_window:
            # Seen recently: one line with the error, not another stack.
            record.error = f"{name}: {exc}"
            record.exc_info = None
            record.exc_text = None
            return
        self._tracebacks[key] = now

    def _report(self, now: float) -> None:
        """Say how many lines each kind lost in windows that have ended; forget idle kinds."""
        self._next_report = now + self.window
        ended = [(k, w) for k, w in self._windows.items() if now - w.started >= self.window]
        for kind, w in ended:
            del self._windows[kind]
            if w.suppressed:
                self._reporting = True
                try:
                    logging.getLogger("leveret.logs").warning(
                        "log lines suppressed", extra={"suppressed": w.suppressed, "like": w.example,
                                                       "logger_of": kind[0], "error_kind": kind[3],
                                                       "window_s": self.window},
                    )
                finally:
                    self._reporting = False
        if len(self._tracebacks) > 10_000:  # bounded even against endless distinct kinds
            self._tracebacks.clear()


def install_rate_limit(logger: logging.Logger | None = None) -> RateLimit:
    """Put one RateLimit on every handler of ``logger`` (the root by default); idempotent."""
    target = logger or logging.getLogger()
    found: RateLimit | None = None
    for handler in target.handlers:
        for f in handler.filters:
            if isinstance(f, RateLimit):
                found = f
    limit = found or RateLimit()
    for handler in target.handlers:
        if limit not in handler.filters:
            handler.addFilter(limit)
    return limit


def flush_rate_limit(logger: logging.Logger | None = None) -> None:
    """Report what the rate limit still holds (at shutdown), so no count is lost."""
    for handler in (logger or logging.getLogger()).handlers:
        for f in handler.filters:
            if isinstance(f, RateLimit):
                f.flush()
                return


# ------------------------------------------------------- the event loop
loop_failures: Counter[str] = Counter()  # exceptions that reached the loop, by kind
_loop_log = logging.getLogger("leveret.loop")


def loop_exception_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """What escapes a callback or task: counted and logged (rate-limited), never fatal."""
    exc = context.get("exception")
    kind = type(exc).__name__ if exc is not None else "no-exception"
    loop_failures[kind] += 1
    extra: dict[str, Any] = {"context": str(context.get("message", "")), "failures": loop_failures[kind]}
    where = suspended_at(context.get("task") or context.get("future"))
    if where:
        extra["where"] = where
    _loop_log.error("unhandled exception in the event loop; contained",
                    exc_info=exc if isinstance(exc, BaseException) else None, extra=extra)


def suspended_at(task: object, depth: int = 8) -> str:
    """Where a task is suspended, innermost frame first ("file:line function <- ..."), or "".

    "Task was destroyed but it is pending!" carries no exception, so no traceback: without this the
    log cannot say which code a collected task was waiting in (bench.chaos saw bursts of them after
    Postgres faults). When the garbage collector has already closed the task's coroutine (it
    finalizes the members of a cycle in no set order) only the coroutine's name is left.
    """
    if not isinstance(task, asyncio.Task):
        return ""
    coro: Any = task.get_coro()
    name = getattr(coro, "__qualname__", "")
    names: list[str] = []
    # Follow the await chain (Task.get_stack gives only the outermost frame of a suspended
    # coroutine); it ends at a future, or at an async generator's asend, which leads no further.
    while coro is not None and len(names) < depth:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        names.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    if not names:
        return f"{name} (frames already cleared)" if name else ""
    return " <- ".join(reversed(names))


def install(loop: asyncio.AbstractEventLoop | None = None) -> None:
    """What the node installs at start: the rate limit on its log handlers and the loop's handler."""
    install_rate_limit()
    (loop or asyncio.get_running_loop()).set_exception_handler(loop_exception_handler)
