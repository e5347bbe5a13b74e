"""``meshmorph validate``: run several plans on local processes, measure their step time and
state bytes, and compare with the cost model fed by a Profile taken just before.

The plans are not used to fit anything: the prediction reads only the Profile (layer times with
every process busy at once, the collectives' alpha-beta fits, the optimizer tail) and the cost
model's physics. All plans run inside ONE spawned job (one process group; each rank rebuilds its
engine per plan). Step time is the median of ``repeats`` steps after ``warmup`` steps; the load
average is recorded before and after each plan.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from meshmorph.cost import CostModel, Profile
from meshmorph.profile.accuracy import kendall_tau, mape
from meshmorph.schedule.table import Schedule
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.cluster import parse_cluster
from meshmorph.spec.model import ModelSpec, Recompute
from meshmorph.spec.plan import Plan, PlanError


@dataclass(frozen=True, slots=True, kw_only=True)
class ValidateConfig:
    """What ``meshmorph validate`` runs."""

    num_plans: int = 8
    """Plans to run and predict."""
    nproc: int = 2
    """Local processes (gloo on CPU; one GPU each where there are GPUs)."""
    model: str = "gpt-small"
    """Catalog model trained by every plan."""
    seq_len: int = 64
    """Sequence length of every plan."""
    global_batch: int = 8
    """Sequences per step of every plan."""
    repeats: int = 5
    """Timed steps per plan; the median is the measured step time."""
    warmup: int = 2
    """Untimed steps before the timed ones."""
    profile_path: Path | None = None
    """A Profile to predict with; None: run ``meshmorph profile`` (quick=False) first."""
    quick_profile: bool = False
    """Profile with the quick settings (tests)."""
    nice: int = 0
    """Priority increment of the profiling and training processes (negative, where privileged:
    ahead of other work sharing the cores); the load average is recorded either way."""
    tensor_parallel: bool = False
    """Also run tp > 1 plans. The profile times layers at tp 1 only; on CPU, DTensor's per-op
    dispatch dominates a tp plan's step and is not profiled, so these are marked outside."""
    interleave: bool = True
    """Predict each plan from profile pieces measured between its own steps
    (profile/interleaved.py), so that both see the same load; False: from the profile taken
    before all the plans (or ``profile_path``) alone. Either way the profile taken first (or
    read) chooses the plans, and its prediction is reported beside as ``predicted_before_s``."""

    def __post_init__(self) -> None:
        if self.num_plans < 2:
            raise ValueError(f"validate needs 2 plans at least for Kendall tau, got {self.num_plans}")


def candidate_plans(model: ModelSpec, nproc: int, global_batch: int, *,
                    tensor_parallel: bool = False,
                    recompute: tuple[Recompute, ...] = (Recompute.NONE, Recompute.FULL)) -> list[Plan]:
    """Every fp32 plan of ``model`` on ``nproc`` processes with micro-batch 1, 2 or 4 and each
    block recompute mode of ``recompute`` that the runtime accepts, in a fixed shuffled order
    that mixes layouts."""
    from meshmorph.run.engine.train_engine import validate_plan

    plans = []
    for tp in (1, 2, 4) if tensor_parallel else (1,):
        for pp in (1, 2, 4):
            if nproc % (tp * pp):
                continue
            dp = nproc // (tp * pp)
            for mb in (1, 2, 4):
                if global_batch % (dp * mb):
                    continue
                m = global_batch // (dp * mb)
                zeros = (0, 1, 2, 3) if dp > 1 else (0,)
                schedules = (Schedule.ONE_F_ONE_B, Schedule.GPIPE) if pp > 1 else (Schedule.ONE_F_ONE_B,)
                for zero, schedule, mode in itertools.product(zeros, schedules, recompute):
                    try:
                        plan = Plan(model=model.name, seq_len=model.seq_len,
                                    global_batch=global_batch, tp=tp, pp=pp, dp=dp, zero=zero,
                                    micro_batch=mb, num_microbatches=m, schedule=schedule,
                                    dtype="fp32").with_even_stages(model, mode)
                        validate_plan(model, plan, nproc)
                    except (PlanError, ValueError):
                        continue
                    plans.append(plan)
    random.Random(0).shuffle(plans)
    # round-robin over (tp, pp) so that the first plans cover every layout
    groups: dict[tuple[int, int], list[Plan]] = {}
    for plan in plans:
        groups.setdefault((plan.tp, plan.pp), []).append(plan)
    rounds = itertools.zip_longest(*(groups[key] for key in sorted(groups)))
    return [plan for row in rounds for plan in row if plan is not None]


def spanning_plans(plans: list[Plan], predicted_s: list[float], n: int) -> list[Plan]:
    """``n`` of ``plans`` whose predicted step times lie as far apart as possible (the largest
    least ratio between neighbours), so that Kendall tau compares real differences, not near
    ties. Chosen from predictions only: nothing measured on the plans decides which run."""
    if n >= len(plans):
        return list(plans)
    order = sorted(range(len(plans)), key=lambda i: predicted_s[i])
    logs = [math.log(max(predicted_s[i], 1e-12)) for i in order]

    def greedy(gap: float) -> list[int] | None:
        chosen = [0]
        for k in range(1, len(logs)):
            if logs[k] - logs[chosen[-1]] >= gap:
                chosen.append(k)
        return chosen if len(chosen) >= n else None

    low, high = 0.0, (logs[-1] - logs[0]) / (n - 1)
    best = greedy(low)
    for _ in range(40):  # bisect the largest gap that still leaves n plans
        mid = (low + high) / 2
        found = greedy(mid)
        if found is not None:
            low, best = mid, found
        else:
            high = mid
    assert best is not None
    return [plans[order[k]] for k in best[:n]]


def plan_name(plan: Plan) -> str:
    sched = f"-{plan.schedule}" if plan.pp > 1 else ""
    modes = {m for m in plan.recompute_of_layer() if m != Recompute.NONE}
    rec = f"-rc{'+'.join(sorted(str(m) for m in modes))}" if modes else ""
    return (f"tp{plan.tp}pp{plan.pp}dp{plan.dp}z{plan.zero}-mb{plan.micro_batch}"
            f"x{plan.num_microbatches}{sched}{rec}")


def _rank_job(rank: int, world: int, model_name: str, seq_len: int, plans_json: list[str],
              warmup: int, repeats: int, out_dir: str, interleave: bool = True) -> None:
    import gc

    import torch
    import torch.distributed as dist

    from meshmorph.profile.interleaved import PlanPieces
    from meshmorph.profile.validate_phases import StepPhases
    from meshmorph.run.config import OptimConfig
    from meshmorph.run.engine.train_engine import build_engine

    model = catalog_model(model_name, seq_len)
    optim = OptimConfig(lr=1e-4, min_lr=1e-5, warmup_steps=1, decay_steps=100)
    device = torch.device("cuda", rank % torch.cuda.device_count()) if torch.cuda.is_available() \
        else torch.device("cpu")
    rows = []
    for text in plans_json:
        plan = Plan.from_json(text)
        loads = [os.getloadavg()[0]]
        pieces = PlanPieces(model, plan, world, rank, device) if interleave else None
        engine = build_engine(model, plan, optim, seed=0, device=device)
        phases = StepPhases(engine)
        gen = torch.Generator().manual_seed(1)
        share = plan.global_batch // plan.dp
        times, cpu = [], []
        # profile pieces -> step -> pieces -> step -> ... -> pieces: each timed step lies
        # between two samples of the pieces its prediction reads, under the same load
        if pieces is not None:
            pieces.sample(keep=False)  # the pieces' own warm-up
        for i in range(warmup + repeats):
            if pieces is not None and i >= warmup:
                pieces.sample()
            batch = torch.randint(0, model.vocab_size, (plan.global_batch, seq_len + 1), generator=gen)
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            phases.begin()
            engine.step(batch[engine.dp_rank * share:(engine.dp_rank + 1) * share])
            if device.type == "cuda":
                torch.cuda.synchronize()
            phases.end()
            if i >= warmup:
                times.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
            loads.append(os.getloadavg()[0])
        if pieces is not None:
            pieces.sample()
        state = engine.captured_state or {}
        state_bytes = float(state.get("params_bytes", 0)) + float(state.get("grads_bytes", 0)) + \
            float(state.get("optimizer_bytes", 0))
        # the slowest rank sets the step time: per step, then the median over steps
        step = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(step, op=dist.ReduceOp.MAX)
        slowest = [float(t) for t in step]
        phases.close()
        every_rank: list[object] = [None] * world  # each rank's phases of the timed steps
        dist.all_gather_object(every_rank, phases.records[warmup:])
        row: dict[str, object] = {
            "measured_step_s": statistics.median(slowest), "measured_times_s": slowest,
            "measured_cpu_s": cpu, "state_bytes_rank0": state_bytes,
            "pp_rank0": engine.train_mesh.pp_rank, "load_before": loads[0],
            "load_after": loads[-1], "load_avg": statistics.mean(loads),
            "measured_phases_s": every_rank}
        if pieces is not None:
            name = plan_name(plan)
            row["pieces_s"] = pieces.seconds
            row["profile"] = pieces.profile(
                source=f"meshmorph validate, between the steps of {name}, {world} processes",
                load_avg=statistics.mean(loads)).to_dict()
            row["step_overheads_s"] = [pieces.overhead_s(slice(r, r + 2)) for r in range(repeats)]
            row["step_profiles"] = [pieces.profile(
                slice(r, r + 2), source=f"meshmorph validate, around step {r} of {name}",
                load_avg=loads[warmup + r]).to_dict() for r in range(repeats)]
        rows.append(row)
        del engine, pieces, phases
        gc.collect()
        if rank == 0:
            (Path(out_dir) / "progress").write_text(str(len(rows)))
    if rank == 0:
        (Path(out_dir) / "measured.json").write_text(json.dumps(rows))


def predict(model: ModelSpec, plan: Plan, nproc: int, profile: Profile,
            overhead_s: float = 0.0) -> dict[str, object]:
    """Predicted step time with its range (the profile's layer spreads applied all one way, then
    all the other) and whether the plan lies outside what was profiled. ``overhead_s``: the
    pipeline schedule's own time per step, measured apart (profile/schedule_overhead.py), added
    to the cost model's step."""
    cluster = parse_cluster(f"cpu:1x{nproc}")
    cost = CostModel(model, cluster, profile=profile)
    est = cost.estimate(plan)
    bounds = []
    for sign in (-1.0, 1.0):
        rows = {k: {**v, "fwd_s": v["fwd_s"] * (1 + sign * v.get("spread", 0.0)),
                    "bwd_s": v["bwd_s"] * (1 + sign * v.get("spread", 0.0))}
                for k, v in profile.layer_times.items()}
        bounds.append(CostModel(model, cluster, profile=replace(profile, layer_times=rows))
                      .estimate(plan).step_time_s)
    outside = []
    if not profile.covers(model.name, model.seq_len, plan.micro_batch, plan.dtype, model.num_layers):
        outside.append(f"micro-batch {plan.micro_batch} x seq {model.seq_len} {plan.dtype} not "
                       "profiled: layer times from the catalog's FLOP/s")
    if plan.tp > 1:
        outside.append("tp > 1: layers profiled at tp 1 (DTensor per-op dispatch not profiled)")
    if profile.processes != nproc:
        outside.append(f"profiled with {profile.processes} processes, run with {nproc}")
    mem = est.memory[0]
    return {"predicted_step_s": est.step_time_s + overhead_s,
            "predicted_low_s": min(bounds) + overhead_s,
            "predicted_high_s": max(bounds) + overhead_s, "breakdown_s": est.breakdown_s,
            "predicted_phases_s": {**predicted_phases(cost, plan, est.breakdown_s),
                                   "schedule_overhead_s": overhead_s},
            "predicted_state_bytes_rank0": mem.params + mem.grads + mem.optimizer,
            "outside_profile": outside}


def predicted_phases(cost: CostModel, plan: Plan, breakdown: dict[str, float]) -> dict[str, object]:
    """The predicted parts to set beside ``measured_phases_s``: per pipeline rank the forward
    and the backward of its micro-batches (ZeRO-3's exposed gathers and scatters and recompute
    in them), and the critical rank's exposed gradient reduction (with the tied embedding's
    sync and the two scalar all-reduces) and optimizer tail."""
    forward, backward = [], []
    for k in range(plan.pp):
        chunks = [plan.stages[c] for c in plan.chunks_of(k)]
        times = [cost.chunk_time(plan, s.start, s.stop, s.recompute, cost.stage_gpu(s))
                 for s in chunks]
        forward.append(plan.num_microbatches * sum(t.fwd_s for t in times))
        backward.append(plan.num_microbatches * sum(t.bwd_s for t in times))
    return {"forward_s": forward, "backward_s": backward, "pp_bubble_s": breakdown["pp_bubble"],
            "grad_reduce_s": breakdown["dp_comm_exposed"] + breakdown["embedding_sync"],
            "optimizer_s": breakdown["optimizer"]}


def predict_between_steps(model: ModelSpec, plan: Plan, nproc: int,
                          step_profiles: list[Profile],
                          step_overheads_s: list[float] | None = None) -> dict[str, object]:
    """The prediction from profile pieces sampled around each timed step (one Profile per step,
    from the samples just before and just after it): the median of the per-step predictions,
    as the measured step time is the median of the steps, and their lowest and highest as the
    range; the breakdown, state bytes and notes of the step whose prediction is the median."""
    if not step_profiles:
        raise ValueError("predict_between_steps needs one profile per timed step, got none")
    overheads = step_overheads_s or [0.0] * len(step_profiles)
    each = [predict(model, plan, nproc, p, o)
            for p, o in zip(step_profiles, overheads, strict=True)]
    times = [float(e["predicted_step_s"]) for e in each]  # type: ignore[arg-type]
    order = sorted(range(len(each)), key=times.__getitem__)
    middle = each[order[(len(order) - 1) // 2]]
    return {**middle, "predicted_step_s": statistics.median(times),
            "predicted_low_s": min(times), "predicted_high_s": max(times),
            "predicted_steps_s": times}


def phase_medians(every_rank: list[list[dict[str, float]]] | None) -> list[dict[str, float]]:
    """Per rank, each phase's median over the timed steps (``measured_phases_s``: per rank, one
    record per step, profile/validate_phases.py)."""
    return [{key: statistics.median(r[key] for r in records) for key in records[0]}
            for records in every_rank or [] if records]


BUSY_EXTRA_LOAD = 2.0
"""Runnable work beyond the larger of the cores and validate's own processes (1-minute load
average) past which a measurement says more of the other jobs than of the plans: on 2 cores,
2 processes measured MAPE 3-6% at load averages 2.1-3.3 and 11-20% at 9."""


def too_busy(loads: list[float], cores: int, nproc: int) -> str | None:
    """Why the machine was too busy to measure (its highest load average beyond what
    validate itself runs), or None."""
    limit = max(cores, nproc) + BUSY_EXTRA_LOAD
    worst = max(loads, default=0.0)
    if worst <= limit:
        return None
    return (f"the machine was too busy to measure: load average up to {worst:.1f} on {cores} "
            f"cores while validate ran {nproc} processes (above {limit:.1f}); the step times "
            f"say more of the other work than of the plans, so no MAPE or Kendall tau is "
            f"reported; rerun when the machine is idle")


def run_validate(config: ValidateConfig) -> dict[str, object]:
    """Profile (unless given), run the plans, predict them; the result dict ``report`` writes."""
    from rich.console import Console
    from rich.progress import Progress

    from meshmorph.profile.job import ProfileConfig, progress_poll, quick_config, run_profile
    from meshmorph.profile.spawn import spawn

    model = catalog_model(config.model, config.seq_len)
    plans = candidate_plans(model, config.nproc, config.global_batch,
                            tensor_parallel=config.tensor_parallel)
    if len(plans) < config.num_plans:
        raise ValueError(f"only {len(plans)} runnable plans of {config.model} on {config.nproc} "
                         f"processes with global batch {config.global_batch}; ask for fewer plans")
    console = Console(stderr=True)
    if config.profile_path is not None:
        profile = Profile.load(config.profile_path)
    else:
        mbs = tuple(sorted({p.micro_batch for p in plans}))  # every candidate's
        pconf = quick_config(config.nproc, (config.model,), config.seq_len) if config.quick_profile \
            else ProfileConfig(nproc=config.nproc, models=(config.model,), seq_len=config.seq_len)
        pconf = replace(pconf, micro_batches=mbs, nice=config.nice)
        with Progress(console=console) as bar:
            task = bar.add_task("profiling", total=pconf.steps())
            profile = run_profile(pconf, on_progress=lambda d: bar.update(task, completed=d))
    plans = spanning_plans(plans, [CostModel(model, parse_cluster(f"cpu:1x{config.nproc}"),
                                             profile=profile).estimate(p).step_time_s
                                   for p in plans], config.num_plans)
    with tempfile.TemporaryDirectory(prefix="meshmorph-validate-") as tmp:
        with Progress(console=console) as bar:
            task = bar.add_task("running plans", total=len(plans))
            spawn(_rank_job, config.nproc, (config.model, config.seq_len,
                                            [p.to_json() for p in plans], config.warmup,
                                            config.repeats, tmp, config.interleave),
                  Path(tmp), timeout_s=600.0, nice=config.nice, poll=progress_poll(
                      Path(tmp) / "progress", lambda d: bar.update(task, completed=d)))
        measured = json.loads((Path(tmp) / "measured.json").read_text())
    rows = []
    for plan, meas in zip(plans, measured, strict=True):
        before = predict(model, plan, config.nproc, profile)
        if "step_profiles" in meas:
            own = predict_between_steps(model, plan, config.nproc,
                                        [Profile.from_dict(p, "step profile")
                                         for p in meas.pop("step_profiles")],
                                        meas.get("step_overheads_s"))
        else:
            own = before
        rows.append({"name": plan_name(plan), "plan": json.loads(plan.to_json()), **own, **meas,
                     "predicted_before_s": before["predicted_step_s"],
                     "measured_phase_medians_s": phase_medians(meas.get("measured_phases_s"))})
    pred = [float(r["predicted_step_s"]) for r in rows]
    meas_s = [float(r["measured_step_s"]) for r in rows]
    pred_before = [float(r["predicted_before_s"]) for r in rows]
    return {"model": config.model, "seq_len": config.seq_len, "nproc": config.nproc,
            "method": "interleaved" if config.interleave else "profile before",
            "mape": mape(pred, meas_s), "kendall_tau": kendall_tau(pred, meas_s),
            "mape_profile_before": mape(pred_before, meas_s),
            "kendall_tau_profile_before": kendall_tau(pred_before, meas_s),
            "load_avg_plans": [min(float(r["load_before"]) for r in rows),
                               max(float(r["load_after"]) for r in rows)],
            "in_range": sum(r["predicted_low_s"] <= r["measured_step_s"] <= r["predicted_high_s"]
                            for r in rows),
            "load_avg_profile": profile.load_avg, "cores": os.cpu_count(),
            "too_busy": too_busy([profile.load_avg, *(float(r["load_avg"]) for r in rows)],
                                 os.cpu_count() or 1, config.nproc),
            "profile": profile.to_dict(), "plans": rows,
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
