"""``meshmorph demo``: plan a small GPT for local CPU processes, show the plans, train the best.

About a minute on a laptop: gpt-small (6 blocks, h 256) on the synthetic token-rule task, whose
loss falls from ln(256) = 5.5 within the run. Writes job.toml, plan.json, metrics.jsonl and
loss.png into the run folder it names at the end.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from meshmorph.cli.output import finish
from meshmorph.cli.run import draw_loss_chart
from meshmorph.plan.report import print_plans
from meshmorph.run.job import load_job
from meshmorph.run.launch.launcher import PreparedRun, check_plan_for_job, launch, searched_plans
from meshmorph.run.metrics import METRICS_FILE, read_metrics
from meshmorph.spec.catalog import load_model
from meshmorph.spec.plan import Plan, PlanError
from meshmorph.tables import report_console

DEMO_MODEL = "gpt-small"
DEMO_SEQ_LEN = 64
DEMO_GLOBAL_BATCH = 16
DEMO_STEPS = 50  # 0.6-1 s a step for 4 processes on 2 cores, plus ~20 s of start-up

_JOB = """\
# written by meshmorph demo
[model]
source = "{model}"
seq_len = {seq_len}

[data]
kind = "synthetic"
seed = 0

[train]
steps = {steps}
global_batch = {global_batch}
micro_batch = 2
seed = 0
dtype = "fp32"

[optim]
lr = 3e-3
min_lr = 3e-4
warmup_steps = 5
decay_steps = {steps}

[checkpoint]
every = 0

[run]
out_dir = "{out_dir}"
"""


def _demo(args: argparse.Namespace) -> int:
    """Plan, show, train; returns the launcher's exit code."""
    from meshmorph.run.launch.run_folder import RunLock, check_fresh, make_folder

    nproc, steps = args.nproc, args.steps
    if nproc < 1 or (steps is not None and steps < 1):
        raise ValueError(f"meshmorph demo needs --nproc >= 1 and --steps >= 1, got --nproc {nproc}"
                         + (f", --steps {steps}" if steps is not None else ""))
    console = report_console(args.wide)
    out_dir = args.out or Path("runs") / "demo"
    make_folder(out_dir)
    check_fresh(out_dir, out_dir / "checkpoints")  # before job.toml is written over
    RunLock(out_dir).acquire().release()  # another demo running here is refused, not overwritten
    job_path = out_dir / "job.toml"
    job_path.write_text(_JOB.format(model=DEMO_MODEL, seq_len=DEMO_SEQ_LEN,
                                    steps=steps or DEMO_STEPS, global_batch=DEMO_GLOBAL_BATCH,
                                    out_dir=out_dir.as_posix()))
    job = load_job(job_path)
    model = load_model(DEMO_MODEL, DEMO_SEQ_LEN)
    console.print(f"[bold]meshmorph demo[/]: {model.name} ({model.num_params / 1e6:.1f} M "
                  f"parameters, {model.num_blocks} blocks, seq_len {DEMO_SEQ_LEN}) on {nproc} "
                  f"local CPU processes, global batch {DEMO_GLOBAL_BATCH}")
    try:
        plans, search_time_s = searched_plans(job, model, nproc)
        console.print(f"planner searched in {search_time_s:.2f} s")
        plans = [plan for plan in plans if _fits(plan, job, model, nproc)] or plans
    except PlanError as exc:
        console.print(f"[yellow]{exc}[/]\nfalling back to pure data parallelism")
        from meshmorph.run.launch.launcher import default_plan

        plans = [default_plan(job, model, nproc)]
    print_plans(plans[:8], console)
    plan = plans[0]
    console.print(f"training plan 1: tp {plan.tp} x pp {plan.pp} x dp {plan.dp}, zero {plan.zero}, "
                  f"micro-batches {plan.num_microbatches} x {plan.micro_batch}, {plan.schedule}")
    check_plan_for_job(plan, job, model, nproc)
    code = launch(PreparedRun(job_path=job_path, job=job, model=model, plan=plan, nproc=nproc,
                              out_dir=out_dir, resume=False))
    metrics = out_dir / METRICS_FILE
    if code == 0 and metrics.is_file():
        draw_loss_chart(out_dir)
        records = read_metrics(metrics)
        console.print(f"loss {records[0]['loss']:.3f} at step 1 -> {records[-1]['loss']:.3f} at "
                      f"step {records[-1]['step']}")
        console.print(f"run folder: {out_dir} (plan.json, metrics.jsonl, loss.png)")
    return code


def _fits(plan: Plan, job: object, model: object, nproc: int) -> bool:
    try:
        check_plan_for_job(plan, job, model, nproc)  # type: ignore[arg-type]
    except PlanError:
        return False
    return True


def register(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser(
        "demo", help="plan and train a small GPT on local CPU processes (about a minute)",
        description="Plan gpt-small for local CPU processes, show the plans, train it on a "
                    "synthetic task and write metrics.jsonl and loss.png.",
    )
    demo.add_argument("--nproc", type=int, default=4, help="processes (default 4)")
    demo.add_argument("--steps", type=int, default=None,
                      help="training steps (default: about a minute of training)")
    demo.add_argument("--out", type=Path, default=None, help="run folder (default runs/demo)")
    finish(demo, _demo)
