"""What the broker's wheel holds, and what ``make run``'s bootstrap level installs (a venv of its own, never
the shared .venv): a node's dependencies and nothing of the test or Spark toolchains."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

from harness.node import REPO_ROOT

NOT_SHIPPED = {"bench", "compat_tests", "examples", "tests", "harness"}


def _wheel(tmp_path: Path, project: Path) -> zipfile.ZipFile:
    out = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--disable-pip-version-check",
                            "-w", str(out), str(project)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = out.glob("*.whl")
    return zipfile.ZipFile(wheel)


def test_broker_wheel_holds_the_node_only(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path, REPO_ROOT)
    names = wheel.namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    # Every package at the repository's root (a new front end too), and none of the test or example code.
    packages = {p.parent.name for p in REPO_ROOT.glob("*/__init__.py")} - NOT_SHIPPED
    assert {"core", "amqp_frontend", "coordination", "persistence", "spark", "leveret"} <= packages
    assert top == packages, top ^ packages
    # What the node reads at run time comes with it.
    assert "persistence/migrations/sqlite/001_initial.sql" in names
    assert any(n.startswith("leveret/http/console/") for n in names)
    assert "leveret/py.typed" in names
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    requires = [line for line in wheel.read(metadata).decode().splitlines() if line.startswith("Requires-Dist:")]
    assert any("leveret-client" in r for r in requires), requires


def test_client_wheel_holds_the_client_only(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path, REPO_ROOT / "client")
    names = wheel.namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"leveret_client"}, top
    assert {"leveret_client/py.typed", "leveret_client/proto/leveret_pb2.py",
            "leveret_client/proto/leveret_pb2.pyi", "leveret_client/proto/leveret_pb2_grpc.py"} <= set(names)
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    requires = sorted(line.split(":", 1)[1].split(">")[0].split("=")[0].strip()
                      for line in wheel.read(metadata).decode().splitlines() if line.startswith("Requires-Dist:"))
    assert requires == ["grpcio", "protobuf"]


def test_run_level_bootstrap_installs_a_node_and_nothing_else(tmp_path: Path) -> None:
    venv = tmp_path / "venv-run"
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "VENV": str(venv),
           "HOME": str(Path.home())}
    first = subprocess.run([str(REPO_ROOT / "scripts" / "bootstrap.sh"), "run"], env=env, capture_output=True,
                           text=True, timeout=900)
    assert first.returncode == 0, first.stdout + first.stderr
    freeze = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=freeze",
                             "--disable-pip-version-check"], capture_output=True, text=True, check=True).stdout
    installed = {line.split("==")[0].lower() for line in freeze.split()}
    assert {"leveret", "leveret-client", "pamqp", "grpcio", "aiohttp"} <= installed
    assert not installed & {"pytest", "playwright", "pyspark", "matplotlib", "pika", "mypy", "ruff"}, installed
    serve = subprocess.run([str(venv / "bin" / "leveret"), "serve", "--help"], capture_output=True, text=True)
    assert serve.returncode == 0 and "--data-dir" in serve.stdout

    # Installed: the next call is quiet; the stamp is keyed by what decides the install, so a changed
    # pyproject (a new hash) installs again.
    again = subprocess.run([str(REPO_ROOT / "scripts" / "bootstrap.sh"), "run"], env=env, capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 0 and again.stdout == "" and again.stderr == ""
    digest = hashlib.sha1(b"".join((REPO_ROOT / f).read_bytes() for f in (
        "pyproject.toml", "client/pyproject.toml", "scripts/bootstrap.sh"))).hexdigest()[:12]
    assert [p.name for p in venv.glob(".installed-*")] == [f".installed-run-{digest}"]
