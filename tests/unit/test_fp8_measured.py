"""The cost model against float8 steps measured on an H200 (bench/results/gpu_fp8.json, written by
bench/gpu_fp8.py from bench/gpu_suite.py runs): gpt3-1.3b and an 8-layer Llama 3 8B shape,
compiled, in bf16 and under each float8 recipe, on one GPU (autocast over fp32 parameters)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from meshmorph.cost.coefficients import CostCoefficients

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_fp8  # noqa: E402

RESULTS = json.loads((ROOT / "bench" / "results" / "gpu_fp8.json").read_text())


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return gpu_fp8.compare(RESULTS)


def test_the_measurements_cover_both_shapes_and_every_recipe(rows: list[dict]) -> None:
    seen = {(r["case"]["model"], r["case"]["dtype"], r["case"]["fp8_scaling"]) for r in rows}
    assert len(seen) == len(rows) == 7
    assert {m for m, _, _ in seen} == {"gpt3-1.3b", "llama3-8b-8l"}
    assert all(r["case"]["gpu"] == "h200" and r["case"]["compile"] for r in rows)


def test_every_measured_step_is_predicted_within_5_percent(rows: list[dict]) -> None:
    ratios = {(r["case"]["model"], r["case"]["fp8_scaling"] if r["case"]["dtype"] == "fp8"
               else "bf16"): round(r["ratio"], 3) for r in rows}
    assert all(abs(ratio - 1) < 0.05 for ratio in ratios.values()), ratios


def test_fp8_gains_over_bf16_tensorwise_close_the_rowwise_recipes_a_little_high(
        rows: list[dict]) -> None:
    """Tensorwise's gain is predicted within 2%; the rowwise recipes' within 8%, and above
    what was measured (their casts transpose and round scales to powers of two, kernels slower
    than the bytes they move suggest)."""
    for row in rows:
        run = row["case"]
        if run["dtype"] != "fp8":
            continue
        error = row["gain_predicted"] / row["gain_measured"] - 1
        if run["fp8_scaling"] == "tensorwise":
            assert abs(error) < 0.02, (run["model"], error)
        else:
            assert 0 < error < 0.08, (run["model"], run["fp8_scaling"], error)


def test_the_autocast_cast_share_is_the_least_squares_fit_of_the_fp8_steps() -> None:
    fp8 = [run for run in RESULTS["runs"] if run["dtype"] == "fp8"]
    default = CostCoefficients()

    def squared_error(share: float) -> float:
        coef = replace(default, fp8_autocast_cast_bandwidth_efficiency=share)
        return sum((gpu_fp8.reprice(run, coef)[0] / run["measured_step_s"] - 1) ** 2
                   for run in fp8)

    best = squared_error(default.fp8_autocast_cast_bandwidth_efficiency)
    share = default.fp8_autocast_cast_bandwidth_efficiency
    assert best < squared_error(share - 0.02) and best < squared_error(share + 0.02)
    assert squared_error(default.fp8_cast_bandwidth_efficiency) > 3 * best  # 0.5 misses them


def test_every_measured_peak_is_predicted_within_3_percent(rows: list[dict]) -> None:
    """Peak allocated memory: float8 held 4-14% less than bf16 (no 16-bit weight copies under
    autocast; float8 copies of the linears' inputs kept for backward), and the model says so."""
    ratios = {(r["case"]["model"], r["case"]["fp8_scaling"] if r["case"]["dtype"] == "fp8"
               else "bf16"): round(r["memory_ratio"], 3) for r in rows}
    assert all(abs(ratio - 1) < 0.03 for ratio in ratios.values()), ratios
