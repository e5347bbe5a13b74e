"""validate's arithmetic: MAPE and Kendall tau on hand-made numbers; the plans it runs."""

from __future__ import annotations

import pytest

from meshmorph.predict.accuracy import kendall_tau, mape
from meshmorph.predict.validate import candidate_plans, plan_name, spanning_plans
from meshmorph.spec.catalog import catalog_model


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
