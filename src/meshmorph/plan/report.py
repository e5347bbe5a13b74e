"""Rich reports of plans: the table of the best plans and the breakdown of one plan's estimate."""

from __future__ import annotations

from collections import Counter
from itertools import groupby
from operator import itemgetter
from typing import Any

from rich import box
from rich.console import Console

from meshmorph.cost.estimate import GIB, Estimate
from meshmorph.schedule.table import Schedule
from meshmorph.spec.model import LayerKind, ModelSpec, Recompute
from meshmorph.spec.plan import Plan
from meshmorph.tables import Column, print_table

# the parts of a rank's memory, in the order the reports and charts stack them
MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "buffers", "reserved")

MEMORY_COLUMNS = (Column("stage"), Column("params"), Column("grads"), Column("optimizer", "optim"),
                  Column("activations", "activ"), Column("buffers"), Column("reserved", "resv"),
                  Column("in flight", "in-fl"), Column("total"), Column("budget"),
                  Column("headroom", "free"))
"""Columns of the memory table of ``estimate``: stage, ``MEMORY_PARTS``, micro-batches in
flight, total, budget, headroom (short headers where 100 columns need them)."""


def schedule_label(plan: Plan) -> str:
    """``1f1b``, ``interleaved v2``, ``-`` without a pipeline."""
    if plan.pp == 1:
        return "-"
    return f"{plan.schedule} v{plan.vpp}" if plan.schedule == Schedule.INTERLEAVED else str(plan.schedule)


def recompute_summary(plan: Plan, model: ModelSpec | None = None) -> str:
    """``full 24/96, sel 8/96``: recomputed layers out of the blocks (out of all the plan's layers
    when the model is not given); ``none`` when nothing is recomputed."""
    modes = plan.recompute_of_layer()
    if model is not None and len(model.layers) == len(modes):
        modes = [m for m, layer in zip(modes, model.layers, strict=True)
                 if layer.kind == LayerKind.BLOCK]
    counts = Counter(modes)
    parts = [f"{short} {counts[mode]}/{len(modes)}"
             for mode, short in ((Recompute.FULL, "full"), (Recompute.SELECTIVE, "sel"))
             if counts[mode]]
    return ", ".join(parts) or "none"


def memory_summary(peak_gib: list[float]) -> str:
    """Peak GiB per stage: every stage up to three, else the range ``min–max``."""
    if not peak_gib:
        return "-"
    if len(peak_gib) <= 3:
        return " / ".join(f"{g:.1f}" for g in peak_gib)
    return f"{min(peak_gib):.1f}–{max(peak_gib):.1f}"


def _figure(predicted: dict[str, Any], key: str, fmt: str, scale: float = 1.0) -> str:
    value = predicted.get(key)
    return format(value * scale, fmt) if isinstance(value, int | float) else "-"


def _tflops(value: Any) -> str:
    if not isinstance(value, int | float):
        return "-"
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def _tokens(value: Any) -> str:
    if not isinstance(value, int | float):
        return "-"
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= limit:
            return f"{value / limit:.2f} {suffix}"
    return f"{value:.1f}"


def _seconds(value: Any) -> str:
    if not isinstance(value, int | float):
        return "-"
    return f"{value:.3f} s" if value >= 1 else f"{value * 1e3:.1f} ms"


def plan_columns(context: bool) -> list[Column]:
    """The columns of the plans table (``cp`` only with ``context``): the degrees, step time,
    MFU and memory always; the rest left out to fit, the throughput figures MFU restates first."""
    return [
        Column("#"), Column("tp pp dp"), *((Column("cp"),) if context else ()),
        Column("ZeRO"), Column("SP", justify="center", drop=3),
        Column("overlap", "ovl", "left", drop=6,
               abbreviate=lambda label: label.replace("grad", "g").replace("no-", "-")),
        Column("schedule", "sched", "left", drop=2,
               abbreviate=lambda label: label.replace("interleaved", "intl")),
        Column("mb x m", drop=1), Column("recompute", "recomp", "left", drop=2,
                                         abbreviate=lambda label: label.replace(", ", ","),
                                         wrap=12),
        Column("step"), Column("tokens/s", "tok/s", drop=5), Column("TFLOP/s/GPU", "TF/s", drop=7),
        Column("MFU"), Column("peak GiB", "GiB"), Column("bubble", drop=4),
    ]


def print_plans(plans: list[Plan], console: Console, *, title: str | None = None,
                search_time_s: float | None = None, model: ModelSpec | None = None) -> None:
    """A table of plans, best first, with their predicted figures (``plan.predicted``), fitted
    to the console's width (meshmorph.tables)."""
    context = any(plan.cp > 1 for plan in plans)  # a cp column only where some plan has cp > 1
    rows = []
    for rank, plan in enumerate(plans, start=1):
        predicted = plan.predicted or {}
        rows.append([
            str(rank), f"{plan.tp} {plan.pp} {plan.dp}", *((str(plan.cp),) if context else ()),
            str(plan.zero),
            "yes" if plan.sequence_parallel else "-", overlap_summary(plan), schedule_label(plan),
            f"{plan.micro_batch} x {plan.num_microbatches}", recompute_summary(plan, model),
            _seconds(predicted.get("step_time_s")), _tokens(predicted.get("tokens_per_s")),
            _tflops(predicted.get("tflops_per_gpu")), _figure(predicted, "mfu", ".1%"),
            memory_summary(list(predicted.get("peak_memory_gib", []))),
            _figure(predicted, "bubble_fraction", ".1%"),
        ])
    caption = f"search took {search_time_s:.2f} s" if search_time_s is not None else None
    print_table(console, plan_columns(context), rows,
                title=title or "best plans, fastest first", caption=caption,
                box=box.SIMPLE_HEAD, edges=False)


def plan_headline(plan: Plan, model: ModelSpec | None = None) -> str:
    """One line naming a plan's layout."""
    return (f"{plan.model}, seq {plan.seq_len}, global batch {plan.global_batch}: "
            f"{plan.degrees()} = {plan.world_size} GPUs, ZeRO {plan.zero}, "
            f"SP {'on' if plan.sequence_parallel else 'off'}, schedule {schedule_label(plan)}, "
            f"micro-batch {plan.micro_batch} x {plan.num_microbatches}, "
            f"recompute {recompute_summary(plan, model)}, overlap {overlap_summary(plan)}, "
            f"{plan.dtype}{f' {plan.fp8_scaling}' if plan.dtype == 'fp8' else ''}")


def overlap_summary(plan: Plan) -> str:
    """The overlap switches that matter for ``plan``, each named when on and ``no-`` when off:
    ``grad`` (overlap_grad_reduce, with more than one data-parallel replica), ``pf``
    (fsdp_prefetch, ZeRO-3 over them) and ``tp`` (tp_comm_overlap, with sequence parallelism);
    ``-`` where none matters."""
    parts = []
    if plan.grad_replicas > 1:
        parts.append("grad" if plan.overlap_grad_reduce else "no-grad")
        if plan.zero == 3:
            parts.append("pf" if plan.fsdp_prefetch else "no-pf")
    if plan.sequence_parallel:
        parts.append("tp" if plan.tp_comm_overlap else "no-tp")
    return " ".join(parts) or "-"


def fit_advice(plan: Plan) -> list[str]:
    """Ways to lower the memory of a plan, most effective first."""
    advice = []
    if any(mode != Recompute.FULL for mode in plan.recompute_of_layer()):
        advice.append("--recompute full")
    if plan.dp > 1 and plan.zero < 3:
        advice.append(f"--zero {plan.zero + 1 if plan.zero < 1 else 3}")
    if plan.micro_batch > 1:
        advice.append(f"--micro-batch {plan.micro_batch // 2}")
    if plan.tp > 1 and not plan.sequence_parallel:
        advice.append("--sequence-parallel")
    if plan.seq_len >= 16_384 and plan.dp % 2 == 0 and plan.seq_len % (4 * plan.cp) == 0:
        # context parallelism halves every activation of a long sequence (docs/cost-model.md)
        advice.append(f"--cp {plan.cp * 2} with --dp {plan.dp // 2}")
    advice.append(f"--pp {plan.pp * 2} with --dp {plan.dp // 2}" if plan.dp % 2 == 0
                  else "more pipeline stages (a larger --pp, a smaller --dp)")
    return advice


def does_not_fit_line(plan: Plan, estimate: Estimate) -> str | None:
    """``DOES NOT FIT: stage k needs X GiB, the device has Y GiB; try ...``, None when it fits."""
    if estimate.fits:
        return None
    over = [m.total - b for m, b in zip(estimate.memory, estimate.memory_budget_bytes, strict=True)]
    stage = max(range(len(over)), key=over.__getitem__)
    need = estimate.memory[stage].total / GIB
    have = estimate.memory_budget_bytes[stage] / GIB
    return (f"DOES NOT FIT: stage {stage} needs {need:.1f} GiB per GPU, the device has "
            f"{have:.1f} GiB (over by {need - have:.1f} GiB); try {', '.join(fit_advice(plan))}")


def layer_strategy_summary(plan: Plan) -> list[str]:
    """One line per stage listing layer strategies, runs of equal ones merged:
    ``stage 0: L0 tp1 dp4 z0 | L1-3 tp2 dp2 z0 | ...``; empty for a uniform plan."""
    lines = []
    for k, stage in enumerate(plan.stages):
        if stage.layer_strategies is None:
            continue
        runs = [(s, [stage.start + offset for offset, _ in run])
                for s, run in groupby(enumerate(stage.layer_strategies), key=itemgetter(1))]
        lines.append(f"stage {k}: " + " | ".join(
            f"L{at[0]}{f'-{at[-1]}' if len(at) > 1 else ''} tp{s.tp} dp{s.dp} z{s.zero}"
            for s, at in runs))
    return lines


def print_estimate(plan: Plan, estimate: Estimate, console: Console, *,
                   model: ModelSpec | None = None) -> None:
    """The breakdown of one plan: time terms, memory per stage against its budget, fit."""
    console.print(f"[bold]plan[/]: {plan_headline(plan, model)}")
    for line in layer_strategy_summary(plan):
        console.print(f"layer strategies, {line}")
    step = estimate.step_time_s
    times = [[term.replace("_", " "), f"{seconds:.4f}", f"{seconds / step:.1%}" if step else "-"]
             for term, seconds in estimate.breakdown_s.items()]
    times.append(["[bold]step[/]", f"[bold]{step:.4f}[/]", "100.0%"])
    print_table(console, [Column("term", justify="left"), Column("seconds"), Column("share")],
                times, title="step time")
    rows = []
    for k, (stage, budget) in enumerate(zip(estimate.memory, estimate.memory_budget_bytes, strict=True)):
        headroom = (budget - stage.total) / GIB
        style = "red" if headroom < 0 else "green"
        rows.append([str(k), *(f"{getattr(stage, part) / GIB:.2f}" for part in MEMORY_PARTS),
                     f"{stage.in_flight_microbatches:g}", f"{stage.total / GIB:.2f}",
                     f"{budget / GIB:.1f}", f"[{style}]{headroom:.2f}[/]"])
    print_table(console, MEMORY_COLUMNS, rows,
                title="peak memory per GPU of each pipeline stage, GiB")

    console.print(
        f"step {_seconds(step)} · {_tokens(estimate.tokens_per_s)} tokens/s · "
        f"{_tflops(estimate.tflops_per_gpu)} TFLOP/s per GPU "
        f"(model {_tflops(estimate.model_tflops_per_gpu)}) · "
        f"MFU {estimate.mfu:.1%} · bubble {estimate.bubble_fraction:.1%}"
    )
    line = does_not_fit_line(plan, estimate)
    if line:
        console.print(f"[bold red]{line}[/]")
    else:
        peak = max(estimate.peak_memory_gib)
        console.print(f"[green]fits[/]: largest stage peak {peak:.1f} GiB of "
                      f"{min(estimate.memory_budget_bytes) / GIB:.1f} GiB")
