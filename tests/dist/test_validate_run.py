"""``meshmorph profile --quick`` then ``meshmorph validate --plans 3``, end to end on 2 gloo
processes each: the JSON has its keys, every measured step time is positive, every prediction
lies inside its own range, and rank 0's state bytes equal the prediction exactly. How close the
predicted times come depends on the machine's load (a shared CI machine can double a step), so
the accuracy figures live in bench/validate.py, not in a timed test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def _cli(args: list[str], timeout_s: float) -> str:
    done = subprocess.run([sys.executable, "-m", "meshmorph.cli.app", *args], capture_output=True,
                          text=True, timeout=timeout_s)
    assert done.returncode == 0, f"meshmorph {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.dist
@pytest.mark.timeout(420)
def test_quick_profile_then_validate_three_plans_reports_each_with_exact_state_bytes(
        tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    out = _cli(["profile", "--quick", "--nproc", "2", "--seq-len", "32", "--out", str(profile)], 180)
    assert "all_reduce/2" in out and "fsdp_all_gather/2" in out and "fsdp_reduce_scatter/2" in out
    data = json.loads(profile.read_text())
    assert data["processes"] == 2 and len(data["layer_times"]) == 3 * 8  # mb 1, 2, 4 x 8 layers
    result = tmp_path / "validate.json"
    _cli(["validate", "--plans", "3", "--nproc", "2", "--seq-len", "32", "--repeats", "3",
          "--warmup", "1", "--profile", str(profile), "--json", str(result)], 180)
    report = json.loads(result.read_text())
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
