"""Lower bounds of the layerwise search that hold for every assignment that fits memory.

``MemoryRelaxation``: a stage's busy time m (f + b) + tail under a memory cap, relaxed with a
multiplier lambda >= 0 on its additive memory: every assignment that fits has
busy >= sum_i min_c (busy_c + lambda add_c) - lambda cap (the least of each layer's busy time
plus lambda times its memory, less lambda times the cap), and the best over a grid of lambda's is
kept; a stage whose layers' least memories already exceed the cap gets infinity. Prefix sums make
every stage [a, b) one subtraction per lambda.

``rest_bounds``: the min-max program over stage ends that bounds every completion of a partial
partition (plan/layerwise_partition.py) and every configuration (plan/layerwise_search.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshmorph.plan.layerwise_front import StageFronts
from meshmorph.schedule.table import Schedule

GRID = tuple(2.0 ** j for j in range(-8, 9))
"""Multipliers tried, in units of (the layers' least busy time) / (the cap)."""


class MemoryRelaxation:
    """Lower bounds on the busy time of any stage of one rank's layers under a memory cap."""

    def __init__(self, rows: Sequence[Sequence[tuple]], cap: float):
        """``rows``: each layer's choices (strategy index, recompute, busy, additive memory, ...)
        in layer order; ``cap``: the bytes the additive memory may take."""
        self.cap = cap
        busy = [np.array([c[2] for c in row]) for row in rows]
        memory = [np.array([c[3] for c in row]) for row in rows]
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


def rest_bounds(fronts: StageFronts) -> list[list[float]]:
    """``table[k][a]``: no completion in which ranks k.. hold layers [a, L) is faster, whatever the
    ranks before hold: the least over their partitions of the largest rank bound, each rank's
    figures the sums of its layers' least ones (the forward and backward chains before a rank
    too) and its busy time at least its memory relaxation's, so the table holds for every
    assignment that fits (a min-max program over stage ends)."""
    p, m, L, zb = fronts.p, fronts.m, fronts.L, fronts.zb
    one_f_one_b = fronts.plan.schedule == Schedule.ONE_F_ONE_B

    def prefix(values: list[float]) -> np.ndarray:
        return np.concatenate([[0.0], np.cumsum(values)])

    F, B = prefix(fronts.least_f), prefix(fronts.least_b)
    T, U = prefix(fronts.least_tail), prefix(fronts.least_busy)
    relaxed = [MemoryRelaxation(fronts.rows(k), fronts.cap) for k in range(p)]

    def rank(k: int, a: int, stops: np.ndarray) -> np.ndarray:
        pf, pb = F[a], B[a]
        f, bb, tail = F[stops] - pf, B[stops] - pb, T[stops] - T[a]
        busy = np.maximum(U[stops] - U[a], relaxed[k].busy_many(a, stops))
        bound = np.maximum(pf + busy, pf + m * (f + bb) + pb)
        if one_f_one_b and not zb:
            lag = min(p - k - 1, m)
            after = F[L] - F[stops] + B[L] - B[stops]
            bound = np.maximum(bound, pf + m * f + (m - lag) * bb + np.maximum(after, lag * bb)
                               + np.maximum(tail, pb))
        return bound

    inf = float("inf")
    table = [[inf] * (L + 1) for _ in range(p + 1)]
    for a in range(p - 1, L):
        table[p - 1][a] = float(rank(p - 1, a, np.array([L]))[0])
    for k in range(p - 2, -1, -1):
        later = np.array(table[k + 1])
        for a in range(k, L - (p - 1 - k)):
            stops = np.arange(a + 1, L - (p - 2 - k))
            if len(stops):
                table[k][a] = float(np.maximum(rank(k, a, stops), later[stops]).min())
    return table
