"""``meshmorph run`` under signals and failures, on 2 gloo processes: Ctrl-C while the ranks are
still starting, a second Ctrl-C (also in a step far longer than the others, then resumed from the
newest checkpoint with every sample once), SIGKILL of torchrun, SIGKILL of one rank in a checkpoint write
(``MESHMORPH_FAULT``, run/fault.py), and a data-parallel
checkpoint resumed under a pipeline plan (the tied head's optimizer state; the run that saved it
also shows that a free ``MASTER_PORT`` is the rendezvous port). Every case ends with every
process gone, a clear message, and the committed checkpoints intact."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from meshmorph.cli import main as cli_main
from meshmorph.run.checkpoint import scan_checkpoints, verify_checkpoint
from meshmorph.run.fault import FAULT_ENV
from meshmorph.run.launch.launcher import descendants
from meshmorph.run.trainer import SAMPLE_LOG_ENV
from tests.helpers.cli import (
    ENVIRONMENT,
    ExampleRun,
    command_line,
    finish,
    records,
    start_cli,
    steps_done,
    wait_for,
)
from tests.helpers.jobs import gpt_tiny_job, write_job


def ranks_of(proc: subprocess.Popen[str]) -> dict[int, int]:
    """rank -> pid of every trainer process below the launcher."""
    found = {}
    for pid in descendants(proc.pid):
        command = command_line(pid)  # torchrun's own command line names the trainer too
        if "meshmorph.run.trainer" not in command or "meshmorph.run.launch.agent" in command:
            continue
        with contextlib.suppress(OSError):
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = next(int(v[5:]) for v in env if v.startswith(b"RANK="))
            found[rank] = pid
    return found


def agent_of(proc: subprocess.Popen[str]) -> int:
    return next(pid for pid in descendants(proc.pid) if "meshmorph.run.launch.agent" in command_line(pid))


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
    return write_job(tmp_path, gpt_tiny_job(steps=steps, train={"seed": 2},
                                            optim={"warmup_steps": 2, "decay_steps": 100},
                                            checkpoint={"every": every, "keep": 3}))


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_ctrl_c_in_the_first_second_stops_torchrun_and_every_rank(tmp_path: Path) -> None:
    job, run_dir, log = job_file(tmp_path, steps=100000, every=5), tmp_path / "run", tmp_path / "log"
    proc = start_cli(["run", "--config", str(job), "--nproc", "2", "--out", str(run_dir)], log)
    # the launcher's first line: its imports can take a minute beside the suite's background runs
    wait_for(lambda: "meshmorph: starting" in log.read_text(), proc, log, 150)
    time.sleep(0.5)
    started = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C while the ranks still import torch
    code = finish(proc, log, 90)
    output = log.read_text()
    assert code == 130, output
    gone_within([*started, *descendants(proc.pid)], 5)
    # torchrun may still wait for its rendezvous (no rank yet: stopped at once) or the ranks may
    # be importing torch (each stops before its first step)
    assert steps_done(run_dir) == 0 and ("before step 1" in output
                                         or "interrupted before any rank started" in output), output
    assert "no checkpoint was saved" in output and "Traceback" not in output, output
    assert scan_checkpoints(run_dir / "checkpoints") == ([], [])


@pytest.mark.dist
@pytest.mark.timeout(200)
def test_second_ctrl_c_aborts_leaving_the_previous_checkpoint_intact(tmp_path: Path) -> None:
    job, run_dir, log = job_file(tmp_path, steps=100000, every=2), tmp_path / "run", tmp_path / "log"
    proc = start_cli(["run", "--config", str(job), "--nproc", "2", "--out", str(run_dir)], log)
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


def sample_ids(folder: Path) -> dict[int, list[int]]:
    """Step -> the sample ids the ranks logged for it (``MESHMORPH_SAMPLE_LOG``), dp order."""
    by_step: dict[int, dict[int, list[int]]] = {}
    for path in folder.glob("samples-rank*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            by_step.setdefault(row["step"], {})[row["dp_rank"]] = row["ids"]
    return {step: [i for dp in sorted(ids) for i in ids[dp]] for step, ids in by_step.items()}


@pytest.mark.dist
@pytest.mark.timeout(330)
def test_second_ctrl_c_in_a_huge_step_stops_at_once_and_the_run_resumes_exactly(
        tmp_path: Path) -> None:
    # step 4 takes ten minutes (rank 0 sleeps in its backward: what global_batch 65536 on two
    # CPU processes would take); the user asks to stop, is told so, and will not wait
    job, run_dir, log = job_file(tmp_path, steps=6, every=2), tmp_path / "run", tmp_path / "log"
    base = ["run", "--config", str(job), "--nproc", "2", "--out", str(run_dir)]
    ids = [tmp_path / "ids-1", tmp_path / "ids-2"]
    for folder in ids:
        folder.mkdir()
    proc = start_cli(base, log, env={**ENVIRONMENT, FAULT_ENV: "0@4:backward:pause=600",
                                     SAMPLE_LOG_ENV: str(ids[0])})
    wait_for(lambda: (run_dir / ".fault-0-4-backward").exists(), proc, log, 240)
    ranks = list(ranks_of(proc).values())
    first = [row["loss"] for row in records(run_dir)]
    assert len(first) == 3 and len(ranks) == 2, log.read_text()
    os.killpg(proc.pid, signal.SIGINT)
    wait_for(lambda: "press Ctrl-C again" in log.read_text(), proc, log, 10)
    said = log.read_text()
    assert "meshmorph: stopping: the ranks finish step 4 (running " in said, said
    assert "longer than the last step's" in said and "(the newest checkpoint, step-2, is kept)" \
        in said, said
    time.sleep(1)  # still in step 4: the first Ctrl-C waits for it
    assert proc.poll() is None and not (run_dir / "checkpoints" / "step-4").exists()
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)  # the second: at once
    code = finish(proc, log, 60)
    took, output = time.monotonic() - sent, log.read_text()
    # at once, against the ten minutes step 4 would take: 11.5 s seen beside the suite's
    # background worlds at a load average of 30 (the launcher and torchrun exiting)
    assert code == 130 and took < 30, f"{took:.1f} s\n{output}"
    assert "aborted: every rank was killed" in output and "Traceback" not in output, output
    gone_within(ranks, 5)  # no orphan
    assert not (run_dir / ".meshmorph.lock").exists() and not (run_dir / ".meshmorph.stop").exists()
    complete, _ = scan_checkpoints(run_dir / "checkpoints")
    assert [verify_checkpoint(path).step for path in complete] == [2], output
    assert f"--out {run_dir} --resume" in output, output

    resumed = start_cli([*base, "--resume"], tmp_path / "log2",
                        env={**ENVIRONMENT, SAMPLE_LOG_ENV: str(ids[1])})
    assert finish(resumed, tmp_path / "log2", 150) == 0, (tmp_path / "log2").read_text()
    again = (tmp_path / "log2").read_text()
    assert f"resumed from {run_dir / 'checkpoints' / 'step-2'} (step 2, 16 samples consumed)" \
        in again, again
    rows = records(run_dir)
    assert [row["step"] for row in rows] == list(range(1, 7))  # one line per step, none twice
    assert [row["consumed_samples"] for row in rows] == [8 * step for step in range(1, 7)]
    assert rows[2]["loss"] == pytest.approx(first[2], rel=1e-6, abs=0)  # step 3 trained again
    before, after = sample_ids(ids[0]), sample_ids(ids[1])
    assert sorted(before) == [1, 2, 3] and sorted(after) == [3, 4, 5, 6]
    assert after[3] == before[3]  # the same samples from the checkpoint's data position
    trajectory = [i for step in (1, 2) for i in before[step]] + \
        [i for step in (3, 4, 5, 6) for i in after[step]]
    assert len(trajectory) == len(set(trajectory)) == 6 * 8  # none lost, none repeated


@pytest.mark.dist
@pytest.mark.timeout(200)
def test_sigkill_of_torchrun_stops_the_orphaned_ranks(tmp_path: Path) -> None:
    job, run_dir, log = job_file(tmp_path, steps=100000, every=3), tmp_path / "run", tmp_path / "log"
    proc = start_cli(["run", "--config", str(job), "--nproc", "2", "--out", str(run_dir)], log)
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
def test_sigkill_of_one_rank_in_a_checkpoint_write_stops_the_job_and_the_run_resumes(
        tmp_path: Path) -> None:
    job, run_dir, log = job_file(tmp_path, steps=12, every=2), tmp_path / "run", tmp_path / "log"
    base = ["run", "--config", str(job), "--nproc", "2", "--out", str(run_dir)]
    # rank 1 dies while saving step 4: its files are in the .tmp- folder, nothing is committed
    proc = start_cli(base, log, env={**ENVIRONMENT, FAULT_ENV: "1@4:checkpoint"})
    ckpt = run_dir / "checkpoints"
    code = finish(proc, log, 150)
    output = log.read_text()
    victim = int((run_dir / ".fault-1-4-checkpoint").read_text())
    assert code == 1, output
    assert f"meshmorph: rank 1 (pid {victim}) was killed by SIGKILL" in output, output
    assert "resume with:" in output and "Traceback" not in output, output
    complete, cut = scan_checkpoints(ckpt)
    assert [p.name for p in complete] == ["step-2"], output
    assert [p.name.split(".tmp-")[0] for p in cut] == ["step-4"], output
    resumed = start_cli([*base, "--resume"], tmp_path / "log2")
    assert finish(resumed, tmp_path / "log2", 150) == 0, (tmp_path / "log2").read_text()
    assert "(step 2," in (tmp_path / "log2").read_text()
    assert steps_done(run_dir) == 12
    complete, cut = scan_checkpoints(ckpt)  # the next save removed the cut one's folder
    assert cut == [] and [verify_checkpoint(p).step for p in complete] == [8, 10, 12]


@pytest.mark.dist
@pytest.mark.timeout(200)
def test_a_frozen_rank_ends_the_job_after_the_collective_timeout_naming_the_waiting_rank(
        tmp_path: Path) -> None:
    job = job_file(tmp_path, steps=100000, every=0)
    job.write_text(job.read_text() + "[run]\ncollective_timeout_s = 5\n")
    run_dir, log = tmp_path / "run", tmp_path / "log"
    proc = start_cli(["run", "--config", str(job), "--nproc", "2", "--out", str(run_dir)], log)
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
@pytest.mark.timeout(200)
def test_a_free_master_port_from_the_environment_is_the_rendezvous_port(
        example_run: ExampleRun) -> None:
    # the session's example run was started with MASTER_PORT set to a free port
    assert f"--rdzv-endpoint localhost:{example_run.port}" in example_run.agent_command
    assert example_run.code == 0, example_run.output
    assert steps_done(example_run.run_dir) == 60


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_dp2_checkpoint_resumes_under_pp2_with_reshard_and_tied_head(
        example_run: ExampleRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # the example job's dp2 run, checkpoints at steps 30 and 60, the second set aside
    run_dir, job, log = example_run.copy_to(tmp_path), example_run.job, tmp_path / "log"
    (run_dir / "checkpoints" / "step-60").rename(run_dir / "checkpoints" / "step-60.tmp-moved")
    plan = tmp_path / "pp2.json"
    plan.write_text(json.dumps({"model": "gpt-tiny", "seq_len": 32, "global_batch": 8, "pp": 2,
                                "schedule": "1f1b", "micro_batch": 2, "num_microbatches": 4,
                                "dtype": "fp32"}))
    base = ["run", "--config", str(job), "--nproc", "2", "--out", str(run_dir), "--plan", str(plan),
            "--resume"]
    with monkeypatch.context() as patch:
        patch.setattr("meshmorph.run.launch.launcher.subprocess.Popen", _refuse_to_start)
        code = cli_main(base)
    refused = capsys.readouterr().err
    assert code == 2 and "saved under another plan" in refused
    assert "pass --reshard" in refused and "Traceback" not in refused
    proc = start_cli([*base, "--reshard"], log)
    assert finish(proc, log, 150) == 0, log.read_text()
    output = log.read_text()
    assert "resharding" in output and "(step 30, 240 samples consumed)" in output, output
    assert steps_done(run_dir) == 60
    assert json.loads((run_dir / "plan.json").read_text())["pp"] == 2


def _refuse_to_start(*args: object, **kwargs: object) -> None:
    raise AssertionError("a process was started before the job was refused")
