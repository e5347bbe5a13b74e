"""The fastest plan of one configuration (plan/space.py), exactly under the cost model.

Regular configurations: non-interleaved schedules get the exact stage partition with the best
per-stage recompute (plan/stage_recompute.py per stage, plan/partition_search.py over stage
ends); interleaved schedules take each chunk split of
``plan.partition_search.interleaved_block_counts`` (even where the blocks divide; else, as
Megatron-LM's first and last stage layer counts, any ends around equal interior chunks), the V
schedules split the blocks evenly; both use one recompute mode for all blocks.

Configurations with per-layer strategies (``Config.strategies``): every layer chooses its
strategy and recompute (plan/strategy_dp.py's program per rank), each plan priced by
``CostModel.estimate`` with every layer its own segment (cost/segments.py).

- pp = 1: the rank's own time is the step; the program gives the optimum over every per-layer
  assignment (tests/unit/test_layerwise_exact.py).
- pp > 1, GPipe, 1F1B and zero-bubble: every stage partition and, per stage, every assignment on
  its front (plan/strategy_fronts.py, plan/partition_search.py's ``best_front_partition``):
  the optimum over all partitions and per-layer assignments
  (tests/unit/test_layerwise_pipeline_exact.py).
- interleaved, zbv, dualpipev: the blocks split evenly and each rank's chunks minimise the
  rank's own m (f + b) + tail together; not proven optimal over the per-chunk trade-offs, so
  the configuration's bound stays open.

With ``ends`` (a tied embedding and head, spec/runnable.py) the model's first and last layer
share one (tp, ZeRO) pair, each pair tried in turn.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

from meshmorph.cost.estimate import Estimate
from meshmorph.cost.layer_cost import PieceCost
from meshmorph.cost.model import CostModel
from meshmorph.plan.block_run import block_run
from meshmorph.plan.bounds import ConfigBounds, rank_chunks
from meshmorph.plan.fastest_layers import cluster_gpu
from meshmorph.plan.partition_search import (
    PartitionResult,
    best_front_partition,
    interleaved_block_counts,
    solve_partition,
    stages_of_counts,
)
from meshmorph.plan.space import Config, SearchOptions
from meshmorph.plan.stage_recompute import StageSolver
from meshmorph.plan.strategy_dp import StageSolution, TermsCache, solve_stage
from meshmorph.plan.strategy_fronts import FrontBudgetExceeded, StageFronts
from meshmorph.schedule.table import Schedule
from meshmorph.spec.gpus import GPUSpec
from meshmorph.spec.model import ModelSpec, Recompute
from meshmorph.spec.plan import LayerStrategy, Plan, StagePlan

Found = tuple[Plan, Estimate] | None
"""A plan with its estimate, or None."""


@dataclass(frozen=True, slots=True)
class LayersResult:
    """What one configuration with per-layer strategies gives."""

    uniform: Found
    """Its best plan with one strategy per stage (a rank's chunks share it)."""
    best: Found
    """Its best plan."""
    open_bound_s: float
    """No plan of it left unexplored is faster than this (inf: solved to the end)."""


def even_estimate(cost: CostModel, config: Config, mode: Recompute) -> tuple[Plan, Estimate]:
    """A configuration with its blocks split evenly (Megatron-style) and ``mode`` recompute."""
    candidate, gpus, times = _even_times(cost, config, mode)
    return candidate, cost.assemble(candidate, gpus, times)


def _even_times(cost: CostModel, config: Config, mode: Recompute
                ) -> tuple[Plan, list[GPUSpec], list[PieceCost]]:
    """``even_estimate``'s plan, chunk GPUs and chunk times, not yet simulated (chunks with
    the same layers and recompute priced once)."""
    candidate = config.plan.with_even_stages(cost.model, mode)
    gpus = _chunk_gpus(cost, config)
    if len(set(config.rank_gpus)) > 1:
        candidate = replace(candidate, stages=tuple(
            replace(s, gpu=g.name) for s, g in zip(candidate.stages, gpus, strict=True)))
    return candidate, gpus, _chunk_times(cost, candidate, candidate.stages, gpus, mode, {})


def _chunk_gpus(cost: CostModel, config: Config) -> list[GPUSpec]:
    """The GPU of each model chunk of ``config`` (its pipeline rank's)."""
    plan = config.plan
    return [cluster_gpu(cost, config.rank_gpus[plan.pp_rank_of_chunk(c)])
            for c in range(plan.num_chunks)]


def _chunk_times(cost: CostModel, plan: Plan, stages: Sequence[StagePlan], gpus: list[GPUSpec],
                 mode: Recompute, chunks: dict[tuple, PieceCost]) -> list[PieceCost]:
    """``cost.chunk_time`` of each stage (every block under ``mode``) on its GPU, looked up in
    and added to ``chunks``: by (first, last, layers, mode, GPU) where the model's ends are
    alike (``_alike_ends``), else by (start, stop, mode, GPU)."""
    alike = _alike_ends(cost.model)
    times, last = [], len(stages) - 1
    for c, (s, g) in enumerate(zip(stages, gpus, strict=True)):
        key = (c == 0, c == last, s.stop - s.start, mode, g.name) if alike else \
            (s.start, s.stop, mode, g.name)
        time = chunks.get(key)
        if time is None:
            time = chunks[key] = cost.chunk_time(plan, s.start, s.stop, s.recompute, g)
        times.append(time)
    return times


def _alike_ends(model: ModelSpec) -> bool:
    """Whether the model is one layer, a run of alike blocks, one layer: a chunk's layers (and
    so its time, added up in the same order) are fixed by its length and whether it holds the
    first or the last layer."""
    run = block_run(model)
    return run is not None and run.prefix == (0,) and run.suffix == (model.num_layers - 1,)


def dominated(times: Sequence[PieceCost], seen: Sequence[Sequence[PieceCost]]) -> bool:
    """Whether some chunk times of ``seen`` (the same chunks under another recompute) are
    nowhere slower than ``times``: every chunk's forward, backward, input and weight gradient
    at most these, with the same compute and parameters (the tail reads only those). The
    simulated schedule never ends sooner when an op grows (max-plus) and the tails are the
    same, so ``times`` cannot give a shorter step than the plan ``seen`` held."""
    return any(all(a.fwd_s <= b.fwd_s and a.bwd_s <= b.bwd_s and a.bgrad_s <= b.bgrad_s
                   and a.wgrad_s <= b.wgrad_s and a.compute_s == b.compute_s
                   and a.params == b.params for a, b in zip(other, times, strict=True))
               for other in seen)


def counts_times(cost: CostModel, config: Config, counts: tuple[int, ...], mode: Recompute,
                 chunks: dict[tuple, PieceCost] | None = None
                 ) -> tuple[list[GPUSpec], list[PieceCost], tuple[StagePlan, ...]]:
    """An interleaved configuration with chunks of ``counts`` blocks and ``mode`` recompute:
    its chunk GPUs, chunk times and stages (``stages_of_counts``; the configuration's plan
    with them is the candidate), not yet simulated.
    ``chunks``: the configuration's chunk times by (start, stop, mode, GPU), filled as they are
    priced (a chunk's time reads the plan's strategy, not the stages of the others)."""
    gpus = _chunk_gpus(cost, config)
    stages = stages_of_counts(cost.model, counts, mode, [g.name for g in gpus]
                              if len(set(config.rank_gpus)) > 1 else None)
    times = _chunk_times(cost, config.plan, stages, gpus, mode, {} if chunks is None else chunks)
    return gpus, times, stages


def busiest_rank_s(plan: Plan, times: Sequence[PieceCost]) -> float:
    """m x the forward and backward of the busiest rank's chunks: no step of them is shorter."""
    return plan.num_microbatches * max(sum(times[c].fwd_s + times[c].bwd_s
                                           for c in plan.chunks_of(k)) for k in range(plan.pp))


def _solve_interleaved(cost: CostModel, config: Config, options: SearchOptions,
                       bound: float, bounds: ConfigBounds) -> PartitionResult:
    """``solve_config`` of an interleaved configuration: every chunk split
    ``interleaved_block_counts`` lists, each recompute mode, cheapest proof first (the ranks'
    layers with the fill, plan/layer_work.py; the busiest rank's chunks with their ZeRO
    traffic, then with the tails) and the schedule simulated only for what none of them cuts."""
    plan = config.plan
    best = None
    chunks: dict[tuple, PieceCost] = {}
    splits = interleaved_block_counts(cost.model.num_blocks, plan.num_chunks)
    work = bounds.layer_work(config)
    filled = dict(zip(options.recompute, work.filled_s(splits, options.recompute), strict=True)) \
        if splits else {}
    for at, counts in enumerate(splits):
        fitted: list[list[PieceCost]] = []  # times of this split's modes that fit memory
        for mode in options.recompute:
            if filled[mode][at] >= bound:
                continue  # its layers with the fill take longer than the best found
            gpus, times, stages = counts_times(cost, config, counts, mode, chunks)
            if busiest_rank_s(plan, times) >= bound or dominated(times, fitted) or \
                    not cost.stages_fit(plan, gpus, stages) or \
                    cost.reaches_bound(plan, gpus, times, [(s.start, s.stop) for s in stages],
                                       bound):
                continue  # no faster than the best found or than a mode that fits, or too big
            candidate = replace(plan, stages=stages)
            estimate = _fits_below(cost, candidate, gpus, times, bound, fitted)
            if estimate is not None:
                bound, best = estimate.step_time_s, (candidate, estimate)
    return PartitionResult(best, float("inf"))


def _fits_below(cost: CostModel, candidate: Plan, gpus: list[GPUSpec], times: list[PieceCost],
                bound: float, fitted: list[list[PieceCost]]) -> Estimate | None:
    """``candidate``'s estimate when it is below ``bound`` and fits memory (its times then join
    ``fitted``, the modes that fit); None otherwise."""
    estimate = cost.assemble_below(candidate, gpus, times, bound, fitting=True)
    if estimate is None or not estimate.fits:
        return None
    fitted.append(times)
    return estimate


def solve_config(cost: CostModel, config: Config, options: SearchOptions,
                 bound: float, bounds: ConfigBounds) -> PartitionResult:
    """The fastest plan of one configuration with step time below ``bound``, and the bound of
    what was left unexplored."""
    plan = config.plan
    if plan.schedule == Schedule.INTERLEAVED:
        return _solve_interleaved(cost, config, options, bound, bounds)
    if plan.num_chunks > plan.pp:  # the V schedules: blocks split evenly
        best = None
        fitted: list[list[PieceCost]] = []  # times of the modes that fit memory
        for mode in options.recompute:
            candidate, gpus, times = _even_times(cost, config, mode)
            if dominated(times, fitted):
                continue  # no faster than a mode that fits
            estimate = _fits_below(cost, candidate, gpus, times, bound, fitted)
            if estimate is not None:
                bound, best = estimate.step_time_s, (candidate, estimate)
        return PartitionResult(best, float("inf"))
    gpus = [cluster_gpu(cost, name) for name in config.rank_gpus]
    return solve_partition(StageSolver(cost, plan, gpus, options.recompute), bound,
                           options.tolerance, options.max_nodes, bounds.split_table(config, bound))


def solve_layers(cost: CostModel, config: Config, options: SearchOptions,
                 bounds: tuple[float, float], cache: TermsCache,
                 config_bound: float) -> LayersResult:
    """The best plans of a configuration with per-layer strategies (module docstring): a rank
    slower than ``bounds`` (the best uniform and per-layer steps found so far) is not finished;
    ``config_bound`` is the configuration's own bound (kept where it is left open)."""
    plan, strategies = config.plan, list(config.strategies or ())
    uniform_only = options.one_strategy_per_stage
    ends = list(config.ends) if config.ends is not None else None
    if plan.pp > 1 and plan.vpp == 1:
        return LayersResult(*solve_partitioned(cost, plan, strategies, options, uniform_only,
                                               bounds, cache, config_bound, ends))
    one, mixed = _solve_plan(cost, plan, strategies, options, uniform_only, bounds, cache, ends)
    # interleaved and V: even chunks, each rank its own busy time: the bound stays open
    return LayersResult(one, mixed, config_bound if plan.pp > 1 else float("inf"))


def _build(cost: CostModel, plan: Plan,
           chunks: list[tuple[int, int, tuple[LayerStrategy, ...], tuple]]) -> tuple[Plan, Estimate]:
    """The plan of ``chunks`` (start, stop, strategy and recompute of each layer, one per model
    chunk in chunk order) and its estimate: its own tp/dp/zero the most common layer strategy
    (with sequence parallelism, the most common at tp > 1), every stage listing its layer
    strategies (the runtime's rule: all stages or none), so that the plan is priced, and run,
    layer by layer as the per-layer search priced it (cost/segments.py)."""
    every = Counter(s for _, _, strategies, _ in chunks for s in strategies)
    split = Counter({s: n for s, n in every.items() if s.tp > 1})
    sp = plan.sequence_parallel and bool(split)
    common = (split if sp else every).most_common(1)[0][0]
    sequences = plan.dp * plan.micro_batch
    top = replace(plan, tp=common.tp, dp=common.dp, zero=common.zero, sequence_parallel=sp,
                  micro_batch=sequences // common.dp, stages=())
    stages = tuple(StagePlan(start=a, stop=b, recompute=tuple(recompute),
                             layer_strategies=tuple(strategies))
                   for a, b, strategies, recompute in chunks)
    final = replace(top, stages=stages)
    return final, cost.estimate(final)


def _assemble(cost: CostModel, plan: Plan, solved: list[StageSolution]) -> tuple[Plan, Estimate]:
    """The plan of the ranks' solutions over ``plan``'s stages (a rank's chunks in order)."""
    per_chunk: dict[int, tuple[tuple[LayerStrategy, ...], tuple]] = {}
    for k, sol in enumerate(solved):
        at = 0
        for c in plan.chunks_of(k):
            n = plan.stages[c].num_layers
            per_chunk[c] = (sol.strategies[at:at + n], sol.recompute[at:at + n])
            at += n
    return _build(cost, plan, [(st.start, st.stop, *per_chunk[c])
                               for c, st in enumerate(plan.stages)])


def _solve_plan(cost: CostModel, plan: Plan, strategies: list[LayerStrategy],
                options: SearchOptions, uniform_only: bool, bounds: tuple[float, float],
                cache: TermsCache, ends: list[tuple[int, int]] | None = None
                ) -> tuple[tuple[Plan, Estimate] | None, tuple[Plan, Estimate] | None]:
    """(best with one strategy per rank, best per layer) of one configuration; a rank slower
    than ``bounds`` (the best uniform and per-layer steps found so far: a step is never shorter
    than any rank's own time) cannot make a better plan and is not finished. With ``ends``
    (a tied embedding and head) the model's first and last layer get one of these (tp, zero)
    pairs, the same on both: at pp = 1 each pair is tried in the one rank's program, with
    pp > 1 each pair in turn for the whole plan (the two ends sit on different ranks)."""
    if ends is not None and plan.pp > 1 and len(ends) > 1:
        one = mixed = None
        for pair in ends:
            found = _solve_plan(cost, plan, strategies, options, uniform_only, bounds, cache,
                                [pair])
            one, mixed = _faster(one, found[0]), _faster(mixed, found[1])
        return one, mixed
    gpu = cost.default_gpu()
    uniform: list[StageSolution] = []
    mixed_: list[StageSolution] = []
    last = cost.model.num_layers - 1
    for k in range(plan.pp):
        chunks = rank_chunks(plan, k)
        holds_end = any(a == 0 or b == last + 1 for a, b in chunks)
        solved = (solve_stage(cost, plan, k, 0, 0, [s], options.recompute, gpu,
                              upper_bound_s=bounds[0], cache=cache, chunks=chunks)
                  for s in strategies  # a tied end under a strategy not in ``ends`` does not run
                  if ends is None or not holds_end or (s.tp, s.zero) in ends)
        best = min((sol for sol in solved if sol is not None), key=lambda sol: sol.busy_s,
                   default=None)
        if best is not None:
            uniform.append(best)
        if uniform_only:
            continue
        bound = min(best.busy_s if best is not None else float("inf"), bounds[1])
        per_layer = None
        for pair in ends if ends is not None and holds_end else [None]:
            found = solve_stage(cost, plan, k, 0, 0, strategies, options.recompute, gpu,
                                upper_bound_s=bound, cache=cache, chunks=chunks, ends=pair)
            if found is not None and (per_layer is None or found.busy_s < per_layer.busy_s):
                per_layer, bound = found, min(bound, found.busy_s)
        if per_layer is not None and (best is None or per_layer.busy_s < best.busy_s):
            best = per_layer
        if best is None:
            return None, None
        mixed_.append(best)
    one = _assemble(cost, plan, uniform) if len(uniform) == plan.pp else None
    return one, (_assemble(cost, plan, mixed_) if not uniform_only else one)


def _step(found: Found) -> float:
    """The step of a found plan (inf for none)."""
    return found[1].step_time_s if found is not None else float("inf")


def _faster(best: Found, found: Found) -> Found:
    """``found`` when it is faster than ``best`` (or ``best`` is None), else ``best``."""
    return found if found is not None and (best is None or _step(found) < _step(best)) \
        else best


LABELS_PER_NODE = 1
"""A stage program may keep this many labels per branch-and-bound node of the options' budget
(``SearchOptions.max_nodes``; None: no budget) before its configuration is left open."""


def solve_partitioned(cost: CostModel, plan: Plan, strategies: list[LayerStrategy],
                      options: SearchOptions, uniform_only: bool, bounds: tuple[float, float],
                      cache: TermsCache, config_bound: float = 0.0,
                      ends: list[tuple[int, int]] | None = None
                      ) -> tuple[tuple[Plan, Estimate] | None, tuple[Plan, Estimate] | None,
                                 float]:
    """(best uniform, best per layer, least bound left open) of a pp > 1 configuration with one
    chunk per rank: the even split first (a quick incumbent), then every partition exactly
    (plan/partition_search.py's ``best_front_partition``), with one strategy per stage, then per layer. With ``ends``
    (a tied embedding and head) the partition search runs once per (tp, zero) pair, the model's
    first and last layer held to it (``StageFronts``'s ``ends``): the best over the pairs is
    the best over every plan whose two ends agree."""
    one, mixed = _solve_plan(cost, plan, strategies, options, uniform_only, bounds, cache, ends)
    gpu = cost.default_gpu()
    open_bound = float("inf")

    def build(stages: list) -> tuple[Plan, Estimate]:
        chunks = []
        for a, b, point in stages:
            picked = point.assignment(strategies)
            chunks.append((a, b, tuple(s for _, s, _ in picked), tuple(r for _, _, r in picked)))
        return _build(cost, plan, chunks)

    for uniform, pair in itertools.product((True, False), ends or [None]):
        if _step(one) < _step(mixed):  # a rank's least busy time is not always the least step
            mixed = one
        if not uniform and uniform_only:
            break
        bound = min(bounds[0], _step(one)) if uniform else \
            min(bounds[1], _step(one), _step(mixed))
        fronts = StageFronts(cost, plan, strategies, options.recompute, gpu, cache,
                             uniform=uniform, max_labels=None if options.max_nodes is None
                             else LABELS_PER_NODE * options.max_nodes, ends=pair)
        try:
            out = best_front_partition(fronts, bound, options.tolerance, options.max_nodes)
        except FrontBudgetExceeded:  # left open: its bound stays unproven
            open_bound = min(open_bound, config_bound)
            continue
        open_bound = min(open_bound, out.open_bound_s)
        if out.stages is not None:
            found = build(out.stages)
            if uniform:
                one = found if _step(found) < _step(one) else one
            if _step(found) < _step(mixed):
                mixed = found
    return one, (one if uniform_only else mixed), open_bound


