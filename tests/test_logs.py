"""The log rate limit: bounded lines per kind, one traceback per kind per interval."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator

import pytest
from pamqp import commands

from harness.fuzzing import fresh_broker
from leveret.node.logs import JSONFormatter, RateLimit
from tests.amqp_client import PROTOCOL_HEADER, Client


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def captured(fake_clock: FakeClock) -> Iterator[tuple[logging.Logger, io.StringIO, RateLimit]]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JSONFormatter())
    limit = RateLimit(window=10.0, lines=5, traceback_window=60.0, clock=fake_clock)
    handler.addFilter(limit)
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logger = logging.getLogger("leveret.test-logs")
    try:
        yield logger, stream, limit
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


class Every(logging.Handler):
    """Every record, unfiltered: what the node would have written without the limit."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def test_repeated_warnings_are_limited_and_the_rest_counted(
    captured: tuple[logging.Logger, io.StringIO, RateLimit], fake_clock: FakeClock
) -> None:
    logger, stream, limit = captured
    for i in range(100):
        logger.warning("connection closed by server", extra={"peer": f"127.0.0.1:{i}"})
    logger.warning("another kind")
    out = lines(stream)
    assert [o["msg"] for o in out].count("connection closed by server") == 5
    assert [o["msg"] for o in out].count("another kind") == 1
    assert limit.suppressed_total == 95
    fake_clock.now += 11  # the window ends: the next line reports what was dropped
    logger.warning("connection closed by server", extra={"peer": "127.0.0.1:1"})
    out = lines(stream)
    report = [o for o in out if o["msg"] == "log lines suppressed"]
    assert len(report) == 1
    assert report[0]["suppressed"] == 95 and report[0]["like"] == "connection closed by server"
    assert out[-1]["msg"] == "connection closed by server"


def test_traceback_once_per_kind_per_interval(
    captured: tuple[logging.Logger, io.StringIO, RateLimit], fake_clock: FakeClock
) -> None:
    logger, stream, _ = captured

    def fail(n: int) -> None:
        raise KeyError(n)

    for i in range(3):
        try:
            fail(i)
        except KeyError:
            logger.exception("internal error handling client data")
    out = lines(stream)
    assert len(out) == 3
    assert "exc" in out[0] and "Traceback" in str(out[0]["exc"])
    assert all("exc" not in o for o in out[1:])  # one line each, no stack
    assert out[1]["error"] == "KeyError: 1"
    fake_clock.now += 61
    try:
        fail(9)
    except KeyError:
        logger.exception("internal error handling client data")
    assert "exc" in lines(stream)[-1]


def test_refused_login_flood_is_bounded(
    captured: tuple[logging.Logger, io.StringIO, RateLimit], fake_clock: FakeClock
) -> None:
    """Every refused connection used to be its own warning line at any rate."""
    _, stream, limit = captured
    counter = Every()
    every = counter.records
    logging.getLogger().addHandler(counter)
    broker = fresh_broker()
    try:
        for _ in range(300):
            c = Client(broker)
            c.send_raw(PROTOCOL_HEADER)
            c.read()
            c.send(0, commands.Connection.StartOk(
                client_properties={"capabilities": {"authentication_failure_close": True}},
                mechanism="PLAIN", response="\0guest\0wrong"))
            c.conn.connection_lost()
    finally:
        logging.getLogger().removeHandler(counter)
    out = lines(stream)
    kinds = {r.msg for r in every}
    assert len(every) >= 600  # at least "login refused" and "connection closed" per connection
    # At most 5 lines of each kind in the window, whatever the rate; the rest counted.
    assert len(out) <= 5 * len(kinds), [o["msg"] for o in out]
    assert limit.suppressed_total == len(every) - len(out)


def test_debug_and_distinct_kinds_pass(captured: tuple[logging.Logger, io.StringIO, RateLimit]) -> None:
    logger, stream, _ = captured
    for i in range(20):
        logger.warning(f"distinct {i}")  # noqa: G004 - distinct templates on purpose
    assert len(lines(stream)) == 20


def test_a_destroyed_pending_task_is_logged_with_what_it_was(caplog: pytest.LogCaptureFixture) -> None:
    import gc

    from leveret.node.logs import loop_exception_handler, suspended_at

    async def waits_forever(fut: asyncio.Future[None]) -> None:
        await fut

    async def outer(fut: asyncio.Future[None]) -> None:
        await waits_forever(fut)

    loop = asyncio.new_event_loop()
    loop.set_exception_handler(loop_exception_handler)
    try:
        fut = loop.create_future()
        task = loop.create_task(outer(fut))
        loop.run_until_complete(asyncio.sleep(0))
        # A live suspended task: the whole chain, innermost first.
        where = suspended_at(task)
        assert where.startswith("test_logs.py:") and " waits_forever <- test_logs.py:" in where
        assert where.endswith(" outer")
        del fut, task  # nothing refers to the task now: it is collected while pending
        with caplog.at_level(logging.ERROR, logger="leveret.loop"):
            gc.collect()
    finally:
        loop.close()
    destroyed = [r for r in caplog.records if getattr(r, "context", "") == "Task was destroyed but it is pending!"]
    assert destroyed, [r.getMessage() for r in caplog.records]
    # The collector may close the coroutine first: then its name is what is left, and is logged.
    assert "outer" in destroyed[0].where
