"""Pipeline timelines as Gantt charts: one row per rank, one box per action, bubbles hatched; a
plan's on the cost model's per-chunk times (``plan``/``estimate --chart``), or several lanes on
one time axis (``meshmorph timeline --compare``: the simulated one over the measured one)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from meshmorph.cost.model import CostModel
from meshmorph.schedule.registry import stage_to_rank
from meshmorph.schedule.simulator import (
    StageTimes,
    Timeline,
    local_transfers_zeroed,
    simulate_schedule,
)
from meshmorph.schedule.table import Schedule
from meshmorph.schedule.trace import OpRecord
from meshmorph.spec.plan import Plan
from meshmorph.viz.figure import pyplot, save_figure

KIND_COLOURS = {"F": "#4c78a8", "B": "#59a14f", "I": "#76b7b2", "W": "#f28e2b", "STEP": "#b07aa1"}
"""Forward, full backward, input-gradient backward, weight gradient, optimizer step."""
KIND_NAMES = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad",
              "STEP": "optimizer step"}


def plan_stage_times(plan: Plan, cost: CostModel) -> StageTimes:
    """The cost model's per-chunk times of ``plan`` (F, full B, I, W, transfer to the next)."""
    model = cost.model.with_seq_len(plan.seq_len)
    if model is not cost.model:
        cost = CostModel(model, cost.cluster, cost.coef, cost.profile)
    plan.check_against(cost.model)
    gpus = [cost.stage_gpu(stage) for stage in plan.stages]
    times = [cost.chunk_time(plan, s.start, s.stop, s.recompute, g)
             for s, g in zip(plan.stages, gpus, strict=True)]
    return StageTimes([t.fwd_s for t in times], [t.bwd_s for t in times],
                      igrad_s=[t.bgrad_s for t in times], wgrad_s=[t.wgrad_s for t in times],
                      p2p_s=[cost.p2p_time(plan, g) for g in gpus])


def plan_timeline(plan: Plan, cost: CostModel, schedule: str | None = None) -> Timeline:
    """Simulate one step of ``plan`` (or of its stages under ``schedule``), every action kept."""
    name = schedule or str(plan.schedule)
    times = plan_stage_times(plan, cost)
    v = Schedule(name).info.vpp_for(plan.vpp if len(times.fwd_s) > plan.pp else 1)
    p2p = local_transfers_zeroed(name, plan.pp, v, times.p2p_s or [])
    times = StageTimes(times.fwd_s, times.bwd_s, times.igrad_s, times.wgrad_s, p2p)
    needed = len(stage_to_rank(name, plan.pp, v))
    if needed != len(times.fwd_s):
        raise ValueError(f"schedule {name} runs {needed} chunks on pp {plan.pp}, the plan has "
                         f"{len(times.fwd_s)}; draw it with a plan of {needed // plan.pp} chunks "
                         f"per rank, or use --schedule NAME --pp P --microbatches M")
    return simulate_schedule(name, plan.pp, plan.num_microbatches, times, v=v)


def plan_title(plan: Plan, schedule: str | None = None) -> str:
    """``tp T pp P dp D, SCHEDULE[ vV], B x M micro-batches``: what a plan's timeline shows."""
    return (f"tp {plan.tp} pp {plan.pp} dp {plan.dp}, {schedule or plan.schedule}"
            f"{f' v{plan.vpp}' if plan.vpp > 1 else ''}, {plan.micro_batch} x "
            f"{plan.num_microbatches} micro-batches")


def write_plan_pipeline_chart(plan: Plan, cost: CostModel, out_png: Path) -> Path:
    """Simulate ``plan`` and draw its timeline into ``out_png``."""
    return draw_timelines([Lane(f"{plan.model}: {plan_title(plan)}",
                                plan_timeline(plan, cost).ops)], out_png)


@dataclass(frozen=True, slots=True)
class Lane:
    """One timeline to draw."""

    title: str
    """Heading above its rows."""
    ops: Sequence[OpRecord]
    """(rank, kind, stage, micro-batch, start_s, end_s) of every action."""


def draw_timelines(lanes: Sequence[Lane], out_png: Path) -> Path:
    """Draw every lane as one Gantt chart (rank 0 on top) on a shared time axis; the idle time
    of each rank up to its lane's last action is hatched (the bubble)."""
    from matplotlib.patches import Patch

    ranks = [1 + max(op[0] for op in lane.ops) for lane in lanes]
    end_s = max(op[5] for lane in lanes for op in lane.ops)
    scale, unit = (1e3, "ms") if end_s < 10 else (1.0, "s")
    fig, axes = pyplot().subplots(len(lanes), 1, sharex=True, squeeze=False,
                             figsize=(12, sum(0.55 * p + 1.0 for p in ranks) + 0.6))
    kinds: set[str] = set()
    for ax, lane, p in zip(axes[:, 0], lanes, ranks, strict=True):
        lane_end = max(op[5] for op in lane.ops)
        busy = [0.0] * p
        for rank, kind, _, mb, start, end in lane.ops:
            busy[rank] += end - start
            kinds.add(kind)
            ax.broken_barh([(start * scale, (end - start) * scale)], (rank - 0.4, 0.8),
                           facecolors=KIND_COLOURS.get(kind, "#999999"), edgecolor="white",
                           linewidth=0.4 if len(lane.ops) <= 300 * p else 0.0, zorder=2)
            if len(lane.ops) <= 100 * p and kind != "STEP":
                ax.text((start + end) / 2 * scale, rank, str(mb), ha="center", va="center",
                        fontsize=6, color="white", zorder=3)
        for rank in range(p):  # the bubble: everything not covered by a box, hatched
            ax.broken_barh([(0.0, lane_end * scale)], (rank - 0.4, 0.8), facecolors="#f3f3f3",
                           edgecolor="#d62728", hatch="///", linewidth=0.0, zorder=1)
        bubble = sum(lane_end - b for b in busy) / (lane_end * p) if lane_end > 0 else 0.0
        ax.set_ylim(p - 0.5, -0.5)
        ax.set_yticks(range(p), [f"rank {k}" for k in range(p)])
        ax.set_title(f"{lane.title} — {lane_end * scale:.3g} {unit}, bubble {bubble:.1%}",
                     fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set(xlim=(0, end_s * scale), xlabel=f"time ({unit})")
    handles = [Patch(color=KIND_COLOURS[k], label=KIND_NAMES[k]) for k in KIND_COLOURS if k in kinds]
    handles.append(Patch(facecolor="#f3f3f3", edgecolor="#d62728", hatch="///", label="bubble"))
    axes[0, 0].legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=7,
                      ncol=len(handles), frameon=False, borderaxespad=0.2)
    return save_figure(fig, out_png)
