"""Runs of probe ticks with and without spot capacity, fitted by maximum likelihood on the tick grid.

A zone is probed every tick; a run is the number n >= 1 of consecutive ticks in one state. The
run length is geometric, or (the probes show many one-tick flickers beside periods of days) a
mixture of two geometrics, short and long:

    P(n)      = w p1 (1 - p1)^(n - 1) + (1 - w) p2 (1 - p2)^(n - 1)
    P(N >= n) = w (1 - p1)^(n - 1)    + (1 - w) (1 - p2)^(n - 1)     (a run cut by the data's ends)

maximised over logit(w), logit(p1), logit(p2) by ``scipy.optimize.minimize``; the mixture is
kept where it has ``MIN_EVENTS_FOR_MIXTURE`` ended runs and lowers Akaike's criterion by more
than 2. A mean run longer than the data cannot be known from them (one censored run of days
drives the long component's p to 0): every p is held at or above 1 / (2 x the ticks in the
data), a mean of at most twice the data's span.
Uncertainty: the inverse of the observed information (central-difference Hessian of -log L);
the mean run ``w / p1 + (1 - w) / p2`` gets its 95% interval by the delta method on its log. A
model on the probes' own grid is what a replay of the trace sees: periods shorter than a tick
are not in either.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import optimize, special, stats

from meshmorph.predict.fits import Z95, Family, hessian

MIN_EVENTS_FOR_MIXTURE = 30
"""Ended runs needed before the two-geometric mixture is tried."""


@dataclass(frozen=True, slots=True)
class Runs:
    """Observed runs: length in ticks, and whether the run ended inside the data."""

    ticks: tuple[int, ...]
    """Length of each run, ticks (>= 1)."""
    complete: tuple[bool, ...]
    """False where the start or end of the data cut the run (it lasted at least that long)."""

    def __post_init__(self) -> None:
        if len(self.ticks) != len(self.complete) or any(n < 1 for n in self.ticks):
            raise ValueError("runs: give one completeness flag per run and lengths >= 1 tick")

    def __add__(self, other: Runs) -> Runs:
        return Runs(self.ticks + other.ticks, self.complete + other.complete)

    @property
    def events(self) -> int:
        """Runs that ended inside the data."""
        return sum(self.complete)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunFit:
    """A fitted run-length distribution on a tick grid, with 95% intervals."""

    family: Family
    """Geometric or a mixture of two geometrics."""
    weight: float
    """Share of runs from the short component (1 for the plain geometric)."""
    p_short: float
    """Per-tick end probability of the short component."""
    p_long: float
    """Per-tick end probability of the long component (= ``p_short`` for the plain geometric)."""
    tick_s: float
    """Seconds per tick."""
    mean_ticks: float
    """Mean run, ticks (inf: runs never ended in the data)."""
    mean_ci95_ticks: tuple[float, float]
    """95% interval of the mean run."""
    events: int
    """Runs that ended inside the data."""
    observations: int
    """Runs in the data."""
    log_likelihood: float
    """Maximised log-likelihood."""
    source: str = ""
    """The data it was fitted to."""

    @property
    def aic(self) -> float:
        return 2 * (3 if self.family is Family.GEOMETRIC_MIXTURE else 1) - 2 * self.log_likelihood

    @property
    def mean_h(self) -> float:
        return self.mean_ticks * self.tick_s / 3600

    @property
    def mean_ci95_h(self) -> tuple[float, float]:
        return (self.mean_ci95_ticks[0] * self.tick_s / 3600,
                self.mean_ci95_ticks[1] * self.tick_s / 3600)

    def sample_s(self, rng: np.random.Generator) -> float:
        """One run's length, seconds (inf where runs never end)."""
        p = self.p_short if rng.random() < self.weight else self.p_long
        return float(rng.geometric(p)) * self.tick_s if p > 0 else math.inf

    def survival(self, ticks: float) -> float:
        """P(a run lasts more than ``ticks`` ticks)."""
        return (self.weight * (1 - self.p_short) ** ticks
                + (1 - self.weight) * (1 - self.p_long) ** ticks)

    def to_dict(self) -> dict[str, object]:
        return {"family": str(self.family), "weight_short": self.weight, "p_short": self.p_short,
                "p_long": self.p_long, "tick_s": self.tick_s, "mean_h": self.mean_h,
                "mean_ci95_h": [float(x) for x in self.mean_ci95_h], "events": self.events,
                "observations": self.observations, "log_likelihood": self.log_likelihood,
                "aic": self.aic, "source": self.source}


def _params(theta: np.ndarray, p_min: float) -> tuple[float, float, float]:
    """(w, p1, p2) from logits, each p held in [p_min, 1 - 1e-12]."""
    def held(x: float, low: float) -> float:
        return min(max(1 / (1 + math.exp(-min(max(x, -700.0), 700.0))), low), 1 - 1e-12)

    if len(theta) == 1:
        p = held(theta[0], p_min)
        return 1.0, p, p
    return held(theta[0], 1e-12), held(theta[1], p_min), held(theta[2], p_min)


def _log_likelihood(theta: np.ndarray, runs: tuple[np.ndarray, np.ndarray, np.ndarray],
                    p_min: float) -> float:
    """log L of the mixture at logit parameters (w, p1, p2) (one value: plain geometric);
    ``runs``: distinct (length, ended) pairs and how often each was seen."""
    w, p1, p2 = _params(theta, p_min)
    ticks, done, weight = runs
    with np.errstate(divide="ignore", invalid="ignore"):
        return _mixture_log_likelihood(ticks - 1.0, done, weight, (w, p1, p2), len(theta) > 1)


def _mixture_log_likelihood(k: np.ndarray, done: np.ndarray, weight: np.ndarray,
                            params: tuple[float, float, float], mixture: bool) -> float:
    w, p1, p2 = params
    log_short = np.log(w) + k * math.log1p(-p1)
    log_long = np.log1p(-w) + k * math.log1p(-p2) if mixture else np.full_like(k, -np.inf)
    ended = np.logaddexp(log_short + np.log(p1), log_long + np.log(p2))
    going = np.logaddexp(log_short, log_long)
    return float(np.sum(weight * np.where(done, ended, going)))


def _mean_ticks(theta: np.ndarray, p_min: float) -> float:
    w, p1, p2 = _params(theta, p_min)
    return w / p1 + (1 - w) / p2 if len(theta) > 1 else 1 / p1


def _fit(runs: Runs, tick_s: float, mixture: bool, source: str) -> RunFit:
    pairs, weight = np.unique(np.array([runs.ticks, runs.complete], dtype=float), axis=1,
                              return_counts=True)
    grouped = (pairs[0], pairs[1] > 0, weight.astype(float))
    total = float(sum(runs.ticks))
    p_min = 1 / (2 * total)
    p0 = min(max(runs.events / total, p_min), 1 - 1e-9)
    def logit(p: float) -> float:
        return float(special.logit(min(max(p, p_min), 1 - 1e-9)))

    starts = [np.array([logit(p0)])]
    if mixture:  # short runs of about a tick, long ones near the longest seen
        starts = [np.array([logit(w), logit(0.7), logit(p)])
                  for w, p in ((0.5, p0 / 2), (0.7, 1 / max(runs.ticks)))]

    def nll(theta: np.ndarray) -> float:
        value = -_log_likelihood(theta, grouped, p_min)
        return value if math.isfinite(value) else 1e12

    best = min((optimize.minimize(nll, x0, method="Nelder-Mead",
                                  options={"xatol": 1e-6, "fatol": 1e-8, "maxiter": 2000})
                for x0 in starts), key=lambda r: r.fun)
    theta = best.x
    if mixture and theta[1] < theta[2]:  # the short component is the one with the larger p
        theta = np.array([-theta[0], theta[2], theta[1]])
    mean = _mean_ticks(theta, p_min)
    try:  # delta method on log mean
        cov = np.linalg.inv(hessian(nll, theta))
        step = 1e-5
        grad = np.array([(math.log(_mean_ticks(theta + step * e, p_min))
                          - math.log(_mean_ticks(theta - step * e, p_min))) / (2 * step)
                         for e in np.eye(len(theta))])
        se = math.sqrt(max(float(grad @ cov @ grad), 0.0))
    except np.linalg.LinAlgError:
        se = math.inf
    w, p1, p2 = _params(theta, p_min)
    return RunFit(family=Family.GEOMETRIC_MIXTURE if mixture else Family.GEOMETRIC,
                  weight=float(w), p_short=float(p1), p_long=float(p2), tick_s=tick_s,
                  mean_ticks=mean, mean_ci95_ticks=(mean * math.exp(-Z95 * se),
                                                    mean * math.exp(Z95 * se)),
                  events=runs.events, observations=len(runs.ticks),
                  log_likelihood=-float(best.fun), source=source)


def rate_fit(events: int, exposure_ticks: float, tick_s: float, source: str = "") -> RunFit:
    """Geometric runs from a count: ``events`` ends in ``exposure_ticks`` ticks (the MLE with
    every run seen whole), with the exact Poisson interval of the rate."""
    if exposure_ticks <= 0:
        raise ValueError(f"{source or 'runs'}: no ticks observed; cannot fit")
    p = min(events / exposure_ticks, 1.0)
    low = float(stats.chi2.ppf(0.025, 2 * events)) / (2 * exposure_ticks) if events else 0.0
    high = float(stats.chi2.ppf(0.975, 2 * events + 2)) / (2 * exposure_ticks)
    loglik = (events * math.log(p) + (exposure_ticks - events) * math.log1p(-p)
              if 0 < p < 1 else 0.0)
    return RunFit(family=Family.GEOMETRIC, weight=1.0, p_short=p, p_long=p, tick_s=tick_s,
                  mean_ticks=1 / p if p > 0 else math.inf,
                  mean_ci95_ticks=(1 / high, 1 / low if low > 0 else math.inf), events=events,
                  observations=events, log_likelihood=loglik, source=source)


def fit_runs(runs: Runs, tick_s: float, source: str = "") -> RunFit:
    """The geometric, or the two-geometric mixture where it has the data and lowers AIC by > 2."""
    if not runs.ticks:
        raise ValueError(f"{source or 'runs'}: no runs to fit")
    if runs.events == 0:  # never ended: a state that lasts
        return rate_fit(0, float(sum(runs.ticks)), tick_s, source)
    plain = _fit(runs, tick_s, False, source)
    if runs.events < MIN_EVENTS_FOR_MIXTURE:
        return plain
    mixture = _fit(runs, tick_s, True, source)
    usable = all(math.isfinite(x) and x > 0 for x in mixture.mean_ci95_ticks)
    return mixture if usable and mixture.aic < plain.aic - 2 else plain


def runs_of(states: Sequence[bool]) -> list[tuple[bool, int, bool]]:
    """``(state, ticks, complete)`` for each run of equal states; the first and last runs are cut
    by the data's ends."""
    out: list[tuple[bool, int, bool]] = []
    for state in states:
        if out and out[-1][0] == state:
            out[-1] = (state, out[-1][1] + 1, True)
        else:
            out.append((bool(state), 1, True))
    if out:
        out[0] = (out[0][0], out[0][1], False)
        out[-1] = (out[-1][0], out[-1][1], False)
    return out
