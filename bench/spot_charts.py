"""The charts of the spot benchmarks (bench/cmdare_fit.py, bench/spot_replay.py): the fitted
hazards and lifetimes beside their data, the capacity probes, and a fit against its replay."""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from meshmorph.predict.availability import period_runs
from meshmorph.predict.measurements import measurements
from meshmorph.predict.revocation import fitted_hazards, kaplan_meier
from meshmorph.predict.spot_data import availability_set, lifetime_set
from meshmorph.predict.traces import packaged_trace
from meshmorph.viz.figure import pyplot, save_figure


def write_hazard_chart(path: Path) -> None:
    """Fitted CDF of VM lifetimes vs the published one (CM-DARE) and ICAC 2019's Feb 2019 VMs."""
    data, hazards = measurements(), fitted_hazards()
    fig, axes = pyplot().subplots(1, 3, figsize=(13, 4), sharey=True)
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
    save_figure(fig, path, dpi=110)


def write_replay_chart(report: dict, path: Path) -> None:
    """Per zone: job time and cost, P10-P90 with the P50 marked, from the fit and from the
    replay; in sample and held out."""
    fig, axes = pyplot().subplots(2, 2, figsize=(13, 8), sharey="row")
    for col, part in enumerate(("in_sample", "held_out")):
        zones = report[part]["zones"]
        names = list(zones) + ["multi-zone"]
        entries = list(zones.values()) + [report[part]["multi_zone"]]
        for row, (key, unit) in enumerate((("time_h", "job time, h"), ("cost_usd", "cost, $"))):
            ax = axes[row][col]
            for shift, side, colour in ((-0.15, "fit", "#1565c0"), (0.15, "replay", "#ef6c00")):
                x = np.arange(len(names)) + shift
                p50 = [e[side][f"{key}_p50"] for e in entries]
                low = [p - e[side][f"{key}_p10"] for p, e in zip(p50, entries, strict=True)]
                high = [e[side][f"{key}_p90"] - p for p, e in zip(p50, entries, strict=True)]
                ax.errorbar(x, p50, yerr=[low, high], fmt="o", color=colour, capsize=2,
                            label=f"{side} (P10-P50-P90)")
            for i, e in enumerate(entries):
                ax.annotate(f"{e[f'{key}_p50_error']:+.0%}", (i, ax.get_ylim()[1]),
                            fontsize=6, ha="center", va="top",
                            color="black" if abs(e[f"{key}_p50_error"]) <= 0.15 else "red")
            ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=7)
            ax.set_ylabel(unit)
            ax.set_yscale("log")
        axes[0][col].set_title(f"{part.replace('_', ' ')}: fit vs replay (P50 error on top)",
                               fontsize=9)
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path, dpi=110)


FIT_ZONES = ("us-central1-a", "us-east4-a", "us-west1-b", "asia-southeast1-b")
"""GCP H100 zones drawn in the fit chart (the most and least available, two between)."""


def _capacity_panels(axes: Any) -> None:
    """Empirical survival of the probe runs (Kaplan-Meier) against the fitted run lengths."""
    trace = packaged_trace("h100-gcp-2025-10")
    data = availability_set("h100-gcp-2025-10")
    for ax, up, title in ((axes[0], True, "capacity lasts (up periods)"),
                          (axes[1], False, "waiting for capacity (down periods)")):
        for zone, colour in zip(FIT_ZONES, ("#2e7d32", "#1565c0", "#c62828", "#6a1b9a"),
                                strict=True):
            runs = period_runs(trace.zones[zone].segments())[0 if up else 1]
            tick_h = trace.tick_s / 3600
            ages, survival = kaplan_meier([(n * tick_h, done) for n, done in
                                           zip(runs.ticks, runs.complete, strict=True)])
            ax.step(ages, survival, where="post", color=colour, alpha=0.6)
            fit = data.availability[zone].up if up else data.availability[zone].down
            hours = np.linspace(0, max(ages.max(), 1.0), 200)
            ax.plot(hours, [fit.survival(h / tick_h) for h in hours], "--", color=colour,
                    label=f"{zone}: {fit.family}, mean {fit.mean_h:.1f} h")
        ax.set_xscale("symlog", linthresh=1.0)
        ax.set_xlabel("hours (probe runs of 10 min; steps: data, dashed: fit)")
        ax.set_ylabel("share still going")
        ax.set_title(f"GCP H100 spot, Oct 2025: {title}", fontsize=9)
        ax.legend(fontsize=6)


def _lifetime_panel(ax: Any) -> None:
    """VM lifetimes: Kaplan-Meier against the fitted distribution."""
    raw = json.loads(resources.files("meshmorph.data").joinpath("spot_data.json").read_text())
    for key, colour in (("l4-aws-2025-12", "#2e7d32"), ("v100-aws-2021", "#1565c0"),
                        ("t4-aws-2021", "#ef6c00")):
        lives = [(h, bool(e)) for v in raw["lifetimes"][key]["zones"].values() for h, e in v]
        ages, survival = kaplan_meier(lives)
        ax.step(ages, survival, where="post", color=colour, alpha=0.6)
        hazard = lifetime_set(key).pooled
        assert hazard is not None
        hours = np.linspace(0, max(h for h, _ in lives), 200)
        fit = lifetime_set(key).fits["pooled"]
        ax.plot(hours, [hazard.survival(h) for h in hours], "--", color=colour,
                label=f"{key} ({sum(e for _, e in lives)} ends): {fit['family']}, mean "
                      f"{fit['mean_h']:.1f} h ({fit['mean_ci95_h'][0]:.1f}-"
                      f"{fit['mean_ci95_h'][1]:.1f})")
    ax.set_xlabel("hours since the VM started")
    ax.set_ylabel("share still running")
    ax.set_title("VM lifetimes (steps: data, dashed: fit)", fontsize=9)
    ax.legend(fontsize=6)


def _rate_panel(ax: Any, rates: list[tuple[str, float, float, float]]) -> None:
    """Preemptions per VM-hour with their 95% intervals, by data set."""
    for i, (_label, rate, low, high) in enumerate(rates):
        ax.errorbar([rate], [i], xerr=[[rate - low], [high - rate]], fmt="o", capsize=2,
                    color="#37474f")
    ax.set_yticks(range(len(rates)), [r[0] for r in rates], fontsize=6)
    ax.set_xscale("log")
    ax.set_xlabel("preemptions per VM-hour (95% interval)")
    ax.set_title("preemption rate by data set (2019 rows: first 24 h, capped)", fontsize=9)


def write_spot_fit_chart(rates: list[tuple[str, float, float, float]], path: Path) -> None:
    """The fitted capacity and lifetime processes beside the data they were fitted to."""
    fig, axes = pyplot().subplots(2, 2, figsize=(13, 9))
    _capacity_panels(axes[0])
    _lifetime_panel(axes[1][0])
    _rate_panel(axes[1][1], rates)
    save_figure(fig, path, dpi=110)
