"""matplotlib, headless, and writing a figure to PNG the same way for every chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display needed), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, out_png: Path, dpi: int = 120) -> Path:
    """Lay out, write (creating the folder) and close ``fig``; returns the path."""
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=dpi)
    pyplot().close(fig)
    return out_png
