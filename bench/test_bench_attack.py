"""``python -m bench.attack`` runs its attacks against a node of its own and prints one row each."""

from __future__ import annotations

import pytest

from bench import attack

pytestmark = pytest.mark.timeout(300)


def test_every_attack_runs_and_reports_the_bystander_and_the_rss(capsys: pytest.CaptureFixture[str]) -> None:
    assert attack.main(["--seconds", "0.5"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "(#" in line]
    assert len(rows) == len(attack.ATTACKS), out
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert not cells[1].startswith("attack failed"), line
        worst, trips, rss, peak = float(cells[2]), int(cells[3]), float(cells[4]), float(cells[5])
        assert trips > 0 and worst < 30_000, line  # the bystander went on through every attack
        assert 0 < rss <= peak, line
