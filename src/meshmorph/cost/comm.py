"""Collective costs in the alpha-beta model, ring algorithms (see reference formulas).

n ranks, M bytes per rank, alpha latency (s), beta per-rank link bandwidth (bytes/s).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshmorph.spec.gpus import LinkSpec


@dataclass(frozen=True, slots=True)
class Link:
    """An effective link: latency and achieved per-rank bandwidth."""

    latency_s: float
    """alpha: seconds per message hop."""
    bandwidth_bps: float
    """beta: achieved bytes per second per rank per direction."""

    @classmethod
    def from_spec(cls, spec: LinkSpec, efficiency: float) -> Link:
        return cls(spec.latency_us * 1e-6, spec.bandwidth_gbps * 1e9 * efficiency)


def all_reduce(n: int, nbytes: float, link: Link) -> float:
    # ring: 2(n-1)·alpha + 2(n-1)/n · M/beta
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * link.latency_s + 2 * (n - 1) / n * nbytes / link.bandwidth_bps


def reduce_scatter(n: int, nbytes: float, link: Link) -> float:
    # ring: (n-1)·alpha + (n-1)/n · M/beta, M = the full (unsharded) buffer
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * link.latency_s + (n - 1) / n * nbytes / link.bandwidth_bps


all_gather = reduce_scatter  # same volume and hops as reduce-scatter


def p2p(nbytes: float, link: Link) -> float:
    # alpha + M/beta
    if nbytes <= 0:
        return 0.0
    return link.latency_s + nbytes / link.bandwidth_bps


def overlapped(parts: Sequence[tuple[float, float]], window_s: float, slowdown: float,
               least_exposed_s: float = 0.0) -> float:
    """Seconds communication adds beside ``window_s`` of compute: each part ``(seconds, share)``
    hides at most its share, all of them together at most the window and all but
    ``least_exposed_s`` (a last bucket that waits for the last gradient); every hidden second
    slows the compute beside it by ``slowdown`` (the SMs the collective holds). One part with
    ``slowdown`` 0 and no floor leaves max(comm (1 - share), comm - compute, 0) exposed."""
    total = sum(seconds for seconds, _ in parts)
    hidden = min(sum(seconds * share for seconds, share in parts), max(window_s, 0.0),
                 max(total - least_exposed_s, 0.0))
    hidden = max(hidden, 0.0)
    return total - hidden + slowdown * hidden
