"""Lower bounds on the step time of a configuration, before its stages are chosen.

The planner visits configurations in order of these bounds and skips every one whose bound
reaches the best step found, so their tightness decides the search time.

- ``lower_bound`` (cheap, no memory): some pipeline rank does at least m x (fastest time of all
  layers) / pp; micro-batch 0 passes forward and backward through every layer; 1F1B and
  zero-bubble fill and drain (continuous relaxation); GPipe's flow shop; a pigeonhole bound on
  the blocks; gradient sync, optimizer and ZeRO-3 traffic, affine in a rank's parameters.
- ``memory_bound``: memory forces recompute. For a model whose blocks are alike (one run of
  identical blocks between at most one layer before and one after), pipeline rank k holding n
  blocks needs at least h_k(n) = m x (work of its layers + the least recompute that frees the
  bytes its memory lacks) + its tail, the recompute taken from the linear relaxation (each block
  none, selective or full, fractions allowed). Every h_k grows with n, so the least possible
  max_k h_k(n_k) over all splits of the blocks is found greedily: give each next block to the
  rank whose h grows least. infinity when even full recompute cannot fit the blocks.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from meshmorph.cost.layer_cost import layer_classes
from meshmorph.cost.model import CostModel, in_flight_microbatches
from meshmorph.cost.state import compute_bytes
from meshmorph.plan.space import Config
from meshmorph.plan.stage_solver import fastest_layer_times, unique_gpus
from meshmorph.spec.gpus import GPUSpec
from meshmorph.spec.gpus import gpu as gpu_by_name
from meshmorph.spec.model import LayerKind, ModelSpec, Recompute
from meshmorph.spec.plan import Plan, Schedule


@dataclass(frozen=True, slots=True)
class _Sums:
    """What ``lower_bound`` needs of the layers' fastest times (shared by many configurations)."""

    total: float
    chain: float
    total_f: float
    total_b: float
    block_time: float
    block_params: float
    blocks: int


class ConfigBounds:
    """Lower bounds of configurations on one CostModel, with what configurations share cached."""

    def __init__(self, cost: CostModel, modes: tuple[Recompute, ...]):
        self.cost = cost
        self.modes = modes
        self._sums: dict[tuple, _Sums] = {}
        self._ranks: dict[tuple, _RankModel] = {}

    def __call__(self, config: Config) -> float:
        """The larger of the two bounds; infinity when no split of the layers fits memory."""
        memory = self.memory_bound(config)
        if memory == math.inf:
            return memory
        return max(memory, self.lower_bound(config))

    def _sums_of(self, plan: Plan, gpus: list[GPUSpec]) -> _Sums:
        key = (plan.dtype, plan.micro_batch, plan.tp, plan.sequence_parallel,
               plan.schedule == Schedule.ZERO_BUBBLE, tuple(g.name for g in gpus))
        sums = self._sums.get(key)
        if sums is None:
            cost = self.cost
            fastest = fastest_layer_times(cost, plan, gpus)
            blocks = [i for i, layer in enumerate(cost.model.layers)
                      if layer.kind == LayerKind.BLOCK]
            sums = self._sums[key] = _Sums(
                total=sum(t.work_s for t in fastest), chain=sum(t.chain_s for t in fastest),
                total_f=sum(t.fwd_s for t in fastest), total_b=sum(t.bwd_s for t in fastest),
                block_time=min((fastest[i].work_s for i in blocks), default=0.0),
                block_params=min((cost.chunk_params(i, i + 1, plan.tp) for i in blocks),
                                 default=0.0),
                blocks=len(blocks))
        return sums

    def lower_bound(self, config: Config) -> float:
        """Some pipeline rank does at least m x (fastest time of all layers) / pp, and
        micro-batch 0 passes forward through every layer and backward again (input gradients
        only, for ZB)."""
        cost = self.cost
        plan = config.plan
        gpus = unique_gpus(config.rank_gpus)
        sums = self._sums_of(plan, gpus)
        # tails and ZeRO-3 traffic are affine in a rank's parameters, so over the ranks they sum
        # to at least pp x their value at the average share: add that share to the average
        # rank's work
        m = plan.num_microbatches
        share = cost.chunk_params(0, cost.model.num_layers, plan.tp) / plan.pp
        bound = max(m * sums.total / plan.pp + min(tail_bound(cost, plan, share, g) for g in gpus),
                    sums.chain)
        if plan.pp > 1 and plan.schedule in (Schedule.ONE_F_ONE_B, Schedule.ZERO_BUBBLE):
            # every rank s needs sum_{r<s} w_r + m w_s (micro-batch 0's chain to it and back,
            # plus its own work; w = f + B). Over any split of the total W, the largest of these
            # is at least C with all of them equal: w_s = C (1 - 1/m)^s / m, so
            # C = W / (1 - (1 - 1/m)^p)
            bound = max(bound, sums.chain / _filled_share(m, plan.pp))
        if plan.schedule == Schedule.GPIPE:
            # GPipe is a forward then a backward flow shop of m identical jobs: at least the sum
            # of the stages plus (m - 1) x the slowest stage, at least the average one
            bound = max(bound, sums.chain + (m - 1) * (sums.total_f + sums.total_b) / plan.pp)
        if sums.blocks:
            # pigeonhole: some rank holds ceil(blocks / pp) blocks, their work and their tail
            most = -(-sums.blocks // plan.pp)
            bound = max(bound, m * most * sums.block_time + min(
                tail_bound(cost, plan, most * sums.block_params, g) for g in gpus))
        return bound

    def memory_bound(self, config: Config) -> float:
        """The least max_k h_k(n_k) over every split of the blocks (see the module notes): 0
        when the model's layers are not a run of alike blocks, infinity when no split fits."""
        run = block_run(self.cost.model)
        if run is None:
            return 0.0
        plan = config.plan
        p = plan.pp
        ranks = [self._rank(plan, run, k, config.rank_gpus[k]) for k in range(p)]
        if p == 1:
            return ranks[0].h(run.count)
        table, _ = _least_max(ranks, _least_blocks(run, p), run.count)
        return table[run.count]

    def fill_bound(self, config: Config, floor: float) -> float:
        """``memory_bound`` with the pipeline's fill: rank s starts its work only after
        micro-batch 0 went forward through every block before it (and, in 1F1B and GPipe, ends
        only after the last micro-batch's backward went back through them): at least
        max_s [c x (blocks before s) + K_s + h_s(n_s)], c the least per-block chain time.

        Least over splits by bisection on the step T: for a given T the ranks in order take as
        many blocks as their h allows (h interpolated linearly between whole blocks, a
        relaxation); a block more on an earlier rank costs each later rank at most c / (m x
        block work) <= 1/m of a block, so with m >= pp - 1 taking the most is optimal and T
        is feasible iff they take all blocks. ``floor`` is a known lower bound (the memory
        bound); returns at least it."""
        run = block_run(self.cost.model)
        plan = config.plan
        p, m = plan.pp, plan.num_microbatches
        if (run is None or p == 1 or m < p - 1
                or plan.schedule not in (Schedule.ONE_F_ONE_B, Schedule.ZERO_BUBBLE, Schedule.GPIPE)
                or floor == math.inf):
            return floor
        ranks = [self._rank(plan, run, k, config.rank_gpus[k]) for k in range(p)]
        least = _least_blocks(run, p)
        reserve = [sum(least[k + 1:]) for k in range(p)]
        hop = min(self.cost.p2p_time(plan, gpu_by_name(g)) for g in config.rank_gpus)
        bound = floor
        # rank s starts after micro-batch 0's forward reached it, then does its work and tail;
        # in 1F1B and GPipe the last backward must also go back to rank 0 (which the tail
        # overlaps, so that variant leaves the tail out); in zero-bubble the last B goes back
        # after the rank's F and B ops (its W ops need not precede it)
        kinds = ("h", "fb" if plan.schedule == Schedule.ZERO_BUBBLE else "work")
        for kind in kinds:
            per_block = min(r.block_chain(kind) for r in ranks)
            entry = ranks[0].fixed_chain(kind)
            hops = hop * (1 if kind == "h" else 2)  # forward only, or there and back

            def feasible(step: float, per_block: float = per_block, entry: float = entry,
                         hops: float = hops, kind: str = kind) -> bool:
                placed = 0.0
                for k, rank in enumerate(ranks):
                    room = step - per_block * placed - (entry + hops * k if k else 0.0)
                    n = rank.capacity(room, run.count, kind)
                    if n < least[k]:
                        return False
                    # no more than the blocks left after the later ranks' least
                    placed += min(n, run.count - placed - reserve[k])
                return placed >= run.count - 1e-9

            lo, hi = bound, bound + per_block * run.count + (entry + hops) * p
            if feasible(lo) or not feasible(hi):
                continue  # no better than the bound so far (or some h infinite everywhere)
            for _ in range(40):
                mid = (lo + hi) / 2
                if feasible(mid):
                    hi = mid
                else:
                    lo = mid
                if hi - lo <= 2e-4 * hi:
                    break
            bound = max(bound, lo)
        return bound

    def split_table(self, config: Config) -> SplitTable | None:
        """For the stage search: per pipeline rank k, the least max h over ranks k.. holding any
        number of the last blocks, and the block counts of the split that minimises the bound
        (a balanced start). None when the model is not a run of alike blocks."""
        run = block_run(self.cost.model)
        if run is None or config.plan.pp == 1:
            return None
        plan = config.plan
        p = plan.pp
        ranks = [self._rank(plan, run, k, config.rank_gpus[k]) for k in range(p)]
        least = _least_blocks(run, p)
        rest: list[list[float]] = []
        balanced: list[int] = []
        for k in range(p):
            table, counts = _least_max(ranks[k:], least[k:], run.count)
            rest.append(table)
            if k == 0 and table[run.count] < math.inf:
                balanced = counts
        return SplitTable(run, rest, balanced)

    def _rank(self, plan: Plan, run: BlockRun, k: int, gpu_name: str) -> _RankModel:
        p = plan.pp
        in_flight = in_flight_microbatches(plan.schedule, p, k, plan.num_microbatches, plan.vpp)
        key = (gpu_name, plan.dtype, plan.micro_batch, plan.tp, plan.sequence_parallel, plan.dp,
               plan.zero, plan.num_microbatches, in_flight, k == 0, k == p - 1, p == 1)
        rank = self._ranks.get(key)
        if rank is None:
            rank = self._ranks[key] = _RankModel(self.cost, plan, run, k, gpu_by_name(gpu_name),
                                                 in_flight, self.modes)
        return rank


def tail_bound(cost: CostModel, plan: Plan, params: float, gpu: GPUSpec) -> float:
    """Least gradient sync + optimizer + ZeRO-3 traffic of a rank holding ``params``: affine in
    ``params``, so the average share bounds the average rank."""
    sync, opt = cost.rank_tail(plan, params, float("inf"), gpu)
    gathers, scatter = cost.microbatch_dp_traffic(plan, params, gpu)
    z3 = plan.num_microbatches * (1 - cost.coef.zero3_overlap) * (gathers + scatter)
    return sync + opt + z3


@dataclass(frozen=True, slots=True)
class BlockRun:
    """The model as one layer before, a run of identical blocks, and one layer after."""

    first: int
    """Index of the first block."""
    count: int
    """Number of blocks."""
    prefix: tuple[int, ...]
    """Layers before the blocks (at most one: it sits on pipeline rank 0)."""
    suffix: tuple[int, ...]
    """Layers after the blocks (at most one: it sits on the last pipeline rank)."""


_BLOCK_RUNS: dict[int, tuple[ModelSpec, BlockRun | None]] = {}


def block_run(model: ModelSpec) -> BlockRun | None:
    """The model's run of alike blocks, or None when its layers have another shape."""
    known = _BLOCK_RUNS.get(id(model))
    if known is None or known[0] is not model:
        if len(_BLOCK_RUNS) > 64:
            _BLOCK_RUNS.clear()
        known = _BLOCK_RUNS[id(model)] = (model, _block_run(model))
    return known[1]


def _block_run(model: ModelSpec) -> BlockRun | None:
    classes = layer_classes(model)
    blocks = [i for i, layer in enumerate(model.layers) if layer.kind == LayerKind.BLOCK]
    if not blocks or blocks != list(range(blocks[0], blocks[-1] + 1)):
        return None
    if len({classes[i] for i in blocks}) != 1:
        return None
    prefix = tuple(range(blocks[0]))
    suffix = tuple(range(blocks[-1] + 1, model.num_layers))
    if len(prefix) > 1 or len(suffix) > 1:
        return None
    return BlockRun(blocks[0], len(blocks), prefix, suffix)


def _hull(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Lower convex hull of (bytes saved, seconds added) per block, from (0, 0) rightwards."""
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


def _least_extra(hull: list[tuple[float, float]], need: float, n: int) -> float:
    """Least added time for n blocks to save ``need`` bytes (fractions of modes allowed)."""
    if need <= 0:
        return 0.0
    if n == 0:
        return math.inf
    x = need / n
    for (x1, y1), (x2, y2) in zip(hull, hull[1:], strict=False):
        if x <= x2:
            return n * (y1 + (y2 - y1) * (x - x1) / (x2 - x1))
    return math.inf


def _least_blocks(run: BlockRun, p: int) -> list[int]:
    """Fewest blocks per pipeline rank: a middle rank holds at least one layer, so one block."""
    return [0 if (k == 0 and run.prefix) or (k == p - 1 and run.suffix) else 1 for k in range(p)]


def _least_max(ranks: list[_RankModel], least: list[int],
               count: int) -> tuple[list[float], list[int]]:
    """Greedy over the ranks: each next block goes to the rank whose h grows least. Every h is
    non-decreasing, so after each block the running max is the least max_k h_k(n_k) over all
    splits of that many blocks. Returns that least max for 0..count blocks (infinity where no
    split fits) and the counts of the split of all ``count`` blocks."""
    table = [math.inf] * (count + 1)
    counts = list(least)
    base = sum(counts)
    if base > count:
        return table, counts
    worst = max(rank.h(n) for rank, n in zip(ranks, counts, strict=True))
    table[base] = worst
    heap = [(rank.h(n + 1), j) for j, (rank, n) in enumerate(zip(ranks, counts, strict=True))]
    heapq.heapify(heap)
    for total in range(base + 1, count + 1):
        value, j = heapq.heappop(heap)
        if value == math.inf:
            break
        counts[j] += 1
        worst = max(worst, value)
        table[total] = worst
        heapq.heappush(heap, (ranks[j].h(counts[j] + 1), j))
    return table, counts


@dataclass(frozen=True, slots=True)
class SplitTable:
    """What the stage search takes from the block-split bound of one configuration."""

    run: BlockRun
    rest: list[list[float]]
    """rest[k][n]: no ranks k..pp-1 holding the last n blocks (and the layer after them) finish
    in less (their own work, recompute and tail; infinity when they cannot hold them)."""
    balanced: list[int]
    """Blocks per rank of the split that minimises the bound (empty when none fits)."""

    def blocks_from(self, start: int) -> int:
        """Blocks among layers [start, L)."""
        return self.run.count - min(max(start - self.run.first, 0), self.run.count)

    def stops(self) -> list[int] | None:
        """Stage ends of the balanced split (the fixed layers with the first and last rank)."""
        if not self.balanced:
            return None
        stops, at = [], self.run.first
        for n in self.balanced[:-1]:
            at += n
            stops.append(at)
        return stops


class _RankModel:
    """h(n) of one pipeline rank: its least time holding its fixed layers and n blocks."""

    def __init__(self, cost: CostModel, plan: Plan, run: BlockRun, k: int, gpu: GPUSpec,
                 in_flight: float, modes: tuple[Recompute, ...]):
        coster = cost.coster(plan.dtype)
        model = cost.model
        m = plan.num_microbatches
        b, tp, sp = plan.micro_batch, plan.tp, plan.sequence_parallel
        fixed = [*(run.prefix if k == 0 else ()), *(run.suffix if k == plan.pp - 1 else ())]
        self.per_param = cost.held(plan).at_peak  # bytes per parameter, buffers included
        pb = compute_bytes(plan.dtype)  # one gathered ZeRO-3 copy
        d = plan.dp
        # fixed layers at their fastest and at their smallest, each on its own (a relaxation)
        self.fixed_work = 0.0
        self.fixed_fwd = 0.0
        self.fixed_wgrad = 0.0
        self.fixed_params = 0.0
        fixed_act = 0.0
        biggest_fixed = 0.0
        for index in fixed:
            layer = model.layers[index]
            layer_modes = [mode for mode in modes if mode in layer.activation] or [Recompute.NONE]
            costs = [coster.layer(index, gpu, b, tp, sp, mode) for mode in layer_modes]
            self.fixed_work += min(c.fwd_s + c.bwd_s for c in costs)
            self.fixed_fwd += min(c.fwd_s for c in costs)
            self.fixed_wgrad += max(c.wgrad_s for c in costs)
            fixed_act += min(c.activation_bytes for c in costs)
            params = cost.chunk_params(index, index + 1, tp)
            self.fixed_params += params
            biggest_fixed = max(biggest_fixed, params)
        if plan.pp == 1 and run.suffix:
            self.fixed_params -= model.layers[run.suffix[0]].tied_params / tp
        self.block_params = cost.chunk_params(run.first, run.first + 1, tp)
        block = model.layers[run.first]
        none = coster.layer(run.first, gpu, b, tp, sp, Recompute.NONE)
        self.block_work = none.fwd_s + none.bwd_s
        self.block_fwd = none.fwd_s
        self.block_wgrad = none.wgrad_s
        self.block_act = in_flight * none.activation_bytes
        points = [(0.0, 0.0)]
        self.working = math.inf  # a block that recomputes needs at least this while it does
        for mode in modes:
            if mode != Recompute.NONE and mode in block.activation:
                c = coster.layer(run.first, gpu, b, tp, sp, mode)
                points.append((in_flight * (none.activation_bytes - c.activation_bytes),
                               c.fwd_s + c.bwd_s - self.block_work))
                self.working = min(self.working, c.working_bytes)
        self.hull = _hull(points)
        zero3 = plan.zero == 3 and d > 1 and plan.pp == 1
        self.buffer_fixed = 2 * biggest_fixed * pb if zero3 else 0.0
        self.buffer_blocks = 2 * max(biggest_fixed, self.block_params) * pb if zero3 else 0.0
        reserved = cost.coef.context_bytes + cost.coef.memory_reserve_fraction * gpu.memory_bytes
        self.fixed_bytes = reserved + in_flight * fixed_act - gpu.memory_bytes
        self.m = m
        t0 = tail_bound(cost, plan, 0.0, gpu)
        self.tail0, self.tail1 = t0, (tail_bound(cost, plan, 1e9, gpu) - t0) / 1e9
        self._h: dict[int, float] = {}

    def h(self, n: int) -> float:
        value = self._h.get(n)
        if value is None:
            value = self._h[n] = self._value(n)
        return value

    def capacity(self, room: float, most: int, kind: str = "h") -> float:
        """Most blocks (a real number: the function interpolated linearly between whole
        blocks) with h (``kind`` "h"), h without the tail ("work") or only the F and B ops
        ("fb") at most ``room``, at most ``most``; -1 when not even zero blocks fit."""
        h = {"h": self.h, "work": self.work, "fb": self.fb}[kind]
        if h(0) > room:
            return -1.0
        lo, hi = 0, most
        if h(most) <= room:
            return float(most)
        while hi - lo > 1:  # h(lo) <= room < h(hi)
            mid = (lo + hi) // 2
            if h(mid) <= room:
                lo = mid
            else:
                hi = mid
        step = h(hi) - h(lo)
        return lo + ((room - h(lo)) / step if step < math.inf else 0.0)

    def work(self, n: int) -> float:
        """h(n) without the tail (gradient sync, optimizer, ZeRO-3 traffic)."""
        value = self.h(n)
        if value == math.inf:
            return value
        return value - self.tail0 - self.tail1 * (self.fixed_params + n * self.block_params)

    def fb(self, n: int) -> float:
        """work(n) without the weight-gradient ops (zero-bubble's W)."""
        return self.work(n) - self.m * (self.fixed_wgrad + n * self.block_wgrad)

    def block_chain(self, kind: str) -> float:
        """One block's share of micro-batch 0's chain in the fill bound of ``kind``: its forward
        ("h"), forward and backward ("work"), forward and input gradient ("fb")."""
        return {"h": self.block_fwd, "work": self.block_work,
                "fb": self.block_work - self.block_wgrad}[kind]

    def fixed_chain(self, kind: str) -> float:
        """The fixed layers' share of that chain."""
        return {"h": self.fixed_fwd, "work": self.fixed_work,
                "fb": self.fixed_work - self.fixed_wgrad}[kind]

    def _value(self, n: int) -> float:
        params = self.fixed_params + n * self.block_params
        need = (self.fixed_bytes + self.per_param * params + n * self.block_act
                + (self.buffer_blocks if n else self.buffer_fixed))
        if need > 0:
            need += self.working  # some block recomputes, and rematerialises while it does
        extra = _least_extra(self.hull, need, n)
        if extra == math.inf:
            return math.inf
        return (self.m * (self.fixed_work + n * self.block_work + extra)
                + self.tail0 + self.tail1 * params)


def _filled_share(m: int, ranks: int) -> float:
    """1 - (1 - 1/m)^ranks, without rounding to 0 for huge m."""
    return 1.0 if m == 1 else -math.expm1(ranks * math.log1p(-1.0 / m))
