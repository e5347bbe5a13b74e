"""The alpha-beta fit of a collective: time = alpha + beta * bytes, by least squares.

``alpha`` is the fixed cost of one call (latency hops, Python and launch overhead), ``beta`` the
seconds per byte. ``ring_link`` turns an all-reduce fit into the per-hop latency and per-rank
bandwidth of the ring formula the cost model prices collectives with (cost/comm.py);
``loopback_link`` writes that link of CPU processes into a Profile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AlphaBeta:
    """A fitted line: seconds = alpha_s + beta_s_per_byte * bytes."""

    alpha_s: float
    """Seconds per call at zero bytes (the intercept, never below 0)."""
    beta_s_per_byte: float
    """Seconds per byte (the slope)."""
    r2: float
    """Coefficient of determination of the fit."""

    def time_s(self, nbytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * nbytes

    def as_dict(self) -> dict[str, float]:
        return {"alpha_s": self.alpha_s, "beta_s_per_byte": self.beta_s_per_byte, "r2": self.r2}


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float]) -> AlphaBeta:
    """Least-squares line through (bytes, seconds); needs two distinct sizes at least."""
    if len(set(nbytes)) < 2:
        raise ValueError("an alpha-beta fit needs timings at two message sizes at least; "
                         f"got sizes {sorted(set(nbytes))}")
    from scipy import stats  # scipy takes a second to import: only where a fit is made

    fit = stats.linregress(list(nbytes), list(seconds))
    return AlphaBeta(max(float(fit.intercept), 0.0), max(float(fit.slope), 1e-15),
                     float(fit.rvalue) ** 2)


def ring_link(kind: str, group_size: int, fit: AlphaBeta) -> tuple[float, float]:
    """(per-hop latency s, per-rank bandwidth bytes/s) of the ring formula that reproduces
    ``fit`` for a collective of ``kind`` over ``group_size`` ranks (cost/comm.py):
    all-reduce 2(n-1) alpha + 2(n-1)/n M/beta; all-gather and reduce-scatter half of that;
    send/recv alpha + M/beta."""
    n = group_size
    if kind == "send_recv":
        hops, volume = 1.0, 1.0
    elif kind == "all_reduce":
        hops, volume = 2.0 * (n - 1), 2.0 * (n - 1) / n
    elif kind in ("all_gather", "reduce_scatter"):
        hops, volume = float(n - 1), (n - 1) / n
    else:
        raise ValueError(f"unknown collective {kind!r}; known: all_reduce, all_gather, "
                         "reduce_scatter, send_recv")
    return fit.alpha_s / hops, volume / fit.beta_s_per_byte


def loopback_link(fits: dict[str, dict[str, float]], world: int
                  ) -> tuple[dict[str, float], dict[str, float]]:
    """The ``loopback`` link's bandwidth (GB/s) and per-hop latency (us), as a Profile's
    ``link_bandwidth_gbps`` and ``link_latency_us``, from the all-reduce fit over all ``world``
    CPU processes (empty without that fit)."""
    row = fits.get(f"all_reduce/{world}")
    if row is None:
        return {}, {}
    alpha, bandwidth = ring_link("all_reduce", world, AlphaBeta(**row))
    return {"loopback": bandwidth / 1e9}, {"loopback": alpha * 1e6}
