"""Maximum-likelihood fits with their uncertainty: durations in hours (VM lifetimes, periods with
and without capacity: ``Durations``, ``Fit``) and runs of probe ticks in one state (``Runs``,
``RunFit``), each maximised by Nelder-Mead from several starts, with 95% intervals from the
observed information (delta method for derived figures).

Durations (exact, interval or right-censored) are Weibull(shape k, scale s),
``S(t) = exp(-(t / s)^k)``, the exponential being k = 1 (constant hazard 1 / s):

    log L = sum_exact log f(t) + sum_interval log(S(lo) - S(hi)) + sum_censored log S(lo)

over (log k, log s). From events and exposure alone (so many preemptions in so many VM-hours) the
exponential's rate is ``events / exposure``, with the exact Poisson (chi-square) interval.

Runs: n >= 1 consecutive probe ticks in one state. The length is geometric or (the probes show
one-tick flickers beside periods of days) a mixture of a short and a long geometric:

    P(n)      = w p1 (1 - p1)^(n - 1) + (1 - w) p2 (1 - p2)^(n - 1)
    P(N >= n) = w (1 - p1)^(n - 1)    + (1 - w) (1 - p2)^(n - 1)     (a run cut by the data's ends)

over logit(w), logit(p1), logit(p2); the mixture is kept where it has ``MIN_EVENTS_FOR_MIXTURE``
ended runs and lowers Akaike's criterion by more than 2. A mean run longer than the data cannot be
known from them (one censored run of days drives p to 0), so every p is held at or above
1 / (2 x the data's ticks). Like a replay of the trace, the model lives on the probes' grid:
periods shorter than a tick are in neither.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from scipy import optimize

Z95 = 1.959964
"""Two-sided 95% normal quantile."""
MIN_EVENTS_FOR_SHAPE = 10
"""A Weibull shape is fitted only from this many ended durations; fewer: exponential."""
MIN_EVENTS_FOR_MIXTURE = 30
"""Ended runs needed before the two-geometric mixture is tried."""


class Family(StrEnum):
    """Shape of a fitted duration distribution."""

    EXPONENTIAL = "exponential"
    WEIBULL = "weibull"
    GEOMETRIC = "geometric"
    GEOMETRIC_MIXTURE = "two-geometric mixture"

    @property
    def parameters(self) -> int:
        """Free parameters of the family (for Akaike's criterion)."""
        return {"weibull": 2, "two-geometric mixture": 3}.get(self.value, 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Fitted:
    """What every fit reports beside its own parameters."""

    family: Family
    """The fitted family."""
    events: int
    """Durations or runs that ended inside the data (uncensored)."""
    observations: int
    """Durations or runs in the data."""
    log_likelihood: float
    """Maximised log-likelihood."""
    source: str = ""
    """The data it was fitted to."""

    @property
    def aic(self) -> float:
        """Akaike's criterion: 2 parameters - 2 log L (lower is better)."""
        return 2 * self.family.parameters - 2 * self.log_likelihood


@dataclass(frozen=True, slots=True)
class Durations:
    """Observed durations in hours: each lies in [low_h, high_h]; high == low is exact, high = inf
    is right-censored (still going when the measurement stopped)."""

    low_h: tuple[float, ...]
    """Lower bound of each duration."""
    high_h: tuple[float, ...]
    """Upper bound of each duration (inf: censored)."""
    def __post_init__(self) -> None:
        if len(self.low_h) != len(self.high_h):
            raise ValueError(f"durations: {len(self.low_h)} lower and {len(self.high_h)} upper "
                             "bounds; give one of each per duration")
        if any(lo < 0 or hi < lo for lo, hi in zip(self.low_h, self.high_h, strict=True)):
            raise ValueError("durations: every bound must be >= 0 and low <= high")

    @classmethod
    def observed(cls, hours: Sequence[float], ended: Sequence[bool]) -> Durations:
        """Exact durations where ``ended``, right-censored at the value otherwise."""
        return cls(tuple(float(h) for h in hours),
                   tuple(float(h) if e else math.inf for h, e in zip(hours, ended, strict=True)))

    @property
    def events(self) -> int:
        """Durations that ended inside the measurement."""
        return sum(math.isfinite(h) for h in self.high_h)

    @property
    def exposure_h(self) -> float:
        """Hours observed (interval durations at their midpoint)."""
        return float(sum(lo if not math.isfinite(hi) else (lo + hi) / 2
                         for lo, hi in zip(self.low_h, self.high_h, strict=True)))


@dataclass(frozen=True, slots=True, kw_only=True)
class Fit(_Fitted):
    """A fitted duration distribution, Weibull(shape, scale_h), with 95% intervals (exponential:
    shape fixed at 1)."""

    shape: float
    """Weibull shape k (< 1: the hazard falls with age; 1: constant)."""
    scale_h: float
    """Weibull scale, hours (the mean for the exponential)."""
    shape_ci95: tuple[float, float]
    """95% interval of the shape ((1, 1) for the exponential)."""
    scale_ci95: tuple[float, float]
    """95% interval of the scale."""
    exposure_h: float
    """Hours observed."""

    @property
    def mean_h(self) -> float:
        """Mean duration, hours: scale * Gamma(1 + 1/shape)."""
        return self.scale_h * math.gamma(1 + 1 / self.shape)

    @property
    def mean_ci95_h(self) -> tuple[float, float]:
        """95% interval of the mean (from the scale's interval at the fitted shape)."""
        factor = math.gamma(1 + 1 / self.shape)
        return self.scale_ci95[0] * factor, self.scale_ci95[1] * factor

    @property
    def rate_per_h(self) -> float:
        """Ends per hour of exposure in the long run: 1 / mean."""
        return 1.0 / self.mean_h if math.isfinite(self.mean_h) else 0.0

    def survival(self, hours: float) -> float:
        return math.exp(-((hours / self.scale_h) ** self.shape)) if math.isfinite(self.scale_h) \
            else 1.0

    def to_dict(self) -> dict[str, object]:
        return {"family": str(self.family), "shape": self.shape,
                "shape_ci95": [float(x) for x in self.shape_ci95], "scale_h": self.scale_h,
                "scale_ci95": [float(x) for x in self.scale_ci95], "mean_h": self.mean_h,
                "mean_ci95_h": [float(x) for x in self.mean_ci95_h], "events": self.events,
                "observations": self.observations, "exposure_h": self.exposure_h,
                "log_likelihood": self.log_likelihood, "aic": self.aic, "source": self.source}


def log_likelihood(data: Durations, shape: float, scale_h: float) -> float:
    """log L of Weibull(shape, scale_h) for ``data`` (see the module docstring)."""
    low, high = np.asarray(data.low_h), np.asarray(data.high_h)
    exact, censored = low == high, ~np.isfinite(high)
    interval = ~exact & ~censored
    z_low = (low / scale_h) ** shape
    total = -float(np.sum(z_low[censored]))
    t = np.maximum(low[exact], 1e-9)
    total += float(np.sum(np.log(shape / scale_h) + (shape - 1) * np.log(t / scale_h)
                          - (t / scale_h) ** shape))
    z_high = (high[interval] / scale_h) ** shape
    # log(S(lo) - S(hi)) = -z_lo + log(1 - exp(-(z_hi - z_lo)))
    total += float(np.sum(-z_low[interval] + np.log(-np.expm1(-(z_high - z_low[interval]))
                                                     + 1e-300)))
    return total


def _minimize(nll: Callable[[np.ndarray], float], starts: list[np.ndarray], xatol: float,
              fatol: float, maxiter: int) -> optimize.OptimizeResult:
    """The best of Nelder-Mead runs of ``nll`` from each start."""
    from scipy import optimize  # scipy takes a second to import: only where a fit is made

    return min((optimize.minimize(nll, x0, method="Nelder-Mead",
                                  options={"xatol": xatol, "fatol": fatol, "maxiter": maxiter})
                for x0 in starts), key=lambda r: r.fun)


def _covariance(nll: Callable[[np.ndarray], float], theta: np.ndarray, step: float = 1e-4
                ) -> np.ndarray | None:
    """Inverse observed information at ``theta``: the inverse of ``nll``'s central-difference
    Hessian (None: it is singular)."""
    n = len(theta)
    e, hessian = np.eye(n) * step, np.zeros((n, n))
    for i, j in itertools.combinations_with_replacement(range(n), 2):
        hessian[i, j] = hessian[j, i] = (nll(theta + e[i] + e[j]) - nll(theta + e[i] - e[j])
                                         - nll(theta - e[i] + e[j]) + nll(theta - e[i] - e[j])
                                         ) / (4 * step * step)
    try:
        return np.linalg.inv(hessian)
    except np.linalg.LinAlgError:
        return None


def poisson_ci95(events: int, exposure: float) -> tuple[float, float]:
    """Exact (chi-square) 95% interval of the rate ``events / exposure``."""
    from scipy import stats  # as in _minimize

    low = float(stats.chi2.ppf(0.025, 2 * events)) / (2 * exposure) if events else 0.0
    return low, float(stats.chi2.ppf(0.975, 2 * events + 2)) / (2 * exposure)


def _interval(theta: float, se: float) -> tuple[float, float]:
    if not math.isfinite(se) or abs(theta) + Z95 * se > 700:  # no usable curvature
        return 0.0, math.inf
    return math.exp(theta - Z95 * se), math.exp(theta + Z95 * se)


def fit_rate(events: int, exposure_h: float, source: str = "") -> Fit:
    """Exponential from a count of ends in ``exposure_h`` hours: rate = events / exposure, exact
    Poisson 95% interval (chi-square); the scale (mean) is 1 / rate."""
    if exposure_h <= 0:
        raise ValueError(f"{source or 'rate'}: no exposure (0 hours observed); cannot fit a rate")
    low, high = poisson_ci95(events, exposure_h)
    rate = events / exposure_h
    scale = 1 / rate if rate > 0 else math.inf
    loglik = events * math.log(rate) - events if rate > 0 else 0.0
    return Fit(family=Family.EXPONENTIAL, shape=1.0, scale_h=scale, shape_ci95=(1.0, 1.0),
               scale_ci95=(1 / high, 1 / low if low > 0 else math.inf), events=events,
               observations=events, exposure_h=exposure_h, log_likelihood=loglik, source=source)


def fit_durations(data: Durations, family: Family, source: str = "") -> Fit:
    """Maximum-likelihood Weibull (or exponential: shape 1) fit of ``data`` with 95% intervals."""
    if not data.low_h:
        raise ValueError(f"{source or 'durations'}: no durations to fit")
    exact = all(lo == hi for lo, hi in zip(data.low_h, data.high_h, strict=True)
                if math.isfinite(hi))
    if data.events == 0 or (exact and family is Family.EXPONENTIAL):
        fit = fit_rate(data.events, data.exposure_h, source)  # closed form, exact interval
        loglik = log_likelihood(data, 1.0, fit.scale_h) if data.events else 0.0
        return replace(fit, observations=len(data.low_h), log_likelihood=loglik)
    weibull = family is Family.WEIBULL

    def nll(theta: np.ndarray) -> float:
        shape = math.exp(min(theta[0], 50.0)) if weibull else 1.0
        with np.errstate(all="ignore"):
            value = -log_likelihood(data, shape, math.exp(min(theta[-1], 700.0)))
        return value if math.isfinite(value) else 1e12

    log_mean = math.log(max(data.exposure_h / data.events, 1e-3))
    starts = [np.array([math.log(k), log_mean]) for k in (1.0, 0.5, 0.25)] if weibull \
        else [np.array([log_mean])]
    best = _minimize(nll, starts, 1e-8, 1e-10, 4000)
    cov = _covariance(nll, best.x)
    se = np.full(len(best.x), np.inf) if cov is None else \
        np.sqrt(np.where(np.diag(cov) > 0, np.diag(cov), np.inf))
    shape = math.exp(best.x[0]) if weibull else 1.0
    return Fit(family=family, shape=shape, scale_h=math.exp(best.x[-1]),
               shape_ci95=_interval(best.x[0], se[0]) if weibull else (1.0, 1.0),
               scale_ci95=_interval(best.x[-1], se[-1]), events=data.events,
               observations=len(data.low_h), exposure_h=data.exposure_h,
               log_likelihood=-float(best.fun), source=source)


def best_fit(data: Durations, source: str = "") -> Fit:
    """The exponential, or the Weibull where it has the data (``MIN_EVENTS_FOR_SHAPE`` ends) and
    lowers Akaike's criterion by more than 2."""
    exponential = fit_durations(data, Family.EXPONENTIAL, source)
    if data.events < MIN_EVENTS_FOR_SHAPE:
        return exponential
    weibull = fit_durations(data, Family.WEIBULL, source)
    return weibull if weibull.aic < exponential.aic - 2 else exponential


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
class RunFit(_Fitted):
    """A fitted run-length distribution on a tick grid (geometric or a mixture of two), with 95%
    intervals."""

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
    k = ticks - 1.0
    with np.errstate(divide="ignore", invalid="ignore"):
        log_short = np.log(w) + k * math.log1p(-p1)
        log_long = np.log1p(-w) + k * math.log1p(-p2) if len(theta) > 1 \
            else np.full_like(k, -np.inf)
        ended = np.logaddexp(log_short + np.log(p1), log_long + np.log(p2))
        going = np.logaddexp(log_short, log_long)
        return float(np.sum(weight * np.where(done, ended, going)))


def _mean_ticks(theta: np.ndarray, p_min: float) -> float:
    w, p1, p2 = _params(theta, p_min)
    return w / p1 + (1 - w) / p2 if len(theta) > 1 else 1 / p1


def _fit(runs: Runs, tick_s: float, mixture: bool, source: str) -> RunFit:
    from scipy import special  # as in _minimize

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

    best = _minimize(nll, starts, 1e-6, 1e-8, 2000)
    theta = best.x
    if mixture and theta[1] < theta[2]:  # the short component is the one with the larger p
        theta = np.array([-theta[0], theta[2], theta[1]])
    mean = _mean_ticks(theta, p_min)
    cov, step = _covariance(nll, theta), 1e-5
    se = math.inf
    if cov is not None:  # delta method on log mean
        grad = np.array([(math.log(_mean_ticks(theta + step * e, p_min))
                          - math.log(_mean_ticks(theta - step * e, p_min))) / (2 * step)
                         for e in np.eye(len(theta))])
        se = math.sqrt(max(float(grad @ cov @ grad), 0.0))
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
    low, high = poisson_ci95(events, exposure_ticks)
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
    out = [(state, len(list(run)), True) for state, run in itertools.groupby(map(bool, states))]
    if out:
        out[0], out[-1] = out[0][:2] + (False,), out[-1][:2] + (False,)
    return out
