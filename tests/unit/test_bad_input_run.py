"""Bad run folders and checkpoints through ``meshmorph run``: damaged checkpoints, ``--resume``
under another model, data or plan, a folder that holds another run, a folder another run has
locked, a port in use. Each ends with exit code 2, a message naming the problem and a way out,
no process started, and no file in the run folder changed."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from meshmorph.cli import main as cli_main
from meshmorph.run.checkpoint import MANIFEST, commit_checkpoint
from meshmorph.run.fingerprint import run_fingerprint
from meshmorph.run.job import load_job
from meshmorph.run.launch.launcher import default_plan
from meshmorph.run.launch.run_folder import RunLock
from meshmorph.spec.catalog import load_model
from tests.helpers.jobs import gpt_tiny_job

JOB = gpt_tiny_job(steps=8, checkpoint={"every": 2})


@pytest.fixture(autouse=True)
def _no_process_may_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a process was started although the input was bad")

    monkeypatch.setattr("subprocess.Popen", refuse)
    monkeypatch.delenv("MASTER_PORT", raising=False)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file below ``folder`` with the SHA-256 of its bytes (the lock file aside: a refused
    run may create it, empty, and leaves it unlocked)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".meshmorph.lock"}


def fake_run(tmp_path: Path, steps: tuple[int, ...] = (2, 4), job_text: str = JOB) -> tuple[Path, Path]:
    """A job file and a run folder holding committed checkpoints of that job (fake shards)."""
    job_path = tmp_path / "job.toml"
    job_path.write_text(job_text)
    job = load_job(job_path)
    model = load_model(job.model.source, job.model.seq_len)
    plan = default_plan(job, model, 2)
    run_dir = tmp_path / "run"
    (run_dir / "plan.json").parent.mkdir(parents=True)
    (run_dir / "plan.json").write_text(plan.to_json())
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    for step in steps:
        tmp = run_dir / "checkpoints" / f"step-{step}.tmp-x"
        tmp.mkdir(parents=True)
        for rank in (0, 1):
            (tmp / f"__{rank}_0.distcp").write_bytes(bytes([step, rank]) * 500)
        (tmp / ".metadata").write_bytes(b"meta")
        commit_checkpoint(tmp, run_dir / "checkpoints" / f"step-{step}", step=step,
                          consumed_samples=8 * step, plan=plan.to_dict(),
                          fingerprint=run_fingerprint(job, model, plan).to_dict())
    return job_path, run_dir


def refused(capsys: pytest.CaptureFixture, run_dir: Path, args: list[str], *needles: str) -> str:
    before = snapshot(run_dir) if run_dir.exists() else {}
    code = cli_main(args)
    captured = capsys.readouterr()
    assert code == 2, f"exit {code}\n{captured.out}\n{captured.err}"
    for needle in needles:
        assert needle in captured.err, f"{needle!r} not in {captured.err!r}"
    assert "Traceback" not in captured.err + captured.out
    assert (snapshot(run_dir) if run_dir.exists() else {}) == before, "a run folder file changed"
    return captured.err


def resume(job: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["run", "--config", str(job), "--nproc", "2", "--out", str(run_dir), "--resume", *extra]


def test_a_new_run_into_a_folder_with_checkpoints_is_refused_and_nothing_is_touched(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    job, run_dir = fake_run(tmp_path)
    refused(capsys, run_dir, ["run", "--config", str(job), "--nproc", "2", "--out", str(run_dir)],
            f"run folder {run_dir} holds checkpoints of an earlier run (step-2, step-4",
            "continue that run with --resume", "another folder (--out NEW)")


def test_an_interrupted_save_alone_also_marks_the_folder_as_taken(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    job, run_dir = fake_run(tmp_path, steps=())
    (run_dir / "checkpoints" / "step-2.tmp-dead").mkdir(parents=True)
    refused(capsys, run_dir, ["run", "--config", str(job), "--nproc", "2", "--out", str(run_dir)],
            "holds checkpoints of an earlier run (step-2.tmp-dead")


@pytest.mark.parametrize("folder", ["missing", "empty", "records only", "cut-short saves only",
                                    "empty checkpoint folder"])
def test_resume_where_no_checkpoint_lies_is_refused_naming_the_folder_and_the_way_out(
        tmp_path: Path, capsys: pytest.CaptureFixture, folder: str) -> None:
    # a typo in --out must not start a new run from step 0 that passes for the resumed one
    job, run_dir = fake_run(tmp_path, steps=())
    if folder == "missing":
        run_dir = tmp_path / "rnu"
    elif folder == "empty":
        for path in run_dir.iterdir():
            path.unlink()
    elif folder == "cut-short saves only":
        (run_dir / "checkpoints" / "step-2.tmp-dead").mkdir(parents=True)
    elif folder == "empty checkpoint folder":
        (run_dir / "checkpoints").mkdir()
    where = (f"run folder {run_dir} does not exist, so there is no checkpoint" if folder == "missing"
             else f"run folder {run_dir} holds no checkpoint to continue from (searched "
             f"{run_dir / 'checkpoints'}")
    err = refused(capsys, run_dir, resume(job, run_dir), f"--resume: {where}", "check --out",
                  "run without --resume to start from step 0")
    assert err.startswith("meshmorph: error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "rnu").exists()  # nothing created for the typo
    if folder == "cut-short saves only":
        assert "only saves cut short, never loaded: step-2.tmp-dead" in err, err


@pytest.mark.parametrize(("damage", "needles"), [
    ("flip", ["step-4 is corrupted: file __1_0.distcp does not match its SHA-256"]),
    ("truncate", ["step-4 is corrupted: file __1_0.distcp has 100 bytes, the manifest says 1000"]),
    ("delete", ["step-4 is corrupted: file __1_0.distcp is missing"]),
    ("no manifest", ["step-4 is incomplete: manifest.json is missing"]),
    ("bad manifest", ["step-4 has an unreadable manifest.json"]),
    ("manifest of wrong types", ["step-4 has an unreadable manifest.json"]),
])
def test_damaged_newest_checkpoint_is_refused_naming_the_file_and_the_previous_one(
        tmp_path: Path, capsys: pytest.CaptureFixture, damage: str, needles: list[str]) -> None:
    job, run_dir = fake_run(tmp_path)
    newest = run_dir / "checkpoints" / "step-4"
    shard, manifest = newest / "__1_0.distcp", newest / MANIFEST
    if damage == "flip":
        data = bytearray(shard.read_bytes())
        data[321] ^= 0x01
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "delete":
        shard.unlink()
    elif damage == "no manifest":
        manifest.unlink()
    elif damage == "bad manifest":
        manifest.write_bytes(b"\x00\x01 not json")
    else:
        manifest.write_text(json.dumps({"step": "four", "consumed_samples": [], "plan": 1,
                                        "files": 3}))
    refused(capsys, run_dir, resume(job, run_dir), *needles,
            f"the previous checkpoint is {run_dir / 'checkpoints' / 'step-2'}")


def test_the_only_checkpoint_damaged_says_to_start_anew(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    job, run_dir = fake_run(tmp_path, steps=(2,))
    (run_dir / "checkpoints" / "step-2" / "__0_0.distcp").write_bytes(b"")
    refused(capsys, run_dir, resume(job, run_dir), "file __0_0.distcp has 0 bytes",
            "no earlier checkpoint exists: start without --resume in a new folder (--out)")


def test_resume_under_another_model_is_refused(tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    _, run_dir = fake_run(tmp_path)
    other = tmp_path / "other.toml"
    other.write_text(JOB.replace('"gpt-tiny"', '"llama-tiny"'))
    refused(capsys, run_dir, resume(other, run_dir), "was saved by another model",
            "source 'gpt-tiny' -> 'llama-tiny'", "resume with the job file that saved it")


def test_resume_under_another_sequence_length_is_refused(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    _, run_dir = fake_run(tmp_path)
    other = tmp_path / "other.toml"
    other.write_text(JOB.replace("seq_len = 32", "seq_len = 16"))
    refused(capsys, run_dir, resume(other, run_dir), "was saved by another model",
            "seq_len 32 -> 16")


def test_resume_on_other_data_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _, run_dir = fake_run(tmp_path)
    other = tmp_path / "other.toml"
    other.write_text(JOB.replace("seed = 1", "seed = 7"))
    refused(capsys, run_dir, resume(other, run_dir), "was saved on other data (seed 1 -> 7)",
            "start without --resume in a new folder")


def test_resume_under_another_plan_needs_reshard(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    job, run_dir = fake_run(tmp_path)
    plan = tmp_path / "zero3.json"
    plan.write_text(json.dumps({"model": "gpt-tiny", "seq_len": 32, "global_batch": 8, "dp": 2,
                                "zero": 3, "micro_batch": 2, "num_microbatches": 2,
                                "dtype": "fp32"}))
    refused(capsys, run_dir, resume(job, run_dir, "--plan", str(plan)),
            "was saved under another plan (tp 1 x pp 1 x dp 2, zero 0",
            "than this run's (tp 1 x pp 1 x dp 2, zero 3", "pass --reshard")


def test_a_checkpoint_without_fingerprint_is_refused(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    job, run_dir = fake_run(tmp_path, steps=(2,))
    manifest = run_dir / "checkpoints" / "step-2" / MANIFEST
    data = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**data, "fingerprint": None}))
    refused(capsys, run_dir, resume(job, run_dir), "has no run fingerprint in its manifest")


def test_a_second_run_into_a_locked_folder_is_refused_naming_the_holder(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    job, run_dir = fake_run(tmp_path)
    with RunLock(run_dir):
        refused(capsys, run_dir, resume(job, run_dir),
                f"run folder {run_dir} is in use by another meshmorph run (pid {os.getpid()}",
                "use another --out")


def test_a_master_port_in_use_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    job, run_dir = fake_run(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        monkeypatch.setenv("MASTER_PORT", str(port))
        refused(capsys, run_dir, resume(job, run_dir), f"MASTER_PORT {port} is in use",
                "unset MASTER_PORT to let meshmorph pick a free port")


def test_a_master_port_that_is_no_port_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    job, run_dir = fake_run(tmp_path)
    monkeypatch.setenv("MASTER_PORT", "http")
    refused(capsys, run_dir, resume(job, run_dir), "MASTER_PORT 'http' is not a port number")


@pytest.mark.parametrize(("args", "needle"), [
    (["--nproc", "0"], "meshmorph demo needs --nproc >= 1 and --steps >= 1, got --nproc 0"),
    (["--steps", "-3"], "got --nproc 4, --steps -3"),
])
def test_bad_demo_arguments_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture,
                                        args: list[str], needle: str) -> None:
    refused(capsys, tmp_path / "demo", ["demo", "--out", str(tmp_path / "demo"), *args], needle)


def test_a_demo_into_a_folder_in_use_leaves_its_job_file_alone(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir = tmp_path / "demo"
    run_dir.mkdir()
    (run_dir / "job.toml").write_text("# the running demo's job\n")
    with RunLock(run_dir):
        refused(capsys, run_dir, ["demo", "--out", str(run_dir)], "is in use by another meshmorph run")
    assert (run_dir / "job.toml").read_text() == "# the running demo's job\n"


def test_an_absurd_sequence_length_is_refused_before_any_process_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    job_path = tmp_path / "job.toml"
    job_path.write_text(JOB.replace("seq_len = 32", "seq_len = 1000000000"))
    code = cli_main(["run", "--config", str(job_path), "--nproc", "2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "seq_len 1,000,000,000 is above meshmorph's limit" in err


def _manifest_with(**changes: object) -> Callable[[Path, dict], None]:
    def damage(manifest: Path, data: dict) -> None:
        manifest.write_text(json.dumps({**data, **changes}))
    return damage


@pytest.mark.parametrize(("damage", "needle"), [
    (lambda m, d: m.write_text(""), "has an unreadable manifest.json (Expecting value"),
    (lambda m, d: m.write_bytes(bytes(range(256))), "has an unreadable manifest.json ('utf-8'"),
    (lambda m, d: m.write_text("[]"), "has an unreadable manifest.json (list indices"),
    (lambda m, d: (m.unlink(), m.mkdir()), "is incomplete: manifest.json is missing"),
    (_manifest_with(consumed_samples=float("nan")), "cannot convert float NaN to integer"),
    (_manifest_with(step=-4), "inconsistent manifest.json: it says step -4, but its folder is step 4"),
    (_manifest_with(step=7), "it says step 7, but its folder is step 4"),
    (_manifest_with(consumed_samples=-8), "it says consumed_samples -8 (< 0)"),
    (_manifest_with(files={}), "inconsistent manifest.json: it lists no files"),
    (lambda m, d: m.write_text(json.dumps({**d, "files": {"../../x": next(iter(d["files"].values()))}})),
     "it names ../../x, a file outside its folder"),
    (_manifest_with(files={"__0_0.distcp": {"bytes": "many", "sha256": "x"}}),
     "has an unreadable manifest.json"),
], ids=["empty", "binary", "a list", "a folder", "NaN count", "negative step", "another step",
        "negative samples", "no files", "file outside", "size a string"])
def test_a_bad_manifest_of_the_newest_checkpoint_is_refused_naming_the_previous_one(
        tmp_path: Path, capsys: pytest.CaptureFixture, damage: Callable[[Path, dict], None],
        needle: str) -> None:
    job, run_dir = fake_run(tmp_path)
    manifest = run_dir / "checkpoints" / "step-4" / MANIFEST
    damage(manifest, json.loads(manifest.read_text()))
    refused(capsys, run_dir, resume(job, run_dir), f"checkpoint {manifest.parent}", needle,
            f"the previous checkpoint is {run_dir / 'checkpoints' / 'step-2'}")
