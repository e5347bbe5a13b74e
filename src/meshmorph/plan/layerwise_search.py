"""``meshmorph plan --layerwise``: the fastest plan whose layers each choose their tp/dp/ZeRO.

Configurations: pipeline degree pp (one GPU type), sequences per stage micro-batch B (dividing
the global batch, m = batch / B micro-batches), sequence parallelism on or off (on: every layer
at tp > 1 splits its activations along the sequence), and the schedules the regular planner
offers: GPipe, and when m >= pp 1F1B, zero-bubble (ZB-H1, no ZeRO-3 layer) and interleaved with
v chunks per rank where the blocks split evenly and m is a multiple of pp. Each stage of
D = world / pp devices offers every split D = tp x dp with tp inside a node and dividing the
heads, dp dividing B and B / dp at most ``max_micro_batch``, under every ZeRO stage of the
options. Plans are priced by ``cost.layerwise_cost.estimate_layerwise``.

Exactness under that cost model (tolerance 0, no node budget):

- pp = 1: the stage's own time is the step; plan/layerwise.py's program gives the optimum over
  every per-layer assignment (tests/unit/test_layerwise_exact.py).
- pp > 1, GPipe, 1F1B and zero-bubble: plan/layerwise_partition.py searches every stage
  partition and, per stage, every assignment on its front (plan/layerwise_front.py): the
  optimum over all partitions and per-layer assignments
  (tests/unit/test_layerwise_pipeline_exact.py).
- interleaved: the blocks split evenly (Megatron's requirement, as the regular planner) and each
  rank's chunks minimise the rank's own m (f + b) + tail together; not proven optimal over the
  per-chunk trade-offs.

Configurations are visited by a lower bound and cut when it reaches the best step found; with a
tolerance or a node budget the result reports the least bound left open (``lower_bound_s``).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter
from dataclasses import dataclass, replace

from meshmorph.cost.estimate import Estimate
from meshmorph.cost.layerwise_cost import estimate_layerwise, layer_plan, reserved_bytes
from meshmorph.cost.model import CostModel
from meshmorph.cost.pipeline import simulate
from meshmorph.plan.layerwise import (
    StageSolution,
    TermsCache,
    solve_stage,
    stage_choices,
    stage_lower_bound_s,
)
from meshmorph.plan.layerwise_bounds import MemoryRelaxation, rest_bounds
from meshmorph.plan.layerwise_front import FrontBudgetExceeded, StageFronts
from meshmorph.plan.layerwise_partition import best_partition
from meshmorph.plan.space import SearchOptions, divisors, tp_degrees
from meshmorph.schedule.table import Schedule
from meshmorph.spec.cluster import Cluster
from meshmorph.spec.gpus import GPUSpec
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import LayerStrategy, Plan, PlanError, StagePlan
from meshmorph.spec.runnable import (
    RUNNABLE_PIPELINE_SCHEDULES,
    TIED_PIPELINE_SCHEDULES,
    layerwise_runnable,
    tied_ends_refusal,
)


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
    lower_bound_s: float = 0.0
    """No layerwise plan of the space is faster than this (proven by the bounds)."""
    runnable: bool = True
    """Whether meshmorph runs ``plan`` (spec/runnable.py); False only from the wide
    search (``runnable=False``), which prices schedules the layerwise runtime does not run."""

    @property
    def optimality_gap(self) -> float:
        """How much slower the best plan may be than the optimum, as a fraction."""
        best = self.estimate.step_time_s
        return max(0.0, (best - self.lower_bound_s) / best)


def _strategies(model: ModelSpec, cluster: Cluster, options: SearchOptions, devices: int,
                sequences: int, *, sequence_parallel: bool = False,
                zero_bubble: bool = False) -> list[LayerStrategy]:
    out = []
    for tp in tp_degrees(model, cluster, options):
        dp = devices // tp
        if devices % tp or sequences % dp or sequences // dp > options.max_micro_batch:
            continue
        if sequence_parallel and model.seq_len % tp:
            continue
        zeros = options.zero_stages if dp > 1 else (0,)
        if zero_bubble:  # torch's zero-bubble pipelining loses ZeRO-3's gradients
            zeros = tuple(z for z in zeros if z != 3)
        out.extend(LayerStrategy(tp=tp, dp=dp, zero=z) for z in zeros)
    return out


def _rank_chunks(plan: Plan, k: int) -> list[tuple[int, int]]:
    """The layer ranges of pipeline rank ``k``'s chunks, in order."""
    return [(plan.stages[c].start, plan.stages[c].stop) for c in plan.chunks_of(k)]


def _build(cost: CostModel, plan: Plan,
           chunks: list[tuple[int, int, tuple[LayerStrategy, ...], tuple]]) -> tuple[Plan, Estimate]:
    """The plan of ``chunks`` (start, stop, strategy and recompute of each layer, one per model
    chunk in chunk order): its own tp/dp/zero the most common layer strategy (with sequence
    parallelism, the most common at tp > 1), stages listing layer strategies only where some
    layer differs from it."""
    every = Counter(s for _, _, strategies, _ in chunks for s in strategies)
    split = Counter({s: n for s, n in every.items() if s.tp > 1})
    sp = plan.sequence_parallel and bool(split)
    common = (split if sp else every).most_common(1)[0][0]
    sequences = plan.dp * plan.micro_batch
    top = replace(plan, tp=common.tp, dp=common.dp, zero=common.zero, sequence_parallel=sp,
                  micro_batch=sequences // common.dp, stages=())
    mixed = any(set(strategies) != {common} for _, _, strategies, _ in chunks)
    stages = tuple(  # every stage lists its strategies or none does (the runtime's rule)
        StagePlan(start=a, stop=b, recompute=tuple(recompute),
                  layer_strategies=tuple(strategies) if mixed else None)
        for a, b, strategies, recompute in chunks)
    final = replace(top, stages=stages)
    return final, estimate_layerwise(cost, final)


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
            if found[0] is not None and (one is None or found[0][1].step_time_s
                                         < one[1].step_time_s):
                one = found[0]
            if found[1] is not None and (mixed is None or found[1][1].step_time_s
                                         < mixed[1].step_time_s):
                mixed = found[1]
        return one, mixed
    gpu = cost.default_gpu()
    uniform: list[StageSolution] = []
    mixed_: list[StageSolution] = []
    last = cost.model.num_layers - 1
    for k in range(plan.pp):
        chunks = _rank_chunks(plan, k)
        holds_end = any(a == 0 or b == last + 1 for a, b in chunks)
        best: StageSolution | None = None
        for s in strategies:
            if ends is not None and holds_end and (s.tp, s.zero) not in ends:
                continue  # a tied end under this strategy does not run
            one = solve_stage(cost, plan, k, 0, 0, [s], options.recompute, gpu,
                              upper_bound_s=bounds[0], cache=cache, chunks=chunks)
            if one is not None and (best is None or one.busy_s < best.busy_s):
                best = one
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
    (plan/layerwise_partition.py), with one strategy per stage, then per layer. With ``ends``
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

    def step(found: tuple[Plan, Estimate] | None) -> float:
        return found[1].step_time_s if found is not None else float("inf")

    for uniform, pair in itertools.product((True, False), ends or [None]):
        if step(one) < step(mixed):  # a rank's least busy time is not always the least step
            mixed = one
        if not uniform and uniform_only:
            break
        bound = min(bounds[0], step(one)) if uniform else min(bounds[1], step(one), step(mixed))
        fronts = StageFronts(cost, plan, strategies, options.recompute, gpu, cache,
                             uniform=uniform, max_labels=None if options.max_nodes is None
                             else LABELS_PER_NODE * options.max_nodes, ends=pair)
        try:
            out = best_partition(fronts, bound, options.tolerance, options.max_nodes)
        except FrontBudgetExceeded:  # left open: its bound stays unproven
            open_bound = min(open_bound, config_bound)
            continue
        open_bound = min(open_bound, out.open_bound_s)
        if out.stages is not None:
            found = build(out.stages)
            if uniform:
                one = found if step(found) < step(one) else one
            if step(found) < step(mixed):
                mixed = found
    return one, (one if uniform_only else mixed), open_bound


def search_layerwise(model: ModelSpec, cluster: Cluster, *, global_batch: int,
                     options: SearchOptions | None = None, cost: CostModel | None = None,
                     uniform_only: bool = False, runnable: bool = True) -> LayerwiseResult:
    """The fastest layerwise plan and the fastest uniform-per-stage plan (module docstring).
    With ``runnable`` (the default) only plans meshmorph runs (spec/runnable.py):
    every pipeline schedule but async, sequence parallelism, a tied embedding and head under one
    runnable (tp, zero); without it every schedule of the options, priced only."""
    options = options or SearchOptions()
    started = time.perf_counter()
    if len({g.gpu.name for g in cluster.groups}) > 1:
        raise PlanError("layerwise planning needs one GPU type; plan mixed clusters without "
                        "--layerwise")
    if runnable and options.dtype == "fp16":
        raise PlanError("layerwise plans run fp32 or bf16 (no fp16 loss scaling); plan with "
                        "--dtype bf16, or without --layerwise")
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
            if m > options.max_microbatches:
                continue
            shapes = [(Schedule.ONE_F_ONE_B, 1)] if pp == 1 else []
            # runnable: the schedules the layerwise runtime runs
            offered = [s for s in options.schedules
                       if not runnable or (s in RUNNABLE_PIPELINE_SCHEDULES and (
                           not model.tied_embeddings or s in TIED_PIPELINE_SCHEDULES))]
            if pp > 1:
                shapes += [(s, 1) for s in (Schedule.GPIPE, Schedule.ONE_F_ONE_B,
                                            Schedule.ZERO_BUBBLE)
                           if s in offered and (m >= pp or s == Schedule.GPIPE)]
                if m >= pp and m % pp == 0 and Schedule.INTERLEAVED in offered:
                    shapes += [(Schedule.INTERLEAVED, v) for v in range(2, options.max_vpp + 1)
                               if model.num_blocks % (pp * v) == 0]
                # the V schedules, as the regular planner offers them: two chunks per rank
                shapes += [(s, 2) for s in (Schedule.ZBV, Schedule.DUALPIPEV)
                           if s in offered and model.num_blocks >= 2 * pp
                           and (s == Schedule.ZBV or m >= 2 * pp)]
            for sp in sorted(set(options.sequence_parallel)):
                for schedule, vpp in shapes:
                    strategies = _strategies(model, cluster, options, devices, sequences,
                                             sequence_parallel=sp,
                                             zero_bubble=schedule.split_backward)
                    if not strategies or (sp and all(s.tp == 1 for s in strategies)):
                        continue  # nothing to split along the sequence: the same as sp off
                    # the data layout: at tp > 1 under sequence parallelism (a plan at tp 1
                    # has no sequence split, Plan drops the flag)
                    first = next((s for s in strategies if s.tp > 1), strategies[0]) if sp \
                        else strategies[0]
                    plan = Plan(model=model.name, seq_len=model.seq_len,
                                global_batch=global_batch, tp=first.tp, dp=first.dp,
                                zero=first.zero, pp=pp, micro_batch=sequences // first.dp,
                                num_microbatches=m, schedule=schedule, vpp=vpp,
                                sequence_parallel=sp, dtype=options.dtype
                                ).with_even_stages(model)
                    plan = replace(plan, sequence_parallel=sp)
                    ends = None
                    if runnable and model.tied_embeddings:  # one runnable layout for both
                        ends = sorted({(s.tp, s.zero) for s in strategies
                                       if tied_ends_refusal(model, s, s,
                                                            apart=plan.num_chunks > 1) is None})
                        if not ends:
                            continue
                    configs.append((plan, strategies, ends))
    # lazily tightened, as the regular planner: every configuration enters with its time-only
    # bound; when it comes first it gets the memory-aware one, and only then is it solved
    queue = [(_config_bound(cost, plan, strategies, options, gpu, cache, memory=False), 0, i)
             for i, (plan, strategies, _) in enumerate(configs)]
    heapq.heapify(queue)
    solved = 0
    proven = float("inf")
    while queue:
        bound, level, index = heapq.heappop(queue)
        plan, strategies, ends = configs[index]
        uniform_step = best_uniform[1].step_time_s if best_uniform else float("inf")
        step = best[1].step_time_s if best else float("inf")
        if bound >= (step if uniform_only else uniform_step) * (1.0 - options.tolerance):
            proven = min(proven, bound)
            break  # by bound: no later configuration beats both bests
        if level == 0:
            tighter = _config_bound(cost, plan, strategies, options, gpu, cache, memory=True)
            if tighter < float("inf"):  # infinite: nothing of this configuration fits
                heapq.heappush(queue, (max(bound, tighter), 1, index))
            continue
        solved += 1
        if plan.pp > 1 and plan.vpp == 1:
            one, mixed, open_bound = solve_partitioned(cost, plan, strategies, options,
                                                       uniform_only, (uniform_step, step), cache,
                                                       bound, ends)
            proven = min(proven, max(bound, open_bound))
        else:
            one, mixed = _solve_plan(cost, plan, strategies, options, uniform_only,
                                     (uniform_step, step), cache, ends)
            if plan.pp > 1:  # interleaved: even chunks, each rank its own busy time
                proven = min(proven, bound)
        if one is not None and (best_uniform is None
                                or one[1].step_time_s < best_uniform[1].step_time_s):
            best_uniform = one
        for found in (one, mixed):
            if runnable and found is not None and not layerwise_runnable(model, found[0]):
                continue  # tp degrees that do not nest across stages or around a layer
            if found is not None and (best is None or found[1].step_time_s < best[1].step_time_s):
                best = found
    if best is None:
        raise LayerwiseDoesNotFit(
            f"no layerwise plan of {world} GPUs fits memory for global batch {global_batch}; "
            "use more or larger GPUs, a shorter sequence, or allow ZeRO-3 and full recompute")
    elapsed = time.perf_counter() - started
    plan, estimate = best
    proven = min(proven, estimate.step_time_s * (1.0 - options.tolerance))
    plan = replace(plan, predicted={**estimate.to_dict(), "search_time_s": elapsed})
    return LayerwiseResult(plan=plan, estimate=estimate,
                           uniform_plan=best_uniform[0] if best_uniform else None,
                           uniform_estimate=best_uniform[1] if best_uniform else None,
                           search_time_s=elapsed, configurations=len(configs),
                           configurations_solved=solved, lower_bound_s=proven,
                           runnable=layerwise_runnable(model, plan))


def _config_bound(cost: CostModel, plan: Plan, strategies: list[LayerStrategy],
                  options: SearchOptions, gpu: GPUSpec, cache: TermsCache, *,
                  memory: bool) -> float:
    """No plan of the configuration is faster. One stage (pp = 1) or even chunks (interleaved):
    each rank's own time with each layer at its fastest, no transition, and with ``memory`` its
    memory relaxation (plan/layerwise_bounds.py). Otherwise any partition: some rank runs at
    least 1/pp of the layers' least busy time, and with ``memory`` the least over stage
    partitions of the largest rank bound (``rest_bounds``)."""
    if plan.pp == 1 or plan.vpp > 1:
        cap = gpu.memory_bytes - reserved_bytes(cost, gpu)
        bound = 0.0
        for k in range(plan.pp):
            rows = stage_choices(cost, plan, k, 0, 0, strategies, options.recompute, gpu, cache,
                                 _rank_chunks(plan, k))
            bound = max(bound, stage_lower_bound_s(rows))
            if memory:
                bound = max(bound, MemoryRelaxation(rows, cap).busy(0, len(rows)))
        if memory and plan.pp > 1:
            bound = max(bound, _simulated_bound(cost, plan, strategies, options, gpu, cache))
        return bound
    fronts = StageFronts(cost, plan, strategies, options.recompute, gpu, cache)
    bubble = _bubble_bound(fronts)
    if not memory:
        return max(sum(fronts.least_busy) / plan.pp, max(fronts.least_busy), bubble)
    return max(rest_bounds(fronts)[0][0], bubble)


def _bubble_bound(fronts: StageFronts) -> float:
    """No partition of a one-chunk pipeline (GPipe, 1F1B, zero-bubble) is faster. Let x_k be
    stage k's forward plus backward (the input gradient under zero-bubble) per micro-batch and
    S_k = x_0 + ... + x_{k-1}: stage k cannot start before micro-batch 0's forwards of the
    stages before it, runs m forwards and backwards, and rank 0 cannot end before micro-batch
    m - 1's backward came back through those stages, so the step is at least m x_k + S_k for
    every k. Over all x >= 0 summing to X, the least of max_k (m x_k + S_k) is
    X / (1 - (1 - 1/m)^p) (stage by stage, as large as the bound allows, gives the most
    work under it), and X is at least the layers' least forwards and backwards."""
    m, p = fronts.m, fronts.p
    work = fronts.prefix_f[-1] + fronts.prefix_b[-1]
    return work / (1.0 - (1.0 - 1.0 / m) ** p)


def _simulated_bound(cost: CostModel, plan: Plan, strategies: list[LayerStrategy],
                     options: SearchOptions, gpu: GPUSpec, cache: TermsCache) -> float:
    """No plan of an even-chunk configuration (interleaved, zbv, dualpipev) is faster: the
    schedule simulated with every chunk's forward, backward (input gradient under a split
    backward) and weight gradient each at the sum of its layers' least, no transition, and each
    rank's tail at its layers' least. Every assignment's figures are at least these and the
    simulator is max-plus (never faster when a figure grows), so its step is at least this."""
    split = plan.schedule.split_backward
    chunks = plan.num_chunks
    fwd, bwd, wgrad = ([0.0] * chunks for _ in range(3))
    tails = []
    for k in range(plan.pp):
        tail = 0.0
        rows = iter(stage_choices(cost, plan, k, 0, 0, strategies, options.recompute, gpu, cache,
                                  _rank_chunks(plan, k)))  # the rank's chunks, in order
        for c in plan.chunks_of(k):
            for row in (next(rows) for _ in range(plan.stages[c].num_layers)):
                fwd[c] += min(x[4].fwd_s for x in row)
                bwd[c] += min(x[4].bwd_s - (x[4].wgrad_s if split else 0.0) for x in row)
                wgrad[c] += min(x[4].wgrad_s for x in row)
                tail += min(x[4].tail_s for x in row)
        tails.append(tail)
    send = min(cost.p2p_time(layer_plan(plan, s), gpu) for s in strategies)
    p2p = (send,) * chunks
    timeline = simulate(plan.schedule, plan.pp, plan.num_microbatches, fwd, bwd, v=plan.vpp,
                        p2p_s=p2p, wgrad_s=wgrad if split else None)
    return max(timeline.rank_end_s[k] + tails[k] for k in range(plan.pp))
