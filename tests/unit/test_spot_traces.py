"""Recorded traces: the packaged ones, the plain full.json form with only its required keys, and
bad input that names the file and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshmorph.predict.availability import ZonePath, fit_zone, replayed_periods
from meshmorph.predict.traces import TraceError, load_trace


def write(path: Path, data: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def test_the_plain_form_needs_only_gap_seconds_and_data(tmp_path: Path) -> None:
    path = write(tmp_path / "my-zone-1" / "full.json",
                 {"metadata": {"gap_seconds": 300}, "data": [0, 0, 1, 1, 1, 0]})
    trace = load_trace(path)
    assert trace.tick_s == 300 and list(trace.zones) == ["my-zone-1"]  # zone from the folder
    zone = trace.zones["my-zone-1"]
    assert zone.states == (True, True, False, False, False, True)  # 1 = no capacity
    assert zone.spot_usd_per_h is None and trace.gpu == ""  # the simulated GPU is assumed


def test_zone_and_prices_are_read_where_present_and_a_folder_is_every_zone(tmp_path: Path) -> None:
    for zone, price in (("a-1", 10.0), ("b-1", 12.0)):
        write(tmp_path / f"{zone}_h100_16" / "full.json",
              {"metadata": {"gap_seconds": 600, "zone": zone,
                            "price_info": {"price": price, "on_demand_price": 80.0}},
               "data": [0, 1, 0, 0], "prices": [price, price + 2, price, price]})
    trace = load_trace(tmp_path)
    assert sorted(trace.zones) == ["a-1", "b-1"]
    assert trace.zones["a-1"].spot_usd_per_h == pytest.approx(10.5)  # the per-tick mean
    assert trace.zones["b-1"].on_demand_usd_per_h == 80.0


@pytest.mark.parametrize(("data", "field"), [
    ({"data": [0, 1]}, "metadata"),
    ({"metadata": {}, "data": [0, 1]}, "metadata.gap_seconds"),
    ({"metadata": {"gap_seconds": -5}, "data": [0]}, "metadata.gap_seconds"),
    ({"metadata": {"gap_seconds": 600}}, "data"),
    ({"metadata": {"gap_seconds": 600}, "data": []}, "data"),
    ({"metadata": {"gap_seconds": 600}, "data": [0, 2, 1]}, r"data\[1\]"),
    ({"metadata": {"gap_seconds": 600, "zone": 7}, "data": [0]}, "metadata.zone"),
    ([1, 2, 3], "top level"),
])
def test_bad_input_names_the_file_and_the_field(tmp_path: Path, data: object, field: str) -> None:
    path = write(tmp_path / "z" / "full.json", data)
    with pytest.raises(TraceError, match=rf"trace {path}: .*{field}"):
        load_trace(path)


def test_a_file_that_is_not_json_or_not_there_says_so(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TraceError, match=rf"trace {bad}: \(file\): not valid JSON"):
        load_trace(bad)
    with pytest.raises(FileNotFoundError, match="does not exist; give a trace file"):
        load_trace(tmp_path / "missing.json")


def test_the_packaged_h100_probes_hold_13_zones_of_2104_rounds_split_at_the_gap() -> None:
    trace = load_trace("h100-gcp-2025-10")
    assert (trace.tick_s, len(trace.zones), trace.gpu) == (600, 13, "h100")
    zone = trace.zones["us-central1-a"]
    assert len(zone.states) == 2104 and [len(s) for s in zone.segments()] == [746, 1358]
    # the reference README: at least 1 of 16 launched in 98% (us-central1-a) and 24% (us-west1-b)
    assert sum(zone.states) / 2104 == pytest.approx(0.98, abs=0.005)
    west = trace.zones["us-west1-b"].states
    assert sum(west) / len(west) == pytest.approx(0.24, abs=0.005)
    assert zone.spot_usd_per_h == pytest.approx(18.979) and zone.on_demand_usd_per_h == \
        pytest.approx(82.5254)


def test_a_replayed_path_reads_the_trace_from_its_offset_and_wraps() -> None:
    states = (True, True, False, True)
    path = ZonePath(replayed_periods(states, 600.0, 2))
    assert [path.up(t) for t in (0, 599, 600, 1199, 1200, 1800, 2400)] == \
        [False, False, True, True, True, True, False]
    assert path.next_change_s(0) == 600 and path.next_change_s(700) == 2400


def test_a_zone_fit_reproduces_the_share_it_was_fitted_to() -> None:
    trace = load_trace("h100-gcp-2025-10")
    for name in ("us-central1-b", "us-east4-a", "us-west1-b"):
        zone = trace.zones[name]
        fit = fit_zone(name, zone.segments(), trace.tick_s, trace.name, zone.counts)
        assert fit.share == pytest.approx(fit.observed_share, abs=0.04)
        assert fit.share_ci95[0] < fit.observed_share < fit.share_ci95[1]
        assert fit.at_least[1] == pytest.approx(fit.observed_share, abs=0.01)
