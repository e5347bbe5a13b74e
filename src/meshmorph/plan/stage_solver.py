"""The best recompute for one pipeline stage, and the exact stage partition of one configuration.

Per stage: among the layers of one kind (identical figures), which ones recompute does not
change time or memory, so the choice is how many use full and how many selective recompute.
For each count of full-recompute layers the fewest selective ones that fit memory are taken;
the fastest of those is the stage's best. The step time never decreases when a stage's times
grow (pipeline.simulate), so the best recompute per stage is the best for the whole plan.

Partition: depth-first over the end of each stage with branch and bound. A rank s must run
m forwards and backwards, after the first micro-batch reached it and before the last backward
left it, so any completion of a partial partition takes at least
max_s [sum_{r<s}(f_r + B_r) + m (f_s + b_s) + tail_s]; the layers still to place need at
least m * (their fastest total) / (ranks left) on some rank, and micro-batch 0 must pass forward
through them and back (B: the input-gradient part in zero-bubble, else the whole backward);
and some rank left holds at least ceil(blocks left / ranks left) blocks. Branches whose bound is not below
the best step found are cut; leaves are simulated. The result equals brute-force enumeration.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from meshmorph.cost.estimate import Estimate
from meshmorph.cost.model import ChunkTime, CostModel, in_flight_microbatches
from meshmorph.cost.pipeline import simulate
from meshmorph.spec.gpus import GPUSpec
from meshmorph.spec.gpus import gpu as gpu_by_name
from meshmorph.spec.model import LayerKind, Recompute
from meshmorph.spec.plan import Plan, Schedule, StagePlan

if TYPE_CHECKING:
    from meshmorph.plan.bounds import SplitTable

_ORDER = (Recompute.FULL, Recompute.SELECTIVE, Recompute.NONE)


@dataclass(frozen=True, slots=True)
class StageChoice:
    """A stage's recompute and what it costs (shared by every stage with the same layers)."""

    recompute: tuple[Recompute, ...]
    time: ChunkTime
    tail_s: float
    """Exposed gradient sync + optimizer after the rank's last backward."""


class StageSolver:
    """Solves the stages of one configuration on one CostModel."""

    def __init__(self, cost: CostModel, plan: Plan, gpus: Sequence[GPUSpec],
                 modes: Sequence[Recompute]):
        self.cost = cost
        self.plan = plan
        self.gpus = list(gpus)
        self.modes = [m for m in _ORDER if m in modes]
        self.model = cost.model
        self.L = self.model.num_layers
        self.classes = cost.coster(plan.dtype).classes
        self.zb = plan.schedule == Schedule.ZERO_BUBBLE
        self._cache: dict[tuple, StageChoice | None] = {}
        self._by_range: dict[tuple[int, int, int], StageChoice | None] = {}
        self._finish: dict[tuple[int, int], bool] = {}
        self.alike_middle = len(set(self.classes[1:-1])) <= 1
        self.class_prefix = []
        for rep in sorted(set(self.classes)):
            prefix = [0]
            for c in self.classes:
                prefix.append(prefix[-1] + (c == rep))
            self.class_prefix.append(prefix)
        fastest = fastest_layer_times(cost, plan, unique_gpus(g.name for g in self.gpus))
        # least_after[i]: the smallest one-layer stage among layers i.., per op kind (a stage
        # holds at least one layer), for the simulated bound of a partial partition
        self.least_after: list[tuple[float, float, float, float]] = [(0.0,) * 4] * (self.L + 1)
        acc = (float("inf"),) * 4
        for index in range(self.L - 1, -1, -1):
            t = fastest[index]
            acc = (min(acc[0], t.fwd_s), min(acc[1], t.bwd_s), min(acc[2], t.bgrad_s),
                   min(acc[3], t.wgrad_s))
            self.least_after[index] = acc
        # pigeonhole: some rank holds at least ceil(blocks left / ranks left) blocks
        blocks = [i for i in range(self.L) if self.model.layers[i].kind == LayerKind.BLOCK]
        self.block_time = min((fastest[i].work_s for i in blocks), default=0.0)
        self.blocks_after = [0] * (self.L + 1)
        for index in range(self.L - 1, -1, -1):
            is_block = self.model.layers[index].kind == LayerKind.BLOCK
            self.blocks_after[index] = self.blocks_after[index + 1] + is_block
        # suffix sums: fastest work of layers [i, L), and of their forward + input-gradient chain
        self.suffix_min = [0.0] * (self.L + 1)
        self.suffix_chain = [0.0] * (self.L + 1)
        for index in range(self.L - 1, -1, -1):
            self.suffix_min[index] = self.suffix_min[index + 1] + fastest[index].work_s
            self.suffix_chain[index] = self.suffix_chain[index + 1] + fastest[index].chain_s

    # --- one stage -----------------------------------------------------------------------------
    def stage(self, k: int, start: int, stop: int) -> StageChoice | None:
        """Fastest recompute for layers [start, stop) on pipeline rank k that fits, or None."""
        found = self._by_range.get((k, start, stop), False)
        if found is False:
            found = self._by_range[(k, start, stop)] = self._stage(k, start, stop)
        return found

    def can_finish(self, k: int, start: int) -> bool:
        """Whether ranks k..pp-1 can hold layers [start, L) within memory. A stage that fits
        still fits without its first or last layers; when the layers between the first and the
        last are alike, each rank taking as many layers as fit (leaving one per later rank)
        therefore reaches the end whenever any partition does. Otherwise: a memoised search."""
        key = (k, start)
        known = self._finish.get(key)
        if known is not None:
            return known
        if not self.alike_middle:
            return self._can_finish_search(k, start)
        p, L = self.plan.pp, self.L
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
                ok = self.stage(j, reach, L) is not None
                reach = L
                break
            if most <= reach or self.stage(j, reach, reach + 1) is None:
                ok = False
                break
            lo, hi = reach + 1, most  # stage(j, reach, lo) fits; find the largest that does
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self.stage(j, reach, mid) is not None:
                    lo = mid
                else:
                    hi = mid - 1
            reach = lo
        for node in path:
            self._finish[node] = ok
        return ok

    def _can_finish_search(self, k: int, start: int) -> bool:
        key = (k, start)
        if key not in self._finish:
            p = self.plan.pp
            if k == p - 1:
                self._finish[key] = self.stage(k, start, self.L) is not None
            else:
                ok = False
                for stop in range(start + 1, self.L - (p - 1 - k) + 1):
                    if self.stage(k, start, stop) is None:
                        break  # more layers never need less memory
                    if self._can_finish_search(k + 1, stop):
                        ok = True
                        break
                self._finish[key] = ok
        return self._finish[key]

    def _stage(self, k: int, start: int, stop: int) -> StageChoice | None:
        gpu = self.gpus[k]
        in_flight = in_flight_microbatches(self.plan.schedule, self.plan.pp, k,
                                           self.plan.num_microbatches, self.plan.vpp)
        # layers of one class are interchangeable: the stage is known by its class counts
        counts = tuple(prefix[stop] - prefix[start] for prefix in self.class_prefix)
        key = (gpu.name, in_flight, start == 0, stop == self.L, counts)
        choice = self._cache.get(key, False)
        if choice is False:
            choice = self._cache[key] = self._solve(k, start, stop, gpu)
        return choice

    def _extra_backward(self, index: int, gpu: GPUSpec) -> dict[Recompute, float]:
        """Backward time a layer adds per mode over no recompute."""
        coster = self.cost.coster(self.plan.dtype)
        plan = self.plan
        base = coster.layer(index, gpu, plan.micro_batch, plan.tp, plan.sequence_parallel,
                            Recompute.NONE).bwd_s
        return {mode: coster.layer(index, gpu, plan.micro_batch, plan.tp, plan.sequence_parallel,
                                   mode).bwd_s - base if mode in self.model.layers[index].activation
                else float("inf") for mode in (Recompute.FULL, Recompute.SELECTIVE)}

    def _fits(self, k: int, start: int, stop: int, modes: tuple[Recompute, ...], gpu: GPUSpec) -> bool:
        memory = self.cost.rank_memory(self.plan, k, [(start, stop, modes)], gpu)
        return memory.total <= gpu.memory_bytes

    def _one_group(self, k: int, start: int, stop: int, gpu: GPUSpec, group: list[int],
                   build):  # type: ignore[no-untyped-def]
        """One group of interchangeable layers (the usual case): for each count of full
        recompute, the fewest selective ones that fit. Memory is affine in the counts, so it is
        computed from the all-none stage; a full recompute costs more time than a selective one,
        so the loop stops once the full ones alone cost more than the best found."""
        plan = self.plan
        coster = self.cost.coster(plan.dtype)
        n = len(group)
        per = {mode: coster.layer(group[0], gpu, plan.micro_batch, plan.tp, plan.sequence_parallel,
                                  mode) for mode in self.modes
               if mode in self.model.layers[group[0]].activation}
        # with no recompute no layer rematerialises anything, so the working set is zero
        none = self.cost.rank_memory(plan, k, [(start, stop, build([(0, 0)]))], gpu)
        in_flight = none.in_flight_microbatches
        budget = gpu.memory_bytes
        a_none = per[Recompute.NONE].activation_bytes

        def total(n_full: int, n_sel: int) -> float:
            saved = 0.0
            work = 0.0
            for mode, count in ((Recompute.FULL, n_full), (Recompute.SELECTIVE, n_sel)):
                if count:
                    saved += count * (a_none - per[mode].activation_bytes)
                    work = max(work, per[mode].working_bytes)
            # rank_memory: activations = in_flight * sum(act) + max(working of the layers)
            return none.total - in_flight * saved + work

        extra = self._extra_backward(group[0], gpu)
        best_extra = float("inf")
        full_counts = range(n + 1) if Recompute.FULL in per else range(1)
        for n_full in full_counts:
            if n_full * extra[Recompute.FULL] >= best_extra:
                break
            sels = range(n - n_full + 1) if Recompute.SELECTIVE in per else range(1)
            lo, hi = 0, len(sels) - 1
            if total(n_full, sels[hi]) > budget:
                continue
            while lo < hi:  # memory decreases as n_sel grows: binary search
                mid = (lo + hi) // 2
                if total(n_full, sels[mid]) <= budget:
                    hi = mid
                else:
                    lo = mid + 1
            modes = build([(n_full, sels[lo])])
            if total(n_full, sels[lo]) > budget * (1 - 1e-9) and not self._fits(
                    k, start, stop, modes, gpu):
                continue  # at the edge the affine shortcut may round wrong: trust rank_memory
            best_extra = min(best_extra, n_full * extra[Recompute.FULL] + sels[lo] * extra[Recompute.SELECTIVE])
            yield modes

    def _solve(self, k: int, start: int, stop: int, gpu: GPUSpec) -> StageChoice | None:
        layers = range(start, stop)
        flexible = [i for i in layers
                    if sum(1 for m in self.modes if m in self.model.layers[i].activation) > 1]
        # group interchangeable layers: same class -> same time and memory
        groups: dict[int, list[int]] = {}
        for i in flexible:
            groups.setdefault(self.classes[i], []).append(i)
        best: StageChoice | None = None
        for modes in self._assignments(k, start, stop, gpu, list(groups.values())):
            time = self.cost.chunk_time(self.plan, start, stop, modes, gpu)
            key = time.bgrad_s if self.zb else time.bwd_s
            if best is None or (time.fwd_s + key, time.bwd_s) < (
                    best.time.fwd_s + (best.time.bgrad_s if self.zb else best.time.bwd_s),
                    best.time.bwd_s):
                best = StageChoice(modes, time, 0.0)
        if best is None:
            return None
        sync, opt = self.cost.rank_tail(self.plan, best.time.params, best.time.compute_s * 2 / 3, gpu)
        return replace(best, tail_s=sync + opt)

    def _assignments(self, k: int, start: int, stop: int, gpu: GPUSpec,
                     groups: list[list[int]]):  # type: ignore[no-untyped-def]
        """Recompute tuples worth trying: per group, each count of full layers with the fewest
        selective ones that fit (memory falls as layers move none -> selective -> full)."""
        base = [Recompute.NONE] * (stop - start)

        def build(counts: list[tuple[int, int]]) -> tuple[Recompute, ...]:
            modes = list(base)
            for group, (n_full, n_sel) in zip(groups, counts, strict=True):
                for j, index in enumerate(group):
                    mode = Recompute.FULL if j < n_full else (
                        Recompute.SELECTIVE if j < n_full + n_sel else Recompute.NONE)
                    if mode not in self.model.layers[index].activation:
                        mode = Recompute.NONE
                    modes[index - start] = mode
            return tuple(modes)

        if len(groups) == 1:
            yield from self._one_group(k, start, stop, gpu, groups[0], build)
            return

        def options(group: list[int]) -> list[tuple[int, int]]:
            n = len(group)
            full_ok = Recompute.FULL in self.modes
            sel_ok = Recompute.SELECTIVE in self.modes
            return [(f, s) for f in (range(n + 1) if full_ok else [0])
                    for s in (range(n - f + 1) if sel_ok else [0])]

        def rec(i: int, chosen: list[tuple[int, int]]):  # type: ignore[no-untyped-def]
            if i == len(groups):
                modes = build(chosen)
                if self._fits(k, start, stop, modes, gpu):
                    yield modes
                return
            for option in options(groups[i]):
                yield from rec(i + 1, [*chosen, option])

        yield from rec(0, [])


def unique_gpus(names: Iterable[str]) -> list[GPUSpec]:
    """The distinct GPU types among ``names``, in first-seen order."""
    return [gpu_by_name(name) for name in dict.fromkeys(names)]


@dataclass(frozen=True, slots=True)
class FastestLayer:
    """A layer's least per-micro-batch times over the GPU types in use, without recompute."""

    fwd_s: float
    bwd_s: float
    bgrad_s: float
    wgrad_s: float
    work_s: float
    """Least forward + backward."""
    chain_s: float
    """Least forward + the backward the pipeline chain waits for (input gradient only for ZB)."""


def fastest_layer_times(cost: CostModel, plan: Plan, gpus: Sequence[GPUSpec]) -> list[FastestLayer]:
    """Per layer, the least times over ``gpus``: what every lower bound of the search starts from."""
    coster = cost.coster(plan.dtype)
    zb = plan.schedule == Schedule.ZERO_BUBBLE
    out = []
    for index in range(cost.model.num_layers):
        costs = [coster.layer(index, g, plan.micro_batch, plan.tp, plan.sequence_parallel,
                              Recompute.NONE) for g in gpus]
        out.append(FastestLayer(
            fwd_s=min(c.fwd_s for c in costs), bwd_s=min(c.bwd_s for c in costs),
            bgrad_s=min(c.bgrad_s for c in costs), wgrad_s=min(c.wgrad_s for c in costs),
            work_s=min(c.fwd_s + c.bwd_s for c in costs),
            chain_s=min(c.fwd_s + (c.bgrad_s if zb else c.bwd_s) for c in costs)))
    return out


@dataclass(slots=True)
class PartitionResult:
    """The best partition found and what is proven about the rest."""

    best: tuple[Plan, Estimate] | None
    """Fastest plan found below the bound, if any."""
    open_bound_s: float
    """Least lower bound of the branches left unexplored when the budget ran out (inf if none):
    no partition of this configuration is faster than min(best, open_bound_s)."""


def solve_partition(solver: StageSolver, bound: float, tolerance: float = 0.0,
                    max_nodes: int | None = None, table: SplitTable | None = None) -> PartitionResult:
    """The fastest stage partition of a non-interleaved configuration with step time below
    ``bound``; with ``tolerance`` > 0, one at most that fraction slower than the fastest. With
    ``max_nodes``, branches beyond that many visited nodes are left open and their bound kept.
    ``table`` (plan.bounds.SplitTable) adds the memory-aware bound of the ranks still to fill
    and a balanced first partition; stage ends are tried nearest the balanced ones first."""
    plan, p, L = solver.plan, solver.plan.pp, solver.L
    m = plan.num_microbatches
    keep = 1.0 - tolerance
    best: list = [bound, None]
    cut = [bound * keep]
    visited = [0]
    open_bound = [float("inf")]

    mixed = len({g.name for g in solver.gpus}) > 1

    def evaluate(choices: list[tuple[int, int, StageChoice]]) -> None:
        stages = tuple(StagePlan(start=a, stop=b, recompute=c.recompute,
                                 gpu=g.name if mixed else None)
                       for (a, b, c), g in zip(choices, solver.gpus, strict=True))
        candidate = replace(plan, stages=stages)
        estimate = solver.cost.assemble(candidate, solver.gpus, [c.time for _, _, c in choices])
        if estimate.step_time_s < best[0]:
            best[0], best[1] = estimate.step_time_s, (candidate, estimate)
            cut[0] = best[0] * keep

    # a balanced partition first, for a good incumbent
    one_f_one_b = plan.schedule == Schedule.ONE_F_ONE_B
    gpipe = plan.schedule == Schedule.GPIPE

    def own_bound(k: int, prefix_f: float, prefix_b: float, t: ChunkTime, tail: float,
                  after: float) -> float:
        """Lower bound on the step from rank k alone (``after``: least time of the chain of the
        ranks after k). After rank k's last backward, its tail and the backward chain to rank 0
        run side by side; in zero-bubble the rank's W ops may also run after its last B."""
        if solver.zb:
            return max(prefix_f + m * (t.fwd_s + t.bwd_s) + tail,
                       prefix_f + m * (t.fwd_s + t.bgrad_s) + prefix_b)
        generic = prefix_f + m * (t.fwd_s + t.bwd_s) + max(tail, prefix_b)
        if not one_f_one_b:
            return generic
        # 1F1B: rank k runs m forwards and m - w backwards before its last forward ends, then
        # waits for that micro-batch's chain through the later ranks (or runs its w other
        # backwards), then its last backward; afterwards the tail, or the chain back to rank 0
        w = min(p - k - 1, m)
        last_b = prefix_f + m * t.fwd_s + (m - w) * t.bwd_s + max(after, w * t.bwd_s)
        return max(generic, last_b + max(tail, prefix_b))

    def flow_shop(prefix: float, max_f: float, max_b: float, t: ChunkTime, after: float) -> float:
        """GPipe runs a forward then a backward flow shop of m identical jobs: each takes at
        least the sum of its stages plus (m - 1) x its slowest stage."""
        if not gpipe:
            return 0.0
        return prefix + t.fwd_s + t.bwd_s + after + (m - 1) * (max(max_f, t.fwd_s) + max(max_b, t.bwd_s))

    p2p = [solver.cost.p2p_time(plan, g) for g in solver.gpus]

    def simulated_bound(chosen: list[tuple[int, int, StageChoice]], stop: int) -> float:
        """Simulate the stages chosen so far followed by ranks holding the smallest possible
        one-layer stage: every real completion is slower (simulate is monotone)."""
        f_min, b_min, bg_min, w_min = solver.least_after[stop]
        left = p - len(chosen)
        times = [c.time for _, _, c in chosen]
        fwd = [t.fwd_s for t in times] + [f_min] * left
        bwd = [(t.bgrad_s if solver.zb else t.bwd_s) for t in times] + [
            bg_min if solver.zb else b_min] * left
        wgrad = [t.wgrad_s for t in times] + [w_min] * left if solver.zb else None
        return simulate(plan.schedule, p, m, fwd, bwd, wgrad_s=wgrad, p2p_s=p2p).makespan_s

    def dfs(k: int, start: int, prefix_f: float, prefix_b: float, lower: float,
            chosen: list[tuple[int, int, StageChoice]], max_f: float = 0.0,
            max_b: float = 0.0, node_bound: float = 0.0) -> None:
        visited[0] += 1
        if max_nodes is not None and visited[0] > max_nodes:
            open_bound[0] = min(open_bound[0], node_bound)  # this branch stays unexplored
            return
        if k == p - 1:
            choice = solver.stage(k, start, L)
            if choice is None:
                return
            own = own_bound(k, prefix_f, prefix_b, choice.time, choice.tail_s, 0.0)
            own = max(own, flow_shop(prefix_f + prefix_b, max_f, max_b, choice.time, 0.0))
            if max(lower, own) < cut[0]:
                evaluate([*chosen, (start, L, choice)])
            return
        candidates = []
        for stop in range(start + 1, L - (p - 1 - k) + 1):
            choice = solver.stage(k, start, stop)
            if choice is None:
                break  # more layers never need less memory
            if own_bound(k, prefix_f, prefix_b, choice.time, choice.tail_s, 0.0) >= cut[0]:
                break  # longer stages only take longer
            candidates.append((stop, choice))
        if target is not None:  # nearest the balanced split first
            candidates.sort(key=lambda c: abs(c[0] - target[k]))
        for stop, choice in candidates:
            t = choice.time
            own = own_bound(k, prefix_f, prefix_b, t, choice.tail_s, solver.suffix_chain[stop])
            own = max(own, flow_shop(prefix_f + prefix_b, max_f, max_b, t, solver.suffix_chain[stop]))
            step_b = t.bgrad_s if solver.zb else t.bwd_s
            # the layers left need m x their work / (ranks left) on some rank, and micro-batch 0
            # must still pass forward through them and backward again
            left = p - 1 - k
            # a later rank s: at least the forward chain up to it plus m x its work (plus, without
            # zero-bubble, the backward chain back from it); micro-batch 0's whole chain
            heaviest = max(solver.suffix_min[stop] / left,
                           -(-solver.blocks_after[stop] // left) * solver.block_time)
            upstream = 0.0 if solver.zb else prefix_b + step_b
            # every later rank s needs the chain to it and back plus m x its own (f + B): over
            # any split of the layers left the largest is at least C = W / (1 - (1 - 1/m)^left)
            # (all equal), W their least f + B per micro-batch (bounds.ConfigBounds.lower_bound derives it)
            spread = solver.suffix_chain[stop] / (1.0 - (1.0 - 1.0 / m) ** left)
            rest = max(prefix_f + t.fwd_s + m * heaviest + upstream,
                       prefix_f + prefix_b + t.fwd_s + step_b + max(solver.suffix_chain[stop], spread))
            if table is not None:
                rest = max(rest, table.rest[k + 1][table.blocks_from(stop)])
            if max(lower, own, rest) >= cut[0] or not solver.can_finish(k + 1, stop):
                continue
            if m <= 4 * p and m * p <= (64 if solver.zb else 256) and simulated_bound(
                    [*chosen, (start, stop, choice)], stop) >= cut[0]:
                continue  # few micro-batches: fill and drain decide, so simulate the prefix
            dfs(k + 1, stop, prefix_f + t.fwd_s, prefix_b + step_b, max(lower, own),
                [*chosen, (start, stop, choice)], max(max_f, t.fwd_s), max(max_b, t.bwd_s),
                max(lower, own, rest))

    def partition_bound(choices: list[tuple[int, int, StageChoice]]) -> float:
        """The per-rank bounds of a whole partition (cheap next to simulating it)."""
        times = [c.time for _, _, c in choices]
        chain = [t.fwd_s + (t.bgrad_s if solver.zb else t.bwd_s) for t in times]
        bound = prefix_f = prefix_b = 0.0
        for k, (_, _, choice) in enumerate(choices):
            t = choice.time
            bound = max(bound, own_bound(k, prefix_f, prefix_b, t, choice.tail_s, sum(chain[k + 1:])))
            prefix_f += t.fwd_s
            prefix_b += chain[k] - t.fwd_s
        return bound

    # balanced partitions first, for a good incumbent (simulated only if it could win)
    target = table.stops() if table is not None else None
    starts = [_balanced(solver)]
    if target is not None:
        starts.insert(0, _from_stops(solver, target))
    for greedy in starts:
        if greedy is not None and partition_bound(greedy) < cut[0]:
            evaluate(greedy)
    if solver.can_finish(0, 0):
        dfs(0, 0, 0.0, 0.0, 0.0, [])
    return PartitionResult(best[1], open_bound[0])


def _from_stops(solver: StageSolver, stops: list[int]) -> list[tuple[int, int, StageChoice]] | None:
    """The partition with these stage ends, if every stage fits."""
    choices, start = [], 0
    for k, stop in enumerate([*stops, solver.L]):
        choice = solver.stage(k, start, stop) if stop > start else None
        if choice is None:
            return None
        choices.append((start, stop, choice))
        start = stop
    return choices


def _balanced(solver: StageSolver) -> list[tuple[int, int, StageChoice]] | None:
    """Greedy: fill each stage up to an equal share of the remaining fastest time."""
    p, L = solver.plan.pp, solver.L
    choices, start = [], 0
    for k in range(p):
        left = p - k
        if k == p - 1:
            stop = L
        else:
            target = solver.suffix_min[start] / left
            stop, acc = start, 0.0
            while stop < L - (left - 1) and (stop == start or acc + (
                    solver.suffix_min[stop] - solver.suffix_min[stop + 1]) / 2 <= target):
                acc += solver.suffix_min[stop] - solver.suffix_min[stop + 1]
                stop += 1
        choice = solver.stage(k, start, stop)
        if choice is None:
            return None
        choices.append((start, stop, choice))
        start = stop
    return choices
