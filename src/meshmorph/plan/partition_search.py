"""The exact stage partition of one non-interleaved configuration: depth-first over the end of
each stage, branch and bound.

Stage ends are tried nearest a balanced split first (the block-split bound's, else an equal
share of the fastest time), whose partition is also the first incumbent. A branch is cut when
a bound of ``plan.partition_bounds`` reaches the best step found (less ``tolerance``), or when
the ranks left cannot hold the layers left (``plan.stage_reach``); leaves are priced by
``CostModel.assemble``. With tolerance 0 and no node budget the result equals brute-force
enumeration. ``interleaved_block_counts`` lists the chunk sizes an interleaved configuration
may take (the planner and ``plan/brute_force.py`` price each).

With per-layer strategies (``best_front_partition``) each stage is one point of its front
(plan/strategy_fronts.py: the assignments no other beats on every figure the step reads)
instead of its best recompute: the same depth-first search over stage ends, cut by the same
one-rank bound (``partition_bounds.rank_step_bound``), the table of the ranks still to fill
(``partition_bounds.rest_bounds``) and, for few micro-batches, the chosen stages simulated with
the least possible one-layer stages after them. Leaves are the schedule simulated over the
chosen stages' times, each rank's end plus its tail (``CostModel.estimate`` of the assembled
plan). With tolerance 0 and no node budget the result is the optimum over every stage
partition and per-layer assignment (tests/unit/test_layerwise_pipeline_exact.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from meshmorph.cost.estimate import Estimate
from meshmorph.cost.layer_cost import PieceCost
from meshmorph.cost.model import CostModel
from meshmorph.cost.pipeline import simulate
from meshmorph.plan.partition_bounds import PartitionBounds, rank_step_bound, rest_bounds
from meshmorph.plan.stage_reach import MemoryReach
from meshmorph.plan.stage_recompute import StageChoice, StageSolver
from meshmorph.plan.strategy_fronts import FrontPoint, StageFronts
from meshmorph.schedule.table import Schedule
from meshmorph.spec.gpus import GPUSpec
from meshmorph.spec.model import ModelSpec, Recompute
from meshmorph.spec.plan import Plan, StagePlan

if TYPE_CHECKING:
    from meshmorph.plan.rank_bound import SplitTable

Choices = list[tuple[int, int, StageChoice]]
Chosen = list[tuple[int, int, FrontPoint]]


@dataclass(slots=True)
class PartitionResult:
    """The best partition found and what is proven about the rest."""

    best: tuple[Plan, Estimate] | None
    """Fastest plan found below the bound, if any."""
    open_bound_s: float
    """Least lower bound of the branches left unexplored when the budget ran out (inf if none):
    no partition of this configuration is faster than min(best, open_bound_s)."""


def _stage_ends(solver: StageSolver, bounds: PartitionBounds, cut: float,
                target: list[int] | None, k: int, start: int, prefix_f: float,
                back: float) -> list[tuple[int, StageChoice]]:
    """Rank k's stage ends from ``start`` that fit memory and whose own bound is below ``cut``
    (longer stages need no less memory and take no less time), nearest ``target``'s first."""
    p, L = solver.plan.pp, solver.L
    candidates = []
    for stop in range(start + 1, L - (p - 1 - k) + 1):
        choice = solver.stage(k, start, stop)
        if choice is None or bounds.own(k, prefix_f, back, choice.time, choice.tail_s,
                                        0.0) >= cut:
            break
        candidates.append((stop, choice))
    if target is not None:
        candidates.sort(key=lambda c: abs(c[0] - target[k]))
    return candidates


def solve_partition(solver: StageSolver, bound: float, tolerance: float = 0.0,
                    max_nodes: int | None = None, table: SplitTable | None = None) -> PartitionResult:
    """The fastest stage partition of a non-interleaved configuration with step time below
    ``bound``; with ``tolerance`` > 0, one at most that fraction slower than the fastest. With
    ``max_nodes``, branches beyond that many visited nodes are left open and their bound kept.
    ``table`` (plan.rank_bound.SplitTable) adds the memory-aware bound of the ranks still to fill
    and a balanced first partition; stage ends are tried nearest the balanced ones first."""
    plan, p, L = solver.plan, solver.plan.pp, solver.L
    bounds = PartitionBounds(solver, table)
    reach = MemoryReach(solver)
    keep = 1.0 - tolerance
    best: list = [bound, None]
    cut = [bound * keep]
    visited = [0]
    open_bound = [float("inf")]
    mixed = len({g.name for g in solver.gpus}) > 1
    pricing = _Pricing(solver.cost)

    def evaluate(choices: Choices) -> None:
        stages = tuple(StagePlan(start=a, stop=b, recompute=c.recompute,
                                 gpu=g.name if mixed else None)
                       for (a, b, c), g in zip(choices, solver.gpus, strict=True))
        candidate = replace(plan, stages=stages)
        estimate = pricing.below(candidate, solver.gpus, [c.time for _, _, c in choices],
                                 best[0])
        if estimate is not None:  # below the best so far
            best[0], best[1] = estimate.step_time_s, (candidate, estimate)
            cut[0] = best[0] * keep

    def dfs(k: int, start: int, prefix_f: float, prefix_b: float, lower: float,
            chosen: Choices, max_f: float = 0.0, max_b: float = 0.0,
            node_bound: float = 0.0, back: float = 0.0) -> None:
        visited[0] += 1
        if max_nodes is not None and visited[0] > max_nodes:
            open_bound[0] = min(open_bound[0], node_bound)  # this branch stays unexplored
            return
        if k == p - 1:
            choice = solver.stage(k, start, L)
            if choice is None:
                return
            own = bounds.own(k, prefix_f, back, choice.time, choice.tail_s, 0.0)
            own = max(own, bounds.flow_shop(prefix_f + prefix_b, max_f, max_b, choice.time, 0.0))
            if max(lower, own) < cut[0]:
                evaluate([*chosen, (start, L, choice)])
            return
        for stop, choice in _stage_ends(solver, bounds, cut[0], target, k, start, prefix_f,
                                        back):
            t = choice.time
            after = bounds.suffix_chain[stop]
            own = bounds.own(k, prefix_f, back, t, choice.tail_s, after)
            own = max(own, bounds.flow_shop(prefix_f + prefix_b, max_f, max_b, t, after))
            # from a later rank's last backward: back to each rank r <= k, then r's own drain
            back_next = bounds.step_b(t) + max(back, bounds.drain_after(k, t, choice.tail_s))
            rest = bounds.rest(k, stop, prefix_f, prefix_b, t, back_next)
            if max(lower, own, rest) >= cut[0] or not reach.can_finish(k + 1, stop):
                continue
            extended = [*chosen, (start, stop, choice)]
            if bounds.simulates and bounds.simulated(extended, stop) >= cut[0]:
                continue
            dfs(k + 1, stop, prefix_f + t.fwd_s, prefix_b + bounds.step_b(t), max(lower, own),
                extended, max(max_f, t.fwd_s), max(max_b, t.bwd_s), max(lower, own, rest),
                back_next)

    # balanced partitions first, for a good incumbent (simulated only if it could win)
    target = table.stops() if table is not None else None
    starts = [_balanced(solver, bounds)]
    if target is not None:
        starts.insert(0, _from_stops(solver, target))
    for greedy in starts:
        if greedy is not None and bounds.whole(greedy) < cut[0]:
            evaluate(greedy)
    if reach.can_finish(0, 0):
        dfs(0, 0, 0.0, 0.0, 0.0, [])
    return PartitionResult(best[1], open_bound[0])


class _Pricing:
    """``CostModel.assemble_below`` of one solve's leaves, with its precheck while that pays:
    near-ties between partitions pass every precheck, so past 16 tries it runs only while one
    in eight spares a simulation (the answer is the same either way)."""

    def __init__(self, cost: CostModel):
        self.cost = cost
        self.tried = self.spared = 0

    def below(self, plan: Plan, gpus: Sequence[GPUSpec], times: Sequence[PieceCost],
              bound: float) -> Estimate | None:
        check = self.tried < 16 or 8 * self.spared >= self.tried
        before = self.cost.prechecks_cut
        estimate = self.cost.assemble_below(plan, gpus, times, bound, precheck=check)
        if check:
            self.tried += 1
            self.spared += self.cost.prechecks_cut - before
        return estimate


def _from_stops(solver: StageSolver, stops: list[int]) -> Choices | None:
    """The partition with these stage ends, if every stage fits."""
    choices, start = [], 0
    for k, stop in enumerate([*stops, solver.L]):
        choice = solver.stage(k, start, stop) if stop > start else None
        if choice is None:
            return None
        choices.append((start, stop, choice))
        start = stop
    return choices


def _balanced(solver: StageSolver, bounds: PartitionBounds) -> Choices | None:
    """Greedy: fill each stage up to an equal share of the remaining fastest time."""
    p, L = solver.plan.pp, solver.L
    suffix = bounds.suffix_min
    stops, start = [], 0
    for k in range(p - 1):
        left = p - k
        target = suffix[start] / left
        stop, acc = start, 0.0
        while stop < L - (left - 1) and (stop == start or acc + (
                suffix[stop] - suffix[stop + 1]) / 2 <= target):
            acc += suffix[stop] - suffix[stop + 1]
            stop += 1
        stops.append(stop)
        start = stop
    return _from_stops(solver, stops)


def interleaved_block_counts(blocks: int, chunks: int) -> list[tuple[int, ...]]:
    """Block counts of the ``chunks`` (pp x vpp) model chunks an interleaved plan may take.

    Blocks that split evenly: the even split alone (Megatron's ``--num-layers-per-virtual-
    pipeline-stage``). Otherwise, as Megatron-LM lets the first and last pipeline stages hold
    their own layer counts: the split ``Plan.with_even_stages`` makes (earlier chunks take the
    extra block), and every split whose interior chunks all hold k = floor or ceil(blocks /
    chunks) blocks and whose first and last chunks (with the embedding and the head) hold any
    a, c >= 0 blocks, a + c = blocks - (chunks - 2) k. Empty when there are fewer blocks than
    chunks."""
    if chunks < 2 or blocks < chunks:
        return []
    base, extra = divmod(blocks, chunks)
    counts = [tuple(base + (1 if i < extra else 0) for i in range(chunks))]
    if extra == 0:
        return counts
    for k in (base, base + 1):
        ends = blocks - (chunks - 2) * k
        if k < 1 or ends < 0:
            continue
        for first in range(ends + 1):
            split = (first, *(k,) * (chunks - 2), ends - first)
            if split not in counts:
                counts.append(split)
    return counts


def stages_of_counts(model: ModelSpec, counts: Sequence[int], mode: Recompute,
                     gpus: Sequence[str | None] | None = None) -> tuple[StagePlan, ...]:
    """Chunks holding ``counts`` blocks each, the embedding in the first and the head in the
    last; every block recomputes with ``mode`` (layers without it: none); ``gpus``: each
    chunk's GPU type (mixed clusters), else None."""
    stages, start = [], 0
    last = len(counts) - 1
    for index, count in enumerate(counts):
        stop = start + count + (index == 0) + (index == last)
        modes = tuple(mode if mode in model.layers[i].activation else Recompute.NONE
                      for i in range(start, stop))
        stages.append(StagePlan(start=start, stop=stop, recompute=modes,
                                gpu=gpus[index] if gpus else None))
        start = stop
    return tuple(stages)


@dataclass(slots=True)
class FrontPartition:
    """The best partition over fronts found below the bound, and what is proven about the rest."""

    stages: Chosen | None
    """(start, stop, front point) of each rank, None when none beat the bound."""
    open_bound_s: float
    """Least lower bound of the branches left when the node budget ran out (inf if none)."""


def best_front_partition(fronts: StageFronts, bound: float, tolerance: float = 0.0,
                         max_nodes: int | None = None) -> FrontPartition:
    """The fastest partition and per-layer assignment of a one-chunk pipeline configuration
    with step below ``bound`` (module docstring)."""
    search = _FrontSearch(fronts, bound, tolerance, max_nodes)
    if search.later[0][0] < search.cut:
        search.dfs(0, 0, 0.0, 0.0, search.later[0][0], [])
    return FrontPartition(search.chosen, search.open_bound)


class _FrontSearch:
    """``best_front_partition``'s depth-first search, with the suffix tables it reads."""

    def __init__(self, fronts: StageFronts, bound: float, tolerance: float,
                 max_nodes: int | None):
        self.fronts, self.plan = fronts, fronts.plan
        self.p, self.m, self.L, self.zb = fronts.p, fronts.m, fronts.L, fronts.zb
        self.p2p = [fronts.cost.p2p_time(self.plan, fronts.gpu)] * self.p
        self.keep, self.max_nodes = 1.0 - tolerance, max_nodes
        self.best, self.chosen, self.cut = bound, None, bound * self.keep
        self.visited, self.open_bound = 0, float("inf")
        L = self.L
        # least figures of the layers from i on, for the bounds on the ranks still to fill
        self.suffix_busy = [0.0] * (L + 1)
        self.suffix_chain = [0.0] * (L + 1)
        self.least_one = [(float("inf"),) * 3] * (L + 1)
        for i in range(L - 1, -1, -1):
            self.suffix_busy[i] = self.suffix_busy[i + 1] + fronts.least_busy[i]
            self.suffix_chain[i] = self.suffix_chain[i + 1] + fronts.least_f[i] + fronts.least_b[i]
            self.least_one[i] = (min(self.least_one[i + 1][0], fronts.least_f[i]),
                                 min(self.least_one[i + 1][1], fronts.least_b[i]),
                                 min(self.least_one[i + 1][2], fronts.least_w[i]))
        self.simulates = self.m * self.p <= 256 and self.plan.schedule != Schedule.ASYNC
        self.later = rest_bounds(fronts)
        total, acc, at = self.suffix_busy[0], 0.0, 0
        self.target = []  # balanced ends: equal shares of the least busy time
        for k in range(1, self.p):
            while at < L and acc + fronts.least_busy[at] / 2 <= total * k / self.p:
                acc += fronts.least_busy[at]
                at += 1
            self.target.append(at)

    def _simulate(self, chosen: Chosen, least: tuple[float, float, float] | None = None) -> float:
        """The step of the chosen stages, each rank's end plus its tail; with ``least`` the
        ranks not chosen yet hold stages of those (least) figures."""
        left = self.p - len(chosen)
        f, b, w = least if least is not None else (0.0, 0.0, 0.0)
        fwd = [pt.fwd_s for _, _, pt in chosen] + [f] * left
        bwd = [pt.bwd_s for _, _, pt in chosen] + [b] * left
        wgrad = [pt.wgrad_s for _, _, pt in chosen] + [w] * left if self.zb else None
        timeline = simulate(self.plan.schedule, self.p, self.m, fwd, bwd, wgrad_s=wgrad,
                            p2p_s=self.p2p)
        ends = max(timeline.rank_end_s[k] + chosen[k][2].tail_s for k in range(len(chosen)))
        return ends if least is None else max(ends, max(timeline.rank_end_s))

    def own(self, k: int, pf: float, pb: float, pt: FrontPoint, after: float) -> float:
        return rank_step_bound(self.plan.schedule, self.zb, self.m, self.p, k, pf, pb, pt.fwd_s,
                               pt.bwd_s, pt.bwd_s + pt.wgrad_s, pt.tail_s, after)

    def dfs(self, k: int, start: int, pf: float, pb: float, lower: float, chosen: Chosen) -> None:
        self.visited += 1
        if self.max_nodes is not None and self.visited > self.max_nodes:
            self.open_bound = min(self.open_bound, lower)
            return
        fronts, L, p = self.fronts, self.L, self.p
        if k == p - 1:
            for pt in fronts.front(k, start, L, self.cut):
                if max(lower, self.own(k, pf, pb, pt, 0.0)) >= self.cut:
                    continue
                whole = [*chosen, (start, L, pt)]
                step = self._simulate(whole)
                if step < self.best:
                    self.best, self.chosen = step, whole
                    self.cut = step * self.keep
            return
        left = p - 1 - k
        for stop in sorted(range(start + 1, L - left + 1),
                           key=lambda s: (abs(s - self.target[k]), s)):
            if max(lower, self.later[k + 1][stop]) >= self.cut:
                continue  # the ranks after cannot finish in time, whatever this one holds
            for pt in fronts.front(k, start, stop, self.cut):
                own = self.own(k, pf, pb, pt, self.suffix_chain[stop])
                rest = pf + pt.fwd_s + self.suffix_busy[stop] / left
                node = max(lower, own, rest, self.later[k + 1][stop])
                if node >= self.cut:
                    continue
                extended = [*chosen, (start, stop, pt)]
                if self.simulates:
                    node = max(node, self._simulate(extended, self.least_one[stop]))
                    if node >= self.cut:
                        continue
                self.dfs(k + 1, stop, pf + pt.fwd_s, pb + pt.bwd_s, node, extended)
