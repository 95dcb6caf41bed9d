"""A throwaway etcd server for tests (and benchmarks).

Debian's ``etcd-server`` package (3.4) provides ``/usr/bin/etcd`` and
``etcd-client`` provides ``/usr/bin/etcdctl``. The server is a single member
on two free loopback ports (client and peer) with its data in a temporary
directory (on /dev/shm when there is one: etcd fsyncs every write and the
tests need no crash safety of etcd itself, only of its process). It can be
stopped (SIGTERM), killed (SIGKILL), paused and started again on the same data
directory and the same ports, so that nodes keep their ``--etcd`` URL across an
etcd restart. Note that etcd resets the remaining TTL of every lease to the
full TTL when it restarts.

Set ``LEVERET_ETCD_BIN`` / ``LEVERET_ETCDCTL_BIN`` to use other binaries.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.ports import free_ports as _free_ports

ETCD_BIN = Path(os.environ.get("LEVERET_ETCD_BIN", "/usr/bin/etcd"))
ETCDCTL_BIN = Path(os.environ.get("LEVERET_ETCDCTL_BIN", "/usr/bin/etcdctl"))
START_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0
CTL_TIMEOUT = 15.0


def etcd_unavailable() -> str | None:
    """Why a throwaway etcd cannot be started here, or None when it can."""
    for tool, package in ((ETCD_BIN, "etcd-server"), (ETCDCTL_BIN, "etcd-client")):
        if not os.access(tool, os.X_OK):
            return f"{tool} is missing: install the Debian package {package} (apt-get install {package})"
    return None


def skip_or_fail_without_etcd() -> None:
    """pytest.skip when etcd is not installed; pytest.fail in CI, where a skip would hide a broken install."""
    reason = etcd_unavailable()
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)



def _scratch_parent() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: str
    create_revision: int
    mod_revision: int
    lease: int  # 0 when the key is not attached to a lease


class EtcdServer:
    """One etcd member on loopback; ``url`` stays the same across restarts."""

    def __init__(self, base_dir: str | Path | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="leveret-etcd-", dir=base_dir or _scratch_parent()))
        self.data_dir = self.dir / "data"
        self.log_path = self.dir / "etcd.log"
        self.client_port = 0
        self.peer_port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    # -- addresses ------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def host(self) -> str:
        return "127.0.0.1"

    # -- life cycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Start (first time on fresh free ports, later on the same ports and data dir)."""
        assert not self.running(), "etcd already running"
        first = self.client_port == 0
        attempts = 3 if first else 1
        for _attempt in range(attempts):
            if first:
                self.client_port, self.peer_port = _free_ports(2)
            if self._start_once():
                return
            tail = self.log_tail()
            if not first or ("address already in use" not in tail and "bind" not in tail):
                break
        raise RuntimeError(f"etcd did not start on {self.url}; its log ends with:\n{self.log_tail()}")

    def _start_once(self) -> bool:
        self.starts += 1
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            str(ETCD_BIN),
            "--name", "leveret-test",
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.url,
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"leveret-test={peer}",
            "--initial-cluster-state", "new",
            "--initial-cluster-token", f"leveret-test-{os.getpid()}-{self.dir.name}",
            "--logger", "zap",
            "--log-outputs", "stderr",
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
        with open(self.log_path, "ab") as log:
            log.write(f"\n--- start {self.starts}: {' '.join(cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                cmd, cwd=self.dir, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self.healthy():
                return True
            time.sleep(0.05)
        self._reap(signal.SIGKILL)
        return False

    def healthy(self) -> bool:
        """True when the member answers /health with a leader (it serves reads and writes)."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1) as resp:
                return bool(json.loads(resp.read()).get("health") == "true")
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Graceful stop (SIGTERM); the data directory stays for a restart."""
        self._reap(signal.SIGTERM)

    def kill(self) -> None:
        """kill -9; the data directory stays for a restart."""
        self._reap(signal.SIGKILL)

    def pause(self) -> None:
        assert self.proc is not None and self.running()
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None and self.running()
        self.proc.send_signal(signal.SIGCONT)

    def restart(self, kill: bool = False) -> None:
        """Stop (or kill -9) and start again on the same data directory and ports."""
        if kill:
            self.kill()
        else:
            self.stop()
        self.start()

    def _reap(self, sig: signal.Signals) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGCONT)  # a paused etcd would never act on SIGTERM
        proc.send_signal(sig)
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    # -- etcdctl --------------------------------------------------------------------------
    def ctl(self, *args: str, timeout: float = CTL_TIMEOUT) -> str:
        """Run ``etcdctl --endpoints URL ARGS...`` (API v3); its stdout. RuntimeError on failure."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCDCTL")}
        env["ETCDCTL_API"] = "3"
        done = subprocess.run(
            [str(ETCDCTL_BIN), "--endpoints", self.url, "--command-timeout", f"{timeout:.0f}s", *args],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout + 5,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"etcdctl {' '.join(args)} exited with {done.returncode}: {done.stderr.decode(errors='replace')}"
            )
        return done.stdout.decode()

    def put(self, key: str, value: str) -> None:
        self.ctl("put", key, value)

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        """Every key under ``prefix`` with its value and revisions, in key order."""
        return self._get(prefix, "--prefix")

    def get(self, key: str) -> KeyValue | None:
        found = self._get(key)
        return found[0] if found else None

    def _get(self, key: str, *flags: str) -> list[KeyValue]:
        doc = json.loads(self.ctl("get", key, *flags, "-w", "json"))
        return [
            KeyValue(
                key=base64.b64decode(kv["key"]).decode(),
                value=base64.b64decode(kv.get("value", "")).decode(errors="replace"),
                create_revision=int(kv.get("create_revision", 0)),
                mod_revision=int(kv.get("mod_revision", 0)),
                lease=int(kv.get("lease", 0)),
            )
            for kv in doc.get("kvs", [])
        ]


@contextlib.contextmanager
def throwaway_etcd(base_dir: str | Path | None = None) -> Iterator[EtcdServer]:
    """A started etcd, killed and removed afterwards. Skips (fails in CI) without etcd."""
    skip_or_fail_without_etcd()
    server = EtcdServer(base_dir)
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module", name="etcd_server")
def etcd_server_fixture() -> Iterator[EtcdServer]:
    """An etcd for the tests of one module, as fixture ``etcd_server``.

    Import it into the test module (``from harness.etcd import etcd_server_fixture as
    etcd_server_fixture``, the redundant alias marks the import as used).
    """
    with throwaway_etcd() as server:
        yield server


if __name__ == "__main__":  # manual check: python -m harness.etcd
    with throwaway_etcd() as etcd:
        etcd.put("/leveret-check/a", "1")
        etcd.restart()
        print(etcd.url, etcd.get("/leveret-check/a"))
