"""The cloud catalog: providers' rules, dated prices per region, and a user file that adds zones,
prices and providers or replaces them."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshmorph.predict.cloud_catalog import load_catalog, zone_region
from meshmorph.predict.market import MarketRequest, build_market
from meshmorph.predict.spot_data import Cloud, PreemptionMode

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "my_zones.toml"


def test_packaged_providers_carry_notice_and_cap_from_the_documentation() -> None:
    catalog = load_catalog()
    gcp, aws = catalog.provider("gcp-preemptible"), catalog.provider("aws-spot")
    assert (gcp.notice_s, gcp.max_runtime_h, gcp.cloud) == (30, 24, Cloud.GCP)
    assert (aws.notice_s, aws.max_runtime_h, aws.cloud) == (120, None, Cloud.AWS)
    assert catalog.provider("gcp-spot").max_runtime_h is None


def test_h100_prices_are_dated_per_region_and_the_region_of_a_zone_is_found() -> None:
    catalog = load_catalog()
    h100 = catalog.instance_for("h100", 8, Cloud.GCP)
    assert h100 is not None and h100.name == "gcp-h100-x8"
    east = catalog.price(h100, "us-east4-a")  # a3-highgpu-8g, GCP Billing Catalog 2025-10-23
    assert (east.spot_usd_per_h, east.on_demand_usd_per_h, east.date) == \
        (14.8534, 82.5254, "2025-10-23")
    assert catalog.price(h100, "asia-south2-b").spot_usd_per_h == 69.9101  # 0.71 of on-demand
    assert "stands in" in catalog.price(h100, "mars-north1-a").source  # no price: the default
    assert [zone_region(z) for z in ("us-east-1a", "us-central1-a", "eu-central-1b")] == \
        ["us-east-1", "us-central1", "eu-central-1"]


def test_no_undated_price_is_left_in_the_catalog() -> None:
    for instance in load_catalog().instances.values():
        assert instance.date[:4].isdigit(), instance.name
    for price in load_catalog().prices.values():
        assert price.date[:4].isdigit() and price.source, price


def test_the_example_user_file_adds_a_zone_a_price_and_a_provider() -> None:
    catalog = load_catalog(EXAMPLE)
    assert "lab-cloud" in catalog.providers and "lab-1a" in catalog.zones
    market = build_market(MarketRequest(gpu="a100-80g", gpus_per_node=8, provider="lab-cloud"),
                          catalog)
    zone = market.zone("lab-1a")
    assert zone.share == pytest.approx(0.9, abs=1e-9)
    assert zone.spot_node_usd_per_h == 12.0 and market.mode is PreemptionMode.LIFETIME
    assert zone.lifetime.rate(3.0) == pytest.approx(0.05)


def test_a_bad_catalog_entry_names_the_key_and_the_valid_ones(tmp_path: Path) -> None:
    user = tmp_path / "bad.toml"
    user.write_text('[providers.x]\nnotice_s = 30\nwarning_s = 2\n')
    with pytest.raises(ValueError, match="unknown key 'warning_s'.*valid keys: name, cloud"):
        load_catalog(user)
    user.write_text('[providers.x]\nnotice_s = -1\n')
    with pytest.raises(ValueError, match="notice_s must be a finite number >= 0"):
        load_catalog(user)
    user.write_text('[providers.x]\nnotice_s = 1\ncloud = "Mars"\n')
    with pytest.raises(ValueError, match="cloud 'Mars' is not one of GCP, AWS, Azure, other"):
        load_catalog(user)
    user.write_text('[[prices]]\ninstance = "nope"\nregion = "r"\ndate = "2026"\nsource = "s"\n')
    with pytest.raises(ValueError, match="a price for unknown instance 'nope'; known:"):
        load_catalog(user)
    user.write_text('[[zones]]\nname = "z"\nprovider = "gcp-spot"\nshare_available = 1.5\n')
    with pytest.raises(ValueError, match="share_available must be in"):
        load_catalog(user)
    user.write_text('[[zones]]\nprovider = "gcp-spot"\n')
    with pytest.raises(ValueError, match=r"\[\[zones\]\] #1: missing name"):
        load_catalog(user)
