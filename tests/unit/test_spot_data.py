"""The packaged spot data as fitted processes: the figures the reference README states, and which
data stands in (and says so) where a GPU or cloud has none."""

from __future__ import annotations

import pytest

from meshmorph.predict.cloud_catalog import load_catalog
from meshmorph.predict.market import MarketRequest, build_market
from meshmorph.predict.spot_data import (
    Cloud,
    PreemptionMode,
    availability_for,
    default_mode,
    lifetime_set,
    lifetimes_for,
    zone_hazard,
)


def test_l4_lifetimes_are_the_seven_preemptions_of_the_reference_run() -> None:
    fit = lifetime_set("l4-aws-2025-12").fits["pooled"]
    assert fit["events"] == 7  # README: 0.4, 0.6, 1.8, 2.1, 2.7, 2.9, 5.6 h
    assert 1 / fit["mean_h"] == pytest.approx(0.25, abs=0.02)  # "about 0.25 per hour"
    assert fit["mean_ci95_h"][0] < fit["mean_h"] < fit["mean_ci95_h"][1]


def test_group_traces_give_the_readme_rates_with_intervals() -> None:
    a100 = lifetime_set("a100-gcp-2021-12").fits["us-east1-b"]
    assert 1 / a100["mean_h"] == pytest.approx(0.10, abs=0.005)  # README: about 0.10/VM-h
    p3 = lifetime_set("v100-aws-2021").fits["pooled"]
    assert 1 / p3["mean_h"] == pytest.approx(0.61, abs=0.02)  # README: 0.61 removals/node-h
    assert p3["events"] == 167


def test_h100_has_capacity_data_but_no_lifetimes_so_it_runs_in_capacity_mode() -> None:
    data, note = availability_for("h100", Cloud.GCP)
    assert data is not None and data.key == "h100-gcp-2025-10" and note == ""
    assert len(data.availability) == 13
    assert default_mode("h100", Cloud.GCP) is PreemptionMode.CAPACITY
    lives, note = lifetimes_for("h100", Cloud.GCP)
    assert lives is not None and lives.key == "a100-gcp-2021-12"
    assert "no VM lifetimes data for h100 on GCP: a100-gcp-2021-12 stands in" in note


def test_gpus_without_data_borrow_the_nearest_generation_of_the_same_cloud_and_say_so() -> None:
    data, note = availability_for("a100-80g", Cloud.GCP)
    assert data is not None and data.key == "h100-gcp-2025-10" and "stands in" in note
    data, note = lifetimes_for("h100", Cloud.AWS)
    assert data is not None and data.key == "l4-aws-2025-12" and "stands in" in note
    assert default_mode("a100-80g", Cloud.GCP) is PreemptionMode.LIFETIME
    data, note = lifetimes_for("k80", Cloud.GCP)  # 2019 CM-DARE: the only K80 source, kept
    assert data is not None and data.key == "k80-gcp-2019" and note == ""
    data, note = availability_for("h100", Cloud.AZURE)
    assert data is None and "no capacity (availability) data for Azure at all" in note


def test_a_zone_uses_its_own_or_its_regions_hazard_else_the_pooled_one_with_a_note() -> None:
    k80 = lifetime_set("k80-gcp-2019")
    own, note = zone_hazard(k80, "us-central1-b")  # the region's 2019 fit
    assert note == "" and own.name.endswith("us-central1")
    pooled, note = zone_hazard(lifetime_set("v100-aws-2023-04"), "us-east-2a")
    assert "no lifetimes of its own" in note and pooled.name.endswith("pooled")


def test_the_market_prints_where_data_stands_in() -> None:
    market = build_market(MarketRequest(gpu="a100-80g", gpus_per_node=8, provider="gcp-spot",
                                        spot_gpu_usd_per_h=1.5), load_catalog())
    assert market.mode is PreemptionMode.LIFETIME
    assert any("h100-gcp-2025-10 stands in" in n for n in market.notes)
    assert market.lifetime_source.startswith("a100-gcp-2021-12")
