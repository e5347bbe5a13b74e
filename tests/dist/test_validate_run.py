"""``meshmorph profile --quick`` then ``meshmorph validate --plans 3``, end to end on 2 gloo
processes each: the JSON has its keys, every measured step time is positive, every prediction
lies inside its own range, and rank 0's state bytes equal the prediction exactly. How close the
predicted times come depends on the machine's load (a shared CI machine can double a step), so
the accuracy figures live in bench/validate.py, not in a timed test.

Both commands run as a background job of the session (``BACKGROUND_JOBS``,
tests/conftest.py); the test reads their output and files."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.cli import run_cli
from tests.helpers.world import BACKGROUND_NICE, Job

PROFILE = ["profile", "--quick", "--nproc", "2", "--seq-len", "32"]
VALIDATE = ["validate", "--plans", "3", "--nproc", "2", "--seq-len", "32", "--repeats", "3",
            "--warmup", "1"]


def run_job(folder: Path, worlds: dict[str, Path | None]) -> None:
    """Profile, then validate with that profile (not where profiling failed); each command's
    exit code and output kept in ``done.json``."""
    profile, result = folder / "profile.json", folder / "validate.json"
    done = {}
    for name, args, timeout_s in (
            ("profile", [*PROFILE, "--out", str(profile)], 600),
            ("validate", [*VALIDATE, "--profile", str(profile), "--json", str(result)], 600)):
        code, output = run_cli(args, timeout_s=timeout_s, nice=BACKGROUND_NICE)
        done[name] = {"args": args, "code": code, "output": output}
        if code:
            break
    (folder / "done.json").write_text(json.dumps(done))


BACKGROUND_JOBS = [Job("validate_run", run_job)]


@pytest.fixture(scope="module")
def validate_folder(background: Callable[[str], Path]) -> Path:
    """The job's folder, waited for here (not inside the test's timeout)."""
    return background("validate_run")


def _output(done: dict, name: str) -> str:
    assert name in done, f"meshmorph {name} did not run"
    run = done[name]
    assert run["code"] == 0, f"meshmorph {' '.join(run['args'])} failed:\n{run['output']}"
    return run["output"]


@pytest.mark.dist
@pytest.mark.timeout(60, func_only=True)
def test_quick_profile_then_validate_three_plans_reports_each_with_exact_state_bytes(
        validate_folder: Path) -> None:
    folder = validate_folder
    done = json.loads((folder / "done.json").read_text())
    out = _output(done, "profile")
    assert "all_reduce/2" in out and "fsdp_all_gather/2" in out and "fsdp_reduce_scatter/2" in out
    data = json.loads((folder / "profile.json").read_text())
    assert data["processes"] == 2 and len(data["layer_times"]) == 3 * 8  # mb 1, 2, 4 x 8 layers
    _output(done, "validate")
    report = json.loads((folder / "validate.json").read_text())
    assert {"mape", "kendall_tau", "plans"} <= set(report)
    assert len(report["plans"]) == 3
    for row in report["plans"]:
        measured, predicted = row["measured_step_s"], row["predicted_step_s"]
        assert measured > 0
        assert predicted > 0, row["name"]
        assert row["state_bytes_rank0"] == row["predicted_state_bytes_rank0"], row["name"]
        assert row["outside_profile"] == []
        assert row["predicted_low_s"] <= predicted <= row["predicted_high_s"]
    assert report["mape"] >= 0
