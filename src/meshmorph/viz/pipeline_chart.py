"""The pipeline timeline of a plan: one row per pipeline rank, one box per F/B/W op.

The ops come from simulating the plan's schedule on its per-chunk times
(``cost.pipeline.simulate(..., keep_ops=True)``), exactly as the cost model times the step.
"""

from __future__ import annotations

from pathlib import Path

from meshmorph.cost.model import CostModel
from meshmorph.cost.pipeline import Timeline, simulate
from meshmorph.spec.plan import Plan, Schedule
from meshmorph.viz.figure import save_figure

OP_COLOURS = {"F": "#4c78a8", "B": "#59a14f", "W": "#f28e2b"}
"""Forward, backward (input gradient only under zero-bubble), weight gradient."""
OP_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient"}


def plan_timeline(plan: Plan, cost: CostModel) -> Timeline:
    """Simulate one step of ``plan`` with every op kept, on the cost model's chunk times."""
    model = cost.model.with_seq_len(plan.seq_len)
    if model is not cost.model:
        cost = CostModel(model, cost.cluster, cost.coef, cost.profile)
    plan.check_against(cost.model)
    gpus = [cost.stage_gpu(stage) for stage in plan.stages]
    times = [cost.chunk_time(plan, s.start, s.stop, s.recompute, g)
             for s, g in zip(plan.stages, gpus, strict=True)]
    zb = plan.schedule == Schedule.ZERO_BUBBLE
    return simulate(plan.schedule, plan.pp, plan.num_microbatches, [t.fwd_s for t in times],
                    [t.bgrad_s if zb else t.bwd_s for t in times], v=plan.vpp,
                    wgrad_s=[t.wgrad_s for t in times] if zb else None,
                    p2p_s=[cost.p2p_time(plan, g) for g in gpus], keep_ops=True)


def write_pipeline_chart(timeline: Timeline, out_png: Path, *, pp: int, vpp: int = 1,
                         title: str = "pipeline timeline") -> Path:
    """Draw ``timeline`` (simulated with ``keep_ops``) into ``out_png``: rank 0 on top, time in
    ms; with virtual stages, a rank's later chunks are drawn lighter."""
    if not timeline.ops:
        raise ValueError("the timeline holds no ops; simulate it with keep_ops=True")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    scale = 1e3 if timeline.makespan_s < 10 else 1.0
    unit = "ms" if scale == 1e3 else "s"
    fig, ax = plt.subplots(figsize=(12, 0.55 * pp + 1.6))
    per_rank = len(timeline.ops) / pp
    labelled = per_rank <= 100  # micro-batch numbers only where the boxes are wide enough
    edge = 0.4 if per_rank <= 300 else 0.0  # white separators would hide thin boxes
    for rank, kind, chunk, micro_batch, start, end in timeline.ops:
        local_chunk = chunk // pp
        alpha = 1.0 - 0.4 * local_chunk / max(vpp - 1, 1) if vpp > 1 else 1.0
        ax.broken_barh([(start * scale, (end - start) * scale)], (rank - 0.4, 0.8),
                       facecolors=OP_COLOURS[kind], alpha=alpha, edgecolor="white",
                       linewidth=edge)
        if labelled:
            ax.text((start + end) / 2 * scale, rank, str(micro_batch), ha="center", va="center",
                    fontsize=6, color="white")
    ax.set_ylim(pp - 0.5, -0.5)
    ax.set_yticks(range(pp), [f"rank {k}" for k in range(pp)])
    ax.set_xlim(0, timeline.makespan_s * scale)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(f"{title} — bubble {timeline.bubble_fraction:.1%}")
    kinds = sorted({op[1] for op in timeline.ops}, key="FBW".index)
    ax.legend(handles=[Patch(color=OP_COLOURS[k], label=OP_NAMES[k]) for k in kinds],
              loc="upper right", fontsize=8, ncol=len(kinds))
    ax.grid(axis="x", alpha=0.3)
    return save_figure(fig, out_png)


def write_plan_pipeline_chart(plan: Plan, cost: CostModel, out_png: Path) -> Path:
    """Simulate ``plan`` and draw its timeline into ``out_png``."""
    title = (f"{plan.model}: tp {plan.tp} pp {plan.pp} dp {plan.dp}, {plan.schedule}"
             f"{f' v{plan.vpp}' if plan.vpp > 1 else ''}, {plan.micro_batch} x "
             f"{plan.num_microbatches} micro-batches")
    return write_pipeline_chart(plan_timeline(plan, cost), out_png, pp=plan.pp, vpp=plan.vpp,
                                title=title)
