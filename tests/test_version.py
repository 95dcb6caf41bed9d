"""One version: leveret/__init__.py's, which pyproject reads, the client package carries and the broker
requires exactly; the CLI and CHANGELOG name it."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import leveret
import leveret_client

ROOT = Path(__file__).resolve().parent.parent


def test_one_version_everywhere() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", leveret.__version__)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and project["dynamic"] == ["version"]
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "leveret.__version__"}
    client = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())
    assert client["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "leveret_client.__version__"}
    assert leveret_client.__version__ == leveret.__version__
    assert f"leveret-client=={leveret.__version__}" in project["dependencies"]


def test_cli_prints_it() -> None:
    out = subprocess.run([sys.executable, "-m", "leveret", "--version"], capture_output=True, text=True, cwd=ROOT)
    assert leveret.__version__ in out.stdout + out.stderr
