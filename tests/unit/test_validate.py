"""validate's arithmetic: MAPE and Kendall tau on hand-made numbers; the plans it runs."""

from __future__ import annotations

import pytest

from meshmorph.cost.profile import Profile, layer_key
from meshmorph.profile.accuracy import kendall_tau, mape
from meshmorph.profile.schedule_overhead import measures
from meshmorph.profile.validate import (
    candidate_plans,
    phase_medians,
    plan_name,
    predict,
    spanning_plans,
)
from meshmorph.schedule.table import Schedule
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.model import Recompute


def test_mape_of_ten_percent_over_and_under_is_ten_percent() -> None:
    assert mape([1.1, 0.9], [1.0, 1.0]) == pytest.approx(10.0)


def test_mape_weights_each_plan_by_its_own_measurement() -> None:
    # |2 - 1| / 1 = 100%, |3 - 4| / 4 = 25%: mean 62.5%
    assert mape([2.0, 3.0], [1.0, 4.0]) == pytest.approx(62.5)


def test_mape_refuses_a_zero_measurement() -> None:
    with pytest.raises(ValueError, match="positive"):
        mape([1.0], [0.0])


def test_kendall_tau_is_one_for_the_same_order_and_minus_one_reversed() -> None:
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)


def test_kendall_tau_with_one_swapped_pair_of_four_is_two_thirds() -> None:
    # 6 pairs, 5 concordant, 1 discordant: (5 - 1) / 6
    assert kendall_tau([1, 2, 3, 4], [1, 2, 4, 3]) == pytest.approx(2 / 3)


def test_candidate_plans_on_two_processes_are_distinct_and_cover_dp_and_pp() -> None:
    model = catalog_model("gpt-small", 64)
    plans = candidate_plans(model, 2, 8)
    names = [plan_name(p) for p in plans]
    # (dp2 x zero 0-3 x mb 1,2,4 + pp2 x 2 schedules x mb 1,2,4) x recompute none, full
    assert len(names) == len(set(names)) == 36
    assert {(p.pp, p.dp) for p in plans[:2]} == {(1, 2), (2, 1)}
    assert all(p.tp == 1 and p.world_size == 2 for p in plans)


def test_spanning_plans_keep_the_widest_least_ratio_between_neighbours() -> None:
    model = catalog_model("gpt-small", 64)
    plans = candidate_plans(model, 2, 8)[:7]
    predicted = [1.0, 1.01, 2.0, 1.02, 4.0, 4.05, 8.0]
    chosen = spanning_plans(plans, predicted, 4)
    assert [predicted[plans.index(p)] for p in chosen] == [1.0, 2.0, 4.0, 8.0]
    assert spanning_plans(plans, predicted, 7) == plans


def test_plan_names_tell_recompute_apart() -> None:
    model = catalog_model("gpt-small", 64)
    names = {plan_name(p) for p in candidate_plans(model, 2, 8)}
    assert "tp1pp1dp2z3-mb1x4" in names and "tp1pp1dp2z3-mb1x4-rcfull" in names


def _profile() -> Profile:
    model = catalog_model("gpt-small", 64)
    rows = {layer_key(model.name, model.seq_len, mb, "fp32", i):
            {"fwd_s": 0.01 * mb, "bwd_s": 0.02 * mb, "spread": 0.0}
            for mb in (1, 2, 4) for i in range(model.num_layers)}
    return Profile(layer_times=rows, processes=2, cores=2, optimizer_s_per_param=1e-9,
                   optimizer_fixed_s=1e-3)


def test_predicted_phases_give_each_pipeline_rank_its_own_layers_times_m() -> None:
    model = catalog_model("gpt-small", 64)
    plans = candidate_plans(model, 2, 8)
    pp = next(p for p in plans if p.pp == 2 and p.micro_batch == 1 and set(p.recompute_of_layer()) == {Recompute.NONE})
    got = predict(model, pp, 2, _profile())["predicted_phases_s"]
    layers = [[i for i in range(s.start, s.stop)] for s in pp.stages]
    assert got["forward_s"] == pytest.approx([pp.num_microbatches * 0.01 * len(k) for k in layers])
    assert got["backward_s"] == pytest.approx([pp.num_microbatches * 0.02 * len(k) for k in layers])
    dp = next(p for p in plans if p.pp == 1 and p.zero == 0 and p.micro_batch == 2
              and set(p.recompute_of_layer()) == {Recompute.NONE})
    got = predict(model, dp, 2, _profile())
    phases = got["predicted_phases_s"]
    assert phases["forward_s"] == pytest.approx([2 * 0.02 * model.num_layers])
    assert phases["optimizer_s"] == pytest.approx(got["breakdown_s"]["optimizer"])


def test_phase_medians_are_per_rank_and_per_phase() -> None:
    steps = [[{"forward_s": 1.0, "step_s": 5.0}, {"forward_s": 3.0, "step_s": 4.0},
              {"forward_s": 2.0, "step_s": 9.0}], [{"forward_s": 7.0, "step_s": 1.0}]]
    assert phase_medians(steps) == [{"forward_s": 2.0, "step_s": 5.0},
                                    {"forward_s": 7.0, "step_s": 1.0}]
    assert phase_medians(None) == []


def test_a_measured_schedule_overhead_adds_to_the_step_and_its_range() -> None:
    model = catalog_model("gpt-small", 64)
    plan = next(p for p in candidate_plans(model, 2, 8) if p.pp == 2)
    bare = predict(model, plan, 2, _profile())
    more = predict(model, plan, 2, _profile(), overhead_s=0.125)
    for key in ("predicted_step_s", "predicted_low_s", "predicted_high_s"):
        assert more[key] == pytest.approx(float(bare[key]) + 0.125)  # type: ignore[arg-type]
    assert more["predicted_phases_s"]["schedule_overhead_s"] == 0.125  # type: ignore[index]


def test_the_schedule_overhead_is_measured_for_one_stage_per_rank_gpipe_and_1f1b() -> None:
    model = catalog_model("gpt-small", 64)
    plans = candidate_plans(model, 2, 8)
    assert {p.schedule for p in plans if measures(p, 2)} == {Schedule.GPIPE, Schedule.ONE_F_ONE_B}
    assert not any(measures(p, 2) for p in plans if p.pp == 1)
    assert not any(measures(p, 4) for p in plans)  # pp 2 of 4 ranks: dp > 1 beside it


def test_a_busy_machine_is_named_instead_of_a_figure(capsys: pytest.CaptureFixture[str]) -> None:
    from meshmorph.cli.validate import report
    from meshmorph.profile.validate import too_busy

    assert too_busy([2.1, 3.3], cores=2, nproc=2) is None  # validate's own load and a little
    reason = too_busy([2.0, 9.0], cores=2, nproc=2)
    assert reason is not None and "load average up to 9.0 on 2 cores" in reason
    row = {"name": "tp1pp1dp2", "measured_step_s": 0.5, "predicted_step_s": 0.55,
           "predicted_low_s": 0.5, "predicted_high_s": 0.6, "state_bytes_rank0": 2**22,
           "predicted_state_bytes_rank0": 2**22, "outside_profile": []}
    result = {"model": "gpt-tiny", "seq_len": 64, "nproc": 2, "plans": [row] * 3, "mape": 10.0,
              "kendall_tau": 1.0, "in_range": 3, "load_avg_profile": 0.5, "cores": 2}
    report({**result, "too_busy": reason}, json_path=None, png_path=None)
    busy = capsys.readouterr().out
    assert "too busy to measure" in busy and "MAPE 10.0%" not in busy
    report(result, json_path=None, png_path=None)
    assert "MAPE 10.0%  Kendall tau 1.000" in capsys.readouterr().out
