"""Writing a matplotlib figure to PNG, the same way for every chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def save_figure(fig: Any, out_png: Path) -> Path:
    """Lay out, write (creating the folder) and close ``fig``; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return out_png
