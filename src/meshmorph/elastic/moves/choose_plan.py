"""Choose the new Plan after a membership change knowing what the move to it costs.

The planner's fastest plan for the new device set is not always the best next plan: a layout
far from the running one moves more bytes, and over the few steps left faster steps may not
pay for the longer move. Each candidate (the planner's best few runnable plans) is priced as
``move_time + steps_left * step_time`` and the smallest wins. Pure (no torch.distributed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshmorph.cost.model import CostModel
from meshmorph.elastic.moves.layout import layout_of
from meshmorph.elastic.moves.move_plan import plan_move
from meshmorph.elastic.moves.move_time import MoveTimeModel, cpu_cluster, move_time
from meshmorph.elastic.moves.placement import ReshapeError
from meshmorph.plan.runnable_plans import runnable_plans
from meshmorph.spec.cluster import Cluster, parse_cluster
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan


@dataclass(frozen=True, slots=True)
class PlanChoice:
    """One candidate next plan, priced."""

    plan: Plan
    """The candidate."""
    step_time_s: float
    """Its predicted step time (the cost model's estimate)."""
    move_time_s: float
    """Predicted time of the move from the running plan to it."""
    bytes_moved: int
    """Bytes its MovePlan sends between devices."""
    steps_left: int
    """Steps still to train."""

    @property
    def total_s(self) -> float:
        """Predicted time to finish the run under this plan, the move included."""
        return self.move_time_s + self.steps_left * self.step_time_s


def rank_choices(model: ModelSpec, plan_a: Plan, candidates: Sequence[tuple[Plan, float]], *,
                 survivors: Sequence[int], steps_left: int, cluster: Cluster | None = None,
                 time_model: MoveTimeModel | None = None) -> list[PlanChoice]:
    """Every ``(plan, step_time_s)`` candidate priced, best (least time to finish) first.
    ``survivors``: Plan A's ranks still alive; devices that join hold nothing and are numbered
    after Plan A's ranks."""
    if not candidates:
        raise ReshapeError("no candidate plan to choose from; give at least one plan that the "
                           "new device set runs")
    if steps_left < 0:
        raise ReshapeError(f"steps_left must be >= 0, got {steps_left}")
    layout_a = layout_of(model, plan_a)
    choices = []
    for plan, step_s in candidates:
        move = plan_move(layout_a, layout_of(model, plan), survivors)
        seconds = move_time(move, cluster or cpu_cluster(move), model=time_model).total_s
        choices.append(PlanChoice(plan, step_s, seconds, move.bytes_moved, steps_left))
    return sorted(choices, key=lambda c: (c.total_s, c.move_time_s))


def choose_plan(model: ModelSpec, plan_a: Plan, world_size: int, *, survivors: Sequence[int],
                steps_left: int, cluster: str | None = None,
                time_model: MoveTimeModel | None = None) -> PlanChoice:
    """The next plan for ``world_size`` devices: least predicted time to finish, move included.
    The candidates are the planner's 8 fastest plans the runtime accepts (the global batch
    kept); where the running plan still fits the device count it is a candidate too (it moves
    only what the lost devices held)."""
    candidates = runnable_plans(model, world_size, global_batch=plan_a.global_batch,
                                dtype=plan_a.dtype, cluster=cluster).plans
    if plan_a.world_size == world_size and all(p != plan_a for p, _ in candidates):
        where = parse_cluster(cluster or f"cpu:1x{world_size}")
        candidates.append((plan_a, CostModel(model, where).estimate(plan_a).step_time_s))
    if not candidates:
        raise ReshapeError(f"the planner found no plan of {model.name} for {world_size} devices "
                           f"with global_batch {plan_a.global_batch} that the runtime runs; wait "
                           "for more devices or restart from the checkpoint with a plan file")
    return rank_choices(model, plan_a, candidates, survivors=survivors, steps_left=steps_left,
                        time_model=time_model)[0]
