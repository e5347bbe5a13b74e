"""Maximum-likelihood fits of durations (VM lifetimes, periods with and without capacity), with the
fit's uncertainty.

Each duration is known exactly, only to lie between two bounds, or only to exceed a bound (still
running when the measurement stopped: right-censored). Two families, both as Weibull(shape k,
scale s) with survival ``S(t) = exp(-(t / s)^k)``; the exponential is k = 1 (a constant hazard
1 / s):

    log L = sum_exact log f(t) + sum_interval log(S(lo) - S(hi)) + sum_censored log S(lo)

maximised over (log k, log s) by ``scipy.optimize.minimize``. The uncertainty is the inverse of the
observed information (a central-difference Hessian of -log L at the optimum, in log parameters):
95% intervals ``exp(theta +- 1.96 se)``. Where the data are events and exposure only (a count of
preemptions in so many VM-hours), the exponential's rate is ``events / exposure`` with the exact
Poisson (chi-square) interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
from scipy import optimize, stats

Z95 = 1.959964
"""Two-sided 95% normal quantile."""
MIN_EVENTS_FOR_SHAPE = 10
"""A Weibull shape is fitted only from this many ended durations; fewer: exponential."""


class Family(StrEnum):
    """Shape of a fitted duration distribution."""

    EXPONENTIAL = "exponential"
    WEIBULL = "weibull"
    GEOMETRIC = "geometric"
    GEOMETRIC_MIXTURE = "two-geometric mixture"


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
class Fit:
    """A fitted duration distribution, Weibull(shape, scale_h), with 95% intervals."""

    family: Family
    """Exponential (shape fixed at 1) or Weibull."""
    shape: float
    """Weibull shape k (< 1: the hazard falls with age; 1: constant)."""
    scale_h: float
    """Weibull scale, hours (the mean for the exponential)."""
    shape_ci95: tuple[float, float]
    """95% interval of the shape ((1, 1) for the exponential)."""
    scale_ci95: tuple[float, float]
    """95% interval of the scale."""
    events: int
    """Durations that ended (uncensored) in the data."""
    observations: int
    """Durations in the data."""
    exposure_h: float
    """Hours observed."""
    log_likelihood: float
    """Maximised log-likelihood."""
    source: str = ""
    """The data it was fitted to."""

    @property
    def aic(self) -> float:
        """Akaike's criterion: 2 parameters - 2 log L (lower is better)."""
        return 2 * (2 if self.family is Family.WEIBULL else 1) - 2 * self.log_likelihood

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


def hessian(f: Callable[[np.ndarray], float], x: np.ndarray, step: float = 1e-4) -> np.ndarray:
    """Central-difference Hessian of ``f`` at ``x``."""
    n = len(x)
    out = np.zeros((n, n))
    for i in range(n):
        for j in range(i, n):
            ei, ej = np.eye(n)[i] * step, np.eye(n)[j] * step
            out[i, j] = out[j, i] = (f(x + ei + ej) - f(x + ei - ej) - f(x - ei + ej)
                                     + f(x - ei - ej)) / (4 * step * step)
    return out


def _interval(theta: float, se: float) -> tuple[float, float]:
    if not math.isfinite(se) or abs(theta) + Z95 * se > 700:  # no usable curvature
        return 0.0, math.inf
    return math.exp(theta - Z95 * se), math.exp(theta + Z95 * se)


def fit_rate(events: int, exposure_h: float, source: str = "") -> Fit:
    """Exponential from a count of ends in ``exposure_h`` hours: rate = events / exposure, exact
    Poisson 95% interval (chi-square); the scale (mean) is 1 / rate."""
    if exposure_h <= 0:
        raise ValueError(f"{source or 'rate'}: no exposure (0 hours observed); cannot fit a rate")
    low = float(stats.chi2.ppf(0.025, 2 * events)) / (2 * exposure_h) if events else 0.0
    high = float(stats.chi2.ppf(0.975, 2 * events + 2)) / (2 * exposure_h)
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
        return Fit(**{**_fields(fit), "observations": len(data.low_h), "log_likelihood": loglik})
    weibull = family is Family.WEIBULL

    def nll(theta: np.ndarray) -> float:
        shape = math.exp(min(theta[0], 50.0)) if weibull else 1.0
        with np.errstate(all="ignore"):
            value = -log_likelihood(data, shape, math.exp(min(theta[-1], 700.0)))
        return value if math.isfinite(value) else 1e12

    log_mean = math.log(max(data.exposure_h / data.events, 1e-3))
    starts = [np.array([math.log(k), log_mean]) for k in (1.0, 0.5, 0.25)] if weibull \
        else [np.array([log_mean])]
    best = min((optimize.minimize(nll, x0, method="Nelder-Mead",
                                  options={"xatol": 1e-8, "fatol": 1e-10, "maxiter": 4000})
                for x0 in starts), key=lambda r: r.fun)
    try:
        cov = np.linalg.inv(hessian(nll, best.x))
        se = np.sqrt(np.where(np.diag(cov) > 0, np.diag(cov), np.inf))
    except np.linalg.LinAlgError:
        se = np.full(len(best.x), np.inf)
    shape = math.exp(best.x[0]) if weibull else 1.0
    return Fit(family=family, shape=shape, scale_h=math.exp(best.x[-1]),
               shape_ci95=_interval(best.x[0], se[0]) if weibull else (1.0, 1.0),
               scale_ci95=_interval(best.x[-1], se[-1]), events=data.events,
               observations=len(data.low_h), exposure_h=data.exposure_h,
               log_likelihood=-float(best.fun), source=source)


def _fields(fit: Fit) -> dict[str, object]:
    return {name: getattr(fit, name) for name in Fit.__dataclass_fields__}


def best_fit(data: Durations, source: str = "") -> Fit:
    """The exponential, or the Weibull where it has the data (``MIN_EVENTS_FOR_SHAPE`` ends) and
    lowers Akaike's criterion by more than 2."""
    exponential = fit_durations(data, Family.EXPONENTIAL, source)
    if data.events < MIN_EVENTS_FOR_SHAPE:
        return exponential
    weibull = fit_durations(data, Family.WEIBULL, source)
    return weibull if weibull.aic < exponential.aic - 2 else exponential
