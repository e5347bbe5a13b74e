"""Memory per pipeline stage: stacked bars of what holds a GPU's memory, against its budget."""

from __future__ import annotations

from pathlib import Path

from meshmorph.cost.estimate import GIB, Estimate
from meshmorph.viz.figure import pyplot, save_figure

PART_COLOURS = {
    "params": "#4c78a8",
    "grads": "#72b7b2",
    "optimizer": "#f28e2b",
    "activations": "#59a14f",
    "buffers": "#b07aa1",
    "reserved": "#bab0ac",
}
"""Stacking order, bottom first, and colour of each part of a rank's memory."""


def write_memory_chart(estimate: Estimate, out_png: Path, *,
                       title: str = "peak memory per GPU by pipeline stage") -> Path:
    """Draw one stacked bar per pipeline stage (GiB) with each stage's device memory as a line."""
    if not estimate.memory:
        raise ValueError("the estimate holds no stage memory")
    stages = range(len(estimate.memory))
    fig, ax = pyplot().subplots(figsize=(max(5.0, 0.6 * len(estimate.memory) + 3), 4.5))
    bottom = [0.0] * len(estimate.memory)
    for part, colour in PART_COLOURS.items():
        heights = [getattr(m, part) / GIB for m in estimate.memory]
        ax.bar(stages, heights, bottom=bottom, color=colour, label=part, width=0.7)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    budgets = [b / GIB for b in estimate.memory_budget_bytes]
    # one step line across the stages: each bar's own device memory
    ax.step([s - 0.5 for s in stages] + [len(budgets) - 0.5], budgets + budgets[-1:], where="post",
            color="#e15759", linewidth=1.8, label="device memory")
    for stage, (total, budget) in enumerate(zip(bottom, budgets, strict=True)):
        if total > budget:
            ax.text(stage, total, "over", ha="center", va="bottom", color="#e15759", fontsize=8)
    ax.set_xticks(list(stages), [str(s) for s in stages])
    ax.set(xlabel="pipeline stage", ylabel="GiB per GPU", title=title,
           ylim=(0, max(max(bottom), max(budgets)) * 1.12))
    handles, labels = ax.get_legend_handles_labels()
    # legend top to bottom in the order the parts are stacked on the bars, the budget line first
    order = [labels.index("device memory"), *reversed(range(len(PART_COLOURS)))]
    ax.legend([handles[i] for i in order], [labels[i] for i in order], fontsize=8,
              loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, out_png)
