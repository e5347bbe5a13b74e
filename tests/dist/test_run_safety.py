"""``meshmorph run`` under signals and failures, on 2 gloo processes: Ctrl-C while the ranks are
still starting, a second Ctrl-C, SIGKILL of torchrun, SIGKILL of one rank, and a data-parallel
checkpoint resumed under a pipeline plan (the tied head's optimizer state). Every case ends with
every process gone, a clear message, and the committed checkpoints intact."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshmorph.run.checkpoint import scan_checkpoints, verify_checkpoint
from meshmorph.run.launch.launcher import descendants

JOB = """
[model]
source = "gpt-tiny"
seq_len = 32
[data]
kind = "synthetic"
seed = 1
[train]
steps = {steps}
global_batch = 8
micro_batch = 2
seed = 2
[optim]
warmup_steps = 2
decay_steps = 100
[checkpoint]
every = {every}
keep = 3
"""


def start(args: list[str], log: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "meshmorph.cli.app", *args], text=True,
                            stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def finish(proc: subprocess.Popen[str], log: Path, timeout_s: float) -> int:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        for pid in [*descendants(proc.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"meshmorph ran past {timeout_s} s; output:\n{log.read_text()}")


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return max((row["step"] for row in rows if "event" not in row), default=0)


def wait_for(predicate, proc: subprocess.Popen[str], log: Path, timeout_s: float = 120) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None and predicate(), log.read_text()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def ranks_of(proc: subprocess.Popen[str]) -> dict[int, int]:
    """rank -> pid of every trainer process below the launcher."""
    found = {}
    for pid in descendants(proc.pid):
        command = _cmdline(pid)  # torchrun's own command line names the trainer too
        if "meshmorph.run.trainer" not in command or "meshmorph.run.launch.agent" in command:
            continue
        with contextlib.suppress(OSError):
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = next(int(v[5:]) for v in env if v.startswith(b"RANK="))
            found[rank] = pid
    return found


def agent_of(proc: subprocess.Popen[str]) -> int:
    return next(pid for pid in descendants(proc.pid) if "meshmorph.run.launch.agent" in _cmdline(pid))


def gone_within(pids: list[int], timeout_s: float) -> float:
    """Seconds until every pid has exited; fails past ``timeout_s``."""
    start_s = time.monotonic()
    while time.monotonic() - start_s < timeout_s:
        alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()
                 and Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"]
        if not alive:
            return time.monotonic() - start_s
        time.sleep(0.1)
    pytest.fail(f"processes still running after {timeout_s} s: {alive}")


def job_file(tmp_path: Path, *, steps: int, every: int) -> Path:
    job = tmp_path / "job.toml"
    job.write_text(JOB.format(steps=steps, every=every))
    return job


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_ctrl_c_in_the_first_second_stops_torchrun_and_every_rank(tmp_path: Path) -> None:
    job, run_dir, log = job_file(tmp_path, steps=100000, every=5), tmp_path / "run", tmp_path / "log"
    proc = start(["run", "--config", str(job), "--nproc", "2", "--out", str(run_dir)], log)
    wait_for(lambda: "meshmorph: starting" in log.read_text(), proc, log, 60)
    time.sleep(0.5)
    started = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C while the ranks still import torch
    code = finish(proc, log, 90)
    output = log.read_text()
    assert code == 130, output
    gone_within([*started, *descendants(proc.pid)], 5)
    assert steps_done(run_dir) == 0 and "before step 1" in output, output
    assert "no checkpoint was saved" in output and "Traceback" not in output, output
    assert scan_checkpoints(run_dir / "checkpoints") == ([], [])


@pytest.mark.dist
@pytest.mark.timeout(200)
def test_second_ctrl_c_aborts_leaving_the_previous_checkpoint_intact(tmp_path: Path) -> None:
    job, run_dir, log = job_file(tmp_path, steps=100000, every=2), tmp_path / "run", tmp_path / "log"
    proc = start(["run", "--config", str(job), "--nproc", "2", "--out", str(run_dir)], log)
    ckpt = run_dir / "checkpoints"
    wait_for(lambda: len(scan_checkpoints(ckpt)[0]) >= 1 and steps_done(run_dir) >= 3, proc, log)
    ranks = list(ranks_of(proc).values())
    os.killpg(proc.pid, signal.SIGINT)
    wait_for(lambda: "press Ctrl-C again" in log.read_text(), proc, log, 10)  # signals do not queue
    os.killpg(proc.pid, signal.SIGINT)  # impatient: abort at once
    code = finish(proc, log, 30)
    output = log.read_text()
    assert code == 130 and "aborted: every rank was killed" in output, output
    gone_within(ranks, 5)
    complete, _ = scan_checkpoints(ckpt)
    assert complete and all(verify_checkpoint(path).step % 2 == 0 for path in complete)
    assert f"--out {run_dir} --resume" in output and "Traceback" not in output, output


@pytest.mark.dist
@pytest.mark.timeout(200)
def test_sigkill_of_torchrun_stops_the_orphaned_ranks(tmp_path: Path) -> None:
    job, run_dir, log = job_file(tmp_path, steps=100000, every=3), tmp_path / "run", tmp_path / "log"
    proc = start(["run", "--config", str(job), "--nproc", "2", "--out", str(run_dir)], log)
    wait_for(lambda: steps_done(run_dir) >= 2, proc, log)
    ranks = ranks_of(proc)
    assert sorted(ranks) == [0, 1], log.read_text()
    os.kill(agent_of(proc), signal.SIGKILL)
    took = gone_within(list(ranks.values()), 30)
    code = finish(proc, log, 30)
    output = log.read_text()
    assert code != 0 and "its parent (torchrun" in output, output
    assert took < 30
    complete, _ = scan_checkpoints(run_dir / "checkpoints")
    assert complete and verify_checkpoint(complete[-1]).step >= 3  # saved on the way out, or before


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_sigkill_of_one_rank_stops_the_job_naming_it_and_the_run_resumes(tmp_path: Path) -> None:
    job, run_dir, log = job_file(tmp_path, steps=12, every=2), tmp_path / "run", tmp_path / "log"
    base = ["run", "--config", str(job), "--nproc", "2", "--out", str(run_dir)]
    proc = start(base, log)
    ckpt = run_dir / "checkpoints"
    wait_for(lambda: len(scan_checkpoints(ckpt)[0]) >= 1 and steps_done(run_dir) >= 3, proc, log)
    victim = ranks_of(proc)[1]
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    code = finish(proc, log, 90)
    stop_s = time.monotonic() - killed
    output = log.read_text()
    assert code == 1, output
    assert stop_s < 60, f"the job took {stop_s:.1f} s to stop\n{output}"
    assert f"meshmorph: rank 1 (pid {victim}) was killed by SIGKILL" in output, output
    assert "resume with:" in output and "Traceback" not in output, output
    newest = verify_checkpoint(scan_checkpoints(ckpt)[0][-1]).step
    resumed = start([*base, "--resume"], tmp_path / "log2")
    assert finish(resumed, tmp_path / "log2", 150) == 0, (tmp_path / "log2").read_text()
    assert f"(step {newest}," in (tmp_path / "log2").read_text()
    assert steps_done(run_dir) == 12


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_a_free_master_port_from_the_environment_is_the_rendezvous_port(tmp_path: Path) -> None:
    job, run_dir, log = job_file(tmp_path, steps=2, every=0), tmp_path / "run", tmp_path / "log"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "meshmorph.cli.app", "run", "--config", str(job),
                             "--nproc", "2", "--out", str(run_dir)], text=True,
                            stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, "MASTER_PORT": str(port)})
    wait_for(lambda: any("meshmorph.run.launch.agent" in _cmdline(pid)
                         for pid in descendants(proc.pid)), proc, log, 60)
    assert f"--rdzv-endpoint localhost:{port}" in _cmdline(agent_of(proc))
    assert finish(proc, log, 120) == 0, log.read_text()
    assert steps_done(run_dir) == 2


@pytest.mark.dist
@pytest.mark.timeout(200)
def test_a_frozen_rank_ends_the_job_after_the_collective_timeout_naming_the_waiting_rank(
        tmp_path: Path) -> None:
    job = job_file(tmp_path, steps=100000, every=0)
    job.write_text(job.read_text() + "[run]\ncollective_timeout_s = 5\n")
    run_dir, log = tmp_path / "run", tmp_path / "log"
    proc = start(["run", "--config", str(job), "--nproc", "2", "--out", str(run_dir)], log)
    wait_for(lambda: steps_done(run_dir) >= 2, proc, log)
    ranks = ranks_of(proc)
    frozen = time.monotonic()
    os.kill(ranks[1], signal.SIGSTOP)  # alive but silent: its peer must not wait forever
    code = finish(proc, log, 90)
    took = time.monotonic() - frozen
    output = log.read_text()
    assert code == 1, output
    assert "meshmorph: error on rank 0: a collective waited longer than the 5 s timeout" in output
    assert "meshmorph: rank 0 (pid" in output and "exited with code 1" in output, output
    assert took < 60, f"{took:.1f} s\n{output}"
    gone_within(list(ranks.values()), 10)
    assert "Traceback" not in output, output


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_dp2_checkpoint_resumes_under_pp2_with_reshard_and_tied_head(tmp_path: Path) -> None:
    job, run_dir = job_file(tmp_path, steps=6, every=3), tmp_path / "run"
    log = tmp_path / "log"
    proc = start(["run", "--config", str(job), "--nproc", "2", "--out", str(run_dir)], log)
    assert finish(proc, log, 150) == 0, log.read_text()
    (run_dir / "checkpoints" / "step-6").rename(run_dir / "checkpoints" / "step-6.tmp-moved")
    plan = tmp_path / "pp2.json"
    plan.write_text(json.dumps({"model": "gpt-tiny", "seq_len": 32, "global_batch": 8, "pp": 2,
                                "schedule": "1f1b", "micro_batch": 2, "num_microbatches": 4,
                                "dtype": "fp32"}))
    base = ["run", "--config", str(job), "--nproc", "2", "--out", str(run_dir), "--plan", str(plan),
            "--resume"]
    refused = subprocess.run([sys.executable, "-m", "meshmorph.cli.app", *base], text=True,
                             capture_output=True, timeout=60)
    assert refused.returncode == 2 and "saved under another plan" in refused.stderr
    assert "pass --reshard" in refused.stderr and "Traceback" not in refused.stderr
    proc = start([*base, "--reshard"], log)
    assert finish(proc, log, 150) == 0, log.read_text()
    output = log.read_text()
    assert "resharding" in output and "(step 3, 24 samples consumed)" in output, output
    assert steps_done(run_dir) == 6
    assert json.loads((run_dir / "plan.json").read_text())["pp"] == 2
