"""The planner: the fastest plans that fit memory, exact under the cost model.

Configurations (plan/space.py) are visited in order of a lower bound on their step time,
tightened lazily (plan/bounds.py: cheap, then memory-aware, then with the pipeline's fill); the
visit stops when the bound reaches the k-th best step found. Each configuration is solved
exactly (plan/solve_config.py). With ``SearchOptions.layerwise`` the per-layer space
(``plan.space.layer_configurations``) is searched the same way, its configurations bounded and
solved by the same modules, and the faster of its best plan and the regular space's is returned
(ties to the regular plan, which needs no layer strategies), each priced by
``CostModel.estimate``.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from meshmorph.cost.estimate import GIB, Estimate
from meshmorph.cost.model import CostModel
from meshmorph.plan.bounds import ConfigBounds
from meshmorph.plan.solve_config import Found, even_estimate, solve_config, solve_layers
from meshmorph.plan.space import Config, SearchOptions, configurations, layer_configurations
from meshmorph.spec.cluster import Cluster
from meshmorph.spec.model import ModelSpec, Recompute
from meshmorph.spec.plan import Plan, PlanError
from meshmorph.spec.runnable import layerwise_runnable

LAYERWISE, REGULAR = "layerwise", "regular"
"""The two spaces a search may return a plan from (``SearchResult.source``)."""


class PlanDoesNotFit(PlanError):
    """No layout of the search space fits the devices' memory."""


@dataclass(slots=True)
class SearchResult:
    """The best plans, best first, with their estimates and what the search cost."""

    plans: list[Plan]
    estimates: list[Estimate]
    search_time_s: float
    """CPU seconds of this process the search took (``time.process_time``: on a loaded
    machine wall time measures the other jobs)."""
    configurations: int
    """Configurations in the search space."""
    configurations_solved: int
    """Configurations whose stages were solved (the rest were cut by their bound)."""
    lower_bound_s: float
    """No plan of the search space is faster than this (proven by the bounds)."""
    source: str = REGULAR
    """The space ``plans`` come from: ``regular``, or ``layerwise`` (per-layer strategies)."""
    runnable: bool = True
    """Whether meshmorph runs ``plans[0]`` (spec/runnable.py); False only from a per-layer
    search with ``runnable_only`` off."""
    uniform_plan: Plan | None = None
    """Per-layer space: the best plan with one strategy per stage it met (not searched to the
    end once the per-layer best cuts the rest), None when none fits."""
    uniform_estimate: Estimate | None = None
    """Its figures."""
    layerwise: SearchResult | None = None
    """With ``SearchOptions.layerwise``: the per-layer space's own result (None: no plan)."""
    regular: SearchResult | None = None
    """With ``SearchOptions.layerwise``: the regular space's own result (None: no plan)."""
    errors: dict[str, str] = field(default_factory=dict)
    """With ``SearchOptions.layerwise``: why a space returned no plan, by space."""

    @property
    def optimality_gap(self) -> float:
        """How much slower the best plan may be than the optimum, as a fraction."""
        best = self.estimates[0].step_time_s
        return max(0.0, (best - self.lower_bound_s) / best)


Tightener = Callable[[Config, float, float], float]
"""A configuration's next bound from (it, its bound so far, the incumbents' limit): at least the
limit whenever no plan of it beats the limit (a bound may then stop short of its exact value)."""


def _best_first(configs: Sequence[Config], first: Callable[[Config], float],
                tighteners: Sequence[Tightener], threshold: Callable[[], float],
                solve: Callable[[int, float, float], float], tolerance: float) -> tuple[float, int]:
    """Visit ``configs`` best bound first (lazily tightened: every configuration enters with
    ``first``; when it comes first it gets the next of ``tighteners``, infinite dropping it,
    and only then is it ``solve``d, which returns the bound of what it left open); stop when
    the first bound reaches ``threshold()`` (the incumbents') less ``tolerance``. Returns (the
    least bound of everything not searched to the end, configurations solved)."""
    queue = [(first(c), 0, i) for i, c in enumerate(configs)]
    heapq.heapify(queue)
    solved = 0
    proven = float("inf")
    while queue:
        bound_s, level, index = heapq.heappop(queue)
        limit = threshold()
        if bound_s >= limit * (1.0 - tolerance):
            proven = min(proven, bound_s)
            break
        if level < len(tighteners):
            tighter = tighteners[level](configs[index], bound_s, limit)
            if tighter < float("inf"):  # infinite: nothing of this configuration fits
                heapq.heappush(queue, (tighter, level + 1, index))
            continue
        solved += 1
        proven = min(proven, max(bound_s, solve(index, bound_s, limit)))
    return proven, solved


def search(model: ModelSpec, cluster: Cluster, *, global_batch: int,
           options: SearchOptions | None = None, cost: CostModel | None = None) -> SearchResult:
    """The ``options.top_k`` fastest plans that fit, best first (one per configuration); with
    ``options.layerwise`` the faster of the per-layer space's best and the regular space's."""
    options = options or SearchOptions()
    if global_batch < 1:
        raise PlanError(f"global_batch must be at least 1, got {global_batch}")
    cost = cost or CostModel(model, cluster)
    if options.layerwise:
        return _faster_space(model, cluster, global_batch, options, cost)
    return _search_regular(model, cluster, global_batch, options, cost)


def _faster_space(model: ModelSpec, cluster: Cluster, global_batch: int,
                  options: SearchOptions, cost: CostModel) -> SearchResult:
    """Both spaces on the same inputs; the faster best plan (ties to the regular one), with each
    space's result. Raises the per-layer search's PlanError when neither finds a plan."""
    found: dict[str, SearchResult] = {}
    errors: dict[str, str] = {}
    failure: PlanError | None = None
    for space in (LAYERWISE, REGULAR):
        try:
            found[space] = search_per_layer(model, cluster, global_batch=global_batch,
                                            options=options, cost=cost) if space == LAYERWISE \
                else _search_regular(model, cluster, global_batch, options, cost)
        except PlanError as exc:
            errors[space] = str(exc)
            failure = failure or exc
    if not found:
        assert failure is not None
        raise failure
    layer, regular = found.get(LAYERWISE), found.get(REGULAR)
    faster = regular if regular is not None and (
        layer is None or regular.estimates[0].tokens_per_s >= layer.estimates[0].tokens_per_s) \
        else layer
    assert faster is not None
    return replace(faster, layerwise=layer, regular=regular, errors=errors)


def _search_regular(model: ModelSpec, cluster: Cluster, global_batch: int,
                    options: SearchOptions, cost: CostModel) -> SearchResult:
    """The regular space: one strategy per plan (module docstring)."""
    started = time.process_time()
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
    best: list[tuple[float, int, Plan, Estimate]] = []  # max-heap by -step

    def threshold() -> float:
        return -best[0][0] if len(best) == options.top_k else float("inf")

    def solve(index: int, bound_s: float, limit: float) -> float:
        result = solve_config(cost, configs[index], options, limit, bounds)
        if result.best is not None:
            plan, estimate = result.best
            entry = (-estimate.step_time_s, -index, plan, estimate)
            if len(best) < options.top_k:
                heapq.heappush(best, entry)
            else:
                heapq.heappushpop(best, entry)
        return result.open_bound_s

    proven, solved = _best_first(
        configs, bounds.lower_bound,
        [bounds.busiest_memory_bound, bounds.ends_memory_bound,
         lambda c, b, _: max(b, bounds.memory_bound(c)), bounds.fill_bound,
         bounds.integer_fill_bound],
        threshold, solve, options.tolerance)
    if not best:
        raise _does_not_fit(cost, configs, options)
    ranked = sorted(best, key=lambda e: (-e[0], -e[1]))
    proven = min(proven, -ranked[0][0])
    elapsed = time.process_time() - started
    plans = [replace(p, predicted={**e.to_dict(), "search_time_s": elapsed}) for _, _, p, e in ranked]
    return SearchResult(plans=plans, estimates=[e for *_, e in ranked], search_time_s=elapsed,
                        configurations=len(configs), configurations_solved=solved,
                        lower_bound_s=proven)


def search_per_layer(model: ModelSpec, cluster: Cluster, *, global_batch: int,
                     options: SearchOptions | None = None,
                     cost: CostModel | None = None) -> SearchResult:
    """The per-layer space alone (plan/space.py's ``layer_configurations``): its fastest plan,
    and the fastest with one strategy per stage it met; ``search`` with ``layerwise`` compares
    it with the regular space. Only plans meshmorph runs unless ``options.runnable_only`` is
    off."""
    options = options or SearchOptions()
    started = time.process_time()
    if len({g.gpu.name for g in cluster.groups}) > 1:
        raise PlanError("layerwise planning needs one GPU type; plan mixed clusters without "
                        "--layerwise")
    if options.runnable_only and options.dtype == "fp16":
        raise PlanError("layerwise plans run fp32 or bf16 (no fp16 loss scaling); plan with "
                        "--dtype bf16, or without --layerwise")
    cost = cost or CostModel(model, cluster)
    configs = list(layer_configurations(model, cluster, global_batch, options))
    bounds = ConfigBounds(cost, options.recompute)
    best: dict[str, Found] = {"uniform": None, "best": None}

    def step(key: str) -> float:
        found = best[key]
        return found[1].step_time_s if found is not None else float("inf")

    def solve(index: int, bound_s: float, limit: float) -> float:
        result = solve_layers(cost, configs[index], options, (step("uniform"), step("best")),
                              bounds.cache, bound_s)
        if result.uniform is not None and result.uniform[1].step_time_s < step("uniform"):
            best["uniform"] = result.uniform
        for found in (result.uniform, result.best):
            if options.runnable_only and found is not None and not layerwise_runnable(
                    model, found[0]):
                continue  # tp degrees that do not nest across stages or around a layer
            if found is not None and found[1].step_time_s < step("best"):
                best["best"] = found
        return result.open_bound_s

    proven, solved = _best_first(
        configs, bounds.lower_bound, [lambda c, b, _: max(b, bounds.memory_bound(c))],
        lambda: step("best" if options.one_strategy_per_stage else "uniform"), solve,
        options.tolerance)
    if best["best"] is None:
        raise PlanDoesNotFit(
            f"no layerwise plan of {cluster.world_size} GPUs fits memory for global batch "
            f"{global_batch}; use more or larger GPUs, a shorter sequence, or allow ZeRO-3 and "
            "full recompute")
    elapsed = time.process_time() - started
    plan, estimate = best["best"]
    uniform = best["uniform"]
    return SearchResult(
        plans=[replace(plan, predicted={**estimate.to_dict(), "search_time_s": elapsed})],
        estimates=[estimate], search_time_s=elapsed, configurations=len(configs),
        configurations_solved=solved,
        lower_bound_s=min(proven, estimate.step_time_s * (1.0 - options.tolerance)),
        source=LAYERWISE, runnable=layerwise_runnable(model, plan),
        uniform_plan=uniform[0] if uniform else None,
        uniform_estimate=uniform[1] if uniform else None)


def _does_not_fit(cost: CostModel, configs: list[Config],
                  options: SearchOptions) -> PlanDoesNotFit:
    """Name the constraint that failed, by how much, for the layout that came closest."""
    closest: tuple[float, Plan, Estimate] | None = None
    mode = Recompute.FULL if Recompute.FULL in options.recompute else options.recompute[-1]
    for config in configs:
        plan = config.plan
        if plan.num_chunks > cost.model.num_blocks:
            continue
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
    # only the ways out the search has not already tried
    ways = ["use more or larger GPUs", "a shorter sequence"]
    if 3 not in options.zero_stages:
        ways.append("allow ZeRO-3")
    if Recompute.FULL not in options.recompute:
        ways.append("allow full recompute")
    if not options.compile and cost.estimate(replace(plan, compile=True)).fits:
        ways.append("--compile (a compiled block keeps fewer activations: the closest then fits)")
    return PlanDoesNotFit(
        f"no plan fits memory: the closest (tp {plan.tp}, pp {plan.pp}, dp {plan.dp}, "
        f"{f'cp {plan.cp}, ' if plan.cp > 1 else ''}"
        f"zero {plan.zero}, micro-batch {plan.micro_batch}, {mode} recompute) needs "
        f"{need:.1f} GiB per GPU on stage {stage}, the device has {have:.1f} GiB "
        f"(over by {need - have:.1f} GiB); {', '.join(ways[:-1])} or {ways[-1]}"
    )
