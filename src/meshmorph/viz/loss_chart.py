"""The loss chart of a run: training loss against step, from ``metrics.jsonl``."""

from __future__ import annotations

from pathlib import Path

from meshmorph.viz.figure import pyplot, save_figure


def write_loss_chart(records: list[dict], out_png: Path, *, title: str = "training loss") -> Path:
    """Draw loss vs step (one point per record with ``step`` and ``loss``) into ``out_png``."""
    steps = [r["step"] for r in records]
    losses = [r["loss"] for r in records]
    fig, ax = pyplot().subplots(figsize=(7, 4))
    ax.plot(steps, losses, marker="." if len(steps) < 60 else None, linewidth=1.5)
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.grid(alpha=0.3)
    return save_figure(fig, out_png)
