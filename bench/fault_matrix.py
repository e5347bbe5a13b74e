"""The fault matrix: ``meshmorph run`` under a kill or signal at every phase of a run, each checked end to end.

One scenario per row, each on the same tiny job (gpt-tiny, 6 steps, global batch 8 in two
micro-batches, a checkpoint every 2 steps, a ZeRO-3 plan over 2 gloo processes): SIGKILL of one
rank in the forward, backward, optimizer step, checkpoint write and reshape transfer (the
restore of an ``--elastic`` restart); SIGTERM and SIGINT to the launcher at start-up, mid-step
and mid-save; SIGKILL of the launcher; a node lost under ``--elastic`` (two one-process nodes
sharing one run folder, as nodes share storage, then a copy of it resumed from its oldest
checkpoint).
Phases are hit precisely through the test-only fault hook ``MESHMORPH_FAULT``
(``src/meshmorph/run/fault.py``): a SIGKILL of the rank itself, or a pause whose marker file
tells this script when to signal the launcher.

Where recovery is expected the job runs under ``--elastic``; where a clean stop is expected it
runs plainly and is continued with ``--resume`` (without it where the stop came before any
checkpoint, as the launcher says: ``--resume`` refuses a folder without one). Every row checks,
against an uninterrupted reference run of the same job and plan:

- outcome and exit codes (recovered: exit 0 after a restart; stopped cleanly: 130 after a signal,
  1 after a lost rank, then the resumed run exits 0);
- losses equal to the reference at every step: bitwise where no step was redone, else within
  ``TOLERANCE`` (the largest difference is recorded);
- every sample id consumed exactly once over the final trajectory (``MESHMORPH_SAMPLE_LOG``: a
  step's ids come from the newest launch and restart round that completed it), and each step's
  ids those of the reference;
- the run folder consistent: no ``.tmp-`` folder, no lock or stop file (but the lost node's,
  not held), every checkpoint verifies (manifest and SHA-256), ``metrics.jsonl`` has one line
  per step 1..N, the node store cleared;
- node rows: the copy resumed from the oldest checkpoint trains the reference's samples to its
  losses from there on;
- no orphans: every process seen below the launcher has exited;
- the seconds the scenario took.

Run: ``python bench/fault_matrix.py [--only NAME ...] [--out PATH | --update]``; writes
bench/results/latest/fault_matrix.json (``--update``: the committed bench/results/fault_matrix.json)
and prints the table. It uses the checkout's ``src``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from meshmorph.run.checkpoint import scan_checkpoints, verify_checkpoint  # noqa: E402
from meshmorph.run.fault import FAULT_ENV  # noqa: E402
from meshmorph.run.launch.launcher import descendants  # noqa: E402
from meshmorph.run.launch.run_folder import lock_file, plan_file  # noqa: E402
from meshmorph.run.trainer import SAMPLE_LOG_ENV  # noqa: E402
from results_path import Outputs, shown  # noqa: E402

OUTPUTS = Outputs("bench/results/fault_matrix.json")

STEPS, GLOBAL_BATCH, EVERY = 6, 8, 2
"""The job: steps, sequences per step, steps between checkpoints."""
TOLERANCE = 1e-6
"""Largest loss difference allowed where a step was redone (or the plan changed)."""
RUN_TIMEOUT_S = 300.0
"""A launch that runs longer is killed and its row fails."""
ORPHAN_WAIT_S = 30.0
"""Seconds every process below a launcher gets to exit once the launcher has."""
JOB = f"""
[model]
source = "gpt-tiny"
seq_len = 32

[data]
kind = "synthetic"
seed = 1

[train]
steps = {STEPS}
global_batch = {GLOBAL_BATCH}
micro_batch = 2
seed = 2

[optim]
warmup_steps = 2
decay_steps = 100

[checkpoint]
every = {{every}}
keep = 3

[run]
collective_timeout_s = 60
"""
PLAN = {"model": "gpt-tiny", "seq_len": 32, "global_batch": GLOBAL_BATCH, "dp": 2, "zero": 3,
        "micro_batch": 2, "num_microbatches": 2, "dtype": "fp32"}


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH"))
                                        if p)
    if FAULT_ENV not in extra:  # a fault only where a row asks for it
        env.pop(FAULT_ENV, None)
    env.pop("MASTER_PORT", None)
    return env


@dataclass
class Launch:
    """One ``meshmorph run`` process, the processes seen below it, its output."""

    proc: subprocess.Popen[str]
    log: Path
    seen: set[int] = field(default_factory=set)
    code: int | None = None
    timed_out: bool = False

    def watch(self) -> None:
        def poll() -> None:
            while self.proc.poll() is None:
                with contextlib.suppress(Exception):
                    self.seen.update(descendants(self.proc.pid))
                time.sleep(0.2)
        threading.Thread(target=poll, daemon=True).start()

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait(self, timeout_s: float = RUN_TIMEOUT_S) -> int:
        try:
            self.code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.timed_out = True
            for pid in [*descendants(self.proc.pid), self.proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.code = self.proc.wait()
        return self.code


def start(args: list[str], log: Path, env: dict[str, str]) -> Launch:
    """``meshmorph ARGS`` in a session of its own (as from a terminal), output into ``log``."""
    proc = subprocess.Popen([sys.executable, "-m", "meshmorph", *args], text=True,
                            stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, env=env, cwd=ROOT)
    launch = Launch(proc, log)
    launch.watch()
    return launch


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids: set[int], wait_s: float) -> list[int]:
    """The processes of ``pids`` still running after at most ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while (alive := sorted(p for p in pids if _alive(p))) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def orphans(launches: list[Launch], wait_s: float = ORPHAN_WAIT_S) -> list[int]:
    """The processes seen below the launchers still running ``wait_s`` after they exited."""
    alive = wait_gone({pid for launch in launches for pid in launch.seen}, wait_s)
    for pid in alive:  # leave nothing behind: the row fails, the next one starts clean
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return alive


def wait_until(predicate: Callable[[], bool], launch: Launch, timeout_s: float = 240) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and launch.proc.poll() is None:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


# --- what a run folder says -------------------------------------------------------------------
def metric_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row for row in rows if "step" in row]


def steps_done(run_dir: Path) -> int:
    return max((row["step"] for row in metric_rows(run_dir)), default=0)


def trained_ids(folders: list[Path]) -> dict[int, list[int]]:
    """Step -> sample ids of the final trajectory: each step's entries from the newest (launch,
    restart round) that completed it; ``folders`` in launch order."""
    entries: list[tuple[tuple[int, int], dict[str, Any]]] = []
    for index, folder in enumerate(folders):
        for path in sorted(folder.glob("samples-rank*.jsonl")):
            for line in path.read_text().splitlines():
                row = json.loads(line)
                entries.append(((index, row["round"]), row))
    newest: dict[int, tuple[int, int]] = {}
    for key, row in entries:
        newest[row["step"]] = max(newest.get(row["step"], key), key)
    by_step: dict[int, dict[int, list[int]]] = {}
    for key, row in entries:
        if key == newest[row["step"]]:  # a rank that re-ran the step in that round: its last
            by_step.setdefault(row["step"], {})[row["dp_rank"]] = row["ids"]
    return {step: [i for dp in sorted(ranks) for i in ranks[dp]]
            for step, ranks in sorted(by_step.items())}


def check_samples(ids: dict[int, list[int]], ref: dict[int, list[int]]) -> str | None:
    flat = [i for step in sorted(ids) for i in ids[step]]
    if sorted(ids) != list(range(1, STEPS + 1)):
        return f"steps with samples {sorted(ids)}"
    if len(flat) != len(set(flat)) or len(flat) != STEPS * GLOBAL_BATCH:
        return f"{len(flat)} ids, {len(set(flat))} distinct (want {STEPS * GLOBAL_BATCH} once)"
    if any(sorted(ids[s]) != sorted(ref[s]) for s in ids):
        return "a step trained other samples than the reference's"
    return None


def check_losses(rows: list[dict[str, Any]], ref: list[dict[str, Any]], exact: bool
                 ) -> tuple[str | None, float, bool]:
    """(failure or None, largest |loss difference|, bitwise equal)."""
    if [r["step"] for r in rows] != list(range(1, STEPS + 1)):
        return f"metrics steps {[r['step'] for r in rows]}", float("nan"), False
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(rows, ref, strict=True))
    bitwise = all(a["loss"] == b["loss"] for a, b in zip(rows, ref, strict=True))
    if exact and not bitwise:
        return f"losses differ (largest {diff:.3g}) where no step was redone", diff, bitwise
    if diff > TOLERANCE:
        return f"losses differ by {diff:.3g} > {TOLERANCE:g}", diff, bitwise
    return None, diff, bitwise


def _held(lock: Path) -> bool:
    """Whether a process holds the lock file (a killed launcher's stays, unheld)."""
    with lock.open("rb") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
    return False


def check_folder(run_dir: Path, store_root: Path | None, lost_node: int | None = None
                 ) -> str | None:
    """``lost_node``: the node killed with its launcher, whose lock file (not held: the next run
    on that node takes it over) and copy of the plan stay."""
    ckpt = run_dir / "checkpoints"
    complete, ignored = scan_checkpoints(ckpt)
    problems = [f"left behind: {', '.join(p.name for p in ignored)}"] if ignored else []
    for path in complete:
        try:
            verify_checkpoint(path)
        except ValueError as exc:
            problems.append(f"{path.name}: {exc}")
    # the lost node's launcher, killed, left its lock (not held) and its copy of the plan
    stale = {run_dir / lock_file(lost_node), run_dir / plan_file(lost_node)} if lost_node else set()
    problems += [f"{path.name} left" for path in sorted(run_dir.glob(".meshmorph*"))
                 if path not in stale or path.suffix == ".lock" and _held(path)]
    steps = [row["step"] for row in metric_rows(run_dir)]
    if steps != list(range(1, STEPS + 1)):
        problems.append(f"metrics.jsonl steps {steps}")
    if store_root is not None and store_root.is_dir() and any(store_root.rglob("*.pt")):
        problems.append("the node store was not cleared")
    return "; ".join(problems) or None


# --- the scenarios ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    """One row: what is done to the job and what must come of it."""

    name: str
    what: str
    expected: str
    mode: str
    """``elastic`` (recovery expected), ``plain`` (a clean stop, then ``--resume``) or
    ``nodes`` (two nodes under ``--elastic 1:2``, one lost)."""
    first_codes: tuple[int, ...]
    """The exit codes the first launch may end with."""
    fault: str = ""
    """``MESHMORPH_FAULT`` of the first launch."""
    inject: str = ""
    """``--inject-failure`` of the first launch."""
    trigger: tuple[str, str, int] | None = None
    """(when: ``start`` or a marker file name, signal name, launcher = 0 / node 1 = 1)."""
    exact: bool = False
    """No step is redone: the losses must be the reference's bit for bit."""
    markers: tuple[str, ...] = ()
    """Marker files the faults must have left (they fired)."""
    every: int = EVERY
    """Steps between checkpoints (0: none)."""


def _signal_row(sig: str, when: str) -> Scenario:
    name = f"{sig.lower()}-launcher-{when}"
    fault, marker = {"start-up": ("", "start"),
                     "mid-step": ("0@3:backward:pause=3", ".fault-0-3-backward"),
                     "mid-save": ("0@4:checkpoint:pause=3", ".fault-0-4-checkpoint")}[when]
    place = {"start-up": "while the ranks start (0.5 s after the launcher says it starts them)",
             "mid-step": "in the backward of step 3", "mid-save": "while step 4's checkpoint is "
             "written (rank 0's files in the .tmp- folder, before the commit)"}[when]
    stop = ("exit 130 before step 1, no checkpoint; the same command without --resume (which "
            "refuses a folder without a checkpoint) starts at step 0" if when == "start-up" else
            f"the ranks finish step {3 if when == 'mid-step' else 4}, save there and exit; "
            "launcher exit 130; --resume continues from that step")
    return Scenario(name, f"{sig} to the launcher {place}", stop, "plain", (130,), fault=fault,
                    trigger=(marker, sig, 0), exact=True,
                    markers=(marker,) if marker != "start" else ())


def _kill_row(phase: str, where: str, step: int = 3) -> Scenario:
    return Scenario(f"sigkill-{phase}", f"SIGKILL of rank 1 {where} of step {step} (--elastic 1:1)",
                    f"torchrun restarts the workers, which restore step {step - 1} from the node "
                    "stores and finish; exit 0", "elastic", (0,), fault=f"1@{step}:{phase}",
                    markers=(f".fault-1-{step}-{phase}",))


_NODE_LOST = ("node 0 re-rendezvouses alone, re-plans for 1 rank, restores step 2 from its store "
              "and the ring copy of node 1's rank, and finishes; exit 0")
_RESUMED = ("; the checkpoints in the shared folder verify, and --resume --reshard of the oldest "
            "on 2 plain processes trains the reference's samples and losses")
SCENARIOS = [
    _kill_row("forward", "in the forward of the second micro-batch"),
    _kill_row("backward", "in the backward (first block's output gradient, first micro-batch)"),
    _kill_row("optimizer", "inside the optimizer step (after the first optimizer's update)"),
    Scenario("sigkill-checkpoint", "SIGKILL of rank 1 in step 4's checkpoint write (its files in "
             "the .tmp- folder, before the commit; plain run)", "the job stops with exit 1 "
             "naming the rank; --resume continues from step-2, the next save removes the "
             ".tmp- folder", "plain", (1,), fault="1@4:checkpoint",
             markers=(".fault-1-4-checkpoint",)),
    Scenario("sigkill-reshape", "rank 1 SIGKILLed in step 3, then rank 0 SIGKILLed in the "
             "restart's restore (reshape transfer) of step 2 (--elastic 1:1)", "a second restart "
             "restores step 2 again and finishes; exit 0", "elastic", (0,), fault="0@2:reshape",
             inject="1@3", markers=(".failure-injected-1-3", ".fault-0-2-reshape")),
    *[_signal_row(sig, when) for sig in ("SIGTERM", "SIGINT")
      for when in ("start-up", "mid-step", "mid-save")],
    Scenario("sigkill-launcher", "SIGKILL of the launcher in the backward of step 3",
             "the ranks see the launcher gone, finish step 3, save and exit (no orphan); "
             "--resume continues from step 3", "plain", (-9,), fault="0@3:backward:pause=3",
             trigger=(".fault-0-3-backward", "SIGKILL", 0), exact=True,
             markers=(".fault-0-3-backward",)),
    Scenario("node-lost", "two nodes of one process (--elastic 1:2) sharing one run folder "
             "(checkpoints every 2 steps); node 1 (launcher, torchrun, worker, memory) SIGKILLed "
             "in the backward of step 3; then a copy of the folder resumed from its oldest "
             "checkpoint", _NODE_LOST + _RESUMED, "nodes", (0,), fault="*@3:backward:pause=30",
             trigger=(".fault-any-3-backward", "SIGKILL", 1),
             markers=(".fault-any-3-backward",)),
    Scenario("node-lost-after-restart", "as node-lost, but node 1's worker is SIGKILLed in the "
             "forward of step 2 first (both nodes recover at step 1), and node 1 is lost in the "
             "optimizer step of step 2, the first step after that recovery", "node 0 restores "
             "step 1 from its store and the ring copy made at the recovery, re-planned for 1 "
             "rank, and finishes; exit 0" + _RESUMED, "nodes", (0,),
             fault="*@2:forward,*@2:optimizer:pause=30",
             trigger=(".fault-any-2-optimizer", "SIGKILL", 1),
             markers=(".fault-any-2-forward",)),
]


@dataclass
class Context:
    """The work folder, the job and plan files, and the reference run."""

    work: Path
    plan: Path
    ref_rows: list[dict[str, Any]] = field(default_factory=list)
    ref_ids: dict[int, list[int]] = field(default_factory=dict)

    def args(self, run_dir: Path, nproc: int = 2, every: int = EVERY) -> list[str]:
        job = self.work / f"job-every{every}.toml"
        if not job.exists():
            job.write_text(JOB.format(every=every))
        return ["run", "--config", str(job), "--nproc", str(nproc), "--plan", str(self.plan),
                "--out", str(run_dir)]


def make_context(work: Path) -> Context:
    plan = work / "plan.json"
    plan.write_text(json.dumps(PLAN))
    return Context(work, plan)


def reference(ctx: Context) -> dict[str, Any]:
    """The uninterrupted run of the job and plan (plain, 2 processes)."""
    run_dir, ids = ctx.work / "reference", ctx.work / "reference-ids"
    ids.mkdir()
    began = time.monotonic()
    launch = start(ctx.args(run_dir), ctx.work / "reference.log", _env(**{SAMPLE_LOG_ENV: str(ids)}))
    code = launch.wait()
    if code != 0:
        raise SystemExit(f"the reference run failed (exit {code}):\n{launch.text()}")
    ctx.ref_rows, ctx.ref_ids = metric_rows(run_dir), trained_ids([ids])
    return {"exit_code": code, "seconds": round(time.monotonic() - began, 1),
            "losses": [row["loss"] for row in ctx.ref_rows]}


def fire_trigger(sc: Scenario, launch: Launch, run_dir: Path) -> str | None:
    """Wait for the trigger's moment and send its signal; a failure, or None."""
    assert sc.trigger is not None
    when, sig, _ = sc.trigger
    if when == "start":
        ready = wait_until(lambda: "meshmorph: starting" in launch.text(), launch, 60)
        time.sleep(0.5)
    else:
        ready = wait_until(lambda: (run_dir / when).exists(), launch)
    if not ready:
        return f"the trigger's moment ({when}) never came"
    with contextlib.suppress(ProcessLookupError):
        os.kill(launch.proc.pid, signal.Signals[sig])
    if sig == "SIGKILL":  # reap it at once, as a shell would: the ranks watch for its pid
        launch.wait()
    return None


def run_plain(sc: Scenario, ctx: Context, folder: Path) -> tuple[list[Launch], list[Path], str]:
    """The first launch (with its fault and trigger), then ``--resume`` unless it finished (the
    same command without it where no checkpoint was saved)."""
    run_dir, ids = folder / "run", [folder / "ids-1", folder / "ids-2"]
    for each in ids:
        each.mkdir()
    env = _env(**{SAMPLE_LOG_ENV: str(ids[0])}, **({FAULT_ENV: sc.fault} if sc.fault else {}))
    first = start(ctx.args(run_dir), folder / "first.log", env)
    note = fire_trigger(sc, first, run_dir) if sc.trigger else None
    first.wait()
    # a killed launcher's ranks stop on their own: resume once they are gone, as a user must
    # (their torchrun holds the run folder's lock until then)
    wait_gone(first.seen, 2 * ORPHAN_WAIT_S)
    launches = [first]
    stopped = steps_done(run_dir)
    # what the launcher's last line says: --resume where a checkpoint was saved; where none was
    # (stopped at start-up), the same command without it (--resume refuses a folder without one)
    saved = bool(scan_checkpoints(run_dir / "checkpoints")[0])
    if stopped < STEPS:
        again = start([*ctx.args(run_dir), *(["--resume"] if saved else [])],
                      folder / "resume.log", _env(**{SAMPLE_LOG_ENV: str(ids[1])}))
        again.wait()
        launches.append(again)
    text = launches[-1].text()
    start_at = text.split("resumed from ", 1)[1].split("(step ", 1)[1].split(",", 1)[0] \
        if "resumed from " in text else "0"
    notes = [f"first run stopped after step {stopped}",
             "not resumed" if len(launches) == 1 else f"resumed from step {start_at}" if saved
             else "no checkpoint: started again without --resume, from step 0"]
    return launches, ids, "; ".join([note, *notes] if note else notes)


def run_elastic(sc: Scenario, ctx: Context, folder: Path) -> tuple[list[Launch], list[Path], str]:
    run_dir, ids = folder / "run", folder / "ids"
    ids.mkdir()
    env = _env(**{SAMPLE_LOG_ENV: str(ids), "MESHMORPH_STORE_ROOT": str(folder / "memory")},
               **({FAULT_ENV: sc.fault} if sc.fault else {}))
    extra = ["--inject-failure", sc.inject] if sc.inject else []
    launch = start([*ctx.args(run_dir), "--elastic", "1:1", *extra], folder / "first.log", env)
    launch.wait()
    restarts = launch.text().count("restarting the workers")
    return [launch], [ids], f"{restarts} restart(s) of the workers"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_nodes(sc: Scenario, ctx: Context, folder: Path) -> tuple[list[Launch], list[Path], str]:
    """Two one-process nodes (own launcher, torchrun, memory) sharing one run folder, as real
    nodes share storage; node 1 killed at its trigger; then ``resume_oldest``."""
    ids, endpoint, rdzv = folder / "ids", f"localhost:{_free_port()}", uuid.uuid4().hex[:8]
    run_dir = folder / "run"
    ids.mkdir()
    nodes = []
    for k in (0, 1):
        env = _env(**{SAMPLE_LOG_ENV: str(ids), "MESHMORPH_STORE_ROOT": str(folder / f"memory{k}")})
        if k == 1:  # "*": whichever global rank node 1's worker gets
            env[FAULT_ENV] = sc.fault
        nodes.append(start([*ctx.args(run_dir, nproc=1, every=sc.every),
                            "--elastic", "1:2",
                            "--node-rank", str(k), "--rdzv-endpoint", endpoint, "--rdzv-id",
                            f"faults-{rdzv}"], folder / f"node{k}.log", env))
    assert sc.trigger is not None
    marker = sc.trigger[0]
    found = wait_until(lambda: any(run_dir.glob(marker)), nodes[1], 400)
    for pid in [*descendants(nodes[1].proc.pid), nodes[1].proc.pid]:  # the whole node at once
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    nodes[1].wait()
    for path in (folder / "memory1").rglob("*"):  # its memory went with it
        if path.is_file():
            path.unlink()
    nodes[0].wait()
    note = f"node 1 killed at its {marker} marker" if found else f"node 1's {marker} never appeared"
    resumed, at = resume_oldest(ctx, folder, run_dir)
    return [*nodes, *([resumed] if resumed else [])], [ids], note + (
        f"; the copy resumed from step {at}" if at is not None else "; no checkpoint to resume")


def resume_oldest(ctx: Context, folder: Path, run_dir: Path) -> tuple[Launch | None, int | None]:
    """A copy of the run folder cut back to its oldest checkpoint (as if the job had stopped
    there), continued with ``--resume --reshard`` on 2 plain processes under the launched plan
    (the checkpoint may hold the survivor's plan): the launch and the checkpoint's step."""
    copy = folder / "resumed"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns(".meshmorph*"))
    complete = scan_checkpoints(copy / "checkpoints")[0]
    if not complete:
        return None, None
    for path in complete[1:]:
        shutil.rmtree(path)
    (folder / "ids-resumed").mkdir()
    launch = start([*ctx.args(copy), "--resume", "--reshard"], folder / "resumed.log",
                   _env(**{SAMPLE_LOG_ENV: str(folder / "ids-resumed")}))
    launch.wait()
    return launch, verify_checkpoint(complete[0]).step


def check_resumed(folder: Path, launch: Launch, ctx: Context) -> str | None:
    """``resume_oldest``'s run: it started at its checkpoint and trained every later step on the
    reference's samples to the reference's losses (within ``TOLERANCE``: another plan sums in
    another order)."""
    text = launch.text()
    if launch.code != 0 or "resumed from " not in text:
        return f"the resumed copy ended with exit {launch.code}"
    at = int(text.split("resumed from ", 1)[1].split("(step ", 1)[1].split(",", 1)[0])
    rows = metric_rows(folder / "resumed")
    if [row["step"] for row in rows] != list(range(1, STEPS + 1)):
        return f"the resumed copy's metrics steps {[row['step'] for row in rows]}"
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(rows[at:], ctx.ref_rows[at:],
                                                            strict=True))
    ids = trained_ids([folder / "ids-resumed"])
    if sorted(ids) != list(range(at + 1, STEPS + 1)) or any(
            sorted(ids[s]) != sorted(ctx.ref_ids[s]) for s in ids):
        return f"the resumed copy trained other samples than the reference's after step {at}"
    return f"the resumed copy's losses differ by {diff:.3g}" if diff > TOLERANCE else None


def outcome_of(sc: Scenario, launches: list[Launch]) -> tuple[str, str | None]:
    """(what happened, a failure of the expected outcome or None)."""
    first, last = launches[0], launches[-1]
    codes = [launch.code for launch in launches]
    if any(launch.timed_out for launch in launches):
        return "hung (killed by the bench)", f"a launch ran past {RUN_TIMEOUT_S:.0f} s"
    if sc.mode != "plain":
        recovered = "recovered at step" in first.text()
        what = "recovered" if recovered and first.code == 0 else f"failed (exit {first.code})"
        return what, None if recovered and first.code in sc.first_codes else \
            f"exit codes {codes}, expected {sc.first_codes[0]} after a recovery"
    how = {130: "stopped cleanly (exit 130)", 1: "stopped, rank lost (exit 1)",
           -9: "launcher killed; ranks stopped on their own"}.get(first.code or 0,
                                                                   f"exit {first.code}")
    what = how + (", resumed" if len(launches) > 1 and last.code == 0 else "")
    if first.code not in sc.first_codes or last.code != 0:
        return what, f"exit codes {codes}, expected {sc.first_codes[0]} then 0"
    return what, None


def judge(sc: Scenario, ctx: Context, folder: Path, launches: list[Launch], ids: list[Path]
          ) -> dict[str, Any]:
    """Every check of one row."""
    outcome, failed = outcome_of(sc, launches)
    checks: dict[str, str] = {"outcome": failed or "ok"}
    run_dir = folder / "run"  # the nodes' shared one in the node rows
    rows = metric_rows(run_dir)
    loss_failure, diff, bitwise = check_losses(rows, ctx.ref_rows, sc.exact)
    checks["losses"] = loss_failure or "ok"
    checks["samples"] = check_samples(trained_ids(ids), ctx.ref_ids) or "ok"
    store = folder / ("memory0" if sc.mode == "nodes" else "memory")
    folder_failure = check_folder(run_dir, store, lost_node=1 if sc.mode == "nodes" else None)
    checks["run folder"] = folder_failure or "ok"
    if sc.mode == "nodes":
        resumed = launches[2] if len(launches) > 2 else None
        checks["resumed from a checkpoint"] = ("no checkpoint was saved" if resumed is None else
                                               check_resumed(folder, resumed, ctx) or "ok")
    left = orphans(launches)
    checks["no orphans"] = f"still running: {left}" if left else "ok"
    missing = [m for m in sc.markers if not (run_dir / m).exists()]
    checks["fault fired"] = f"no marker {missing}" if missing else "ok"
    output = "".join(launch.text() for launch in launches)
    checks["no traceback"] = "Traceback in the output" if "Traceback" in output else "ok"
    return {"outcome": outcome, "exit_codes": [launch.code for launch in launches],
            "checks": checks, "passed": all(v == "ok" for v in checks.values()),
            "loss_max_abs_diff": diff, "losses_bitwise": bitwise}


RUNNERS = {"plain": run_plain, "elastic": run_elastic, "nodes": run_nodes}


def run_scenario(sc: Scenario, ctx: Context) -> dict[str, Any]:
    folder = ctx.work / sc.name
    folder.mkdir()
    began = time.monotonic()
    launches, ids, note = RUNNERS[sc.mode](sc, ctx, folder)
    row = {"name": sc.name, "what": sc.what, "expected": sc.expected, "mode": sc.mode,
           "fault": sc.fault, **judge(sc, ctx, folder, launches, ids), "notes": note,
           "seconds": round(time.monotonic() - began, 1),
           "command": f"python bench/fault_matrix.py --only {sc.name}"}
    if not row["passed"]:  # keep what a failing row printed
        row["output_tail"] = "\n".join(launches[0].text().splitlines()[-30:])
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'scenario':<28} {'outcome':<48} {'checks':<10} {'max |dloss|':>11} {'s':>6}"]
    for row in rows:
        checks = "pass" if row["passed"] else "FAIL: " + ", ".join(
            k for k, v in row["checks"].items() if v != "ok")
        lines.append(f"{row['name']:<28} {row['outcome']:<48} {checks:<10} "
                     f"{row['loss_max_abs_diff']:>11.3g} {row['seconds']:>6.1f}")
    return "\n".join(lines)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as the table of docs/faults.md."""
    lines = ["| scenario | what was done | expected | observed | checks | s | reproduce |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        failed = [f"{k}: {v}" for k, v in row["checks"].items() if v != "ok"]
        checks = (f"all {len(row['checks'])} passed" if not failed else "FAILED: "
                  + "; ".join(failed)) + \
            (" (losses bitwise)" if row["losses_bitwise"] else
             f" (losses within {row['loss_max_abs_diff']:.1g})")
        observed = f"{row['outcome']}; exit {', '.join(map(str, row['exit_codes']))}; " \
            f"{row['notes']}"
        lines.append(f"| `{row['name']}` | {row['what']} | {row['expected']} | {observed} | "
                     f"{checks} | {row['seconds']:.0f} | `{row['command']}` |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [sc.name for sc in SCENARIOS]
    parser.add_argument("--only", nargs="+", choices=names, metavar="NAME",
                        help=f"run these scenarios only ({', '.join(names)})")
    OUTPUTS.add_args(parser)
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--markdown", type=Path, metavar="JSON",
                        help="print the rows of a results file as docs/faults.md's table; no run")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())["rows"]))
        return 0
    chosen = [sc for sc in SCENARIOS if not args.only or sc.name in args.only]
    began = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="meshmorph-faults-"))
    ctx = make_context(work)
    ref = reference(ctx)
    print(f"reference: {ref['seconds']} s, losses {ref['losses']}", flush=True)
    rows = []
    for sc in chosen:
        rows.append(run_scenario(sc, ctx))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    total = round(time.monotonic() - began, 1)
    job = {"steps": STEPS, "global_batch": GLOBAL_BATCH, "checkpoint_every": EVERY, "plan": PLAN,
           "processes": 2, "tolerance": TOLERANCE}
    result = {"machine": f"{os.cpu_count()} CPU cores, gloo", "job": job,
              "reference": ref, "rows": rows, "total_seconds": total,
              "passed": sum(row["passed"] for row in rows), "scenarios": len(rows)}
    out = OUTPUTS.path(args)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows))
    print(f"{result['passed']} of {len(rows)} passed in {total:.0f} s; wrote {shown(out)}")
    if args.keep:
        print(f"work folder kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if result["passed"] == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
