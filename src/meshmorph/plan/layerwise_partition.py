"""The exact stage partition and per-layer assignment of one pp > 1 layerwise configuration.

Depth-first over the end of each stage and, for each stage, over its front
(plan/layerwise_front.py: the assignments no other beats on every figure the step reads), branch
and bound. A branch is cut when a lower bound on every completion reaches the best step found
(less ``tolerance``): the rank's own bound (micro-batch 0's forward chain to it, its m forwards
and backwards, then its tail beside the backward chain back; under 1F1B also the wait for the
last micro-batch's chain through the later layers), the layers still to place (some later rank
runs at least their least busy time over the ranks left, after the forward chain reaches it),
and, for few micro-batches, the chosen stages simulated with the least possible one-layer stages
after them (the simulator is monotone). Leaves are the schedule simulated over the chosen
stages' times, each rank's end plus its tail: ``estimate_layerwise`` of the assembled plan.
With tolerance 0 and no node budget the result is the optimum over every stage partition and
per-layer assignment (tests/unit/test_layerwise_pipeline_exact.py checks it against brute
force).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshmorph.cost.pipeline import simulate
from meshmorph.plan.layerwise_bounds import rest_bounds
from meshmorph.plan.layerwise_front import FrontPoint, StageFronts
from meshmorph.schedule.table import Schedule

Chosen = list[tuple[int, int, FrontPoint]]


@dataclass(slots=True)
class PartitionOutcome:
    """The best partition found below the bound, and what is proven about the rest."""

    step_s: float
    """Its step (inf when none beat the bound)."""
    stages: Chosen | None
    """(start, stop, front point) of each rank, None when none beat the bound."""
    open_bound_s: float
    """Least lower bound of the branches left when the node budget ran out (inf if none)."""
    nodes: int
    """Branch-and-bound nodes visited."""


def best_partition(fronts: StageFronts, bound: float, tolerance: float = 0.0,
                   max_nodes: int | None = None) -> PartitionOutcome:
    """The fastest partition and assignment with step below ``bound`` (module docstring)."""
    cost, plan = fronts.cost, fronts.plan
    p, m, L, zb = fronts.p, fronts.m, fronts.L, fronts.zb
    p2p = [cost.p2p_time(plan, fronts.gpu)] * p
    keep = 1.0 - tolerance
    best: list = [bound, None]
    cut = [bound * keep]
    visited = [0]
    open_bound = [float("inf")]
    # least figures of the layers from i on, for the bounds on the ranks still to fill
    suffix_busy = [0.0] * (L + 1)
    suffix_chain = [0.0] * (L + 1)
    least_one = [(float("inf"),) * 3] * (L + 1)
    for i in range(L - 1, -1, -1):
        suffix_busy[i] = suffix_busy[i + 1] + fronts.least_busy[i]
        suffix_chain[i] = suffix_chain[i + 1] + fronts.least_f[i] + fronts.least_b[i]
        least_one[i] = (min(least_one[i + 1][0], fronts.least_f[i]),
                        min(least_one[i + 1][1], fronts.least_b[i]),
                        min(least_one[i + 1][2], fronts.least_w[i]))
    simulates = m * p <= 256 and plan.schedule != Schedule.ASYNC
    later = rest_bounds(fronts)
    total = suffix_busy[0]
    target = []  # balanced ends: equal shares of the least busy time
    acc, at = 0.0, 0
    for k in range(1, p):
        while at < L and acc + fronts.least_busy[at] / 2 <= total * k / p:
            acc += fronts.least_busy[at]
            at += 1
        target.append(at)

    def step_of(chosen: Chosen) -> float:
        fwd = [pt.fwd_s for _, _, pt in chosen]
        bwd = [pt.bwd_s for _, _, pt in chosen]
        wgrad = [pt.wgrad_s for _, _, pt in chosen] if zb else None
        timeline = simulate(plan.schedule, p, m, fwd, bwd, wgrad_s=wgrad, p2p_s=p2p)
        return max(timeline.rank_end_s[k] + chosen[k][2].tail_s for k in range(p))

    def simulated(chosen: Chosen, stop: int) -> float:
        f, b, w = least_one[stop]
        left = p - len(chosen)
        fwd = [pt.fwd_s for _, _, pt in chosen] + [f] * left
        bwd = [pt.bwd_s for _, _, pt in chosen] + [b] * left
        wgrad = [pt.wgrad_s for _, _, pt in chosen] + [w] * left if zb else None
        timeline = simulate(plan.schedule, p, m, fwd, bwd, wgrad_s=wgrad, p2p_s=p2p)
        return max(max(timeline.rank_end_s[k] + chosen[k][2].tail_s
                       for k in range(len(chosen))), max(timeline.rank_end_s))

    def own(k: int, pf: float, pb: float, pt: FrontPoint, after: float) -> float:
        f, b, w, tail = pt.fwd_s, pt.bwd_s, pt.wgrad_s, pt.tail_s
        if zb:
            return max(pf + m * (f + b + w) + tail, pf + m * (f + b) + pb)
        generic = pf + m * (f + b) + max(tail, pb)
        if plan.schedule != Schedule.ONE_F_ONE_B:
            return generic
        # 1F1B: rank k runs m forwards and m - w backwards before its last forward ends, then
        # waits for that micro-batch's chain through the later layers (or runs its w other
        # backwards), then its last backward; then its tail, or the chain back to rank 0
        lag = min(p - k - 1, m)
        last_b = pf + m * f + (m - lag) * b + max(after, lag * b)
        return max(generic, last_b + max(tail, pb))

    def dfs(k: int, start: int, pf: float, pb: float, lower: float, chosen: Chosen) -> None:
        visited[0] += 1
        if max_nodes is not None and visited[0] > max_nodes:
            open_bound[0] = min(open_bound[0], lower)
            return
        if k == p - 1:
            for pt in fronts.front(k, start, L, cut[0]):
                if max(lower, own(k, pf, pb, pt, 0.0)) >= cut[0]:
                    continue
                whole = [*chosen, (start, L, pt)]
                step = step_of(whole)
                if step < best[0]:
                    best[0], best[1] = step, whole
                    cut[0] = step * keep
            return
        stops = sorted(range(start + 1, L - (p - 1 - k) + 1),
                       key=lambda s: (abs(s - target[k]), s))
        for stop in stops:
            left = p - 1 - k
            if max(lower, later[k + 1][stop]) >= cut[0]:
                continue  # the ranks after cannot finish in time, whatever this one holds
            for pt in fronts.front(k, start, stop, cut[0]):
                own_b = own(k, pf, pb, pt, suffix_chain[stop])
                rest = pf + pt.fwd_s + suffix_busy[stop] / left
                node = max(lower, own_b, rest, later[k + 1][stop])
                if node >= cut[0]:
                    continue
                extended = [*chosen, (start, stop, pt)]
                if simulates:
                    node = max(node, simulated(extended, stop))
                    if node >= cut[0]:
                        continue
                dfs(k + 1, stop, pf + pt.fwd_s, pb + pt.bwd_s, node, extended)

    if later[0][0] < cut[0]:
        dfs(0, 0, 0.0, 0.0, later[0][0], [])
    return PartitionOutcome(best[0] if best[1] is not None else float("inf"), best[1],
                            open_bound[0], visited[0])
