"""The revocation hazard fitted to CM-DARE's preemptible GCE VMs, and its provider rules."""

from __future__ import annotations

import math

import numpy as np
import pytest

from meshmorph.predict.revocation import Hazard, fit_counts, fitted_hazards, revocation_report


def test_fitted_hazard_reproduces_the_published_fraction_revoked_by_24_hours() -> None:
    report = revocation_report()
    published = {"k80": 72 / 156, "p100": 65 / 120, "v100": 69 / 120}
    for gpu, fraction in published.items():
        entry = report["gpus"][gpu]
        assert entry["revoked_by_24h_published"] == pytest.approx(fraction, abs=1e-12)
        assert entry["revoked_by_24h_model"] == pytest.approx(fraction, abs=0.005)
        assert entry["max_cdf_gap_published"] < 0.05  # measured 0.030 / 0.021 / 0.039


def test_hazard_is_highest_in_the_first_hour() -> None:
    for hazard in fitted_hazards().values():
        assert hazard.rates_per_h[0] == max(hazard.rates_per_h)
    assert fitted_hazards()["k80"].rates_per_h[0] == pytest.approx(33 / (156 - 33 / 2), rel=1e-12)


def test_fit_matches_the_128_individual_k80_lifetimes_it_did_not_see() -> None:
    # Kolmogorov-Smirnov distance of the survival curves before the cap (measured 0.165)
    assert revocation_report()["gpus"]["k80"]["ks_k80_128_lifetimes"] < 0.2


def test_one_bin_mle_is_events_over_vm_hours_at_risk() -> None:
    # 10 VMs, 2 revoked in hour 0 and 1 in hour 1: exposure 9 and 7.5 VM-hours
    assert fit_counts([2, 1], 10, edges=(0.0, 1.0, 2.0)) == (2 / 9, 1 / 7.5)


def test_lifetime_inverts_the_cumulative_hazard_and_stops_at_the_cap() -> None:
    hazard = Hazard(name="t", edges_h=(0.0, 1.0, 3.0), rates_per_h=(0.5, 0.1), max_runtime_h=24.0)
    assert hazard.lifetime_h(0.25) == pytest.approx(0.5, rel=1e-12)
    assert hazard.lifetime_h(0.6) == pytest.approx(2.0, rel=1e-12)
    assert hazard.lifetime_h(5.0) == 24.0  # no tail hazard: the cap ends it
    assert hazard.survival(2.0) == pytest.approx(math.exp(-0.6), rel=1e-12)
    draws = [hazard.sample_h(np.random.default_rng(s)) for s in range(2000)]
    assert np.mean([d <= 1.0 for d in draws]) == pytest.approx(1 - math.exp(-0.5), abs=0.03)
