"""Brute force: the reference the planner is tested against, for tiny instances only.

It walks the same configurations as ``plan.search`` (``plan.space.configurations``) and, for each,
every contiguous partition of the layers into ``pp`` stages and every per-layer recompute
assignment (the product over layers of the modes each supports among ``options.recompute``),
scores each complete Plan with ``CostModel.estimate`` and keeps the fastest that fits memory.
Interleaved configurations use the planner's documented space: every chunk split
``plan.partition_search.interleaved_block_counts`` lists (even where the blocks divide), the V
schedules blocks split evenly (``Plan.with_even_stages``); one recompute mode for every block.

The overlap switches are enumerated here, not taken from the planner's space: configurations
come with ``fsdp_prefetch`` on, and every ZeRO-3 Plan with more than one data-parallel replica
is scored with each setting ``options.fsdp_prefetch`` lists, pipeline or not (other plans gather
nothing per micro-batch: on where listed); ``overlap_grad_reduce`` is the one setting ``options``
gives; every sequence-parallel Plan is scored with each ``options.tp_comm_overlap`` setting.

Nothing here prunes or bounds: the cost is (configurations) x (partitions) x (modes^layers),
so ``max_plans`` refuses instances that would take too long.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from itertools import combinations, product
from math import comb, prod

from meshmorph.cost.estimate import Estimate
from meshmorph.cost.model import CostModel
from meshmorph.plan.partition_search import interleaved_block_counts, stages_of_counts
from meshmorph.plan.search import PlanDoesNotFit
from meshmorph.plan.space import Config, SearchOptions, configurations
from meshmorph.schedule.table import Schedule
from meshmorph.spec.cluster import Cluster
from meshmorph.spec.model import ModelSpec, Recompute
from meshmorph.spec.plan import Plan, StagePlan


def layer_modes(model: ModelSpec, options: SearchOptions) -> list[tuple[Recompute, ...]]:
    """Recompute modes each layer may take: those of ``options.recompute`` it supports
    (a layer that supports none of them runs without recompute)."""
    out = []
    for layer in model.layers:
        modes = tuple(mode for mode in options.recompute if mode in layer.activation)
        out.append(modes or (Recompute.NONE,))
    return out


def partitions(num_layers: int, parts: int) -> Iterator[list[tuple[int, int]]]:
    """Every split of layers [0, num_layers) into ``parts`` non-empty contiguous ranges."""
    for cuts in combinations(range(1, num_layers), parts - 1):
        bounds = (0, *cuts, num_layers)
        yield [(bounds[i], bounds[i + 1]) for i in range(parts)]


def candidate_plans(model: ModelSpec, config: Config, options: SearchOptions) -> Iterator[Plan]:
    """Every complete Plan of one configuration."""
    plan = config.plan
    mixed = len(set(config.rank_gpus)) > 1
    if plan.schedule == Schedule.INTERLEAVED:  # each chunk split the planner's space lists
        for counts in interleaved_block_counts(model.num_blocks, plan.num_chunks):
            gpus = [config.rank_gpus[plan.pp_rank_of_chunk(c)] for c in range(plan.num_chunks)]
            for mode in options.recompute:
                yield replace(plan, stages=stages_of_counts(model, counts, mode,
                                                            gpus if mixed else None))
        return
    if plan.num_chunks > plan.pp:  # the V schedules: blocks split evenly
        if plan.num_chunks > model.num_blocks:
            return
        for mode in options.recompute:
            candidate = plan.with_even_stages(model, mode)
            if mixed:
                candidate = replace(candidate, stages=tuple(
                    replace(stage, gpu=config.rank_gpus[plan.pp_rank_of_chunk(c)])
                    for c, stage in enumerate(candidate.stages)))
            yield candidate
        return
    modes = layer_modes(model, options)
    for bounds in partitions(model.num_layers, plan.pp):
        for assignment in product(*modes):
            stages = tuple(
                StagePlan(start=start, stop=stop, recompute=tuple(assignment[start:stop]),
                          gpu=config.rank_gpus[k] if mixed else None)
                for k, (start, stop) in enumerate(bounds))
            yield replace(plan, stages=stages)


def prefetch_settings(plan: Plan, options: SearchOptions) -> tuple[bool, ...]:
    """The ``fsdp_prefetch`` settings brute force scores ``plan`` with."""
    if plan.zero == 3 and plan.dp * plan.cp > 1:
        return tuple(options.fsdp_prefetch)
    return (True in options.fsdp_prefetch,)


def tp_overlap_settings(plan: Plan, options: SearchOptions) -> tuple[bool, ...]:
    """The ``tp_comm_overlap`` settings brute force scores ``plan`` with (it needs SP)."""
    return tuple(options.tp_comm_overlap) if plan.sequence_parallel else (False,)


def with_switches(plans: Iterator[Plan], options: SearchOptions) -> Iterator[Plan]:
    """Each plan once per setting of ``prefetch_settings`` and ``tp_overlap_settings``, with
    ``options.overlap_grad_reduce``."""
    for plan in plans:
        for prefetch, tpo in product(prefetch_settings(plan, options),
                                     tp_overlap_settings(plan, options)):
            yield replace(plan, fsdp_prefetch=prefetch, tp_comm_overlap=tpo,
                          overlap_grad_reduce=options.overlap_grad_reduce)


def count_plans(model: ModelSpec, configs: Sequence[Config], options: SearchOptions) -> int:
    """How many Plans brute force would score."""
    per_assignment = prod(len(m) for m in layer_modes(model, options))
    total = 0
    for config in configs:
        plan = config.plan
        switches = len(prefetch_settings(plan, options)) * len(tp_overlap_settings(plan, options))
        if plan.schedule == Schedule.INTERLEAVED:
            total += switches * len(options.recompute) * len(
                interleaved_block_counts(model.num_blocks, plan.num_chunks))
        elif plan.num_chunks > plan.pp:
            total += switches * len(options.recompute) if plan.num_chunks <= model.num_blocks else 0
        else:
            # C(L - 1, pp - 1) partitions, each with every recompute assignment
            total += switches * comb(model.num_layers - 1, plan.pp - 1) * per_assignment
    return total


def brute_force(model: ModelSpec, cluster: Cluster, *, global_batch: int,
                options: SearchOptions | None = None, cost: CostModel | None = None,
                max_plans: int = 200_000) -> tuple[Plan, Estimate]:
    """The fastest Plan that fits, by scoring every Plan of the planner's search space.

    Raises PlanDoesNotFit when none fits, and ValueError when the space holds more than
    ``max_plans`` plans (restrict ``options``: zero_stages, schedules, max_micro_batch, tp/pp).
    """
    options = options or SearchOptions()
    cost = cost or CostModel(model, cluster)
    configs = list(configurations(model, cluster, global_batch,
                                  replace(options, fsdp_prefetch=(True,), tp_comm_overlap=(False,))))
    total = count_plans(model, configs, options)
    if total > max_plans:
        raise ValueError(
            f"brute force would score {total} plans (limit {max_plans}); restrict the options "
            "(zero_stages, schedules, max_micro_batch, tp_degrees, pp_degrees) or use plan.search"
        )
    best: tuple[Plan, Estimate] | None = None
    for config in configs:
        for plan in with_switches(candidate_plans(model, config, options), options):
            estimate = cost.estimate(plan)
            if estimate.fits and (best is None or estimate.step_time_s < best[1].step_time_s):
                best = (plan, estimate)
    if best is None:
        raise PlanDoesNotFit(
            f"none of the {total} plans of {len(configs)} configurations fits memory "
            f"for global batch {global_batch} on {cluster.describe()}"
        )
    return best
