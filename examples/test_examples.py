"""Run every example as a subprocess against a broker and check what it prints.

The broker comes from the ``amqp_url`` fixture (compat_tests/conftest.py): a
Leveret node started for the session, or the broker named by
``LEVERET_TEST_AMQP_URL``::

    .venv/bin/python -m pytest examples
    LEVERET_TEST_AMQP_URL=amqp://guest:guest@127.0.0.1:5672/ .venv/bin/python -m pytest examples

Every test uses its own exchange and queue names, so runs do not interfere.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import pytest

from compat_tests.util import Names

EXAMPLES = Path(__file__).resolve().parent
READY_TIMEOUT = 20.0
EXIT_TIMEOUT = 30.0
RECEIVED = re.compile(r"^received (\S+) (\{.*\})( \(redelivered\))?$")

pytestmark = pytest.mark.timeout(120)


def fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Program:
    """An example running in the background; its output is collected line by line."""

    def __init__(self, script: str, url: str, *args: str) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("AMQP_URL", None)
        self.name = " ".join([script, *args])
        self.proc = subprocess.Popen(
            [sys.executable, str(EXAMPLES / script), "--url", url, *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        self._stdout: list[str] = []
        self._stderr: list[str] = []
        self._changed = threading.Condition()
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self._stdout), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self._stderr), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream: IO[str], sink: list[str]) -> None:
        for line in iter(stream.readline, ""):
            with self._changed:
                sink.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def stdout(self) -> list[str]:
        with self._changed:
            return list(self._stdout)

    @property
    def stderr(self) -> str:
        with self._changed:
            return "\n".join(self._stderr)

    def describe(self) -> str:
        output = "\n".join(self.stdout)
        return f"{self.name} (exit {self.proc.poll()})\nstdout:\n{output}\nstderr:\n{self.stderr}"

    def wait_for(self, prefix: str, timeout: float = READY_TIMEOUT) -> str:
        """Wait until the program prints a line starting with ``prefix``."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self._stdout:
                    if line.startswith(prefix):
                        return line
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.proc.poll() is not None and not any(r.is_alive() for r in self._readers)):
                    pytest.fail(f"no line starting with {prefix!r}: {self.describe()}", pytrace=False)
                self._changed.wait(min(remaining, 0.2))

    def finish(self, timeout: float = EXIT_TIMEOUT) -> int:
        """Wait for the program to exit on its own; return its exit status."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"did not exit within {timeout:g}s: {self.describe()}", pytrace=False)
        for reader in self._readers:
            reader.join(timeout=5)
        return self.proc.returncode

    def interrupt(self, timeout: float = 10.0) -> int:
        """Press Ctrl-C and wait for the program to exit."""
        self.proc.send_signal(signal.SIGINT)
        return self.finish(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def start(amqp_url: str) -> Iterator[Callable[..., Program]]:
    """``start("news_consumer.py", "--count", "3")`` runs an example in the background."""
    started: list[Program] = []

    def factory(script: str, *args: str) -> Program:
        program = Program(script, amqp_url, *args)
        started.append(program)
        return program

    yield factory
    for program in started:
        program.kill()


@pytest.fixture
def run(start: Callable[..., Program]) -> Callable[..., Program]:
    """``run("rpc_client.py", "10")`` runs an example to completion."""

    def factory(script: str, *args: str, timeout: float = EXIT_TIMEOUT) -> Program:
        program = start(script, *args)
        program.finish(timeout)
        return program

    return factory


def received(program: Program) -> list[tuple[str, int, bool]]:
    """(routing key, message id, redelivered) for each message a news consumer printed."""
    result = []
    for line in program.stdout:
        match = RECEIVED.match(line)
        if match:
            result.append((match.group(1), json.loads(match.group(2))["id"], bool(match.group(3))))
    return result


# ----------------------------------------------------------------------- news


def test_news_topic_patterns(names: Names, start: Callable[..., Program], run: Callable[..., Program]) -> None:
    exchange = names.exchange("examples.news")
    sport = start("news_consumer.py", "--exchange", exchange, "--topic", "news.sport.#",
                  "--count", "3", "--idle-timeout", "20")
    uk = start("news_consumer.py", "--exchange", exchange, "--topic", "news.*.uk",
               "--count", "3", "--idle-timeout", "20")
    everything = start("news_consumer.py", "--exchange", exchange, "--count", "6", "--idle-timeout", "20")
    for consumer in (sport, uk, everything):
        consumer.wait_for("waiting for news")

    keys = ["news.sport.uk", "news.politics.uk", "news.sport.us", "news.tech.eu", "news.weather.uk", "news.sport.fr"]
    producer = run("news_producer.py", "--exchange", exchange, "--count", "6",
                   *[arg for key in keys for arg in ("--routing-key", key)])
    assert producer.proc.returncode == 0, producer.describe()
    sent = [line for line in producer.stdout if line.startswith("sent ")]
    assert [line.split()[1] for line in sent] == keys
    assert "done: 6 message(s) confirmed" in producer.stdout

    for consumer in (sport, uk, everything):
        assert consumer.finish() == 0, consumer.describe()
    assert received(sport) == [("news.sport.uk", 1, False), ("news.sport.us", 3, False), ("news.sport.fr", 6, False)]
    assert received(uk) == [("news.sport.uk", 1, False), ("news.politics.uk", 2, False),
                            ("news.weather.uk", 5, False)]
    assert received(everything) == [(key, number, False) for number, key in enumerate(keys, 1)]


def test_news_durable_queue_and_manual_acks(names: Names, run: Callable[..., Program]) -> None:
    exchange = names.exchange("examples.news")
    queue = names.queue("examples.news")
    common = ("--exchange", exchange, "--queue", queue, "--topic", "news.sport.*")

    # Declare and bind the durable queue, then go away: it keeps collecting messages.
    setup = run("news_consumer.py", *common, "--idle-timeout", "0.5")
    assert setup.proc.returncode == 0, setup.describe()
    assert received(setup) == []

    producer = run("news_producer.py", "--exchange", exchange, "--count", "5", "--mandatory",
                   "--routing-key", "news.sport.uk")
    assert producer.proc.returncode == 0, producer.describe()

    # Take two, with room to prefetch all five: the three unacked ones must go back to the queue.
    first = run("news_consumer.py", *common, "--count", "2", "--prefetch", "5", "--idle-timeout", "10")
    assert first.proc.returncode == 0, first.describe()
    assert [number for _, number, _ in received(first)] == [1, 2]

    rest = run("news_consumer.py", *common, "--idle-timeout", "1")
    assert rest.proc.returncode == 0, rest.describe()
    assert sorted(number for _, number, _ in received(rest)) == [3, 4, 5]
    assert "no message for 1s, stopping" in rest.stdout


def test_news_producer_mandatory_unroutable(names: Names, run: Callable[..., Program]) -> None:
    exchange = names.exchange("examples.news")
    producer = run("news_producer.py", "--exchange", exchange, "--count", "1", "--mandatory")
    assert producer.proc.returncode == 1, producer.describe()
    assert "unroutable: no queue bound for news.sport.uk" in producer.stderr


# ------------------------------------------------------------------------ rpc

NUMBERS = [0, 1, 2, 10, 30, 90]


def expected_answers(numbers: list[int]) -> list[str]:
    return [f"fib({n}) = {fib(n)}" for n in numbers]


def answers(program: Program) -> list[str]:
    return [line for line in program.stdout if line.startswith("fib(")]


def test_rpc_pika(names: Names, start: Callable[..., Program], run: Callable[..., Program]) -> None:
    queue = names.queue("examples.rpc")
    server = start("rpc_server.py", "--queue", queue, "--count", str(len(NUMBERS)))
    server.wait_for("awaiting RPC requests")
    client = run("rpc_client.py", "--queue", queue, "--timeout", "10", *map(str, NUMBERS))
    assert client.proc.returncode == 0, client.describe()
    assert answers(client) == expected_answers(NUMBERS)
    assert server.finish() == 0, server.describe()
    assert f"done: {len(NUMBERS)} request(s) answered" in server.stdout


def test_rpc_pika_errors(names: Names, start: Callable[..., Program], run: Callable[..., Program]) -> None:
    queue = names.queue("examples.rpc")
    server = start("rpc_server.py", "--queue", queue, "--count", "1")
    server.wait_for("awaiting RPC requests")
    bad = run("rpc_client.py", "--queue", queue, "--", "-1")
    assert bad.proc.returncode == 1, bad.describe()
    assert "fib(-1) failed: n must be between 0 and" in bad.stderr
    assert server.finish() == 0, server.describe()

    # Nobody consumes the queue any more: the client gives up after its timeout.
    began = time.monotonic()
    late = run("rpc_client.py", "--queue", queue, "--timeout", "1", "5")
    assert late.proc.returncode == 1, late.describe()
    assert "no reply for fib(5) within 1s" in late.stderr
    assert time.monotonic() - began < 15

    # That request expired with the client's timeout: a new server sees only the new one.
    server = start("rpc_server.py", "--queue", queue, "--count", "1")
    server.wait_for("awaiting RPC requests")
    fresh = run("rpc_client.py", "--queue", queue, "8")
    assert fresh.proc.returncode == 0, fresh.describe()
    assert answers(fresh) == ["fib(8) = 21"]
    assert server.finish() == 0, server.describe()
    assert [line for line in server.stdout if line.startswith("request '")] == ["request '8' -> 21"]

    # No such queue: the mandatory request comes back at once.
    missing = run("rpc_client.py", "--queue", names("examples.missing"), "--timeout", "30", "5", timeout=15)
    assert missing.proc.returncode == 1, missing.describe()
    assert "request returned" in missing.stderr and "312" in missing.stderr


def test_aio_rpc_both(names: Names, run: Callable[..., Program]) -> None:
    queue = names.queue("examples.aio")
    program = run("aio_rpc.py", "--role", "both", "--queue", queue, "--timeout", "10", *map(str, NUMBERS))
    assert program.proc.returncode == 0, program.describe()
    assert answers(program) == expected_answers(NUMBERS)


def test_aio_rpc_errors(names: Names, run: Callable[..., Program]) -> None:
    queue = names.queue("examples.aio")
    bad = run("aio_rpc.py", "--role", "both", "--queue", queue, "--", "7", "-1")
    assert bad.proc.returncode == 1, bad.describe()
    assert answers(bad) == ["fib(7) = 13"]
    assert "fib(-1) failed: n must be between 0 and" in bad.stderr

    missing = run("aio_rpc.py", "--role", "client", "--queue", names("examples.missing"), "--timeout", "30", "5",
                  timeout=15)
    assert missing.proc.returncode == 1, missing.describe()
    assert "request returned" in missing.stderr and "NO_ROUTE" in missing.stderr

    # A request that timed out expires: the server started afterwards answers only the new one.
    late = run("aio_rpc.py", "--role", "client", "--queue", queue, "--timeout", "1", "5")
    assert late.proc.returncode == 1, late.describe()
    assert "no reply for fib(5) within 1s" in late.stderr
    fresh = run("aio_rpc.py", "--role", "both", "--queue", queue, "8")
    assert fresh.proc.returncode == 0, fresh.describe()
    assert answers(fresh) == ["fib(8) = 21"]
    assert [line for line in fresh.stdout if line.startswith("request '")] == ["request '8' -> 21"]


def test_pika_and_aio_pika_interoperate(names: Names, start: Callable[..., Program],
                                        run: Callable[..., Program]) -> None:
    queue = names.queue("examples.mixed")
    aio_server = start("aio_rpc.py", "--role", "server", "--queue", queue, "--count", "2")
    aio_server.wait_for("awaiting RPC requests")
    pika_client = run("rpc_client.py", "--queue", queue, "12", "20")
    assert pika_client.proc.returncode == 0, pika_client.describe()
    assert answers(pika_client) == expected_answers([12, 20])
    assert aio_server.finish() == 0, aio_server.describe()

    pika_server = start("rpc_server.py", "--queue", queue, "--count", "2")
    pika_server.wait_for("awaiting RPC requests")
    aio_client = run("aio_rpc.py", "--role", "client", "--queue", queue, "13", "21")
    assert aio_client.proc.returncode == 0, aio_client.describe()
    assert answers(aio_client) == expected_answers([13, 21])
    assert pika_server.finish() == 0, pika_server.describe()


# --------------------------------------------------------------------- Ctrl-C


@pytest.mark.parametrize(("script", "args", "ready"), [
    ("news_consumer.py", ("--topic", "news.none.#"), "waiting for news"),
    ("news_producer.py", ("--count", "0", "--interval", "0.2", "--routing-key", "news.none"), "sent "),
    ("rpc_server.py", (), "awaiting RPC requests"),
    ("aio_rpc.py", ("--role", "server"), "awaiting RPC requests"),
])
def test_ctrl_c_exits_cleanly(names: Names, start: Callable[..., Program], script: str, args: tuple[str, ...],
                              ready: str) -> None:
    if script.startswith("news_"):
        args = ("--exchange", names.exchange("examples.news"), *args)
    else:
        args = ("--queue", names.queue("examples.rpc"), *args)
    program = start(script, *args)
    program.wait_for(ready)
    assert program.interrupt() == 0, program.describe()
    assert "interrupted" in program.stderr
    assert "Traceback" not in program.stderr, program.describe()
