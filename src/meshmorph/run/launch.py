"""``meshmorph run``: check a job completely, then start torchrun and watch it.

Everything that can be refused is refused before any process starts: the job file, the data, the
plan against the model and the number of processes, and the checkpoint to resume from. Then the
plan is written into the run folder and ``torch.distributed.run`` starts the ranks in a session of
its own; Ctrl-C (or SIGTERM) is forwarded to it once, and escalated if the ranks do not stop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from meshmorph.run.job import JobConfig, load_job
from meshmorph.spec.catalog import load_model
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan, PlanError

STOP_GRACE_S = 20.0
"""Seconds the ranks get to stop at a step boundary after Ctrl-C before they are terminated."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PreparedRun:
    """A job that passed every check, ready to launch."""

    job_path: Path
    """The job file."""
    job: JobConfig
    """The job it holds."""
    model: ModelSpec
    """The model at the job's sequence length."""
    plan: Plan
    """The plan the ranks run (stages filled in)."""
    nproc: int
    """Processes to start."""
    out_dir: Path
    """Run folder."""
    resume: bool
    """Continue from the newest checkpoint."""


def default_plan(job: JobConfig, model: ModelSpec, nproc: int) -> Plan:
    """Pure data parallelism over ``nproc`` ranks with even stages."""
    per_step = nproc * job.train.micro_batch  # dp x micro_batch sequences per micro-step
    if job.train.global_batch % per_step:
        raise PlanError(
            f"global_batch {job.train.global_batch} is not divisible by dp {nproc} x micro_batch "
            f"{job.train.micro_batch} = {per_step}; change [train] global_batch or micro_batch, "
            f"or --nproc"
        )
    plan = Plan(model=job.model.source, seq_len=job.model.seq_len,
                global_batch=job.train.global_batch, dp=nproc,
                micro_batch=job.train.micro_batch,
                num_microbatches=job.train.global_batch // per_step, dtype=job.train.dtype)
    return plan.with_even_stages(model)


def searched_plans(job: JobConfig, model: ModelSpec, nproc: int) -> tuple[list[Plan], float]:
    """Plans the planner ranks best first for ``nproc`` local CPU processes, and its search time."""
    try:
        from meshmorph.plan.search import search
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("meshmorph"):
            raise PlanError(
                "--plan auto needs the planner (meshmorph.plan.search), which this build lacks; "
                "pass --plan FILE, or leave --plan out for pure data parallelism"
            ) from None
        raise
    from meshmorph.plan.space import SearchOptions
    from meshmorph.spec.cluster import parse_cluster

    options = SearchOptions(dtype=job.train.dtype, top_k=8)
    result = search(model, parse_cluster(f"cpu:1x{nproc}"), global_batch=job.train.global_batch,
                    options=options)
    plans = [plan if plan.stages else plan.with_even_stages(model) for plan in result.plans]
    if not plans:
        raise PlanError(
            f"the planner found no plan for {model.name} on {nproc} CPU processes with "
            f"global_batch {job.train.global_batch}; try another --nproc or batch"
        )
    return plans, float(result.search_time_s)


def check_plan_for_job(plan: Plan, job: JobConfig, model: ModelSpec, nproc: int) -> None:
    """Refuse a plan made for another model, sequence length, batch or world size."""
    if plan.model != job.model.source:
        raise PlanError(
            f"the plan was made for model {plan.model!r} but the job trains "
            f"{job.model.source!r}; plan this model or fix [model] source"
        )
    for what, planned, wanted in (("seq_len", plan.seq_len, job.model.seq_len),
                                  ("global_batch", plan.global_batch, job.train.global_batch)):
        if planned != wanted:
            raise PlanError(
                f"the plan has {what} {planned} but the job has {wanted}; make them agree"
            )
    from meshmorph.run.engine import validate_plan

    validate_plan(model, plan, nproc)  # check_against, plus what the runtime itself needs


def prepare_run(job_path: Path, *, nproc: int | None, plan_arg: str | None, resume: bool,
                out: Path | None) -> PreparedRun:
    """Every check a run needs, with no process started and nothing written."""
    from meshmorph.run.checkpoint import latest_checkpoint
    from meshmorph.run.trainer import make_source

    job = load_job(job_path)
    model = load_model(job.model.source, job.model.seq_len)
    make_source(job, model)  # data file present, long enough, fits the vocabulary
    if plan_arg == "auto":
        plans, _ = searched_plans(job, model, nproc or 1)
        plan = plans[0]
    elif plan_arg:
        plan = Plan.load(plan_arg)
        plan = plan if plan.stages else plan.with_even_stages(model)
    else:
        plan = default_plan(job, model, nproc or 1)
    nproc = nproc or plan.world_size
    check_plan_for_job(plan, job, model, nproc)
    out_dir = out or job.out_dir()
    if resume:
        latest_checkpoint(job.checkpoint_dir(out_dir))  # a corrupted newest one is refused here
    return PreparedRun(job_path=job_path, job=job, model=model, plan=plan, nproc=nproc,
                       out_dir=out_dir, resume=resume)


def torchrun_command(run: PreparedRun, plan_path: Path) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(run.nproc), "-m", "meshmorph.run.trainer",
               "--job", str(run.job_path.resolve()), "--plan", str(plan_path.resolve()),
               "--out", str(run.out_dir.resolve())]
    return command + (["--resume"] if run.resume else [])


def _process_tree(root: int) -> dict[int, list[int]]:
    """Children of every process below ``root`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])  # field 4 of /proc/PID/stat: ppid
        children.setdefault(parent, []).append(int(entry.name))
    return children


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, children before grandchildren."""
    children, found, todo = _process_tree(pid), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def stop_ranks(proc: subprocess.Popen[bytes]) -> None:
    """Stop a torchrun started by ``launch``: SIGINT to every rank (each stops at its next step
    boundary, together with the others), then SIGTERM to torchrun, then SIGKILL to whatever of
    its process tree is left."""
    ranks = _process_tree(proc.pid).get(proc.pid, [])  # torchrun's children are the ranks
    tree = descendants(proc.pid)
    _signal(ranks, signal.SIGINT)
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # torchrun closes its ranks itself
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    _signal([pid for pid in tree if Path(f"/proc/{pid}").exists()], signal.SIGKILL)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def launch(run: PreparedRun, *, quiet: bool = False) -> int:
    """Write the plan into the run folder, run torchrun, and return its exit code
    (130 after Ctrl-C or SIGTERM, once every rank has stopped)."""
    run.out_dir.mkdir(parents=True, exist_ok=True)
    plan_path = run.out_dir / "plan.json"
    plan_path.write_text(run.plan.to_json() + "\n")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // run.nproc)))
    if not quiet:
        print(f"meshmorph: starting {run.nproc} processes: tp {run.plan.tp} x pp {run.plan.pp} x "
              f"dp {run.plan.dp} (zero {run.plan.zero}); run folder {run.out_dir}", flush=True)
    # Ctrl-C must reach this process even when started in the background (where SIGINT is
    # ignored); torchrun runs in a session of its own so that only this process forwards it.
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        proc = subprocess.Popen(torchrun_command(run, plan_path), env=env, start_new_session=True)
        try:
            return proc.wait()
        except KeyboardInterrupt:
            started = time.monotonic()
            stop_ranks(proc)
            print(f"meshmorph: interrupted; every rank stopped within "
                  f"{time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
            return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_job(job_path: Path, *, nproc: int | None = None, plan_arg: str | None = None,
            resume: bool = False, out: Path | None = None) -> int:
    """Check, then launch; PlanError and other ValueErrors reach the caller before any process."""
    return launch(prepare_run(job_path, nproc=nproc, plan_arg=plan_arg, resume=resume, out=out))
