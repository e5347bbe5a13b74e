"""``meshmorph plan --layerwise``: the fastest plan whose layers each choose their tp/dp/ZeRO.

Configurations: pipeline degree pp (one GPU type; chunks split the blocks evenly, as
``Plan.with_even_stages``), sequences per stage micro-batch B (dividing the global batch, m =
batch / B micro-batches), schedule: 1F1B when m >= pp, else GPipe, and interleaved with v
chunks per rank where the blocks split evenly and m is a multiple of pp. Each stage of D = world / pp devices
offers every split D = tp x dp with tp inside a node and dividing the heads, dp dividing B and
B / dp at most ``max_micro_batch``, under every ZeRO stage of the options. Each pipeline rank (all its
chunks together) is solved by plan/layerwise.py, first with one strategy for all its layers
(``uniform``), then per layer with the best uniform time as its bound; the plan is priced by
``cost.layerwise_cost.estimate_layerwise``.

Exactness: with pp = 1 the stage's own time is the step, so the result is the optimum under
the layerwise cost model over every per-layer assignment (tests/unit/test_layerwise_exact.py
checks it against brute force). With pp > 1 each rank minimises its own m (f + b) + tail, the
step then simulated; that is exact for the slowest stage's busy time, not for the pipeline's
fill, which the stage partition (even here) dominates.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, replace

from meshmorph.cost.estimate import Estimate
from meshmorph.cost.layerwise_cost import estimate_layerwise
from meshmorph.cost.model import CostModel
from meshmorph.plan.layerwise import (
    StageSolution,
    TermsCache,
    solve_stage,
    stage_choices,
    stage_lower_bound_s,
)
from meshmorph.plan.space import SearchOptions, divisors, tp_degrees
from meshmorph.spec.cluster import Cluster
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import LayerStrategy, Plan, PlanError, Schedule, StagePlan


class LayerwiseDoesNotFit(PlanError):
    """No layerwise plan of the cluster fits memory."""


@dataclass(frozen=True, slots=True)
class LayerwiseResult:
    """The best layerwise plan and the best plan with one strategy per stage."""

    plan: Plan
    """Best plan (per-layer strategies where they differ from the plan's)."""
    estimate: Estimate
    """Its figures under cost/layerwise_cost.py."""
    uniform_plan: Plan | None
    """Best plan with one strategy per stage, None when none fits."""
    uniform_estimate: Estimate | None
    """Its figures under the same cost model."""
    search_time_s: float
    """Wall-clock seconds of the whole search."""
    configurations: int
    """(pp, micro-batch) configurations in the space."""
    configurations_solved: int
    """Those solved (the others' lower bound could not beat the best found)."""


def _strategies(model: ModelSpec, cluster: Cluster, options: SearchOptions, devices: int,
                sequences: int) -> list[LayerStrategy]:
    out = []
    for tp in tp_degrees(model, cluster, options):
        dp = devices // tp
        if devices % tp or sequences % dp or sequences // dp > options.max_micro_batch:
            continue
        out.extend(LayerStrategy(tp=tp, dp=dp, zero=z)
                   for z in (options.zero_stages if dp > 1 else (0,)))
    return out


def _rank_chunks(plan: Plan, k: int) -> list[tuple[int, int]]:
    """The layer ranges of pipeline rank ``k``'s chunks, in order."""
    return [(plan.stages[c].start, plan.stages[c].stop) for c in plan.chunks_of(k)]


def _assemble(cost: CostModel, plan: Plan, solved: list[StageSolution]) -> tuple[Plan, Estimate]:
    """The plan of the ranks' solutions: its own tp/dp/zero the most common layer strategy,
    stages listing layer strategies only where some layer differs from it."""
    common = Counter(s for sol in solved for s in sol.strategies).most_common(1)[0][0]
    sequences = plan.dp * plan.micro_batch
    top = replace(plan, tp=common.tp, dp=common.dp, zero=common.zero,
                  micro_batch=sequences // common.dp, stages=())
    per_chunk: dict[int, tuple[tuple[LayerStrategy, ...], tuple]] = {}
    for k, sol in enumerate(solved):
        at = 0
        for c in plan.chunks_of(k):
            n = plan.stages[c].num_layers
            per_chunk[c] = (sol.strategies[at:at + n], sol.recompute[at:at + n])
            at += n
    stages = tuple(
        StagePlan(start=st.start, stop=st.stop, recompute=per_chunk[c][1],
                  layer_strategies=None if set(per_chunk[c][0]) == {common} else per_chunk[c][0])
        for c, st in enumerate(plan.stages))
    final = replace(top, stages=stages)
    return final, estimate_layerwise(cost, final)


def _solve_plan(cost: CostModel, plan: Plan, strategies: list[LayerStrategy],
                options: SearchOptions, uniform_only: bool, bounds: tuple[float, float],
                cache: TermsCache) -> tuple[tuple[Plan, Estimate] | None,
                                            tuple[Plan, Estimate] | None]:
    """(best with one strategy per rank, best per layer) of one configuration; a rank slower
    than ``bounds`` (the best uniform and per-layer steps found so far: a step is never shorter
    than any rank's own time) cannot make a better plan and is not finished."""
    gpu = cost.default_gpu()
    uniform: list[StageSolution] = []
    mixed: list[StageSolution] = []
    for k in range(plan.pp):
        chunks = _rank_chunks(plan, k)
        best: StageSolution | None = None
        for s in strategies:
            one = solve_stage(cost, plan, k, 0, 0, [s], options.recompute, gpu,
                              upper_bound_s=bounds[0], cache=cache, chunks=chunks)
            if one is not None and (best is None or one.busy_s < best.busy_s):
                best = one
        if best is not None:
            uniform.append(best)
        if uniform_only:
            continue
        bound = min(best.busy_s if best is not None else float("inf"), bounds[1])
        per_layer = solve_stage(cost, plan, k, 0, 0, strategies, options.recompute, gpu,
                                upper_bound_s=bound, cache=cache, chunks=chunks)
        if per_layer is not None and (best is None or per_layer.busy_s < best.busy_s):
            best = per_layer
        if best is None:
            return None, None
        mixed.append(best)
    one = _assemble(cost, plan, uniform) if len(uniform) == plan.pp else None
    return one, (_assemble(cost, plan, mixed) if not uniform_only else one)


def search_layerwise(model: ModelSpec, cluster: Cluster, *, global_batch: int,
                     options: SearchOptions | None = None, cost: CostModel | None = None,
                     uniform_only: bool = False) -> LayerwiseResult:
    """The fastest layerwise plan and the fastest uniform-per-stage plan (module docstring)."""
    options = options or SearchOptions()
    started = time.perf_counter()
    if len({g.gpu.name for g in cluster.groups}) > 1:
        raise PlanError("layerwise planning needs one GPU type; plan mixed clusters without "
                        "--layerwise")
    cost = cost or CostModel(model, cluster)
    world = cluster.world_size
    best: tuple[Plan, Estimate] | None = None
    best_uniform: tuple[Plan, Estimate] | None = None
    cache: TermsCache = {}
    gpu = cost.default_gpu()
    configs = []
    for pp in divisors(world):
        if pp > model.num_blocks or (options.pp_degrees and pp not in options.pp_degrees):
            continue
        devices = world // pp
        for sequences in divisors(global_batch):
            m = global_batch // sequences
            strategies = _strategies(model, cluster, options, devices, sequences)
            if m > options.max_microbatches or not strategies:
                continue
            first = strategies[0]
            shapes = [(Schedule.ONE_F_ONE_B if pp == 1 or m >= pp else Schedule.GPIPE, 1)]
            if pp > 1 and m >= pp and m % pp == 0 and Schedule.INTERLEAVED in options.schedules:
                shapes += [(Schedule.INTERLEAVED, v) for v in range(2, options.max_vpp + 1)
                           if model.num_blocks % (pp * v) == 0]
            for schedule, vpp in shapes:
                plan = Plan(model=model.name, seq_len=model.seq_len, global_batch=global_batch,
                            tp=first.tp, dp=first.dp, zero=first.zero, pp=pp,
                            micro_batch=sequences // first.dp, num_microbatches=m,
                            schedule=schedule, vpp=vpp, dtype=options.dtype
                            ).with_even_stages(model)
                # a step is never shorter than any rank's own time, each layer at its fastest
                bound = max(stage_lower_bound_s(stage_choices(
                    cost, plan, k, 0, 0, strategies, options.recompute, gpu, cache,
                    _rank_chunks(plan, k))) for k in range(pp))
                configs.append((bound, len(configs), plan, strategies))
    configs.sort(key=lambda c: (c[0], c[1]))
    solved = 0
    for bound, _, plan, strategies in configs:
        uniform_step = best_uniform[1].step_time_s if best_uniform else float("inf")
        step = best[1].step_time_s if best else float("inf")
        if bound >= (step if uniform_only else uniform_step):
            break  # sorted by bound: no later configuration beats both bests
        solved += 1
        one, mixed = _solve_plan(cost, plan, strategies, options, uniform_only,
                                 (uniform_step, step), cache)
        if one is not None and (best_uniform is None
                                or one[1].step_time_s < best_uniform[1].step_time_s):
            best_uniform = one
        for found in (one, mixed):
            if found is not None and (best is None or found[1].step_time_s < best[1].step_time_s):
                best = found
    if best is None:
        raise LayerwiseDoesNotFit(
            f"no layerwise plan of {world} GPUs fits memory for global batch {global_batch}; "
            "use more or larger GPUs, a shorter sequence, or allow ZeRO-3 and full recompute")
    elapsed = time.perf_counter() - started
    plan, estimate = best
    plan = replace(plan, predicted={**estimate.to_dict(), "search_time_s": elapsed})
    return LayerwiseResult(plan=plan, estimate=estimate,
                           uniform_plan=best_uniform[0] if best_uniform else None,
                           uniform_estimate=best_uniform[1] if best_uniform else None,
                           search_time_s=elapsed, configurations=len(configs),
                           configurations_solved=solved)
