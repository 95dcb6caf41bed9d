"""Parent-side management of worker processes: start, handshake, sampling waits, teardown."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection as Pipe
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import Any

# spawn, not fork: children start with no inherited event loop or sockets.
CTX = multiprocessing.get_context("spawn")


class WorkerFailed(Exception):
    pass


class Workers:
    def __init__(self) -> None:
        self.procs: list[BaseProcess] = []
        self.pipes: list[Pipe] = []
        self.results: list[dict[str, Any] | None] = []

    def start(self, target: Callable[..., None], *args: Any) -> int:
        parent, child = CTX.Pipe()
        proc = CTX.Process(target=target, args=(*args, child), daemon=True)
        proc.start()
        child.close()
        self.procs.append(proc)
        self.pipes.append(parent)
        self.results.append(None)
        return len(self.procs) - 1

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for pipe in self.pipes:
            msg = self._recv(pipe, deadline, "ready")
            if msg[0] != "ready":
                raise WorkerFailed(str(msg[1]))

    def go(self, start_at: float, end_at: float) -> None:
        for pipe in self.pipes:
            pipe.send(("go", start_at, end_at))

    def sleep_until(self, deadline: float) -> None:
        """Sleep, but fail fast if any worker reports (only errors arrive early)."""
        while (left := deadline - time.monotonic()) > 0:
            ready = wait(list(self.pipes), timeout=left)
            for pipe in ready:
                assert isinstance(pipe, Pipe)
                msg = pipe.recv()
                if msg[0] == "error":
                    raise WorkerFailed(str(msg[1]))
                self.results[self.pipes.index(pipe)] = msg[1]

    def collect(self, timeout: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        out: list[dict[str, Any]] = []
        for i, pipe in enumerate(self.pipes):
            result = self.results[i]
            if result is None:
                msg = self._recv(pipe, deadline, "done")
                if msg[0] != "done":
                    raise WorkerFailed(str(msg[1]))
                result = msg[1]
            out.append(result)
        return out

    def stop(self) -> None:
        """Reap every worker; terminate (then kill) those that overstay."""
        for proc in self.procs:
            proc.join(timeout=3)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for pipe in self.pipes:
            pipe.close()

    @staticmethod
    def _recv(pipe: Pipe, deadline: float, what: str) -> Sequence[Any]:
        if not pipe.poll(max(0.0, deadline - time.monotonic())):
            raise WorkerFailed(f"timed out waiting for worker {what}")
        try:
            msg: Sequence[Any] = pipe.recv()
        except EOFError as exc:
            raise WorkerFailed(f"worker exited before {what}") from exc
        return msg
