"""The pipeline timeline of a plan: one row per pipeline rank, one box per F/B/W op.

The ops come from simulating the plan's schedule on its per-chunk times
(``cost.pipeline.simulate(..., keep_ops=True)``), exactly as the cost model times the step; the
drawing is ``viz.timeline_chart``'s, the one ``meshmorph timeline`` uses.
"""

from __future__ import annotations

from pathlib import Path

from meshmorph.cost.model import CostModel
from meshmorph.cost.pipeline import Timeline, simulate
from meshmorph.spec.plan import Plan
from meshmorph.viz.timeline_chart import Lane, draw_timelines, plan_stage_times


def plan_timeline(plan: Plan, cost: CostModel) -> Timeline:
    """Simulate one step of ``plan`` with every op kept, on the cost model's chunk times."""
    times = plan_stage_times(plan, cost)
    zb = plan.schedule.split_backward
    return simulate(plan.schedule, plan.pp, plan.num_microbatches, list(times.fwd_s),
                    list(times.igrad_s if zb else times.bwd_s), v=plan.vpp,
                    wgrad_s=list(times.wgrad_s) if zb else None,
                    p2p_s=list(times.p2p_s), keep_ops=True)


def write_pipeline_chart(timeline: Timeline, out_png: Path, *, pp: int, vpp: int = 1,
                         title: str = "pipeline timeline", split_backward: bool = False) -> Path:
    """Draw ``timeline`` (simulated with ``keep_ops``) into ``out_png`` with
    ``viz.timeline_chart`` (rank 0 on top, bubbles hatched); under a zero-bubble schedule
    (``split_backward``) the B boxes are input-gradient backwards and are drawn as such."""
    if not timeline.ops:
        raise ValueError("the timeline holds no ops; simulate it with keep_ops=True")
    ops = [(k, "I" if split_backward and kind == "B" else kind, c, j, start, end)
           for k, kind, c, j, start, end in timeline.ops]
    return draw_timelines([Lane(title, ops)], out_png)


def write_plan_pipeline_chart(plan: Plan, cost: CostModel, out_png: Path) -> Path:
    """Simulate ``plan`` and draw its timeline into ``out_png``."""
    title = (f"{plan.model}: tp {plan.tp} pp {plan.pp} dp {plan.dp}, {plan.schedule}"
             f"{f' v{plan.vpp}' if plan.vpp > 1 else ''}, {plan.micro_batch} x "
             f"{plan.num_microbatches} micro-batches")
    return write_pipeline_chart(plan_timeline(plan, cost), out_png, pp=plan.pp, vpp=plan.vpp,
                                title=title,
                                split_backward=plan.schedule.split_backward)
