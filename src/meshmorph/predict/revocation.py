"""When a transient VM is revoked: a piecewise-constant hazard by hours since start, plus the
provider's rules (notice before the stop, a runtime cap).

Fitted by maximum likelihood to CM-DARE's published revocations per hour of VM age (156 K80,
120 P100, 120 V100 preemptible GCE VMs): in each age bin the hazard is revocations / VM-hours at
risk, where a VM revoked inside the bin counts half the bin. VMs still alive at 24 h are censored
(stopped by GCP's cap, not revoked). The fit is checked against data it did not see: the 128
individual K80 lifetimes and ICAC 2019's February 2019 lifetimes (Kolmogorov-Smirnov distance of
the survival curves).

Hour of day is not modelled: the published hour-of-day counts carry no launch times (so no
exposure per clock hour) and no time zone, and the ICAC VMs were launched in batches, so clock hour
and VM age cannot be told apart in this data.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from meshmorph.predict.measurements import measurements

AGE_BINS_H = (0.0, 1.0, 2.0, 3.0, 6.0, 12.0, 18.0, 24.0)
"""Edges of the age bins (hours since the VM started)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Hazard:
    """Revocation hazard of one VM type on one offering."""

    name: str
    """What it describes (``gcp-preemptible/k80``)."""
    edges_h: tuple[float, ...] = AGE_BINS_H
    """Age-bin edges, hours."""
    rates_per_h: tuple[float, ...] = ()
    """Hazard in each bin, revocations per VM-hour (one fewer than edges)."""
    tail_rate_per_h: float = 0.0
    """Hazard after the last edge (offerings without a cap)."""
    max_runtime_h: float | None = None
    """The provider stops the VM at this age (GCP preemptible: 24); None: no cap."""
    notice_s: float = 30.0
    """Warning before a revocation (GCP/Azure 30 s, AWS 120 s)."""

    def __post_init__(self) -> None:
        if len(self.rates_per_h) != len(self.edges_h) - 1:
            raise ValueError(f"hazard {self.name}: {len(self.rates_per_h)} rates for "
                             f"{len(self.edges_h) - 1} age bins; give one rate per bin")
        if min(self.rates_per_h, default=0.0) < 0 or self.tail_rate_per_h < 0:
            raise ValueError(f"hazard {self.name}: rates must be >= 0")

    def rate(self, age_h: float) -> float:
        index = bisect.bisect_right(self.edges_h, age_h) - 1
        return self.rates_per_h[index] if 0 <= index < len(self.rates_per_h) else self.tail_rate_per_h

    def cumulative(self, age_h: float) -> float:
        """Integrated hazard from 0 to ``age_h``."""
        total = 0.0
        for lo, hi, rate in zip(self.edges_h, self.edges_h[1:], self.rates_per_h, strict=False):
            total += rate * max(0.0, min(age_h, hi) - lo)
        return total + self.tail_rate_per_h * max(0.0, age_h - self.edges_h[-1])

    def survival(self, age_h: float) -> float:
        """Probability that a VM is still running at ``age_h`` (the cap ends it)."""
        if self.max_runtime_h is not None and age_h >= self.max_runtime_h:
            return 0.0
        return math.exp(-self.cumulative(age_h))

    def lifetime_h(self, draw: float) -> float:
        """The age at which the integrated hazard reaches ``draw`` (an Exp(1) sample), capped."""
        remaining, age = draw, 0.0
        for lo, hi, rate in zip(self.edges_h, self.edges_h[1:], self.rates_per_h, strict=False):
            if rate * (hi - lo) >= remaining:
                age = lo + remaining / rate
                break
            remaining -= rate * (hi - lo)
        else:
            tail = self.tail_rate_per_h
            age = self.edges_h[-1] + remaining / tail if tail > 0 else math.inf
        return min(age, self.max_runtime_h) if self.max_runtime_h is not None else age

    def sample_h(self, rng: np.random.Generator) -> float:
        return self.lifetime_h(float(rng.exponential()))

    def mean_rate_per_h(self, horizon_h: float = 24.0) -> float:
        """Average hazard over the first ``horizon_h`` hours (for checkpoint intervals)."""
        return self.cumulative(horizon_h) / horizon_h


def fit_counts(counts: list[int], launched: int, edges: tuple[float, ...] = AGE_BINS_H
               ) -> tuple[float, ...]:
    """MLE hazard per age bin from revocations per one-hour bin of ``launched`` VMs."""
    rates = []
    alive = float(launched)
    for lo, hi in zip(edges, edges[1:], strict=False):
        events, exposure = 0, 0.0
        for hour in range(int(lo), int(hi)):
            n = counts[hour] if hour < len(counts) else 0
            exposure += alive - n / 2  # a VM revoked in the hour counts half of it
            events += n
            alive -= n
        rates.append(events / exposure if exposure > 0 else 0.0)
    return tuple(rates)


@cache
def fitted_hazards() -> dict[str, Hazard]:
    """GCP preemptible hazards per GPU (``k80``, ``p100``, ``v100``) and pooled (``any``)."""
    data = measurements()
    counts, launched = data["revocations_by_hours_since_start"], data["instances_launched"]
    out = {}
    for name in ("K80", "P100", "V100"):
        out[name.lower()] = Hazard(name=f"gcp-preemptible/{name.lower()}",
                                   rates_per_h=fit_counts(counts[name], launched[name]),
                                   max_runtime_h=24.0, notice_s=30.0)
    pooled = [sum(counts[n][h] for n in ("K80", "P100", "V100")) for h in range(24)]
    out["any"] = Hazard(name="gcp-preemptible/any",
                        rates_per_h=fit_counts(pooled, sum(launched.values())),
                        max_runtime_h=24.0, notice_s=30.0)
    return out


def kaplan_meier(lifetimes: list[tuple[float, bool]]) -> tuple[np.ndarray, np.ndarray]:
    """Ages and survival after each revocation (``(age_h, revoked)``; not revoked = censored)."""
    ordered = sorted(lifetimes)
    at_risk, survival, ages, values = len(ordered), 1.0, [0.0], [1.0]
    for age, revoked in ordered:
        if revoked:
            survival *= 1 - 1 / at_risk
            ages.append(age)
            values.append(survival)
        at_risk -= 1
    return np.array(ages), np.array(values)


def ks_distance(hazard: Hazard, lifetimes: list[tuple[float, bool]], horizon_h: float = 23.9) -> float:
    """Largest gap between the model's and the Kaplan-Meier survival before ``horizon_h``."""
    ages, values = kaplan_meier(lifetimes)
    grid = np.linspace(0.0, horizon_h, 480)
    empirical = values[np.searchsorted(ages, grid, side="right") - 1]
    model = np.array([math.exp(-hazard.cumulative(t)) for t in grid])
    return float(np.max(np.abs(model - empirical)))


def revocation_report() -> dict[str, Any]:
    """Fitted rates, and the fit against the published CDF and against held-out lifetimes."""
    data, hazards = measurements(), fitted_hazards()
    report: dict[str, Any] = {"age_bins_h": list(AGE_BINS_H), "gpus": {}}
    for name in ("k80", "p100", "v100"):
        hazard = hazards[name]
        counts, launched = data["revocations_by_hours_since_start"][name.upper()], \
            data["instances_launched"][name.upper()]
        published = np.cumsum(counts) / launched  # CDF at the end of each hour
        model = [1 - math.exp(-hazard.cumulative(h + 1)) for h in range(24)]
        held_out = [(age, not capped) for age, capped in
                    data["icac_feb2019_lifetimes_h"][name.upper()]]
        entry = {"rates_per_h": list(hazard.rates_per_h), "launched": launched,
                 "revoked_by_24h_published": float(published[-1]),
                 "revoked_by_24h_model": model[-1],
                 "max_cdf_gap_published": float(np.max(np.abs(np.array(model) - published))),
                 "ks_icac_feb2019": ks_distance(hazard, held_out),
                 "icac_feb2019_vms": len(held_out)}
        if name == "k80":
            lifetimes = [(age, not censored) for age, censored in data["k80_lifetimes_h"]]
            entry["ks_k80_128_lifetimes"] = ks_distance(hazard, lifetimes)
        report["gpus"][name] = entry
    report["any"] = {"rates_per_h": list(hazards["any"].rates_per_h)}
    # descriptive only (see the module docstring for why clock hour is not modelled)
    by_hour = data["revocations_by_hour_of_day"]
    report["hour_of_day_share_09_17"] = {
        gpu: sum(counts[9:17]) / sum(counts) for gpu, counts in by_hour.items()}
    return report
