"""CM-DARE's measured training speeds reproduced by the physics-first regression."""

from __future__ import annotations

import pytest

from meshmorph.predict.speed_model import (
    SpeedModel,
    cluster_points,
    fit,
    fit_report,
    single_worker_points,
)


def test_cmdare_speeds_are_reproduced_with_leave_one_out_mape_under_12_percent() -> None:
    report = fit_report()
    assert report["single_worker"]["points"] == 40  # 20 CNNs x K80/P100, median of 13 samples
    assert report["cluster"]["points"] == 96  # 1-8 workers, 1-2 parameter servers
    assert report["single_worker"]["mape_leave_one_out"] <= 0.12  # measured 0.063
    assert report["cluster"]["mape_leave_one_out"] <= 0.12  # measured 0.093
    assert report["mape_leave_one_out_all"] <= 0.12  # measured 0.084


def test_a_second_parameter_server_lifts_the_plateau_as_measured() -> None:
    model = fit()
    points = {(p.gpu, p.model, p.parameter_servers, p.workers): p for p in cluster_points()}
    one, two = points[("p100", "ResNet-15", 1, 8)], points[("p100", "ResNet-15", 2, 8)]
    # measured 103.7 vs 176.7 steps/s; the model must see at least 1.4x of that 1.70x
    assert model.steps_per_s(two) / model.steps_per_s(one) > 1.4
    assert model.steps_per_s(one) == pytest.approx(one.steps_per_s, rel=0.15)


def test_a_slower_gpu_is_predicted_slower_for_every_model() -> None:
    model = SpeedModel(worker=fit().worker)
    by_model: dict[str, dict[str, float]] = {}
    for p in single_worker_points():
        by_model.setdefault(p.model, {})[p.gpu] = model.step_time_s(p)
    assert len(by_model) == 20
    assert all(times["k80"] > 1.5 * times["p100"] for times in by_model.values())
