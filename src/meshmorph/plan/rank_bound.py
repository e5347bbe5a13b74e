"""h_k(n): the least time pipeline rank k can take holding its fixed layers and n blocks.

Memory forces recompute: the rank needs at least m x (work of its layers + the least recompute
that frees the bytes its memory lacks) + its tail, the recompute taken from the linear
relaxation (each block none, selective or full, fractions allowed; ``plan.relaxations``). Its
memory and tail are ``CostModel``'s (``cost.rank_terms``), evaluated for n blocks. Every h_k
grows with n, so the least max_k h_k(n_k) over the splits of the blocks is found greedily
(``least_max``).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace
from enum import StrEnum

import numpy as np

from meshmorph.cost.model import CostModel
from meshmorph.cost.rank_terms import least_rank_tail_s, rank_memory_terms
from meshmorph.plan.block_run import BlockRun
from meshmorph.plan.relaxations import least_extra_time, recompute_hull
from meshmorph.spec.gpus import GPUSpec
from meshmorph.spec.model import Recompute
from meshmorph.spec.plan import Plan


class FillKind(StrEnum):
    """Which of a rank's times the fill bound counts once micro-batch 0's chain reached it."""

    WITH_TAIL = "h"
    """h: its work, recompute and tail (the forward chain reached it)."""
    WORK = "work"
    """h without the tail (1F1B, GPipe: the last backward must still go back to rank 0)."""
    FB_OPS = "fb"
    """Without the W ops it runs after its last input gradient (zero-bubble: those need not
    precede the last B going back); ``left_out``: how many."""
    AFTER_WARMUP = "back"
    """h without its warm-up forwards (``left_out``: how many), which alone may run before its
    first backward: that waits for micro-batch 0's chain through every layer and back to it."""


class RankBound:
    """h(n) of one pipeline rank (module docstring), memoised."""

    def __init__(self, cost: CostModel, plan: Plan, run: BlockRun, k: int, gpu: GPUSpec,
                 modes: tuple[Recompute, ...], in_flight: float | None = None):
        """``in_flight``: the micro-batches the rank keeps in flight, when not its own (h grows
        with them: ``ConfigBounds.busiest_memory_bound``)."""
        terms = rank_memory_terms(cost, plan, k, gpu)
        self.terms = terms = terms if in_flight is None else replace(terms, in_flight=in_flight)
        # the embedding's chunk is rank 0's; the head's is the last rank's, or rank 0's in a V
        head_rank = plan.pp_rank_of_chunk(plan.num_chunks - 1)
        fixed = (*(run.prefix if k == 0 else ()), *(run.suffix if k == head_rank else ()))
        layers = _layer_figures(cost, plan, run, fixed, gpu, modes)
        (self.fixed_work, self.fixed_fwd, self.fixed_wgrad, self.fixed_stored, self.fixed_params,
         self.biggest_fixed, self.block_params, self.block_work, self.block_fwd,
         self.block_wgrad, self.block_stored, recomputing, self.fixed_compute,
         self.block_compute) = layers
        points = [(0.0, 0.0)]
        self.working = math.inf  # a block that recomputes needs at least this while it does
        for stored, work, working in recomputing:
            saved = terms.activation_bytes(self.block_stored - stored, 0.0)
            points.append((saved, work - self.block_work))
            self.working = min(self.working, working)
        self.hull = recompute_hull(points)
        self.m = plan.num_microbatches
        self.tail0, self.tail1, self.syncs = rank_tail_line(cost, plan, gpu)
        self._tail_of_none = least_rank_tail_s(cost, plan, 0.0, gpu)  # the line starts at one
        self._h: dict[int, float] = {}
        self._values: dict[tuple[FillKind, int, int], np.ndarray] = {}
        self._scalars: dict[tuple[FillKind, int, int], float] = {}

    def h(self, n: int) -> float:
        value = self._h.get(n)
        if value is None:
            value = self._h[n] = self._value(n)
        return value

    def capacity(self, room: float, most: int, kind: FillKind = FillKind.WITH_TAIL,
                 left_out: int = 0) -> float:
        """Most blocks (a real number: the function interpolated linearly between whole
        blocks) whose time of ``kind`` is at most ``room``, at most ``most``; -1 when not even
        zero blocks fit. By bisection on ``value`` (non-decreasing in the blocks): a few of
        them, where a whole array costs a deep pipeline's every rank more."""
        if self.value(kind, 0, left_out) > room:
            return -1.0
        if self.value(kind, most, left_out) <= room:
            return float(most)
        lo, hi = 0, most  # value(lo) <= room < value(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.value(kind, mid, left_out) <= room:
                lo = mid
            else:
                hi = mid
        low, high = self.value(kind, lo, left_out), self.value(kind, hi, left_out)
        step = high - low
        return lo + ((room - low) / step if step < math.inf else 0.0)

    def value(self, kind: FillKind, n: int, left_out: int = 0) -> float:
        """``values(kind, ., left_out)[n]`` alone, by the same operations (memoised)."""
        key = (kind, n, left_out)
        found = self._scalars.get(key)
        if found is None:
            found = self._scalars[key] = self._of_kind(kind, self.h(n), n, left_out)
        return found

    def _of_kind(self, kind: FillKind, h, n, left_out: int):  # noqa: ANN001, ANN202
        """The time of ``kind`` from h for n blocks (numbers, or arrays of them)."""
        if kind == FillKind.WITH_TAIL:
            return h
        if kind == FillKind.AFTER_WARMUP:
            return h - left_out * (self.fixed_fwd + n * self.block_fwd)
        work = h - self.tail(n)  # inf - a finite tail stays inf
        if kind == FillKind.FB_OPS:
            return work - left_out * (self.fixed_wgrad + n * self.block_wgrad)
        return work

    def values(self, kind: FillKind, most: int, left_out: int = 0) -> np.ndarray:
        """For n = 0..most: h(n), work(n) (h without the tail: gradient sync, optimizer,
        ZeRO-3 traffic), work(n) less ``left_out`` W ops, or h(n) less ``left_out`` forwards,
        by ``kind`` (a block's forward is the same under every recompute mode); memoised
        (ranks with the same figures share one RankBound)."""
        key = (kind, most, left_out)
        found = self._values.get(key)
        if found is not None:
            return found
        n = np.arange(most + 1)
        h = self._values.get((FillKind.WITH_TAIL, most, 0))
        if h is None:
            h = self._values[(FillKind.WITH_TAIL, most, 0)] = self._all(most)
        with np.errstate(invalid="ignore"):  # inf - a finite tail stays inf
            found = self._values[key] = self._of_kind(kind, h, n, left_out)
        return found

    def tail(self, n):  # noqa: ANN001, ANN201 (a block count, or an array of them)
        """The least tail of the rank holding n blocks: ``least_rank_tail_s`` of its parameters
        (its sync hidden as far as the overlap share allows), plus what of each sync part
        (``CostModel.sync_parts``) cannot hide within the compute it hides behind: two thirds
        of the rank's compute without recompute (``tail_overlap_window_s``; of its first
        chunk, where it holds several, so at most all of it), each part its own fraction.
        The exposed share grows by at most the window's, which m x a block's work exceeds: h
        still grows with n."""
        params = self.fixed_params + n * self.block_params
        scalar = isinstance(n, int)
        if scalar and params <= 0:
            return self._tail_of_none  # no parameters: no collective runs
        tail = self.tail0 + self.tail1 * params + exposed_sync_s(
            self.syncs, params, 2 / 3 * (self.fixed_compute + n * self.block_compute))
        return tail if scalar else np.where(params > 0, tail, self._tail_of_none)

    def fill_chain(self, kind: FillKind) -> tuple[float, float]:
        """(one block's, the fixed layers') share of micro-batch 0's chain in the fill bound of
        ``kind``: their forward, forward and backward, or forward and input gradient
        (``AFTER_WARMUP``: ``back_chain``)."""
        return {FillKind.WITH_TAIL: (self.block_fwd, self.fixed_fwd),
                FillKind.WORK: (self.block_work, self.fixed_work),
                FillKind.FB_OPS: (self.block_work - self.block_wgrad,
                                  self.fixed_work - self.fixed_wgrad)}[kind]

    def back_chain(self, split: bool) -> tuple[float, float]:
        """(one block's, the fixed layers') backward that micro-batch 0's chain back from the loss
        waits for: B, or the input gradient under a ``split`` backward."""
        return (self.block_work - self.block_fwd - (self.block_wgrad if split else 0.0),
                self.fixed_work - self.fixed_fwd - (self.fixed_wgrad if split else 0.0))

    def _all(self, most: int) -> np.ndarray:
        """h(n) for n = 0..most: ``_value`` over an array, the same operations in the same
        order (so the same figures)."""
        n = np.arange(most + 1)
        need = self._over_budget(n, np.where(n > 0, max(self.biggest_fixed, self.block_params),
                                             self.biggest_fixed))
        over = need > 0
        extra = np.zeros(most + 1)
        if over.any():
            # least_extra_time on the hull, per block count
            with np.errstate(divide="ignore", invalid="ignore"):
                x = (need + self.working) / n
            xs = np.array([p[0] for p in self.hull])
            ys = np.array([p[1] for p in self.hull])
            seg = np.clip(np.searchsorted(xs, x, side="left"), 1, max(len(xs) - 1, 1))
            if len(xs) > 1:
                x1, x2, y1, y2 = xs[seg - 1], xs[seg], ys[seg - 1], ys[seg]
                with np.errstate(divide="ignore", invalid="ignore"):
                    inside = n * (y1 + (y2 - y1) * (x - x1) / (x2 - x1))
                inside = np.where((n > 0) & (x <= xs[-1]), inside, math.inf)
            else:
                inside = np.full(most + 1, math.inf)
            extra = np.where(over, inside, 0.0)
        with np.errstate(invalid="ignore"):
            return self.m * (self.fixed_work + n * self.block_work + extra) + self.tail(n)

    def _over_budget(self, n, largest):  # noqa: ANN001, ANN202 (numbers, or arrays of them)
        """Bytes over the budget with no recompute of n blocks, the largest layer's parameters
        ``largest``: CostModel.rank_memory's terms (RankMemoryTerms.total), inline (the same
        operations in the same order, so the same figures)."""
        terms = self.terms
        params = self.fixed_params + n * self.block_params
        stored = self.fixed_stored + n * self.block_stored
        return (params * terms.bytes_per_param + (terms.in_flight * stored + 0.0)
                + largest * terms.gather_bytes_per_param + terms.reserved_bytes) \
            - terms.budget_bytes

    def _value(self, n: int) -> float:
        # ``_over_budget`` and least_extra_time, inline: the same figures as rank_memory's
        need = self._over_budget(
            n, max(self.biggest_fixed, self.block_params) if n else self.biggest_fixed)
        extra = 0.0
        if need > 0:
            need += self.working  # some block recomputes, and rematerialises while it does
            extra = least_extra_time(self.hull, need, n)
            if extra == math.inf:
                return math.inf
        return self.m * (self.fixed_work + n * self.block_work + extra) + self.tail(n)


def _layer_figures(cost: CostModel, plan: Plan, run: BlockRun, fixed: tuple[int, ...],
                   gpu: GPUSpec, modes: tuple[Recompute, ...]) -> tuple:
    """What a ``RankBound`` reads of its layers' costs, memoised on ``cost`` (many ranks of
    many configurations share them): the fixed layers at their fastest and smallest, each on
    its own (a relaxation), one block without recompute, (stored bytes, forward + backward,
    working bytes) of the block under each recompute mode, and the compute the gradient sync
    may hide behind (``tail_overlap_window_s``: without recompute) of the fixed layers, at
    their most, and of a block."""
    coster = cost.coster(plan)
    b, tp, sp = plan.micro_batch, plan.tp, plan.sequence_parallel
    key = (id(coster), gpu.name, b, tp, sp, fixed, plan.pp == 1, modes, run.first)
    found = cost.rank_layers.get(key)
    if found is not None:
        return found
    model = cost.model
    fixed_work = fixed_fwd = fixed_wgrad = fixed_params = fixed_stored = biggest_fixed = 0.0
    fixed_compute = 0.0
    for index in fixed:
        layer = model.layers[index]
        layer_modes = [mode for mode in modes if mode in layer.activation] or [Recompute.NONE]
        costs = [coster.layer(index, gpu, b, tp, sp, mode) for mode in layer_modes]
        fixed_work += min(c.fwd_s + c.bwd_s for c in costs)
        fixed_fwd += min(c.fwd_s for c in costs)
        fixed_wgrad += max(c.wgrad_s for c in costs)
        fixed_stored += min(c.activation_bytes for c in costs)
        fixed_compute += max(c.compute_s for c in costs)
        params = cost.chunk_params(index, index + 1, tp)
        fixed_params += params
        biggest_fixed = max(biggest_fixed, params)
    if plan.pp == 1:  # one rank holds every layer: the cost model's count of its params
        apart = sum(cost.chunk_params(i, i + 1, tp) for i in range(model.num_layers))
        fixed_params -= apart - cost.chunk_params(0, model.num_layers, tp)
    block = model.layers[run.first]
    none = coster.layer(run.first, gpu, b, tp, sp, Recompute.NONE)
    recomputing = []
    for mode in modes:
        if mode != Recompute.NONE and mode in block.activation:
            c = coster.layer(run.first, gpu, b, tp, sp, mode)
            recomputing.append((c.activation_bytes, c.fwd_s + c.bwd_s, c.working_bytes))
    found = cost.rank_layers[key] = (
        fixed_work, fixed_fwd, fixed_wgrad, fixed_stored, fixed_params, biggest_fixed,
        cost.chunk_params(run.first, run.first + 1, tp), none.fwd_s + none.bwd_s, none.fwd_s,
        none.wgrad_s, none.activation_bytes, tuple(recomputing), fixed_compute, none.compute_s)
    return found


def rank_tail_line(cost: CostModel, plan: Plan,
                   gpu: GPUSpec) -> tuple[float, float, tuple[tuple[float, ...], ...]]:
    """``least_rank_tail_s`` of a rank of ``plan`` on ``gpu`` as a line in its parameters
    (its value at none extended from one parameter on, slope; a rank holds at least one
    layer), and per sync part that may hide (``CostModel.sync_parts``): its
    seconds as a line (at none, slope: collectives are affine in their bytes), its share that
    may hide, the fraction of the window it hides behind, and 1 - ``overlap_slowdown`` (what
    each second it cannot hide adds beyond the least tail)."""
    # memoised on ``cost`` by what least_rank_tail_s reads (a superset of sync_parts's fields)
    key = (type(plan), plan.tp, plan.dp, plan.cp, plan.pp, plan.zero, plan.dtype,
           plan.reduce_dtype, plan.num_microbatches, plan.overlap_grad_reduce,
           plan.overlap_param_gather, plan.fsdp_prefetch, gpu.name, gpu.hbm_gbps)
    found = cost.tail_lines.get(key)
    if found is not None:
        return found
    one, many = cost.sync_parts(plan, 1.0, gpu), cost.sync_parts(plan, 1e9, gpu)
    syncs = tuple((*params_line(a.seconds, b.seconds), a.share, a.window,
                   1.0 - cost.coef.overlap_slowdown)
                  for a, b in zip(one, many, strict=True) if a.share > 0 and b.seconds > 0)
    found = cost.tail_lines[key] = (
        *params_line(least_rank_tail_s(cost, plan, 1.0, gpu),
                     least_rank_tail_s(cost, plan, 1e9, gpu)), syncs)
    return found


def exposed_sync_s(syncs: tuple[tuple[float, ...], ...], params, window):  # noqa: ANN001, ANN201
    """What of a rank's sync parts (``rank_tail_line``'s third item) cannot hide behind
    ``window`` seconds of compute beyond the least tail, for a rank holding ``params``
    (numbers or arrays), as ``RankBound.tail`` reads it."""
    exposed = 0.0
    for at_none, slope, share, fraction, kept in syncs:
        short = share * (at_none + slope * params) * (1 - 1e-12) - fraction * window * (1 + 1e-12)
        exposed = exposed + kept * (np.maximum(short, 0.0) if isinstance(short, np.ndarray)
                                    else max(short, 0.0))
    return exposed


def params_line(at_one: float, at_billion: float) -> tuple[float, float]:
    """(value at no parameters, slope) of the line through a figure's values at 1 and 1e9
    parameters: the figures of a rank's tail are affine in its parameters once bytes move (a
    collective's latency counts then), so the line through 0, where none runs, would not do."""
    slope = (at_billion - at_one) / (1e9 - 1.0)
    return at_one - slope, slope


def least_max(ranks: list[RankBound], least: list[int],
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


def grouped_least_max(groups: list[tuple[RankBound, int, int]], count: int) -> float:
    """``least_max``'s least max for all ``count`` blocks, over groups of ranks that share one
    h: (its RankBound, how many ranks, the fewest blocks each holds). The greedy's next block
    at value h(n + 1) goes to every rank of the group in turn, so it takes them all at once
    (the last ones as many as are left): the same picks, the same value."""
    counts = [least for _, _, least in groups]
    left = count - sum(ranks * least for _, ranks, least in groups)
    if left < 0:
        return math.inf
    worst = max(rank.h(n) for (rank, _, _), n in zip(groups, counts, strict=True))
    heap = [(rank.h(n + 1), j) for j, ((rank, _, _), n) in enumerate(zip(groups, counts,
                                                                            strict=True))]
    heapq.heapify(heap)
    while left > 0:
        value, j = heap[0]
        if value == math.inf:
            return math.inf
        worst = max(worst, value)
        rank, ranks, _ = groups[j]
        left -= ranks
        counts[j] += 1
        heapq.heapreplace(heap, (rank.h(counts[j] + 1), j))
    return worst


@dataclass(frozen=True, slots=True)
class SplitTable:
    """What the stage search takes from the block-split bound of one configuration."""

    run: BlockRun
    """The model's layers as one before, a run of alike blocks, one after."""
    rest: list[list[float]]
    """rest[k][n]: no ranks k..pp-1 holding the last n blocks (and the layer after them) finish
    in less (their own work, recompute and tail; infinity when they cannot hold them)."""
    balanced: list[int]
    """Blocks per rank of the split that minimises the bound (empty when none fits)."""
    fill: tuple[tuple[bool, list[list[float]]], ...] = ()
    """Per kind of the fill bound (whether its chain is the forward alone, or the forward and
    the backward the chain waits for): fill[k][n], the least time after micro-batch 0's chain
    through ranks before k reached rank k in which ranks k.. holding the last n whole blocks
    finish (plan/bounds.py's ``_fill_tables``)."""

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
