"""Celery (pyamqp transport, rpc:// result backend) against the broker.

One Celery worker subprocess serves the whole module on its own queue; the
test process acts as the Celery client with the very same app module.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pika
import pika.exceptions
import pytest

celery = pytest.importorskip("celery")

pytestmark = pytest.mark.timeout(30)

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKER_START_TIMEOUT = 20.0

APP_TEMPLATE = '''
from celery import Celery

app = Celery({name!r}, broker={broker!r}, backend="rpc://")
app.conf.update(
    task_default_queue={queue!r},
    task_default_exchange={queue!r},
    task_default_routing_key={queue!r},
    worker_enable_remote_control=False,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    broker_heartbeat=0,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
)


@app.task
def add(x, y):
    return x + y


@app.task
def total(values):
    return sum(values)


@app.task(bind=True, max_retries=2)
def flaky(self):
    """Fails twice, then succeeds: returns how many retries it took."""
    if self.request.retries < 2:
        raise self.retry(exc=RuntimeError("not yet"), countdown=0.2, max_retries=2)
    return self.request.retries


@app.task(bind=True, max_retries=1)
def always_retry(self):
    raise self.retry(exc=KeyError("gave up"), countdown=0.1, max_retries=1)


@app.task
def boom(message):
    raise ValueError(message)
'''


def _celery_bin() -> str:
    candidate = REPO_ROOT / ".venv" / "bin" / "celery"
    if candidate.exists():
        return str(candidate)
    return str(Path(sys.executable).parent / "celery")


def _stop_worker(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)  # warm shutdown
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def _delete_entities(url: str, queue: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        ch.queue_delete(queue)
        ch.exchange_delete(queue)
    except pika.exceptions.AMQPError:
        pass
    finally:
        if conn.is_open:
            conn.close()


@pytest.fixture(scope="module")
def celery_app(amqp_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleType]:
    token = uuid.uuid4().hex[:12]
    module_name = f"compat_celery_app_{token}"
    queue = f"compat.celery.{token}"
    workdir = tmp_path_factory.mktemp("celery")
    broker = amqp_url.replace("amqp://", "pyamqp://", 1)
    (workdir / f"{module_name}.py").write_text(
        textwrap.dedent(APP_TEMPLATE.format(name=module_name, broker=broker, queue=queue))
    )
    log_path = workdir / "worker.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(workdir), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [
        _celery_bin(), "-A", module_name, "worker",
        "--pool=solo", "--concurrency=1",
        "--without-gossip", "--without-mingle", "--without-heartbeat",
        "-Q", queue,
        "-n", f"compat-{token}@%h",
        "--loglevel=INFO",
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
    sys.path.insert(0, str(workdir))
    module: ModuleType | None = None
    try:
        module = importlib.import_module(module_name)
        # wait for the worker to consume from its queue
        deadline = time.monotonic() + WORKER_START_TIMEOUT
        while True:
            if proc.poll() is not None:
                pytest.fail(f"celery worker exited with {proc.returncode}:\n{log_path.read_text(errors='replace')}",
                            pytrace=False)
            if "ready." in log_path.read_text(errors="replace"):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"celery worker not ready:\n{log_path.read_text(errors='replace')}", pytrace=False)
            time.sleep(0.1)
        yield module
    finally:
        if module is not None:
            module.app.close()
        _stop_worker(proc)
        sys.path.remove(str(workdir))
        sys.modules.pop(module_name, None)
        _delete_entities(amqp_url, queue)
        if proc.returncode not in (0, -signal.SIGTERM):
            sys.stderr.write(f"\ncelery worker exited with {proc.returncode}; log tail:\n"
                             f"{log_path.read_text(errors='replace')[-5000:]}\n")


def test_task_returns_result(celery_app: ModuleType) -> None:
    result = celery_app.add.delay(2, 3)
    assert result.get(timeout=10) == 5
    assert result.successful()
    assert result.state == "SUCCESS"


def test_many_tasks(celery_app: ModuleType) -> None:
    results = [celery_app.add.delay(i, i) for i in range(10)]
    assert [r.get(timeout=10) for r in results] == [2 * i for i in range(10)]


def test_task_retries_then_succeeds(celery_app: ModuleType) -> None:
    started = time.monotonic()
    result = celery_app.flaky.delay()
    assert result.get(timeout=10) == 2  # third try, after two retries
    assert time.monotonic() - started >= 0.4  # two countdowns of 0.2 s


def test_task_retries_exhausted_raises(celery_app: ModuleType) -> None:
    result = celery_app.always_retry.delay()
    with pytest.raises(KeyError, match="gave up"):
        result.get(timeout=10)
    assert result.state == "FAILURE"


def test_chain(celery_app: ModuleType) -> None:
    workflow = celery.chain(celery_app.add.s(1, 2), celery_app.add.s(3), celery_app.add.s(4))
    assert workflow.apply_async().get(timeout=10) == 10


def test_group(celery_app: ModuleType) -> None:
    result = celery.group(celery_app.add.s(i, 10) for i in range(5)).apply_async()
    assert result.get(timeout=10) == [10, 11, 12, 13, 14]


def test_chain_of_group_results(celery_app: ModuleType) -> None:
    parts = celery.group(celery_app.add.s(i, i) for i in range(4)).apply_async().get(timeout=10)
    assert celery_app.total.delay(parts).get(timeout=10) == 12


def test_failure_propagates(celery_app: ModuleType) -> None:
    result = celery_app.boom.delay("kaput")
    with pytest.raises(ValueError, match="kaput"):
        result.get(timeout=10)
    assert result.failed()
    assert isinstance(result.result, ValueError)
