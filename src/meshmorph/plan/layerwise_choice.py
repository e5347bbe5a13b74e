"""``plan --layerwise``'s answer: the layerwise search's best or the regular planner's, the faster.

The layerwise search (plan/layerwise_search.py) offers by default only the plans the layerwise
runtime runs, a smaller space than the regular planner's (no interleaved, zero-bubble or V
schedule, no sequence parallelism, no pipeline for a tied embedding and head). So the regular
planner (plan/search.py) runs on the same inputs too, and the faster of the two best plans is
returned: each priced as ``meshmorph estimate`` prices it (a plan with layer strategies under
cost/layerwise_cost.py, the regular plan under cost/model.py). A regular plan lists no layer
strategies: every layer uses its stage's strategy, and meshmorph runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshmorph.cost.estimate import Estimate
from meshmorph.cost.model import CostModel
from meshmorph.plan.layerwise_search import LayerwiseResult, search_layerwise
from meshmorph.plan.search import SearchResult, search
from meshmorph.plan.space import SearchOptions
from meshmorph.spec.cluster import Cluster
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan, PlanError

LAYERWISE, REGULAR = "layerwise", "regular"


@dataclass(frozen=True, slots=True)
class LayerwiseChoice:
    """The plan ``plan --layerwise`` returns and both searches' results."""

    plan: Plan
    """The faster of the two best plans."""
    estimate: Estimate
    """Its figures (layerwise cost model for the layerwise plan, cost/model.py for the regular)."""
    source: str
    """Which search it came from: ``"layerwise"`` or ``"regular"``."""
    runnable: bool
    """Whether meshmorph runs ``plan`` (False only for a wide layerwise search's plan)."""
    layerwise: LayerwiseResult | None
    """The layerwise search's result; None when it found nothing (``layerwise_error``)."""
    layerwise_error: str | None
    """Why the layerwise search returned no plan (no fit, fp16), or None."""
    regular: SearchResult | None
    """The regular planner's result; None when no regular plan fits (``regular_error``)."""
    regular_error: str | None
    """Why the regular planner returned no plan, or None."""

    @property
    def regular_tokens_per_s(self) -> float | None:
        """The regular planner's best throughput (cost/model.py), None when none fits."""
        return self.regular.estimates[0].tokens_per_s if self.regular else None

    @property
    def uniform_tokens_per_s(self) -> float | None:
        """The layerwise search's best with one strategy per stage, None when none."""
        found = self.layerwise.uniform_estimate if self.layerwise else None
        return found.tokens_per_s if found else None


def choose_layerwise(model: ModelSpec, cluster: Cluster, *, global_batch: int,
                     options: SearchOptions, cost: CostModel, uniform_only: bool = False,
                     runnable: bool = True) -> LayerwiseChoice:
    """Run the layerwise search and the regular planner on the same inputs; return the faster
    best plan (ties to the regular one, which needs no layer strategies). Raises the layerwise
    search's PlanError when neither finds a plan."""
    layerwise: LayerwiseResult | None = None
    regular: SearchResult | None = None
    layerwise_error = regular_error = None
    failure: PlanError | None = None
    try:
        layerwise = search_layerwise(model, cluster, global_batch=global_batch, options=options,
                                     cost=cost, uniform_only=uniform_only, runnable=runnable)
    except PlanError as exc:
        layerwise_error, failure = str(exc), exc
    try:
        regular = search(model, cluster, global_batch=global_batch, options=options, cost=cost)
    except PlanError as exc:
        regular_error = str(exc)
    if layerwise is None and regular is None:
        assert failure is not None
        raise failure
    if regular is not None and (layerwise is None or regular.estimates[0].tokens_per_s
                                >= layerwise.estimate.tokens_per_s):
        return LayerwiseChoice(plan=regular.plans[0], estimate=regular.estimates[0],
                               source=REGULAR, runnable=True, layerwise=layerwise,
                               layerwise_error=layerwise_error, regular=regular,
                               regular_error=regular_error)
    assert layerwise is not None
    return LayerwiseChoice(plan=layerwise.plan, estimate=layerwise.estimate, source=LAYERWISE,
                           runnable=layerwise.runnable, layerwise=layerwise,
                           layerwise_error=layerwise_error, regular=regular,
                           regular_error=regular_error)
