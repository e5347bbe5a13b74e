"""``meshmorph run``: check a job completely, then start torchrun and watch it.

Everything that can be refused is refused before any process starts or any file is written: the
job file, the data, the plan against the model and the number of processes, a run folder that
holds another run's checkpoints (without ``--resume``), one that holds none (with ``--resume``),
and the checkpoint to resume from (its files, and its model, data and plan fingerprint; another
plan only with ``--reshard``). Then the run folder is locked for the run's lifetime, the plan
is written into it, and torchrun (``run/launch/agent.py``) starts the ranks in a session of its
own. The first Ctrl-C (or SIGTERM) asks the ranks to stop after the current step and save, and
says which step that is and how long it should take still; the second kills them at once,
leaving the newest complete checkpoint as it was. Afterwards the exact command to resume is printed. An ``--elastic`` run's
stderr passes through the launcher (``run/launch/console.py``): a failure torchrun's agent
restarts and the workers recover from shows as one line per event, torch's output of it kept in
a log under the run folder.
"""

from __future__ import annotations

import contextlib
import os
import select
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from meshmorph.plan.runnable_plans import runnable_plans
from meshmorph.run.checkpoint import PREFIX, TMP_INFIX, CheckpointInfo, scan_checkpoints
from meshmorph.run.job import JobConfig, load_job
from meshmorph.run.launch.console import Relay, last_step, last_step_record
from meshmorph.run.launch.host_memory import check_host_memory
from meshmorph.run.launch.run_folder import (
    RunLock,
    check_fresh,
    check_resumable,
    clear_stop,
    make_folder,
    plan_file,
    request_stop,
    set_aside_earlier_run,
)
from meshmorph.run.metrics import METRICS_FILE
from meshmorph.spec.catalog import load_model
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan, PlanError, load_plan
from meshmorph.spec.runnable import check_fp8_job, check_plan, refuse_context_parallel

STOP_GRACE_S = 300.0
"""Seconds the ranks get, after the first Ctrl-C and beyond what their step is expected to take
still (``stopping_line``), to finish it, save and exit before they are killed (a second Ctrl-C
kills them at once)."""


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
    resume_from: CheckpointInfo | None = None
    """The checkpoint a resumed run continues from (None: a run without ``--resume``, from step
    0)."""
    reshard: bool = False
    """The checkpoint was saved under another plan; DCP reshards it on load."""
    elastic: str | None = None
    """``MIN:MAX`` nodes: run under torchrun's elastic agent (c10d rendezvous, restarts), the
    state kept in the node-local store; None: a fixed set of processes."""
    inject_failure: str | None = None
    """``RANK@STEP``: SIGKILL that rank's worker once in that step (tests and demos)."""
    node: ElasticNode | None = None
    """With ``elastic``: this machine is one node of several (``--node-rank``); None: one
    node, rendezvous on a free local port."""


@dataclass(frozen=True, slots=True)
class ElasticNode:
    """One node of a multi-node ``--elastic`` run: every node gives the same endpoint and id."""

    rank: int
    """This node's number, 0 on the node whose address is the endpoint (it hosts the
    rendezvous store); it names the node's store, which outlives its workers."""
    endpoint: str
    """``HOST:PORT`` of the c10d rendezvous (node 0's address, a free port there)."""
    run_id: str | None = None
    """The rendezvous id and the node stores' name (None: derived from the endpoint)."""

    def resolved_id(self) -> str:
        return self.run_id or "meshmorph-" + self.endpoint.replace(":", "-").replace(".", "-")


def parse_failure(text: str | None) -> tuple[int, int] | None:
    """``RANK@STEP`` -> (rank, step); None for None."""
    if text is None:
        return None
    rank, sep, step = text.partition("@")
    if not sep or not rank.isdigit() or not step.isdigit() or int(step) < 1:
        raise ValueError(f"--inject-failure takes RANK@STEP (e.g. 3@4, step >= 1), got {text!r}")
    return int(rank), int(step)


def parse_elastic(text: str) -> tuple[int, int]:
    """``MIN:MAX`` nodes (or one number) -> (min, max)."""
    low, _, high = text.partition(":")
    high = high or low
    if not low.isdigit() or not high.isdigit() or not 1 <= int(low) <= int(high):
        raise ValueError(f"--elastic takes MIN:MAX nodes with 1 <= MIN <= MAX, got {text!r}")
    return int(low), int(high)


def parse_node(node_rank: int | None, endpoint: str | None, run_id: str | None,
               elastic: str | None, nproc: int, plan: Plan) -> ElasticNode | None:
    """The node a ``--node-rank`` run is, checked (None without ``--node-rank``: one machine,
    which an ``--elastic`` minimum above one node would wait for forever)."""
    if node_rank is None and endpoint is None and run_id is None:
        low = parse_elastic(elastic)[0] if elastic is not None else 1
        if low > 1:
            raise ValueError(
                f"--elastic {elastic} waits for at least {low} nodes, but without --node-rank "
                f"and --rdzv-endpoint only this machine joins (one node): use --elastic 1:1 "
                f"here, or start every node with --elastic {elastic} --node-rank K "
                f"--rdzv-endpoint HOST:PORT")
        return None
    if elastic is None or node_rank is None or endpoint is None:
        raise ValueError("--node-rank and --rdzv-endpoint go together, with --elastic MIN:MAX "
                         "(e.g. --elastic 1:2 --node-rank 0 --rdzv-endpoint node0:29500)")
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"--rdzv-endpoint takes HOST:PORT, got {endpoint!r}")
    _, high = parse_elastic(elastic)
    if not 0 <= node_rank < high:
        raise ValueError(f"--node-rank {node_rank} must be 0 to {high - 1} (one number per node, "
                         f"below the --elastic maximum {high})")
    if plan.world_size != nproc * high:
        raise ValueError(f"the plan has {plan.world_size} ranks but {high} nodes x --nproc "
                         f"{nproc} make {nproc * high}; the job starts on every node at once "
                         "and shrinks from there (give a plan for the full world)")
    return ElasticNode(node_rank, endpoint, run_id)


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
                num_microbatches=job.train.global_batch // per_step, dtype=job.train.dtype,
                fp8_scaling=job.train.fp8_scaling, compile=job.train.compile)
    return plan.with_even_stages(model)


def searched_plans(job: JobConfig, model: ModelSpec, nproc: int) -> tuple[list[Plan], float]:
    """Plans the planner ranks best first for ``nproc`` local CPU processes that the runtime
    runs, and its search time."""
    found = runnable_plans(model, nproc, global_batch=job.train.global_batch,
                           dtype=job.train.dtype, compile=job.train.compile)
    if not found.plans:
        raise PlanError(
            f"the planner found no plan for {model.name} on {nproc} CPU processes with "
            f"global_batch {job.train.global_batch} that the runtime runs; try another --nproc "
            "or batch"
        )
    return [plan for plan, _ in found.plans], found.search_time_s


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
    import torch  # where the ranks will run; not the runtime itself (seconds more to import)

    if job.train.compile:  # the ranks compile the plan's blocks ([train] compile)
        plan = replace(plan, compile=True)
    # the plan's own checks and what the runtime needs, as the ranks will check them again
    check_plan(model, plan, nproc, cuda=torch.cuda.is_available())
    check_host_memory(model, plan, nproc)  # the steps' batches and activations fit this machine


def check_resume_point(job: JobConfig, model: ModelSpec, plan: Plan, out_dir: Path, *,
                       reshard: bool) -> tuple[CheckpointInfo, bool]:
    """The verified newest checkpoint of the run folder, checked to belong to this model, data
    and (unless ``reshard``) plan; and whether loading it reshards. A folder without one is
    refused: ``--resume`` never starts from step 0."""
    from meshmorph.run.checkpoint import latest_checkpoint
    from meshmorph.run.fingerprint import RunFingerprint, check_resume, run_fingerprint

    check_resumable(out_dir, job.checkpoint_dir(out_dir))  # none at all: refused, not step 0
    info = latest_checkpoint(job.checkpoint_dir(out_dir))  # a damaged newest one is refused here
    assert info is not None  # check_resumable found a step-N folder, verified or refused above
    differs = check_resume(RunFingerprint.from_dict(info.fingerprint),
                           run_fingerprint(job, model, plan), where=str(info.path), reshard=reshard)
    return info, differs


def prepare_run(job_path: Path, *, nproc: int | None, plan_arg: str | None, resume: bool,
                out: Path | None, reshard: bool = False, elastic: str | None = None,
                inject_failure: str | None = None, node_rank: int | None = None,
                rdzv_endpoint: str | None = None, rdzv_id: str | None = None) -> PreparedRun:
    """Every check a run needs, with no process started and nothing written."""
    from meshmorph.run.data import make_source

    if nproc is not None and nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}; leave it out to use the "
                         "plan's world size")
    if reshard and not resume:
        raise ValueError("--reshard loads a checkpoint into another plan, so it needs --resume")
    job = load_job(job_path)
    model = load_model(job.model.source, job.model.seq_len)
    make_source(job, model)  # data file present, long enough, fits the vocabulary
    if plan_arg == "auto":
        check_fp8_job(job.train.dtype, plan_auto=True, elastic=False)  # before the search
        plans, _ = searched_plans(job, model, nproc or 1)
        plan = plans[0]
    elif plan_arg:
        plan = load_plan(plan_arg)
        plan = plan if plan.stages else plan.with_even_stages(model)
    else:
        plan = default_plan(job, model, nproc or 1)
    nproc = plan.world_size if nproc is None else nproc
    refuse_context_parallel(plan)  # before any process starts
    check_fp8_job(plan.dtype, plan_auto=False, elastic=elastic is not None)
    node = parse_node(node_rank, rdzv_endpoint, rdzv_id, elastic, nproc, plan)
    check_plan_for_job(plan, job, model, plan.world_size if node else nproc)
    out_dir = out or job.out_dir()
    info, differs = None, False
    if resume:
        info, differs = check_resume_point(job, model, plan, out_dir, reshard=reshard)
    elif node is None or node.rank == 0:  # node K > 0 joins the folder node 0 checked
        check_fresh(out_dir, job.checkpoint_dir(out_dir))
    if elastic is not None or inject_failure is not None:
        if elastic is not None:
            parse_elastic(elastic)
        failure = parse_failure(inject_failure)
        if failure is not None and not elastic:
            raise ValueError("--inject-failure needs --elastic (a killed worker is restarted "
                             "by torchrun's elastic agent)")
        ranks = plan.world_size if node else nproc
        if failure is not None and not (failure[0] < ranks and failure[1] <= job.train.steps):
            raise ValueError(f"--inject-failure {inject_failure}: rank must be below {ranks} "
                             f"and step at most [train] steps {job.train.steps}")
    return PreparedRun(job_path=job_path, job=job, model=model, plan=plan, nproc=nproc,
                       out_dir=out_dir, resume=resume, resume_from=info, reshard=differs,
                       elastic=elastic, inject_failure=inject_failure, node=node)


def master_port_args(env: dict[str, str]) -> list[str]:
    """torchrun's rendezvous arguments: ``--standalone`` (a free port), or the ``MASTER_PORT``
    the environment names, refused when it is not a port or another process listens on it."""
    text = env.get("MASTER_PORT")
    if not text:
        return ["--standalone"]
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"MASTER_PORT {text!r} is not a port number (1-65535); unset it to let "
                         "meshmorph pick a free port")
    port = int(text)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            raise ValueError(
                f"MASTER_PORT {port} is in use on this machine (another job?); unset MASTER_PORT "
                "to let meshmorph pick a free port, or set it to a free one"
            ) from None
    return ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
            "--rdzv-id", uuid.uuid4().hex]


def resume_command(run: PreparedRun) -> str:
    """The command that continues this run from its newest checkpoint."""
    return shlex.join(["meshmorph", "run", "--config", str(run.job_path), "--nproc", str(run.nproc),
                       "--plan", str(run.out_dir / "plan.json"), "--out", str(run.out_dir),
                       "--resume"])


RELAY_DRAIN_S = 5.0
"""Seconds the launcher waits, once torchrun exited, for the rest of its stderr."""
ELASTIC_MAX_RESTARTS = 3
"""Worker-group restarts torchrun's elastic agent allows an ``--elastic`` run."""


def elastic_args(run: PreparedRun) -> tuple[list[str], list[str]]:
    """(torchrun's rendezvous arguments, the trainer's) for an ``--elastic MIN:MAX`` run: c10d
    rendezvous on a free local port (or the node's ``--rdzv-endpoint``, hosted by node 0),
    ``--max-restarts``, and the node store's run id."""
    if run.node is not None:
        endpoint, run_id = run.node.endpoint, run.node.resolved_id()
        host_conf = ["--rdzv-conf", f"is_host={'true' if run.node.rank == 0 else 'false'}"]
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        endpoint, run_id, host_conf = f"localhost:{port}", uuid.uuid4().hex[:12], []
    rendezvous = ["--nnodes", str(run.elastic), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                  endpoint, "--rdzv-id", run_id, *host_conf,
                  "--max-restarts", str(ELASTIC_MAX_RESTARTS)]
    trainer = ["--elastic-run-id", run_id]
    return rendezvous, trainer + (["--inject-failure", run.inject_failure]
                                  if run.inject_failure else [])


TRAINER = "meshmorph.run.trainer"
"""The module each rank of a plain run runs."""
ELASTIC_WORKER = "meshmorph.elastic.live.worker"
"""The module each rank of an ``--elastic`` run runs: the trainer with the node-local store."""


def torchrun_command(run: PreparedRun, plan_path: Path,
                     rendezvous: list[str] | None = None) -> list[str]:
    extra: list[str] = []
    if run.elastic:
        rendezvous, extra = elastic_args(run)
    command = [sys.executable, "-m", "meshmorph.run.launch.agent", *(rendezvous or ["--standalone"]),
               "--nproc_per_node", str(run.nproc), "-m", ELASTIC_WORKER if run.elastic else TRAINER,
               "--job", str(run.job_path.resolve()), "--plan", str(plan_path.resolve()),
               "--out", str(run.out_dir.resolve()), *extra]
    return command + (["--resume"] if run.resume else [])


def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...); None when the
    process is gone (Linux /proc)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _process_tree(root: int) -> dict[int, list[int]]:
    """Children of every process below ``root`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(entry.name)
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))  # field 4: ppid
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


KILL_WAIT_S = 5.0
"""How long ``kill_tree`` waits for the killed processes below torchrun to end (SIGKILL is
delivered asynchronously; orphans are reaped by init, not by us)."""


def _running(pid: int) -> bool:
    """Whether ``pid`` still exists and is not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"  # field 3: the state


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL torchrun and every process below it; returns once they have ended (or after
    ``KILL_WAIT_S``), so that no rank outlives the launcher's exit."""
    tree = descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    _signal([proc.pid, *tree], signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + KILL_WAIT_S
    while any(_running(pid) for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.02)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _newest(run: PreparedRun) -> Path | None:
    complete, _ = scan_checkpoints(run.job.checkpoint_dir(run.out_dir))
    return complete[-1] if complete else None


def _say(message: str) -> None:
    print(f"meshmorph: {message}", file=sys.stderr, flush=True)


def _start(run: PreparedRun, plan_path: Path, rendezvous: list[str], lock_fd: int
           ) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // run.nproc)))
    from meshmorph.run.stop import LAUNCHER_PID_ENV

    env[LAUNCHER_PID_ENV] = str(os.getpid())
    if run.node is not None:  # names this node's store (elastic/live/elastic_run.py)
        env["MESHMORPH_NODE_ID"] = str(run.node.rank)
    # torchrun inherits the lock (so it stays held while torchrun lives) and runs in a session
    # of its own, so that a terminal's Ctrl-C reaches only this process, which asks the ranks
    return subprocess.Popen(torchrun_command(run, plan_path, rendezvous), env=env,
                            start_new_session=True, pass_fds=(lock_fd,),
                            stderr=subprocess.PIPE if run.elastic else None)


def _relay(run: PreparedRun, proc: subprocess.Popen[bytes]) -> tuple[Relay, threading.Thread]:
    """Relay torchrun's stderr (its agent's and its workers') to ours through a ``Relay``, on a
    thread of its own, until every writer has closed it."""

    def step_now() -> int | None:
        done = last_step(run.out_dir / METRICS_FILE)
        return None if done is None else done + 1

    relay = Relay(run.out_dir, sys.stderr, step_now)
    assert proc.stderr is not None
    fd = proc.stderr.fileno()

    def feed(text: str, now: float) -> None:
        try:
            relay.feed(text, now)
        except Exception:  # never stop draining: the ranks would block on a full pipe
            with contextlib.suppress(Exception):
                sys.stderr.write(text + "\n")

    def pump() -> None:
        pending = b""
        while True:
            ready, _, _ = select.select([fd], [], [], 1.0)
            now = time.monotonic()
            chunk = os.read(fd, 1 << 16) if ready else None
            if chunk == b"":
                break
            pending += chunk or b""
            *lines, pending = pending.split(b"\n")
            for line in lines:
                feed(line.decode(errors="replace").rstrip("\r"), now)
            with contextlib.suppress(Exception):
                relay.tick(now)
        if pending:
            feed(pending.decode(errors="replace"), time.monotonic())

    thread = threading.Thread(target=pump, name="meshmorph-stderr", daemon=True)
    thread.start()
    return relay, thread


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if value < 10 else f"{value:,.0f} s"


def stopping_line(run: PreparedRun, newest: Path | None, now: float) -> tuple[str, float]:
    """What the first Ctrl-C says (the step the ranks finish, how long it should take still, from
    the last step's time in metrics.jsonl, what a second Ctrl-C does) and those seconds (0:
    unknown or overdue); ``now`` is the wall clock (``time.time``)."""

    metrics = run.out_dir / METRICS_FILE
    record = last_step_record(metrics)
    left = 0.0
    if record is None or not isinstance(record.get("step_time_s"), int | float):
        step = 1 if record is None else int(record["step"]) + 1
        timing = "its length is unknown: no step has finished yet"
    else:
        step, took = int(record["step"]) + 1, float(record["step_time_s"])
        try:
            running = max(0.0, now - metrics.stat().st_mtime)  # since the last step line
        except OSError:
            running = 0.0
        left = max(0.0, took - running)
        timing = (f"about {_seconds(left)} more: the last step took {_seconds(took)}" if left
                  else f"running {_seconds(running)}, longer than the last step's "
                  f"{_seconds(took)}")
    saving = "save a checkpoint, " if run.job.checkpoint.every else ""
    kept = (f"the newest checkpoint, {newest.name}, is kept" if newest is not None else
            "no checkpoint is saved yet")
    again = f"; press Ctrl-C again to stop at once ({kept})"
    cut = scan_checkpoints(run.job.checkpoint_dir(run.out_dir))[1]
    if any(path.name.startswith(f"{PREFIX}{step - 1}{TMP_INFIX}") for path in cut):  # saving
        return f"stopping: the ranks finish saving step {step - 1}'s checkpoint and exit{again}", 0.0
    return f"stopping: the ranks finish step {step} ({timing}), {saving}and exit{again}", left


def _watch(run: PreparedRun, proc: subprocess.Popen[bytes]) -> tuple[int, str, float]:
    """Wait for torchrun; (its exit code, how it ended: ``done``, ``stopped``, ``aborted``,
    when the first Ctrl-C came)."""

    deadline: float | None = None
    asked = time.monotonic()
    while True:
        try:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            code = proc.wait(timeout)
            return code, "done" if deadline is None else "stopped", asked
        except KeyboardInterrupt:
            if deadline is None and not descendants(proc.pid):
                # torchrun still waits for its rendezvous: no rank to finish its step
                kill_tree(proc)
                return proc.returncode, "not started", time.monotonic()
            if deadline is None:
                request_stop(run.out_dir)
                asked = time.monotonic()
                line, left = stopping_line(run, _newest(run), time.time())
                deadline = asked + left + STOP_GRACE_S  # a long step is not cut short
                _say(line)
                continue
            kill_tree(proc)  # the second Ctrl-C: at once, whatever the step is doing
            return proc.returncode, "aborted", asked
        except subprocess.TimeoutExpired:
            _say(f"the ranks did not stop within {deadline - asked:,.0f} s; killing them")
            kill_tree(proc)
            return proc.returncode, "aborted", asked


def launch(run: PreparedRun, *, quiet: bool = False) -> int:
    """Lock the run folder, write the plan into it, run torchrun, and return its exit code
    (130 after Ctrl-C or SIGTERM, once every rank has stopped)."""

    rendezvous = master_port_args(dict(os.environ))
    make_folder(run.out_dir)
    joins = run.node is not None and run.node.rank > 0  # node 0 owns a shared run folder
    with RunLock(run.out_dir, run.node.rank if run.node else None) as lock:
        if not run.resume and not joins:  # checked again under the lock: another run may have
            check_fresh(run.out_dir, run.job.checkpoint_dir(run.out_dir))  # saved meanwhile
            aside = set_aside_earlier_run(run.out_dir)
            if aside is not None and not quiet:
                print(f"meshmorph: run folder {run.out_dir} held an earlier run's records and no "
                      f"checkpoint; they were moved to {aside}", flush=True)
        clear_stop(run.out_dir)
        plan_path = run.out_dir / plan_file(run.node.rank if run.node else None)
        staging = plan_path.with_name(plan_path.name + ".partial")
        staging.write_text(run.plan.to_json() + "\n")
        staging.replace(plan_path)
        if not quiet:
            print(f"meshmorph: starting {run.nproc} processes: tp {run.plan.tp} x pp {run.plan.pp} "
                  f"x dp {run.plan.dp} (zero {run.plan.zero}); run folder {run.out_dir}", flush=True)
            if run.reshard and run.resume_from is not None:
                print(f"meshmorph: resharding {run.resume_from.path} into this plan (DCP reshards "
                      "on load)", flush=True)
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, _raise_interrupt) for sig in handled}
        signal.pthread_sigmask(signal.SIG_BLOCK, handled)  # no Ctrl-C between start and watch
        proc: subprocess.Popen[bytes] | None = None
        relay: tuple[Relay, threading.Thread] | None = None
        try:
            proc = _start(run, plan_path, rendezvous, lock.fd or -1)
            relay = _relay(run, proc) if proc.stderr is not None else None
            signal.pthread_sigmask(signal.SIG_UNBLOCK, handled)
            code, how, asked = _watch(run, proc)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, handled)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            clear_stop(run.out_dir)
            if joins:  # node K's copy of the plan; plan.json is node 0's record
                plan_path.unlink(missing_ok=True)
            if relay is not None:  # what is still held did not recover: the console's
                relay[1].join(RELAY_DRAIN_S)
                relay[0].close()
    newest = _newest(run)
    resume = (f"; resume with:\n  {resume_command(run)}" if newest else
              "; no checkpoint was saved, so a new run starts from step 0")
    if how == "aborted":
        _say(f"aborted: every rank was killed {time.monotonic() - asked:.1f} s after the first Ctrl-C"
             + (f"; the newest complete checkpoint is {newest}" if newest else "")
             + " (a save cut short is left as a .tmp- folder, never loaded and removed by the next save)" + resume)
        return 130
    if how == "not started":
        _say("interrupted before any rank started (torchrun was still waiting for its "
             "rendezvous); nothing was trained" + resume)
        return 130
    if how == "stopped":
        _say(f"interrupted; every rank stopped within {time.monotonic() - asked:.1f} s"
             + (f"; newest checkpoint {newest}" if newest else "") + resume)
        return 130
    if code != 0:
        _say(f"the job failed (exit code {code})"
             + (f"; its newest checkpoint is {newest}" if newest else "") + resume)
    return code


def run_job(job_path: Path, *, nproc: int | None = None, plan_arg: str | None = None,
            resume: bool = False, out: Path | None = None, reshard: bool = False,
            elastic: str | None = None, inject_failure: str | None = None,
            node_rank: int | None = None, rdzv_endpoint: str | None = None,
            rdzv_id: str | None = None) -> int:
    """Check, then launch; PlanError and other ValueErrors reach the caller before any process."""
    return launch(prepare_run(job_path, nproc=nproc, plan_arg=plan_arg, resume=resume, out=out,
                              reshard=reshard, elastic=elastic, inject_failure=inject_failure,
                              node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
                              rdzv_id=rdzv_id))
