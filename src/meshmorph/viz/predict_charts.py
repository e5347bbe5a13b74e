"""Charts of the predict package: a simulated run's timeline, and fitted vs published revocations."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from meshmorph.predict.simulate import RunResult

COLOURS = {"start": "#9e9e9e", "compute": "#2e7d32", "checkpoint": "#1565c0",
           "recover": "#c62828", "wait": "#ef6c00"}


def write_timeline_chart(runs: dict[str, RunResult], path: Path, title: str) -> None:
    """One row per strategy: what the job did over time, and the nodes it ran on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.9 * len(runs)))
    for row, run in enumerate(runs.values()):
        for start, end, kind, _ in run.timeline:
            ax.barh(row, (end - start) / 3600, left=start / 3600, color=COLOURS[kind], height=0.6)
    ax.set_yticks(range(len(runs)), list(runs))
    ax.set_xlabel("hours since the first request")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    ax.legend(handles, list(COLOURS), loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=5)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_hazard_chart(path: Path) -> None:
    """Fitted CDF of VM lifetimes vs the published one (CM-DARE) and ICAC 2019's Feb 2019 VMs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from meshmorph.predict.measurements import measurements
    from meshmorph.predict.revocation import fitted_hazards, kaplan_meier

    data, hazards = measurements(), fitted_hazards()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), sharey=True)
    hours = np.linspace(0, 24, 241)
    for ax, name in zip(axes, ("K80", "P100", "V100"), strict=True):
        hazard = hazards[name.lower()]
        ax.plot(hours, [1 - math.exp(-hazard.cumulative(h)) for h in hours], label="fitted hazard")
        counts = data["revocations_by_hours_since_start"][name]
        published = np.concatenate([[0.0], np.cumsum(counts) / data["instances_launched"][name]])
        ax.step(np.arange(25), published, where="post", label="CM-DARE published (fit data)")
        held = [(age, not capped) for age, capped in data["icac_feb2019_lifetimes_h"][name]]
        ages, survival = kaplan_meier(held)
        ax.step(np.append(ages, 24), np.append(1 - survival, 1 - survival[-1]), where="post",
                linestyle="--", label="ICAC Feb 2019 (held out)")
        if name == "K80":
            k80 = [(age, not censored) for age, censored in data["k80_lifetimes_h"]]
            ages, survival = kaplan_meier(k80)
            ax.step(np.append(ages, 24), np.append(1 - survival, 1 - survival[-1]), where="post",
                    linestyle=":", label="128 K80 lifetimes")
        ax.set_title(f"{name} preemptible (GCE)")
        ax.set_xlabel("hours since start")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("fraction revoked (24 h cap not counted)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
