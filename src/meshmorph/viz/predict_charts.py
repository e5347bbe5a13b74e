"""The chart of ``meshmorph simulate``: a simulated run's timeline, one row per policy (the spot
benchmarks' charts are bench/spot_charts.py)."""

from __future__ import annotations

from pathlib import Path

from meshmorph.predict.simulate import RunResult
from meshmorph.viz.figure import pyplot, save_figure

COLOURS = {"start": "#9e9e9e", "compute": "#2e7d32", "checkpoint": "#1565c0",
           "recover": "#c62828", "wait": "#ef6c00"}


def write_timeline_chart(runs: dict[str, RunResult], path: Path, title: str) -> None:
    """One row per policy: what the job did over time."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.9 * len(runs)))
    for row, run in enumerate(runs.values()):
        for start, end, kind, *_ in run.timeline:
            ax.barh(row, (end - start) / 3600, left=start / 3600, color=COLOURS[kind], height=0.6)
    ax.set_yticks(range(len(runs)), list(runs))
    ax.set(xlabel="hours since the first request", title=title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    ax.legend(handles, list(COLOURS), loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=5)
    save_figure(fig, path, dpi=110)
