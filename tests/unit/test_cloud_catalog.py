"""The cloud catalog: providers' rules, dated prices, and a user file that adds or replaces entries."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshmorph.predict.cloud_catalog import load_catalog


def test_packaged_providers_carry_notice_and_cap_from_the_documentation() -> None:
    catalog = load_catalog()
    gcp, aws = catalog.provider("gcp-preemptible"), catalog.provider("aws-spot")
    assert (gcp.notice_s, gcp.max_runtime_h) == (30, 24)
    assert (aws.notice_s, aws.max_runtime_h) == (120, None)
    assert catalog.provider("gcp-spot").hazard_for("h100").max_runtime_h is None
    assert aws.hazard_for("v100-16g").rate(5.0) == pytest.approx(0.4395, rel=1e-12)


def test_instances_hold_dated_on_demand_and_spot_prices() -> None:
    catalog = load_catalog()
    p3 = catalog.instances["aws-p3.2xlarge"]
    assert (p3.gpu, p3.gpus, p3.on_demand_usd_per_h, p3.spot_usd_per_h, p3.date) == \
        ("v100-16g", 1, 3.06, 0.918, "2023-04")
    p2 = catalog.instances["aws-p2.16xlarge"]
    assert p2.price_per_gpu_hour(spot=True) == pytest.approx(1.7025 / 16, rel=1e-12)


def test_a_user_catalog_replaces_a_price_and_adds_an_instance(tmp_path: Path) -> None:
    user = tmp_path / "prices.toml"
    user.write_text('''
[[instances]]
name = "gcp-h100-x8"
cloud = "GCP"
provider = "gcp-spot"
gpu = "h100"
gpus = 8
interconnect = "nvlink4"
network = "ib-ndr"
on_demand_usd_per_h = 88.0
spot_usd_per_h = 20.0
region = "us-central1"
date = "2026-11"
source = "quote"

[providers.lab-spot]
notice_s = 60
rate_per_h = 0.05
''')
    catalog = load_catalog(user)
    assert catalog.instances["gcp-h100-x8"].price_per_gpu_hour(spot=True) == 2.5
    assert catalog.provider("lab-spot").hazard_for("h100").rate(100.0) == 0.05
    assert "aws-p3.2xlarge" in catalog.instances


def test_a_bad_catalog_entry_names_the_key_and_the_valid_ones(tmp_path: Path) -> None:
    user = tmp_path / "bad.toml"
    user.write_text('[providers.x]\nnotice_s = 30\nwarning_s = 2\n')
    with pytest.raises(ValueError, match="unknown key 'warning_s'.*valid keys: name, notice_s"):
        load_catalog(user)
    user.write_text('[providers.x]\nnotice_s = -1\n')
    with pytest.raises(ValueError, match="notice_s must be a finite number >= 0"):
        load_catalog(user)
