"""The planner's fastest plans that meshmorph's runtime runs: what ``run --plan auto``, ``demo``
and a reshape after a membership change train with.

One search (cp 1: the runtime does not split sequences), every plan given even stages where the
search left them open, and only the plans ``Plan.check_against`` and spec/runnable.py accept,
best first, with their predicted step times.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshmorph.plan.search import search
from meshmorph.plan.space import SearchOptions
from meshmorph.spec.cluster import parse_cluster
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan, PlanError
from meshmorph.spec.runnable import runtime_refusal


@dataclass(frozen=True, slots=True)
class RunnablePlans:
    """The runnable plans of one search, best first."""

    plans: list[tuple[Plan, float]]
    """(plan, predicted step time in seconds), fastest first."""
    refused: list[str]
    """Why each faster plan the runtime cannot run was left out."""
    search_time_s: float
    """CPU seconds the search took."""


def runnable_plans(model: ModelSpec, world_size: int, *, global_batch: int, dtype: str = "fp32",
                   cluster: str | None = None, top_k: int = 8,
                   compile: bool = False) -> RunnablePlans:
    """The planner's ``top_k`` fastest plans for ``world_size`` devices (``cluster``, or that
    many local CPU processes) that the runtime runs, the global batch kept; ``compile``: every
    block compiled (``Plan.compile``)."""
    result = search(model, parse_cluster(cluster or f"cpu:1x{world_size}"),
                    global_batch=global_batch,
                    options=SearchOptions(dtype=dtype, top_k=top_k, cp_max=1, compile=compile))
    plans, refused = [], []
    for plan, estimate in zip(result.plans, result.estimates, strict=True):
        plan = plan if plan.stages else plan.with_even_stages(model)
        try:
            plan.check_against(model, world_size)
        except PlanError as exc:
            refused.append(str(exc))
            continue
        reason = runtime_refusal(model, plan)
        if reason is not None:
            refused.append(reason)
            continue
        plans.append((plan, estimate.step_time_s))
    return RunnablePlans(plans, refused, float(result.search_time_s))
