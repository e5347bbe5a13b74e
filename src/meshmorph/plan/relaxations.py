"""Small closed forms the lower bounds are built from: continuous relaxations of recompute and
of a pipeline's fill and drain."""

from __future__ import annotations

import math


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
