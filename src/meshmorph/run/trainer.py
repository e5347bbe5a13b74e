"""The per-rank training entry point, run under torchrun.

``python -m meshmorph.run.trainer --job job.toml --plan plan.json --out RUN_DIR [--resume]``

Each rank: joins the process group (collectives time out after ``[run] collective_timeout_s``),
builds the engine for its part of the Plan, and loops (its data-parallel share of the batch, one
engine step, metrics on rank 0, a checkpoint every K steps). A stop request (SIGINT/SIGTERM, the
launcher's stop file, or a dead parent: ``run/stop.py``) only raises a flag; the ranks agree on it
before every step, so all of them stop at the same step boundary, save a checkpoint there (when
the job checkpoints at all) and exit with 0 (the launcher, which asked, reports the interruption).
A collective that fails or times out ends the rank with a message naming it and exit code 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshmorph.run import fault
from meshmorph.run.checkpoint import (
    CheckpointInfo,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from meshmorph.run.data import DataShard, SampleOrder, make_source
from meshmorph.run.engine.state_line import write_state_line
from meshmorph.run.fingerprint import run_fingerprint
from meshmorph.run.job import JobConfig, load_job
from meshmorph.run.launch.run_folder import stop_file
from meshmorph.run.metrics import MetricsLogger
from meshmorph.run.stop import StopFlag
from meshmorph.spec.catalog import load_model
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan

SAMPLE_LOG_ENV = "MESHMORPH_SAMPLE_LOG"
"""Debug mode: a folder where every rank appends, after each completed step, the sample ids it
trained on (``samples-rank<r>.jsonl``: restart round, step, dp rank, ids), so a test can check
that a failure and restart skipped and repeated no sample."""


def log_samples(shard: DataShard, consumed: int, step: int) -> None:
    """Append this rank's sample ids of ``step`` (begun at ``consumed``) when debugging."""
    folder = os.environ.get(SAMPLE_LOG_ENV)
    if not folder:
        return
    record = {"round": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "step": step,
              "dp_rank": shard.dp_rank, "ids": [int(i) for i in shard.indices(consumed)]}
    with (Path(folder) / f"samples-rank{dist.get_rank()}.jsonl").open("a") as handle:
        handle.write(json.dumps(record) + "\n")


def restart_store(timeout: timedelta) -> dist.Store | None:
    """The store of this worker-group round under torchrun's elastic agent: the agent's shared
    TCPStore outlives a restart, so the keys the dead round left there (each rank's gloo/NCCL
    address) would send the new workers to closed ports ("Connection refused" in
    ``connectFullMesh``); prefixing every key with ``TORCHELASTIC_RESTART_COUNT`` gives each
    round a clean namespace. None where the workers do not share the agent's store."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"meshmorph/round{attempt}", store)


def init_distributed(timeout_s: float) -> torch.device:
    """Join the process group torchrun describes, with every collective bounded by
    ``timeout_s``; the device this rank trains on."""
    timeout = timedelta(seconds=timeout_s)
    store = restart_store(timeout)
    where = {} if store is None else {"store": store, "rank": int(os.environ["RANK"]),
                                      "world_size": int(os.environ["WORLD_SIZE"])}
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("cuda:nccl,cpu:gloo", timeout=timeout, **where)
        return torch.device("cuda", local_rank)
    dist.init_process_group("gloo", timeout=timeout, **where)
    return torch.device("cpu")


def find_resume_point(ckpt_dir: Path) -> CheckpointInfo | None:
    """Rank 0 finds and verifies the newest checkpoint; every rank gets the same answer."""
    answer: list[object] = [None]
    if dist.get_rank() == 0:
        try:
            answer[0] = latest_checkpoint(ckpt_dir)
        except ValueError as exc:
            answer[0] = str(exc)
    dist.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], str):
        raise ValueError(answer[0])
    return answer[0]  # type: ignore[return-value]


@dataclass(slots=True)
class RankRun:
    """One rank's training loop and where it stands."""

    job: JobConfig
    """What to train."""
    plan: Plan
    """The plan the engine runs (a restored run's may differ from the one launched)."""
    engine: Any
    """The TrainEngine."""
    shard: DataShard
    """This rank's share of every global batch."""
    metrics: MetricsLogger
    """The metric lines (rank 0)."""
    ckpt_dir: Path
    """Where checkpoints go."""
    fingerprint: dict[str, Any]
    """What the checkpoints belong to."""
    step: int = 0
    """Steps done."""
    consumed: int = 0
    """Samples consumed (the data-loader state)."""
    saved_step: int = 0
    """The step of the newest checkpoint this run saved (or started from)."""

    def save(self) -> None:
        save_checkpoint(self.engine, self.ckpt_dir, step=self.step,
                        consumed_samples=self.consumed, plan=self.plan.to_dict(),
                        keep=self.job.checkpoint.keep, fingerprint=self.fingerprint)
        self.saved_step = self.step

    def one_step(self, device: torch.device, trace: Any, elastic: Any) -> None:
        """Train one step and log it; the step boundary in the node store and a checkpoint
        where the job asks for one."""
        tokens = self.shard.batch(self.consumed).to(device)
        lr = float(self.engine.optimizers[0].param_groups[0]["lr"])  # the LR this step uses
        if trace:  # meshmorph run --trace: time every pipeline action of a few steps
            trace.before_step()
        fault.arm_step(self.engine, self.step + 1)  # MESHMORPH_FAULT, --inject-failure: tests
        start = time.perf_counter()
        loss = self.engine.step(tokens)
        step_time_s = time.perf_counter() - start
        if trace:
            trace.after_step()
        self.step += 1
        log_samples(self.shard, self.consumed, self.step)
        self.consumed += self.plan.global_batch
        self.metrics.log(step=self.step, loss=loss, lr=lr, grad_norm=self.engine.grad_norm_last(),
                         step_time_s=step_time_s, consumed_samples=self.consumed)
        write_state_line(self.engine, self.metrics, self.step)  # once, after its first step
        if elastic is not None:  # the step boundary, in the node-local store
            elastic.after_step(self.engine, self.plan, self.step, self.consumed)
        every = self.job.checkpoint.every
        if every and self.step % every == 0:
            self.save()


def _engine_at_start(job: JobConfig, plan: Plan, model: ModelSpec, device: torch.device, *,
                     resume: bool, elastic: Any, ckpt_dir: Path) -> tuple[Any, Plan, int, int, Any]:
    """(engine, plan, step, consumed samples, reshape event or None): restored from the node
    stores after an elastic restart (whatever ``resume`` says: a restart before the first step
    boundary finds the stores empty and starts fresh, or from the checkpoint ``resume`` named),
    resumed from the newest checkpoint (``resume``: refused where there is none), or fresh;
    compiled where the job asks."""
    from meshmorph.run.engine.train_engine import build_engine

    rank = dist.get_rank()
    restored = elastic.restore(model, job.optim, seed=job.train.seed, device=device,
                               total_steps=job.train.steps) \
        if elastic is not None else None  # torchrun restarted us: the node stores have the state
    step, consumed, reshape = 0, 0, None
    if restored is not None:  # the plan may be another one (the world size changed)
        engine, plan, step, consumed, reshape = restored
    else:
        engine = build_engine(model, plan, job.optim, seed=job.train.seed, device=device)
    if plan.compile or job.train.compile:  # torch.compile per block (run/parallel/compile.py)
        from meshmorph.run.parallel.compile import compile_blocks, resolve_backend

        async_tp = plan.tp_comm_overlap  # torch's async TP: an inductor pass
        choice = resolve_backend(job.train.compile_backend, device, async_tp=async_tp)
        if rank == 0 and choice.note:
            print(choice.note, flush=True)
        compile_blocks(engine.model_parts, choice.backend, async_tp=async_tp)
    if restored is None and resume:
        info = find_resume_point(ckpt_dir)
        if info is None:  # meshmorph run refuses this before launch; the rank program does too
            raise ValueError(f"--resume: no checkpoint in {ckpt_dir} to continue from; check "
                             "--out, or run without --resume to start from step 0")
        load_checkpoint(engine, info)
        step, consumed = info.step, info.consumed_samples
        if rank == 0:
            print(f"resumed from {info.path} (step {step}, {consumed} samples consumed)",
                  flush=True)
    return engine, plan, step, consumed, reshape


def _final_line(run: RankRun, interrupted: bool) -> str:
    state = "stopped by a signal" if interrupted else "finished"
    saved = (f"checkpoint {run.ckpt_dir / f'step-{run.step}'}" if run.saved_step == run.step
             and run.step else "no checkpoint saved ([checkpoint] every = 0)" if interrupted
             and not run.job.checkpoint.every else "")
    return f"{state} at step {run.step}; metrics in {run.metrics.path}" + \
        (f"; {saved}" if saved else "")


def train(job: JobConfig, plan: Plan, out_dir: Path, *, resume: bool, stop: StopFlag,
          elastic: Any = None) -> int:
    from meshmorph.run.engine.pipeline import RunTrace

    device = init_distributed(job.run.collective_timeout_s)
    rank = dist.get_rank()
    if stop.agreed():  # asked to stop while the ranks were starting
        if rank == 0:
            print(f"stopped by {stop.reason or 'a stop request'} before step 1", flush=True)
        return 0
    fault.install(out_dir, elastic.injected() if elastic is not None else None)
    if job.train.compile and not plan.compile:  # [train] compile: the plan says it, as priced
        plan = replace(plan, compile=True)
    model = load_model(job.model.source, job.model.seq_len)
    source = make_source(job, model)
    if not plan.schedule.info.flush:  # no flush: the asynchronous executor (run/async_pipe/)
        from meshmorph.run.async_pipe.train import run_async_job

        return run_async_job(model=model, plan=plan, optim=job.optim, source=source,
                             data_seed=job.data.seed, steps=job.train.steps,
                             seed=job.train.seed, out_dir=out_dir, device=device,
                             resume=resume, elastic=elastic)
    ckpt_dir = job.checkpoint_dir(out_dir)
    engine, plan, step, consumed, reshape = _engine_at_start(
        job, plan, model, device, resume=resume, elastic=elastic, ckpt_dir=ckpt_dir)
    shard = DataShard(source, SampleOrder(len(source), job.data.seed),
                      global_batch=plan.global_batch, dp_rank=engine.dp_rank,
                      dp_size=engine.dp_size)
    metrics = MetricsLogger(out_dir, enabled=rank == 0, total_steps=job.train.steps,
                            start_step=step, tokens_per_step=plan.global_batch * plan.seq_len)
    if reshape is not None:
        metrics.log_event(reshape)
    run = RankRun(job, plan, engine, shard, metrics, ckpt_dir,
                  run_fingerprint(job, model, plan).to_dict(), step, consumed, step)
    trace = RunTrace.from_env(getattr(engine, "schedule", None), plan, out_dir,
                              job.train.steps - step)
    interrupted = False
    try:
        while run.step < job.train.steps and not (interrupted := stop.agreed()):
            run.one_step(device, trace, elastic)
        if interrupted and job.checkpoint.every and run.step > run.saved_step:
            run.save()
        if elastic is not None and not interrupted:  # done: the node store is no longer needed
            dist.barrier()
            if int(os.environ.get("LOCAL_RANK", "0")) == 0:
                elastic.store.clear()
    finally:
        metrics.close()
    if rank == 0:
        print(_final_line(run, interrupted), flush=True)
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="meshmorph.run.trainer",
                                     description="One rank of a meshmorph training job.")
    parser.add_argument("--job", required=True, type=Path, help="job file (TOML)")
    parser.add_argument("--plan", required=True, type=Path, help="plan file (JSON)")
    parser.add_argument("--out", required=True, type=Path, help="run folder")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint of the run folder "
                             "(refused where there is none)")
    parser.add_argument("--elastic-run-id", default=None,
                        help="keep state in the node-local store under this id (run --elastic)")
    parser.add_argument("--inject-failure", default=None, metavar="RANK@STEP",
                        help="SIGKILL that rank's worker once, in that step")
    return parser.parse_args(argv)


_PEER_SIGNS = ("gloo", "nccl", "connection", "timed out", "timeout", "socket", "peer")


def is_collective_failure(exc: BaseException) -> bool:
    """Whether an error came from the communication layer (a dead or silent peer)."""
    return isinstance(exc, dist.DistError) or any(sign in str(exc).lower() for sign in _PEER_SIGNS)


def collective_failure(exc: BaseException, rank: str, timeout_s: float | None) -> str:
    """One line for a collective that failed on this rank: timed out, or a peer went away."""
    text = str(exc).strip()
    first = text.splitlines()[0][:240] if text else type(exc).__name__
    if "timeout" in text.lower() or "timed out" in text.lower():
        what = (f"a collective waited longer than the {timeout_s:.0f} s timeout "
                "([run] collective_timeout_s)" if timeout_s else "a collective timed out")
    else:
        what = "a collective failed"
    return (f"meshmorph: error on rank {rank}: {what}: {first}; another rank stopped or died "
            "(its message is above); continue from the newest checkpoint with --resume")


def main(argv: list[str] | None = None,
         make_elastic: Callable[[argparse.Namespace], Any] | None = None) -> int:
    """One rank's run; ``make_elastic`` builds the elastic session from the parsed arguments
    (``python -m meshmorph.elastic.live.worker`` passes it; None: a plain run)."""
    stop = StopFlag()
    stop.watch_parents()
    args = parse_args(argv)
    stop.stop_path = stop_file(args.out)
    rank = os.environ.get("RANK", "0")
    code, timeout_s, clean = 0, None, True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            job = load_job(args.job)
            timeout_s = job.run.collective_timeout_s
            plan = Plan.load(args.plan)
            elastic = make_elastic(args) if make_elastic and args.elastic_run_id else None
            code = train(job, plan, args.out, resume=args.resume, stop=stop, elastic=elastic)
    except (ValueError, FileNotFoundError) as exc:
        print(f"meshmorph: error on rank {rank}: {exc}", file=sys.stderr, flush=True)
        code = 2
    except RuntimeError as exc:  # gloo/NCCL: a peer died, or a collective waited past the timeout
        if not is_collective_failure(exc):
            raise  # a bug, not a failed peer: its traceback is the useful message
        print(collective_failure(exc, rank, timeout_s), file=sys.stderr, flush=True)
        code, clean = 1, False
    finally:
        if dist.is_initialized() and clean:
            dist.destroy_process_group()
    return code


def exit_now(code: int) -> None:
    """End the rank without interpreter finalisation, once its output is flushed: the work is
    done (metrics, checkpoints and logs closed, the process group destroyed), and torch's C++
    threads (gloo's workers, the intra-op pool) that touch a Python object while the interpreter
    tears down abort the process (``terminate called without an active exception``, SIGABRT),
    which the launcher reports as a failed job after a finished run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
