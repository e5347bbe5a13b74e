"""The planner: the fastest plans that fit memory, exact under the cost model.

Configurations (plan/space.py) are visited in order of a lower bound on their step time,
tightened lazily (plan/bounds.py: cheap, then memory-aware, then with the pipeline's fill); the
visit stops when the bound reaches the k-th best step found. Each configuration's stages and
recompute are solved exactly (plan/stage_recompute.py per stage, plan/partition_search.py
over stage ends). Interleaved schedules take each chunk split of
``plan.partition_search.interleaved_block_counts`` (even where the blocks divide; else, as
Megatron-LM's first and last stage layer counts, any ends around equal interior chunks), the V
schedules split the blocks evenly; both use one recompute mode for all blocks.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, replace

from meshmorph.cost.estimate import GIB, Estimate
from meshmorph.cost.model import CostModel
from meshmorph.plan.bounds import ConfigBounds
from meshmorph.plan.fastest_layers import cluster_gpu
from meshmorph.plan.partition_search import (
    PartitionResult,
    interleaved_block_counts,
    solve_partition,
    stages_of_counts,
)
from meshmorph.plan.space import Config, SearchOptions, configurations
from meshmorph.plan.stage_recompute import StageSolver
from meshmorph.schedule.table import Schedule
from meshmorph.spec.cluster import Cluster
from meshmorph.spec.gpus import GPUSpec
from meshmorph.spec.model import ModelSpec, Recompute
from meshmorph.spec.plan import Plan, PlanError


class PlanDoesNotFit(PlanError):
    """No layout of the search space fits the devices' memory."""


@dataclass(slots=True)
class SearchResult:
    """The best plans, best first, with their estimates and what the search cost."""

    plans: list[Plan]
    estimates: list[Estimate]
    search_time_s: float
    configurations: int
    """Configurations in the search space."""
    configurations_solved: int
    """Configurations whose stages were solved (the rest were cut by their bound)."""
    lower_bound_s: float
    """No plan of the search space is faster than this (proven by the bounds)."""

    @property
    def optimality_gap(self) -> float:
        """How much slower the best plan may be than the optimum, as a fraction."""
        best = self.estimates[0].step_time_s
        return max(0.0, (best - self.lower_bound_s) / best)


def even_estimate(cost: CostModel, config: Config, mode: Recompute) -> tuple[Plan, Estimate]:
    """A configuration with its blocks split evenly (Megatron-style) and ``mode`` recompute."""
    plan = config.plan
    candidate = plan.with_even_stages(cost.model, mode)
    gpus = [cluster_gpu(cost, config.rank_gpus[plan.pp_rank_of_chunk(c)])
            for c in range(plan.num_chunks)]
    if len(set(config.rank_gpus)) > 1:
        candidate = replace(candidate, stages=tuple(
            replace(s, gpu=g.name) for s, g in zip(candidate.stages, gpus, strict=True)))
    times = [cost.chunk_time(candidate, s.start, s.stop, s.recompute, g)
             for s, g in zip(candidate.stages, gpus, strict=True)]
    return candidate, cost.assemble(candidate, gpus, times)


def counts_estimate(cost: CostModel, config: Config, counts: tuple[int, ...],
                    mode: Recompute, bound: float = float("inf")
                    ) -> tuple[Plan, Estimate | None]:
    """An interleaved configuration with chunks of ``counts`` blocks and ``mode`` recompute;
    the estimate is None (not simulated) when its busiest rank's own work, m x the forward and
    backward of its chunks, already reaches ``bound``: no step of it can be shorter."""
    plan = config.plan
    gpus = [cluster_gpu(cost, config.rank_gpus[plan.pp_rank_of_chunk(c)])
            for c in range(plan.num_chunks)]
    names = [g.name for g in gpus] if len(set(config.rank_gpus)) > 1 else None
    candidate = replace(plan, stages=stages_of_counts(cost.model, counts, mode, names))
    times = [cost.chunk_time(candidate, s.start, s.stop, s.recompute, g)
             for s, g in zip(candidate.stages, gpus, strict=True)]
    busiest = max(sum(times[c].fwd_s + times[c].bwd_s for c in plan.chunks_of(k))
                  for k in range(plan.pp))
    if plan.num_microbatches * busiest >= bound:
        return candidate, None
    return candidate, cost.assemble(candidate, gpus, times)


class _LayerWork:
    """m x (forward + backward) of any run of layers of an interleaved configuration, from
    prefix sums of the per-layer times (no ZeRO traffic: at most a chunk's own time), so a
    chunk split is dropped before its chunks are priced."""

    def __init__(self, cost: CostModel, config: Config):
        self.cost, self.plan = cost, config.plan
        self.gpus = [cluster_gpu(cost, config.rank_gpus[self.plan.pp_rank_of_chunk(c)])
                     for c in range(self.plan.num_chunks)]
        self._prefix: dict[tuple[str, Recompute], list[float]] = {}

    def prefix(self, gpu: GPUSpec, mode: Recompute) -> list[float]:
        key = (gpu.name, mode)
        sums = self._prefix.get(key)
        if sums is None:
            plan, model = self.plan, self.cost.model
            coster = self.cost.coster(plan.dtype, plan.cp, plan.tp_comm_overlap)
            sums = [0.0]
            for index, layer in enumerate(model.layers):
                c = coster.layer(index, gpu, plan.micro_batch, plan.tp, plan.sequence_parallel,
                                 mode if mode in layer.activation else Recompute.NONE)
                sums.append(sums[-1] + c.fwd_s + c.bwd_s)
            self._prefix[key] = sums
        return sums

    def busiest_rank_s(self, counts: tuple[int, ...], mode: Recompute) -> float:
        plan = self.plan
        busy = [0.0] * plan.pp
        start = 0
        for c, count in enumerate(counts):
            stop = start + count + (c == 0) + (c == len(counts) - 1)
            sums = self.prefix(self.gpus[c], mode)
            busy[plan.pp_rank_of_chunk(c)] += sums[stop] - sums[start]
            start = stop
        return plan.num_microbatches * max(busy)


def solve_config(cost: CostModel, config: Config, options: SearchOptions,
                 bound: float, bounds: ConfigBounds) -> PartitionResult:
    """The fastest plan of one configuration with step time below ``bound``, and the bound of
    what was left unexplored."""
    plan = config.plan
    if plan.schedule == Schedule.INTERLEAVED:  # every chunk split interleaved_block_counts lists
        best = None
        work = _LayerWork(cost, config)
        for counts in interleaved_block_counts(cost.model.num_blocks, plan.num_chunks):
            for mode in options.recompute:
                if work.busiest_rank_s(counts, mode) >= bound:
                    continue  # its busiest rank alone takes longer than the best found
                candidate, estimate = counts_estimate(cost, config, counts, mode, bound)
                if estimate is not None and estimate.fits and estimate.step_time_s < bound:
                    bound = estimate.step_time_s
                    best = (candidate, estimate)
        return PartitionResult(best, float("inf"))
    if plan.num_chunks > plan.pp:  # the V schedules: blocks split evenly
        best = None
        for mode in options.recompute:
            candidate, estimate = even_estimate(cost, config, mode)
            if estimate.fits and estimate.step_time_s < bound:
                bound = estimate.step_time_s
                best = (candidate, estimate)
        return PartitionResult(best, float("inf"))
    gpus = [cluster_gpu(cost, name) for name in config.rank_gpus]
    return solve_partition(StageSolver(cost, plan, gpus, options.recompute), bound,
                           options.tolerance, options.max_nodes, bounds.split_table(config))


def search(model: ModelSpec, cluster: Cluster, *, global_batch: int,
           options: SearchOptions | None = None, cost: CostModel | None = None) -> SearchResult:
    """The ``options.top_k`` fastest plans that fit, best first (one per configuration)."""
    options = options or SearchOptions()
    started = time.perf_counter()
    if global_batch < 1:
        raise PlanError(f"global_batch must be at least 1, got {global_batch}")
    cost = cost or CostModel(model, cluster)
    world = cluster.world_size
    if global_batch > world * options.max_micro_batch * options.max_microbatches:
        raise PlanDoesNotFit(
            f"global batch {global_batch} needs more than {options.max_microbatches} "
            f"micro-batches per step on every layout of {world} GPUs (micro-batches of at most "
            f"{options.max_micro_batch} sequences); lower the batch or raise max_micro_batch")
    configs = list(configurations(model, cluster, global_batch, options))
    if not configs:
        raise PlanDoesNotFit(
            f"no layout of {cluster.world_size} GPUs divides global batch {global_batch} with "
            f"tp | {cluster.gpus_per_node} dividing {model.num_heads} heads; change the batch "
            "to a multiple of the data-parallel degree or the number of GPUs"
        )
    bounds = ConfigBounds(cost, options.recompute)
    # lazily tightened: every configuration enters with the cheap bound; when it comes first it
    # gets the memory bound, then the fill bound, then it is solved, so the dearer bounds are
    # computed only for configurations that might still win
    queue = [(bounds.lower_bound(c), 0, i) for i, c in enumerate(configs)]
    heapq.heapify(queue)
    best: list[tuple[float, int, Plan, Estimate]] = []  # max-heap by -step
    solved = 0
    proven = float("inf")  # least bound of everything not searched to the end
    while queue:
        bound_s, level, index = heapq.heappop(queue)
        threshold = -best[0][0] if len(best) == options.top_k else float("inf")
        if bound_s >= threshold * (1.0 - options.tolerance):
            proven = min(proven, bound_s)
            break
        config = configs[index]
        if level == 0:
            tighter = bounds.memory_bound(config)
            if tighter < float("inf"):  # infinite: nothing of this configuration fits
                heapq.heappush(queue, (max(bound_s, tighter), 1, index))
            continue
        if level == 1:
            heapq.heappush(queue, (bounds.fill_bound(config, bound_s), 2, index))
            continue
        solved += 1
        result = solve_config(cost, config, options, threshold, bounds)
        proven = min(proven, max(bound_s, result.open_bound_s))
        if result.best is None:
            continue
        plan, estimate = result.best
        entry = (-estimate.step_time_s, -index, plan, estimate)
        if len(best) < options.top_k:
            heapq.heappush(best, entry)
        else:
            heapq.heappushpop(best, entry)
    if not best:
        raise _does_not_fit(cost, configs, options)
    ranked = sorted(best, key=lambda e: (-e[0], -e[1]))
    proven = min(proven, -ranked[0][0])
    elapsed = time.perf_counter() - started
    plans = [replace(p, predicted={**e.to_dict(), "search_time_s": elapsed}) for _, _, p, e in ranked]
    return SearchResult(plans=plans, estimates=[e for *_, e in ranked], search_time_s=elapsed,
                        configurations=len(configs), configurations_solved=solved,
                        lower_bound_s=proven)


def _does_not_fit(cost: CostModel, configs: list[Config],
                  options: SearchOptions) -> PlanDoesNotFit:
    """Name the constraint that failed, by how much, for the layout that came closest."""
    closest: tuple[float, Plan, Estimate] | None = None
    for config in configs:
        plan = config.plan
        if plan.num_chunks > cost.model.num_blocks:
            continue
        mode = Recompute.FULL if Recompute.FULL in options.recompute else options.recompute[-1]
        candidate, estimate = even_estimate(cost, config, mode)
        excess = max(m.total - b for m, b in zip(estimate.memory, estimate.memory_budget_bytes,
                                                   strict=True))
        if closest is None or excess < closest[0]:
            closest = (excess, candidate, estimate)
    if closest is None:
        return PlanDoesNotFit("no layout of the search space can hold the model's layers")
    _, plan, estimate = closest
    stage = max(range(plan.pp), key=lambda k: estimate.memory[k].total - estimate.memory_budget_bytes[k])
    need = estimate.memory[stage].total / GIB
    have = estimate.memory_budget_bytes[stage] / GIB
    return PlanDoesNotFit(
        f"no plan fits memory: the closest (tp {plan.tp}, pp {plan.pp}, dp {plan.dp}, "
        f"{f'cp {plan.cp}, ' if plan.cp > 1 else ''}"
        f"zero {plan.zero}, micro-batch {plan.micro_batch}, full recompute) needs "
        f"{need:.1f} GiB per GPU on stage {stage}, the device has {have:.1f} GiB "
        f"(over by {need - have:.1f} GiB); use more or larger GPUs, a shorter sequence, "
        "or allow ZeRO-3 and full recompute"
    )
