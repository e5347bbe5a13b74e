"""Maximum-likelihood fits recover known parameters from synthetic data, with honest intervals."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshmorph.predict.fits import (
    Durations,
    Family,
    Runs,
    best_fit,
    fit_durations,
    fit_rate,
    fit_runs,
    rate_fit,
    runs_of,
)


def test_weibull_with_censoring_recovers_shape_and_scale_inside_its_interval() -> None:
    rng = np.random.default_rng(1)
    lives = 3.0 * rng.weibull(0.6, 400)
    cut = 8.0  # measurement stops at 8 h: longer lifetimes are censored
    fit = fit_durations(Durations.observed(np.minimum(lives, cut), lives < cut), Family.WEIBULL)
    assert fit.shape_ci95[0] < 0.6 < fit.shape_ci95[1]  # measured 0.59 (0.54-0.65)
    assert fit.scale_ci95[0] < 3.0 < fit.scale_ci95[1]  # measured 2.93 (2.44-3.51)
    assert best_fit(Durations.observed(np.minimum(lives, cut), lives < cut)).family \
        is Family.WEIBULL  # shape 0.6 is far from 1: AIC keeps it


def test_exponential_durations_give_the_closed_form_rate_and_best_fit_keeps_it() -> None:
    rng = np.random.default_rng(2)
    lives = rng.exponential(2.0, 300)
    data = Durations.observed(lives, [True] * 300)
    fit = fit_durations(data, Family.EXPONENTIAL)
    assert fit.mean_h == pytest.approx(lives.mean(), rel=1e-9)  # events / exposure
    assert fit.mean_ci95_h[0] < 2.0 < fit.mean_ci95_h[1]
    assert best_fit(data).family is Family.EXPONENTIAL


def test_interval_durations_are_fitted_from_both_bounds() -> None:
    rng = np.random.default_rng(3)
    lives = rng.exponential(1.5, 500)
    low = np.floor(lives * 2) / 2  # known to the half hour
    fit = fit_durations(Durations(tuple(low), tuple(low + 0.5)), Family.EXPONENTIAL)
    assert fit.mean_ci95_h[0] < 1.5 < fit.mean_ci95_h[1]


@settings(max_examples=25, deadline=None)
@given(events=st.integers(0, 400), exposure=st.floats(1.0, 1e4))
def test_poisson_interval_brackets_the_rate_and_shrinks_with_events(events: int,
                                                                     exposure: float) -> None:
    fit = fit_rate(events, exposure)
    low, high = 1 / fit.scale_ci95[1], (1 / fit.scale_ci95[0] if fit.scale_ci95[0] else 0.0)
    assert low <= events / exposure <= (high if events else math.inf)
    assert fit.rate_per_h == pytest.approx(events / exposure)


def test_a_count_of_154_preemptions_in_1548_vm_hours_is_0_10_per_hour() -> None:
    fit = fit_rate(154, 1548.2)  # Bamboo's GCP A100 group (README: about 0.10 per VM-hour)
    assert fit.rate_per_h == pytest.approx(0.0995, abs=1e-4)
    assert 1 / fit.scale_ci95[1] == pytest.approx(0.084, abs=1e-3)


@settings(max_examples=15, deadline=None)
@given(p=st.floats(0.02, 0.5), seed=st.integers(0, 10_000))
def test_geometric_runs_mle_is_ends_over_ticks_and_recovers_p(p: float, seed: int) -> None:
    ticks = np.random.default_rng(seed).geometric(p, 400)
    fit = fit_runs(Runs(tuple(int(t) for t in ticks), (True,) * 400), 600.0)
    if fit.family is Family.GEOMETRIC:
        assert fit.p_short == pytest.approx(400 / ticks.sum(), rel=1e-3)
    assert fit.mean_ci95_ticks[0] < 1 / p * 1.25 and fit.mean_ci95_ticks[1] > 1 / p * 0.8


def test_flickers_beside_long_periods_are_fitted_as_a_two_geometric_mixture() -> None:
    rng = np.random.default_rng(4)
    short = rng.random(600) < 0.7  # 70% one-tick flickers (p = 0.9), 30% long (p = 0.02)
    ticks = np.where(short, rng.geometric(0.9, 600), rng.geometric(0.02, 600))
    fit = fit_runs(Runs(tuple(int(t) for t in ticks), (True,) * 600), 600.0)
    assert fit.family is Family.GEOMETRIC_MIXTURE
    assert fit.weight == pytest.approx(0.7, abs=0.06)
    assert fit.p_short == pytest.approx(0.9, abs=0.06)
    assert fit.p_long == pytest.approx(0.02, abs=0.006)
    true_mean = 0.7 / 0.9 + 0.3 / 0.02
    assert fit.mean_ci95_ticks[0] < true_mean < fit.mean_ci95_ticks[1]


def test_runs_cut_by_the_ends_of_the_data_are_censored() -> None:
    assert runs_of([True, True, False, True, True, True]) == [
        (True, 2, False), (False, 1, True), (True, 3, False)]
    # two censored runs and no end: the fit is a state that lasts (never ends)
    fit = fit_runs(Runs((5, 7), (False, False)), 600.0)
    assert fit.mean_ticks == math.inf and fit.events == 0
    assert rate_fit(2, 100.0, 60.0).mean_h == pytest.approx(50 * 60 / 3600)
