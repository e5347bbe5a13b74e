"""Resume through the real ``meshmorph run`` CLI: a run killed after its step-4 checkpoint and
resumed trains to the same per-step losses as the uninterrupted run; bad checkpoints, data and
plans are refused before any process starts."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from meshmorph.cli import main as cli_main
from meshmorph.run.checkpoint import verify_checkpoint
from meshmorph.run.launch.launcher import descendants

STEPS, EVERY = 8, 4
JOB = f"""
[model]
source = "gpt-tiny"
seq_len = 32
[data]
kind = "synthetic"
seed = 1
[train]
steps = {STEPS}
global_batch = 8
micro_batch = 2
seed = 2
[optim]
lr = 3e-3
warmup_steps = 2
decay_steps = {STEPS}
[checkpoint]
every = {EVERY}
keep = 3
"""
FSDP_PLAN = {"model": "gpt-tiny", "seq_len": 32, "global_batch": 8, "dp": 2, "zero": 3,
             "micro_batch": 2, "num_microbatches": 2, "dtype": "fp32"}
PP_PLAN = {"model": "gpt-tiny", "seq_len": 32, "global_batch": 8, "pp": 2, "schedule": "1f1b",
           "micro_batch": 2, "num_microbatches": 4, "dtype": "fp32"}


def run_cli(args: list[str], *, timeout_s: float = 120) -> tuple[int, str]:
    """``meshmorph <args>`` in a subprocess; on a timeout every process it started is killed
    and the test fails showing all output (every rank's lines come through torchrun)."""
    proc = subprocess.Popen([sys.executable, "-m", "meshmorph.cli.app", *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for pid in [*descendants(proc.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"meshmorph {' '.join(args)} ran past {timeout_s} s; output:\n{output}")
    return proc.returncode, output


def losses(run_dir: Path) -> list[tuple[int, float, int]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"], r["consumed_samples"]) for r in map(json.loads, lines)
            if "event" not in r]


def _no_process_may_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a process was started before the job was refused")

    monkeypatch.setattr("meshmorph.run.launch.launcher.subprocess.Popen", refuse)


def _kill_after_first_checkpoint(run_dir: Path) -> None:
    """What a kill during the step-8 save leaves: step-4 committed, step-8 half-written."""
    ckpt = run_dir / "checkpoints"
    shutil.rmtree(ckpt / f"step-{STEPS}")
    partial = ckpt / f"step-{STEPS}.tmp-deadbeef"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")


def _full_then_resumed(tmp_path: Path, layout: str, plan_args: list[str]) -> Path:
    job = tmp_path / "job.toml"
    job.write_text(JOB)
    run_dir = tmp_path / layout
    base = ["run", "--config", str(job), "--nproc", "2", "--out", str(run_dir), *plan_args]
    code, output = run_cli(base)
    assert code == 0, output
    full = losses(run_dir)
    assert [step for step, _, _ in full] == list(range(1, STEPS + 1)), output
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-4", "step-8"]

    _kill_after_first_checkpoint(run_dir)
    code, output = run_cli([*base, "--resume"])
    assert code == 0, output
    assert "ignoring" in output and "step-8.tmp-deadbeef" in output, output
    assert f"resumed from {run_dir / 'checkpoints' / 'step-4'} (step 4, 32 samples" in output
    resumed = losses(run_dir)
    assert [step for step, _, _ in resumed] == list(range(1, STEPS + 1))
    for (step, expected, consumed), (_, got, got_consumed) in zip(full[EVERY:], resumed[EVERY:],
                                                                 strict=True):
        assert got == pytest.approx(expected, rel=1e-6, abs=0), f"step {step}"
        assert got_consumed == consumed == step * 8
    assert resumed[-1][1] < resumed[0][1]
    return run_dir


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_dp2_resume_after_kill_matches_uninterrupted_losses_and_refuses_corruption(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    run_dir = _full_then_resumed(tmp_path, "dp2", [])
    assert json.loads((run_dir / "plan.json").read_text())["dp"] == 2
    # the resumed run committed step-8 again; now a shard of it is truncated
    ckpt = run_dir / "checkpoints"
    shard = ckpt / "step-8" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    _no_process_may_start(monkeypatch)
    code = cli_main(["run", "--config", str(tmp_path / "job.toml"), "--nproc", "2",
                     "--out", str(run_dir), "--resume"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"checkpoint {ckpt / 'step-8'} is corrupted: file __1_0.distcp has 100 bytes" in err
    assert f"the previous checkpoint is {ckpt / 'step-4'}" in err
    assert "Traceback" not in err
    assert verify_checkpoint(ckpt / "step-4").step == 4  # good state left as it was
    assert (ckpt / "step-8").is_dir()


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("layout", "plan"), [("fsdp_zero3", FSDP_PLAN), ("pp2_1f1b", PP_PLAN)])
def test_fsdp_and_pipeline_resume_after_kill_matches_uninterrupted_losses(
        tmp_path: Path, layout: str, plan: dict) -> None:
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    run_dir = _full_then_resumed(tmp_path, layout, ["--plan", str(plan_file)])
    written = json.loads((run_dir / "plan.json").read_text())
    assert (written["zero"], written["pp"], len(written["stages"])) == (
        plan.get("zero", 0), plan.get("pp", 1), plan.get("pp", 1))


def _job_file(tmp_path: Path, text: str) -> Path:
    job = tmp_path / "job.toml"
    job.write_text(text)
    return job


def test_missing_data_file_is_refused_before_any_process_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    job = _job_file(tmp_path, JOB.replace('kind = "synthetic"', 'kind = "text"\npath = "gone.txt"'))
    _no_process_may_start(monkeypatch)
    assert cli_main(["run", "--config", str(job), "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert f"data file {tmp_path / 'gone.txt'} does not exist; fix [data] path" in err
    assert "Traceback" not in err


def test_plan_for_another_world_size_is_refused_before_any_process_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    job = _job_file(tmp_path, JOB)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({**FSDP_PLAN, "dp": 4, "num_microbatches": 1}))
    _no_process_may_start(monkeypatch)
    out = tmp_path / "out"
    assert cli_main(["run", "--config", str(job), "--nproc", "2", "--plan", str(plan),
                     "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "meshmorph: error: tp 1 x pp 1 x dp 4 = 4 ranks, but the job has 2" in err
    assert "Traceback" not in err
    assert not out.exists()  # nothing written either


def test_plan_for_another_batch_or_model_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    job = _job_file(tmp_path, JOB)
    plan = tmp_path / "plan.json"
    _no_process_may_start(monkeypatch)
    plan.write_text(json.dumps({**FSDP_PLAN, "global_batch": 16, "num_microbatches": 4}))
    assert cli_main(["run", "--config", str(job), "--plan", str(plan)]) == 2
    assert "the plan has global_batch 16 but the job has 8" in capsys.readouterr().err
    plan.write_text(json.dumps({**FSDP_PLAN, "model": "llama-tiny"}))
    assert cli_main(["run", "--config", str(job), "--plan", str(plan)]) == 2
    assert "the plan was made for model 'llama-tiny' but the job trains 'gpt-tiny'" in \
        capsys.readouterr().err
