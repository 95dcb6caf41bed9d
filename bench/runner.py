"""Runs scenarios against targets, turning every failure into an Outcome instead of a crash."""

from __future__ import annotations

import asyncio
import sys
import time

from bench import loop
from bench.connection import Connection
from bench.results import Outcome, RunOptions, Skipped
from bench.scenarios import SCENARIOS
from bench.target import Target

# Pause between runs so one broker's teardown/GC doesn't land in the next measurement.
SETTLE_BETWEEN_RUNS = 1.0


async def _probe(target: Target) -> None:
    conn = await Connection.open(target.url, timeout=5.0)
    await conn.close()


def probe(target: Target) -> str | None:
    """None if the broker accepts an AMQP handshake, else why not."""
    try:
        loop.run(asyncio.wait_for(_probe(target), 10.0))
    except Exception as exc:
        return f"unreachable: {type(exc).__name__}: {exc}".rstrip(": ")
    return None


def run_one(scenario: str, target: Target, opts: RunOptions) -> Outcome:
    try:
        metrics, notes = SCENARIOS[scenario](target, opts)
    except Skipped as exc:
        return Outcome("skipped", reason=str(exc))
    except Exception as exc:
        first_line = (str(exc).splitlines() or [""])[0]
        return Outcome("error", reason=f"{type(exc).__name__}: {first_line}")
    return Outcome("ok", metrics, notes=notes)


def _interference(outcome: Outcome) -> float:
    cpu = outcome.notes.get("cpu")
    other = cpu.get("other") if isinstance(cpu, dict) else None
    return float(other) if other is not None else 0.0


def pick(runs: list[Outcome]) -> Outcome:
    """Of repeated runs keep the one least disturbed by other processes (first if unknown)."""
    ok = [r for r in runs if r.status == "ok"]
    if not ok:
        return runs[-1]
    best = min(ok, key=_interference)
    if len(runs) > 1:
        best.notes["runs"] = [
            {"status": r.status, "reason": r.reason, "cpu": r.notes.get("cpu"),
             "metrics": {f"{m.name} [{m.unit}]": m.value for m in r.metrics}}
            for r in runs
        ]
    return best


def run_all(
    scenarios: list[str], targets: list[Target], opts: RunOptions, repeat: int = 1
) -> dict[tuple[str, str], Outcome]:
    unreachable = {t.name: why for t in targets if (why := probe(t)) is not None}
    outcomes: dict[tuple[str, str], Outcome] = {}
    for scenario in scenarios:
        runs: dict[str, list[Outcome]] = {t.name: [] for t in targets}
        # Brokers alternate within each repetition so slow drifts hit them alike.
        for rep in range(repeat):
            for target in targets:
                if target.name in unreachable:
                    continue
                if runs[target.name] and runs[target.name][-1].status == "skipped":
                    continue
                print(f"  running {scenario} on {target.name} ({rep + 1}/{repeat}) ...", file=sys.stderr, flush=True)
                started = time.monotonic()
                outcome = run_one(scenario, target, opts)
                outcome.notes["seconds"] = round(time.monotonic() - started, 1)
                runs[target.name].append(outcome)
                time.sleep(SETTLE_BETWEEN_RUNS)
        for target in targets:
            if target.name in unreachable:
                outcomes[scenario, target.name] = Outcome("skipped", reason=unreachable[target.name])
            else:
                outcomes[scenario, target.name] = pick(runs[target.name])
    return outcomes
