"""The chart of ``meshmorph validate``: predicted against measured step time, one point a plan."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from meshmorph.viz.figure import pyplot, save_figure


def chart(rows: Sequence[dict[str, object]], path: Path, title: str) -> None:
    """Predicted (with its range) against measured step time, one point per plan, y = x line."""
    meas = [float(r["measured_step_s"]) for r in rows]  # type: ignore[arg-type]
    pred = [float(r["predicted_step_s"]) for r in rows]  # type: ignore[arg-type]
    low = [p - float(r["predicted_low_s"]) for p, r in zip(pred, rows, strict=True)]  # type: ignore[arg-type]
    high = [float(r["predicted_high_s"]) - p for p, r in zip(pred, rows, strict=True)]  # type: ignore[arg-type]
    fig, ax = pyplot().subplots(figsize=(6.4, 5.2))
    ax.errorbar(meas, pred, yerr=[low, high], fmt="o", capsize=3, label="plans")
    top = max(meas + pred) * 1.1
    ax.plot([0, top], [0, top], "k--", lw=0.8, label="predicted = measured")
    ax.plot([0, top], [0, top * 1.1], ":", color="grey", lw=0.8, label="±10%")
    ax.plot([0, top], [0, top * 0.9], ":", color="grey", lw=0.8)
    for r, x, y in zip(rows, meas, pred, strict=True):
        ax.annotate(str(r["name"]), (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set(xlim=(0, top), ylim=(0, top), xlabel="measured step time (s)",
           ylabel="predicted step time (s)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    save_figure(fig, path)
