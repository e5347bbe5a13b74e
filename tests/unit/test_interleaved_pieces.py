"""The samplers validate interleaves with a plan's steps: windows over samples, the fits through
their medians, and the prediction from one profile per timed step — on hand-made numbers."""

from __future__ import annotations

import statistics

import pytest
import torch

from meshmorph.cost.profile import Profile, layer_key
from meshmorph.profile.hardware import CollectiveSamples
from meshmorph.profile.interleaved import PlanPieces
from meshmorph.profile.layers import LayerPasses, OptimizerTails
from meshmorph.profile.validate import candidate_plans, predict, predict_between_steps
from meshmorph.spec.catalog import catalog_model

MODEL = catalog_model("gpt-tiny", 16)
"""Any model serves: the samplers are checked on hand-made figures (the smallest model keeps the
timed passes they take before those figures are written in short)."""


def test_layer_passes_window_takes_every_pass_of_the_samples_it_names() -> None:
    passes = LayerPasses(MODEL, 1, "fp32", torch.device("cpu"))
    passes.sample(keep=False)  # warm-up: nothing kept
    for _ in range(3):
        passes.sample(passes=2)
    assert passes.starts == [0, 2, 4] and len(passes.fwd[0]) == 6
    # hand-made figures for layer 0: sample 0 = passes 0, 1; sample 1 = 2, 3; sample 2 = 4, 5
    passes.fwd[0] = [1.0, 2.0, 10.0, 20.0, 100.0, 200.0]
    passes.bwd[0] = [3.0, 3.0, 30.0, 50.0, 300.0, 300.0]
    key = layer_key(MODEL.name, MODEL.seq_len, 1, "fp32", 0)
    second = passes.times(slice(1, 2))[key]
    assert second["fwd_s"] == pytest.approx(15.0) and second["bwd_s"] == pytest.approx(40.0)
    both = passes.times(slice(1, 3))[key]  # passes 2..5: medians of four
    assert both["fwd_s"] == pytest.approx(60.0) and both["bwd_s"] == pytest.approx(175.0)
    assert passes.times()[key]["fwd_s"] == pytest.approx(15.0)  # all six: (10 + 20) / 2


def test_optimizer_tails_fit_the_line_through_the_window_medians() -> None:
    tails = OptimizerTails(MODEL, torch.device("cpu"))
    tails.counts = [1000.0, 2000.0, 4000.0]
    # samples 0 and 1 lie on 0.5 ms + 1 ns/param, sample 2 on twice that
    line = [5e-4 + 1e-9 * c for c in tails.counts]
    tails.seconds = [[t, t, 2 * t] for t in line]
    fixed, per_param = tails.fit(slice(0, 2))
    assert fixed == pytest.approx(5e-4) and per_param == pytest.approx(1e-9)
    fixed, per_param = tails.fit(slice(2, 3))
    assert fixed == pytest.approx(1e-3) and per_param == pytest.approx(2e-9)


def test_collective_samples_fit_alpha_beta_per_window_and_only_for_member_groups() -> None:
    samples = CollectiveSamples.__new__(CollectiveSamples)
    samples.sizes = [1000.0, 3000.0]
    samples.members = {"all_reduce/2"}
    # 1 ms + 1 us per byte in samples 0-2, then a loaded sample at 3x
    samples.seconds = {"all_reduce/2": [[0.002, 0.002, 0.002, 0.006], [0.004, 0.004, 0.004, 0.012]],
                       "all_reduce/3": [[1.0], [2.0]]}
    fits = samples.fits(slice(0, 3))
    assert set(fits) == {"all_reduce/2"}
    assert fits["all_reduce/2"]["alpha_s"] == pytest.approx(1e-3)
    assert fits["all_reduce/2"]["beta_s_per_byte"] == pytest.approx(1e-6)
    assert samples.fits(slice(3, 4))["all_reduce/2"]["alpha_s"] == pytest.approx(3e-3)


def _profile(scale: float) -> Profile:
    rows = {layer_key(MODEL.name, MODEL.seq_len, mb, "fp32", i):
            {"fwd_s": 0.01 * scale * mb, "bwd_s": 0.02 * scale * mb, "spread": 0.0}
            for mb in (1, 2, 4) for i in range(MODEL.num_layers)}
    return Profile(layer_times=rows, processes=2, cores=2, optimizer_s_per_param=1e-9 * scale,
                   optimizer_fixed_s=1e-3 * scale)


def test_prediction_between_steps_is_the_median_of_the_per_step_predictions() -> None:
    plan = next(p for p in candidate_plans(MODEL, 2, 8) if p.pp == 1 and p.zero == 0)
    profiles = [_profile(s) for s in (1.0, 3.0, 2.0, 1.5, 10.0)]
    each = [float(predict(MODEL, plan, 2, p)["predicted_step_s"]) for p in profiles]  # type: ignore[arg-type]
    got = predict_between_steps(MODEL, plan, 2, profiles)
    assert got["predicted_steps_s"] == each
    assert got["predicted_step_s"] == pytest.approx(statistics.median(each))
    assert got["predicted_low_s"] == min(each) and got["predicted_high_s"] == max(each)
    # slower pieces predict a slower step, in the order of their scale
    assert each[0] < each[3] < each[2] < each[1] < each[4]
    with pytest.raises(ValueError, match="one profile per timed step"):
        predict_between_steps(MODEL, plan, 2, [])


def test_plan_pieces_run_as_many_passes_as_one_rank_computes_per_step() -> None:
    plans = candidate_plans(MODEL, 2, 8)
    dp = next(p for p in plans if p.pp == 1 and p.num_microbatches == 4)
    pp = next(p for p in plans if p.pp == 2 and p.num_microbatches == 8)
    assert PlanPieces(MODEL, dp, 1, 0, torch.device("cpu")).passes == 4
    assert PlanPieces(MODEL, pp, 1, 0, torch.device("cpu")).passes == 4
