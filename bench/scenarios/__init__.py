"""Scenario registry: name -> callable(target, options) -> (metrics, notes)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from bench.results import Metric, RunOptions
from bench.scenarios import bindings, confirm_latency, flood, idle_memory, latency, stream
from bench.scenarios.throughput import PLANS, run_plan
from bench.target import Target

ScenarioFn = Callable[[Target, RunOptions], tuple[list[Metric], dict[str, object]]]


def _persistent(target: Target, opts: RunOptions) -> tuple[list[Metric], dict[str, object]]:
    metrics, notes = run_plan(PLANS["persistent"], target, opts)
    lone_metrics, lone_notes = confirm_latency.run(target, opts)
    return metrics + lone_metrics, {**notes, **lone_notes}


# Run order.  idle_conn_memory goes first: after a throughput scenario the
# broker's allocator holds freed memory that new connections reuse, so the
# RSS delta would read near zero (seen with a Python broker) or go negative.
SCENARIOS: dict[str, ScenarioFn] = {
    "idle_conn_memory": idle_memory.run,
    "transient": partial(run_plan, PLANS["transient"]),
    "latency": latency.run,
    "fanout": partial(run_plan, PLANS["fanout"]),
    "topic": partial(run_plan, PLANS["topic"]),
    "flood": partial(flood.run, "flood"),
    "flood_fanout": partial(flood.run, "flood_fanout"),
    "flood_topic": partial(flood.run, "flood_topic"),
    "flood_pair": partial(flood.run, "flood_pair"),
    "persistent": _persistent,
    "persistent_1mib": partial(run_plan, PLANS["persistent_1mib"]),
    "stream": stream.run,
    # Topic routing with 100 / 10,000 / 100,000 bindings (issue 25): OPT_IN.
    "bindings_100": partial(bindings.run, "bindings_100"),
    "bindings_10k": partial(bindings.run, "bindings_10k"),
    "bindings_100k": partial(bindings.run, "bindings_100k"),
}

# Run only when named with --scenario: binding 100,000 routes and tearing them down takes
# minutes against a broker that routes by scanning, too long for a default run.
OPT_IN = frozenset({"bindings_100", "bindings_10k", "bindings_100k"})
