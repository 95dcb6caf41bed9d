"""Rendering results: a plain-text table for humans and a JSON document for tools."""

from __future__ import annotations

import json
import os
from typing import Any

from bench.results import Metric, Outcome, RunOptions
from bench.target import Target

Outcomes = dict[tuple[str, str], Outcome]


def fmt_value(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.3f}"


def _metric_label(metric: Metric) -> str:
    hint = "" if metric.better == "higher" else ", lower is better"
    return f"{metric.name} [{metric.unit}{hint}]"


def _rows(scenarios: list[str], targets: list[Target], outcomes: Outcomes) -> list[list[str]]:
    subject, baselines = targets[0], targets[1:]
    rows: list[list[str]] = []
    for scenario in scenarios:
        # Metric rows come from whichever broker produced them (normally all).
        labels: dict[tuple[str, str], Metric] = {}
        for t in targets:
            for m in outcomes[scenario, t.name].metrics:
                labels.setdefault((m.name, m.unit), m)
        if not labels:
            rows.append([scenario, "-", *(outcomes[scenario, t.name].status for t in targets),
                         *("-" for _ in baselines)])
            continue
        for key, metric in labels.items():
            values: dict[str, float] = {}
            cells = []
            for t in targets:
                outcome = outcomes[scenario, t.name]
                found = [m.value for m in outcome.metrics if (m.name, m.unit) == key]
                if found:
                    values[t.name] = found[0]
                    cells.append(fmt_value(found[0]))
                else:
                    cells.append(outcome.status)
            ratios = []
            for b in baselines:
                if subject.name in values and values.get(b.name):
                    ratios.append(f"{values[subject.name] / values[b.name]:.2f}x")
                else:
                    ratios.append("-")
            rows.append([scenario, _metric_label(metric), *cells, *ratios])
    return rows


def render_table(scenarios: list[str], targets: list[Target], outcomes: Outcomes, opts: RunOptions) -> str:
    subject, baselines = targets[0], targets[1:]
    header = ["scenario", "metric", *(t.name for t in targets), *(f"{subject.name}/{b.name}" for b in baselines)]
    rows = [header, *_rows(scenarios, targets, outcomes)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [
        f"subject: {subject.name}; baselines: {', '.join(b.name for b in baselines) or '(none)'}; "
        f"warm-up {opts.warmup:g} s, measured {opts.duration:g} s per scenario",
        f"note: the broker(s) and this client share the machine ({os.cpu_count()} CPUs); "
        "throughput scenarios use 2 client processes (producer, consumer).",
        "",
    ]
    for i, row in enumerate(rows):
        cells = [c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    problems = [
        f"  {scenario} on {name}: {o.status}: {o.reason}"
        for (scenario, name), o in outcomes.items()
        if o.status != "ok"
    ]
    cleanup = [
        f"  {scenario} on {name}: cleanup: {o.notes['cleanup_problems']}"
        for (scenario, name), o in outcomes.items()
        if o.notes.get("cleanup_problems")
    ]
    routing = [
        f"  {scenario} on {name}: ROUTING: {o.notes['routing_problem']}"
        for (scenario, name), o in outcomes.items()
        if o.notes.get("routing_problem")
    ]
    warnings = [
        f"  {scenario} on {name}: {o.notes['warning']}"
        for (scenario, name), o in outcomes.items()
        if o.notes.get("warning")
    ]
    if problems or cleanup or routing or warnings:
        lines += ["", "not measured / problems:", *problems, *routing, *warnings, *cleanup]
    cpu_lines = [_cpu_line(scenario, name, cpu) for (scenario, name), o in outcomes.items()
                 if isinstance(cpu := o.notes.get("cpu"), dict)]
    if cpu_lines:
        lines += ["", f"CPU use in the measured window (CPUs busy, of {os.cpu_count()}):", *cpu_lines]
    return "\n".join(lines)


# Above this many CPUs used by unrelated processes, a figure is not trustworthy.
NOISY_OTHER_CPU = 0.15


def _cpu_line(scenario: str, broker: str, cpu: dict[str, float | None]) -> str:
    def show(v: float | None) -> str:
        return "?" if v is None else f"{v:.2f}"

    line = (f"  {scenario} on {broker}: broker {show(cpu['broker'])}, client {show(cpu['client'])}, "
            f"kernel {show(cpu.get('kernel'))}, other processes {show(cpu['other'])}")
    other = cpu.get("other")
    if other is not None and other > NOISY_OTHER_CPU:
        line += "  <- other processes were busy: figure unreliable, rerun"
    return line


def to_json(scenarios: list[str], targets: list[Target], outcomes: Outcomes, opts: RunOptions) -> dict[str, Any]:
    from bench.loop import loop_name

    subject = targets[0]
    results = []
    for scenario in scenarios:
        for t in targets:
            o = outcomes[scenario, t.name]
            results.append({
                "scenario": scenario,
                "broker": t.name,
                "status": o.status,
                "reason": o.reason,
                "metrics": [{"name": m.name, "unit": m.unit, "value": m.value, "better": m.better}
                            for m in o.metrics],
                "notes": o.notes,
            })
    ratios = []
    for scenario in scenarios:
        mine = {(m.name, m.unit): m.value for m in outcomes[scenario, subject.name].metrics}
        for b in targets[1:]:
            for m in outcomes[scenario, b.name].metrics:
                if (m.name, m.unit) in mine and m.value:
                    ratios.append({"scenario": scenario, "metric": m.name, "unit": m.unit, "baseline": b.name,
                                   "ratio": mine[m.name, m.unit] / m.value})
    return {
        "meta": {
            "subject": subject.name,
            "baselines": [b.name for b in targets[1:]],
            "urls": {t.name: f"amqp://{t.url.host}:{t.url.port}" for t in targets},
            "duration_s": opts.duration,
            "warmup_s": opts.warmup,
            "cpus": os.cpu_count(),
            "event_loop": loop_name(),
            "note": "broker(s) and client share this machine",
        },
        "results": results,
        "ratios": ratios,
    }


def write_json(path: str, doc: dict[str, Any]) -> None:
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=2, default=str)
        fh.write("\n")
