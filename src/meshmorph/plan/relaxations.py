"""Small closed forms the lower bounds are built from: continuous relaxations of recompute and
of a pipeline's fill and drain, and a Lagrangian relaxation of a per-layer assignment's memory.

``MemoryRelaxation``: a stage's busy time m (f + b) + tail under a memory cap, relaxed with a
multiplier lambda >= 0 on its additive memory: every assignment that fits has
busy >= sum_i min_c (busy_c + lambda add_c) - lambda cap (the least of each layer's busy time
plus lambda times its memory, less lambda times the cap), and the best over a grid of lambda's is
kept; a stage whose layers' least memories already exceed the cap gets infinity. Prefix sums make
every stage [a, b) one subtraction per lambda.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from meshmorph.plan.strategy_dp import Choice


def recompute_hull(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Lower convex hull of (bytes saved, seconds added) per block, from (0, 0) rightwards: the
    cheapest way to save any number of bytes when a block may mix recompute modes."""
    points = sorted(set(points))
    hull: list[tuple[float, float]] = []
    for point in points:
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (y2 - y1) * (point[0] - x1) >= (point[1] - y1) * (x2 - x1):
                hull.pop()  # the middle point lies on or above the chord
            else:
                break
        hull.append(point)
    # keep only the part where saving more costs more time (the cheapest way to save x bytes)
    out = [hull[0]]
    for point in hull[1:]:
        if point[0] > out[-1][0]:
            out.append(point)
    return out


def least_extra_time(hull: list[tuple[float, float]], need: float, n: int) -> float:
    """Least added time for n blocks to save ``need`` bytes (fractions of modes allowed);
    infinity when even the most saving mode on every block frees less."""
    if need <= 0:
        return 0.0
    if n == 0:
        return math.inf
    x = need / n
    for (x1, y1), (x2, y2) in zip(hull, hull[1:], strict=False):
        if x <= x2:
            return n * (y1 + (y2 - y1) * (x - x1) / (x2 - x1))
    return math.inf


def filled_share(m: int, ranks: int) -> float:
    """1 - (1 - 1/m)^ranks, computed without rounding to 0 for huge m.

    Every rank s of a pipeline needs the chain of micro-batch 0 to it and back plus m x its
    own work w_s; over any split of the total chain W the largest of these is at least C with
    all of them equal: w_s = C (1 - 1/m)^s / m, so C = W / filled_share(m, ranks)."""
    if m == 1:
        return 1.0
    return -math.expm1(ranks * math.log1p(-1.0 / m))


GRID = tuple(2.0 ** j for j in range(-8, 9))
"""Multipliers tried, in units of (the layers' least busy time) / (the cap)."""


class MemoryRelaxation:
    """Lower bounds on the busy time of any stage of one rank's layers under a memory cap."""

    def __init__(self, rows: Sequence[Sequence[Choice]], cap: float):
        """``rows``: each layer's choices (plan/strategy_dp.py) in layer order; ``cap``: the
        bytes the additive memory may take."""
        self.cap = cap
        busy = [np.array([c.busy_s for c in row]) for row in rows]
        memory = [np.array([c.memory_bytes for c in row]) for row in rows]
        scale = sum(float(b.min()) for b in busy) / max(cap, 1.0)
        self.lambdas = scale * np.array(GRID)
        per_layer = np.array([(b[None, :] + self.lambdas[:, None] * mem[None, :]).min(axis=1)
                              for b, mem in zip(busy, memory, strict=True)]).T
        self.sums = np.concatenate([np.zeros((len(GRID), 1)), per_layer.cumsum(axis=1)], axis=1)
        self.least_memory = np.concatenate([[0.0], np.cumsum([float(m.min()) for m in memory])])

    def busy_many(self, a: int, stops: np.ndarray) -> np.ndarray:
        """No assignment of layers [a, b) that fits is faster, for each b of ``stops``."""
        relaxed = (self.sums[:, stops] - self.sums[:, a:a + 1]
                   - self.lambdas[:, None] * self.cap).max(axis=0)
        over = self.least_memory[stops] - self.least_memory[a] > self.cap
        return np.where(over, np.inf, np.maximum(relaxed, 0.0))

    def busy(self, a: int, b: int) -> float:
        """No assignment of layers [a, b) that fits is faster (layer positions in ``rows``)."""
        return float(self.busy_many(a, np.array([b]))[0])
