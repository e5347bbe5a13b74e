"""Whether the pipeline ranks still to fill can hold the layers still to place, within memory.

A stage that fits still fits without its first or last layers (more layers never need less
memory). When the layers between the first and the last are alike, each rank taking as many
layers as fit (leaving one per later rank) therefore reaches the end whenever any partition
does: a greedy with a binary search per rank. Otherwise a memoised search over stage ends.
"""

from __future__ import annotations

from itertools import takewhile

from meshmorph.plan.stage_recompute import StageSolver


class MemoryReach:
    """``can_finish(k, start)`` for one configuration, memoised."""

    def __init__(self, solver: StageSolver):
        self.solver = solver
        self.alike_middle = len(set(solver.classes[1:-1])) <= 1
        self._finish: dict[tuple[int, int], bool] = {}

    def can_finish(self, k: int, start: int) -> bool:
        """Whether ranks k..pp-1 can hold layers [start, L) within memory."""
        known = self._finish.get((k, start))
        if known is not None:
            return known
        if not self.alike_middle:
            return self._search(k, start)
        solver = self.solver
        p, L = solver.plan.pp, solver.L
        path = []
        reach = start
        ok = True
        for j in range(k, p):
            path.append((j, reach))
            if self._finish.get((j, reach)) is not None:
                ok = self._finish[(j, reach)]
                reach = L if ok else reach
                break
            most = L - (p - 1 - j)
            if j == p - 1:
                ok = solver.fits(j, reach, L)
                reach = L
                break
            if most <= reach or not solver.fits(j, reach, reach + 1):
                ok = False
                break
            lo, hi = reach + 1, most  # stage(j, reach, lo) fits; find the largest that does
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if solver.fits(j, reach, mid):
                    lo = mid
                else:
                    hi = mid - 1
            reach = lo
        for node in path:
            self._finish[node] = ok
        return ok

    def _search(self, k: int, start: int) -> bool:
        key = (k, start)
        if key not in self._finish:
            solver = self.solver
            p = solver.plan.pp
            if k == p - 1:
                self._finish[key] = solver.fits(k, start, solver.L)
            else:  # the ends that fit come first: more layers never need less memory
                stops = takewhile(lambda stop: solver.fits(k, start, stop),
                                  range(start + 1, solver.L - (p - 1 - k) + 1))
                self._finish[key] = any(self._search(k + 1, stop) for stop in stops)
        return self._finish[key]
