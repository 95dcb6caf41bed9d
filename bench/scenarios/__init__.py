"""Scenario registry: name -> callable(target, options) -> (metrics, notes)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from bench.results import Metric, RunOptions
from bench.scenarios import confirm_latency, idle_memory, latency
from bench.scenarios.throughput import PLANS, run_plan
from bench.target import Target

ScenarioFn = Callable[[Target, RunOptions], tuple[list[Metric], dict[str, object]]]


def _persistent(target: Target, opts: RunOptions) -> tuple[list[Metric], dict[str, object]]:
    metrics, notes = run_plan(PLANS["persistent"], target, opts)
    lone_metrics, lone_notes = confirm_latency.run(target, opts)
    return metrics + lone_metrics, {**notes, **lone_notes}


SCENARIOS: dict[str, ScenarioFn] = {
    "transient": partial(run_plan, PLANS["transient"]),
    "latency": latency.run,
    "fanout": partial(run_plan, PLANS["fanout"]),
    "topic": partial(run_plan, PLANS["topic"]),
    # Before the persistent ones: their large in-flight bodies leave the broker
    # releasing memory for a while, which would blur the RSS delta.
    "idle_conn_memory": idle_memory.run,
    "persistent": _persistent,
    "persistent_1mib": partial(run_plan, PLANS["persistent_1mib"]),
}
