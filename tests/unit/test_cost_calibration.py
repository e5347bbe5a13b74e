"""Calibration against every published run (cost/calibration.py, bench/calibrate.py)."""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest

from meshmorph.cost import CostModel
from meshmorph.cost.calibration import (
    FIT_SPACE,
    FitSpace,
    errors,
    fit,
    leave_one_out,
    published_runs,
)
from meshmorph.cost.coefficients import CostCoefficients

RUNS = published_runs()


def test_every_published_source_is_read_with_its_layout() -> None:
    assert len(RUNS) == 32
    assert {run.source for run in RUNS} == {"narayanan2021_table1.json",
                                             "megatron_readme_tables.json"}
    for run in RUNS:
        assert run.plan.tp * run.plan.pp * run.plan.dp == run.cluster.world_size, run.id
        assert run.plan.global_batch == run.plan.dp * run.plan.micro_batch * run.plan.num_microbatches


@pytest.mark.parametrize("run", RUNS, ids=[run.id for run in RUNS])
def test_runs_that_really_ran_are_never_predicted_out_of_memory(run) -> None:
    estimate = CostModel(run.model, run.cluster).estimate(run.plan)
    assert estimate.fits, (run.id, estimate.peak_memory_gib)


def test_default_coefficients_within_15_percent_of_every_run_and_6_percent_on_average() -> None:
    errs = errors(RUNS, CostCoefficients())
    worst = max(zip(errs, RUNS, strict=True), key=lambda pair: abs(pair[0]))
    assert abs(worst[0]) <= 0.15, (worst[1].id, worst[0])
    assert statistics.fmean(abs(e) for e in errs) <= 0.06


def _fake(truth: CostCoefficients):
    """Published figures made by the model itself with known coefficients."""
    small = [run for run in RUNS if run.plan.pp == 1]
    table = {run.id: CostModel(run.model, run.cluster, truth).estimate(run.plan).tflops_per_gpu
             for run in small}
    return [replace(run, published_tflops=table[run.id]) for run in small]


def test_fit_recovers_the_coefficients_that_made_the_data() -> None:
    truth = replace(CostCoefficients(), matmul_efficiency=0.55, elementwise_passes=2.5,
                    link_efficiency=0.75)
    runs = _fake(truth)
    fitted = fit(runs, FIT_SPACE, CostCoefficients())
    for name in FIT_SPACE.names:
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.02), name
    assert max(abs(e) for e in errors(runs, fitted)) < 1e-3


def test_leave_one_out_refits_without_the_run_it_predicts() -> None:
    runs = _fake(replace(CostCoefficients(), matmul_efficiency=0.5))[:4]
    # one run made 20% faster than the model can be: only its own fit can chase it
    runs[0] = replace(runs[0], published_tflops=runs[0].published_tflops * 1.2)
    space = FitSpace(names=("matmul_efficiency",), lower=(0.3,), upper=(1.0,))
    in_sample = errors(runs, fit(runs, space, CostCoefficients()))[0]
    loo = leave_one_out(runs, space, CostCoefficients())
    assert loo[0][0] == pytest.approx(1 / 1.2 - 1, abs=1e-3)  # fitted on the other three
    assert abs(loo[0][0]) > abs(in_sample)
    assert all(abs(err) < 0.2 for err, _ in loo[1:])
