"""The retention report as a chart a person can read (matplotlib, Agg: no display needed).

Two panels side by side, one row per queue, named on the axis: messages
(kept, removed and archived, removed and not archived) and bytes (kept,
removed); a legend, units on the axes, and the run's time and id in the title.
The size in pixels follows from the number of queues (``chart_size``), so a
report of 3 queues and one of 300 both stay legible.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

WIDTH_IN = 12.0
DPI = 100
ROW_IN = 0.32  # height per queue
FRAME_IN = 1.6  # title, axis labels and legend

KEPT = "#2e9f43"
REMOVED = "#d62728"
ARCHIVED = "#1f77b4"


def chart_size(queues: int) -> tuple[int, int]:
    """(width, height) in pixels of the chart of a report with ``queues`` queues."""
    return int(WIDTH_IN * DPI), int(round(_height_in(queues) * DPI))


def _height_in(queues: int) -> float:
    return FRAME_IN + ROW_IN * max(queues, 3)


def _label(q: dict[str, Any]) -> str:
    name = q["queue"] if q["vhost"] == "/" else f"{q['vhost']}/{q['queue']}"
    return name + (" (fenced)" if q.get("fenced") else "")


def _unit(largest: int) -> tuple[str, int]:
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if largest >= size:
            return unit, size
    return "B", 1


def render(path: str, report: dict[str, Any]) -> None:
    """Write the chart of ``report`` (the job's JSON report) to ``path`` as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    queues = list(reversed(report["queues"]))  # the first queue at the top, as in the table
    labels = [_label(q) for q in queues]
    rows = range(len(queues))
    kept = [q["kept_messages"] for q in queues]
    archived = [q["archived_messages"] for q in queues]
    removed_only = [max(0, q["removed_messages"] - q["archived_messages"]) for q in queues]
    unit, size = _unit(max((q["kept_bytes"] + q["removed_bytes"] for q in queues), default=0))
    kept_b = [q["kept_bytes"] / size for q in queues]
    removed_b = [q["removed_bytes"] / size for q in queues]

    fig, (by_count, by_size) = plt.subplots(1, 2, figsize=(WIDTH_IN, _height_in(len(queues))), dpi=DPI,
                                            sharey=True)
    try:
        by_count.barh(rows, kept, color=KEPT, label="kept")
        by_count.barh(rows, archived, left=kept, color=ARCHIVED, label="removed, archived")
        by_count.barh(rows, removed_only, left=[k + a for k, a in zip(kept, archived, strict=True)], color=REMOVED,
                      label="removed")
        by_count.set_xlabel("messages")
        by_count.set_yticks(list(rows), labels)
        by_count.set_title("Messages per queue")
        by_size.barh(rows, kept_b, color=KEPT, label="kept")
        by_size.barh(rows, removed_b, left=kept_b, color=REMOVED, label="removed")
        by_size.set_xlabel(f"bytes ({unit})")
        by_size.set_title("Bytes per queue")
        for ax in (by_count, by_size):
            ax.grid(axis="x", alpha=0.3)
            ax.set_axisbelow(True)
        when = dt.datetime.fromtimestamp(float(report["now"]), tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        mode = " (dry run)" if report.get("dry_run") else " (marked only)" if report.get("mark_only") else ""
        totals = report["totals"]
        fig.suptitle(f"Leveret retention run {report['run_id']} at {when}{mode}: "
                     f"{totals['removed_messages']} of {totals['messages_before']} messages removed, "
                     f"{totals['archived_messages']} archived", fontsize=11)
        handles, names = by_count.get_legend_handles_labels()
        fig.legend(handles, names, loc="lower center", ncol=3, frameon=False)
        fig.tight_layout(rect=(0, 0.06, 1, 0.95))
        fig.savefig(path, format="png", dpi=DPI)
    finally:
        plt.close(fig)
