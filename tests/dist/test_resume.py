"""Resume through the real ``meshmorph run`` CLI: a run killed after a checkpoint (step 4 of 8;
for data parallelism the example job's step 30 of 60) and resumed trains to the same per-step
losses as the uninterrupted run; bad checkpoints, data and plans are refused before any process
starts. The ZeRO-3 and pipeline runs (uninterrupted, then resumed) are background jobs of the
session (``BACKGROUND_JOBS``, tests/conftest.py)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest

from meshmorph.cli import main as cli_main
from meshmorph.run.checkpoint import verify_checkpoint
from tests.helpers.cli import ExampleRun, run_cli
from tests.helpers.jobs import gpt_tiny_job, write_job
from tests.helpers.world import BACKGROUND_NICE, Job

STEPS, EVERY = 8, 4
JOB = gpt_tiny_job(steps=STEPS, train={"seed": 2},
                   optim={"lr": 3e-3, "warmup_steps": 2, "decay_steps": STEPS},
                   checkpoint={"every": EVERY, "keep": 3})
FSDP_PLAN = {"model": "gpt-tiny", "seq_len": 32, "global_batch": 8, "dp": 2, "zero": 3,
             "micro_batch": 2, "num_microbatches": 2, "dtype": "fp32"}
PP_PLAN = {"model": "gpt-tiny", "seq_len": 32, "global_batch": 8, "pp": 2, "schedule": "1f1b",
           "micro_batch": 2, "num_microbatches": 4, "dtype": "fp32"}


def losses(run_dir: Path) -> list[tuple[int, float, int]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"], r["consumed_samples"]) for r in map(json.loads, lines)
            if "event" not in r]


def _no_process_may_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a process was started before the job was refused")

    monkeypatch.setattr("meshmorph.run.launch.launcher.subprocess.Popen", refuse)


def _kill_after_first_checkpoint(run_dir: Path, last: int) -> None:
    """What a kill during the last save leaves: the one before it committed, ``step-<last>``
    half-written."""
    ckpt = run_dir / "checkpoints"
    shutil.rmtree(ckpt / f"step-{last}")
    partial = ckpt / f"step-{last}.tmp-deadbeef"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")


def _resume(run_dir: Path, base: list[str], full: list[tuple[int, float, int]], *,
            nice: int = 0, timeout_s: float = 120) -> tuple[int, str]:
    """Leave ``run_dir`` as a kill during its last save would (``full``: its losses) and run
    ``base`` with ``--resume``: (exit code, output)."""
    _kill_after_first_checkpoint(run_dir, len(full))
    return run_cli([*base, "--resume"], nice=nice, timeout_s=timeout_s)


def _check_resumed(run_dir: Path, full: list[tuple[int, float, int]], code: int, output: str,
                   every: int, batch: int = 8) -> None:
    """The resumed run ignored the half-written checkpoint, started from step ``every`` and
    logged the uninterrupted run's losses and data positions (``full``) from there on."""
    steps = len(full)
    assert [step for step, _, _ in full] == list(range(1, steps + 1))
    assert code == 0, output
    assert "ignoring" in output and f"step-{steps}.tmp-deadbeef" in output, output
    assert (f"resumed from {run_dir / 'checkpoints' / f'step-{every}'} (step {every}, "
            f"{every * batch} samples") in output
    resumed = losses(run_dir)
    assert [step for step, _, _ in resumed] == list(range(1, steps + 1))
    for (step, expected, consumed), (_, got, got_consumed) in zip(full[every:], resumed[every:],
                                                                 strict=True):
        assert got == pytest.approx(expected, rel=1e-6, abs=0), f"step {step}"
        assert got_consumed == consumed == step * batch
    assert resumed[-1][1] < resumed[0][1]


LAYOUTS = {"fsdp_zero3": FSDP_PLAN, "pp2_1f1b": PP_PLAN}
"""The plans resumed in the background (``BACKGROUND_JOBS``, tests/conftest.py)."""


def _full_then_resumed(layout: str, plan: dict, tmp_path: Path,
                       worlds: dict[str, Path | None]) -> None:
    """In the background: the uninterrupted run of ``plan``, then the resumed one; what the
    test reads besides the run folder goes to ``runs.json``."""
    job = write_job(tmp_path, JOB)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    run_dir = tmp_path / layout
    base = ["run", "--config", str(job), "--nproc", "2", "--out", str(run_dir), "--plan",
            str(plan_file)]
    runs: dict[str, object] = {}
    code, output = run_cli(base, nice=BACKGROUND_NICE, timeout_s=600)
    runs["full"] = {"code": code, "output": output}
    if code == 0:
        runs["full_losses"] = full = losses(run_dir)
        runs["checkpoints"] = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        code, output = _resume(run_dir, base, full, nice=BACKGROUND_NICE, timeout_s=600)
        runs["resumed"] = {"code": code, "output": output}
    (tmp_path / "runs.json").write_text(json.dumps(runs))


BACKGROUND_JOBS = [Job(f"resume_{layout}", partial(_full_then_resumed, layout, plan))
                   for layout, plan in LAYOUTS.items()]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_dp2_resume_after_kill_matches_uninterrupted_losses_and_refuses_corruption(
        example_run: ExampleRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    # the uninterrupted run: the session's dp2 run of the example job (60 steps, checkpoints at
    # 30 and 60, tests/conftest.py), resumed in a copy of its folder
    run_dir = example_run.copy_to(tmp_path)
    full = losses(run_dir)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-30", "step-60"]
    base = ["run", "--config", str(example_run.job), "--nproc", "2", "--out", str(run_dir)]
    _check_resumed(run_dir, full, *_resume(run_dir, base, full), 30)
    assert json.loads((run_dir / "plan.json").read_text())["dp"] == 2
    # the resumed run committed step-60 again; now a shard of it is truncated
    ckpt = run_dir / "checkpoints"
    shard = ckpt / "step-60" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    _no_process_may_start(monkeypatch)
    code = cli_main([*base, "--resume"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"checkpoint {ckpt / 'step-60'} is corrupted: file __1_0.distcp has 100 bytes" in err
    assert f"the previous checkpoint is {ckpt / 'step-30'}" in err
    assert "Traceback" not in err
    assert verify_checkpoint(ckpt / "step-30").step == 30  # good state left as it was
    assert (ckpt / "step-60").is_dir()


@pytest.fixture
def resumed(background: Callable[[str], Path], layout: str) -> Path:
    """The folder of ``layout``'s background job, waited for here (not inside the test's
    timeout)."""
    return background(f"resume_{layout}")


@pytest.mark.dist
@pytest.mark.timeout(60, func_only=True)
@pytest.mark.parametrize(("layout", "plan"), list(LAYOUTS.items()))
def test_fsdp_and_pipeline_resume_after_kill_matches_uninterrupted_losses(
        resumed: Path, layout: str, plan: dict) -> None:
    tmp_path = resumed
    runs = json.loads((tmp_path / "runs.json").read_text())
    assert runs["full"]["code"] == 0, runs["full"]["output"]
    full = [tuple(row) for row in runs["full_losses"]]
    assert [step for step, _, _ in full] == list(range(1, STEPS + 1)), runs["full"]["output"]
    assert runs["checkpoints"] == ["step-4", "step-8"]
    run_dir = tmp_path / layout
    _check_resumed(run_dir, full, runs["resumed"]["code"], runs["resumed"]["output"], EVERY)
    written = json.loads((run_dir / "plan.json").read_text())
    assert (written["zero"], written["pp"], len(written["stages"])) == (
        plan.get("zero", 0), plan.get("pp", 1), plan.get("pp", 1))


def test_missing_data_file_is_refused_before_any_process_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    job = write_job(tmp_path, JOB.replace('kind = "synthetic"', 'kind = "text"\npath = "gone.txt"'))
    _no_process_may_start(monkeypatch)
    assert cli_main(["run", "--config", str(job), "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert f"data file {tmp_path / 'gone.txt'} does not exist; fix [data] path" in err
    assert "Traceback" not in err


def test_plan_for_another_world_size_is_refused_before_any_process_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    job = write_job(tmp_path, JOB)
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
    job = write_job(tmp_path, JOB)
    plan = tmp_path / "plan.json"
    _no_process_may_start(monkeypatch)
    plan.write_text(json.dumps({**FSDP_PLAN, "global_batch": 16, "num_microbatches": 4}))
    assert cli_main(["run", "--config", str(job), "--plan", str(plan)]) == 2
    assert "the plan has global_batch 16 but the job has 8" in capsys.readouterr().err
    plan.write_text(json.dumps({**FSDP_PLAN, "model": "llama-tiny"}))
    assert cli_main(["run", "--config", str(job), "--plan", str(plan)]) == 2
    assert "the plan was made for model 'llama-tiny' but the job trains 'gpt-tiny'" in \
        capsys.readouterr().err
