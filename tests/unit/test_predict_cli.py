"""``meshmorph simulate`` and ``meshmorph advise`` run in-process: tables, JSON, charts, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshmorph.cli import main
from tests.unit.test_plan_cli import PNG_MAGIC, run_cli

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_simulate_prints_p10_p50_p90_per_policy_with_the_zones_used(tmp_path: Path) -> None:
    out_json, png = tmp_path / "sim.json", tmp_path / "sim.png"
    code, out, _ = run_cli(["simulate", "--model", "gpt3-125m", "--tokens", "2e10", "--cluster",
                            "h100:2x8", "--spot", "--zones", "auto", "--deadline", "24",
                            "--runs", "4", "--json", str(out_json), "--png", str(png)])
    assert code == 0
    data = json.loads(out_json.read_text())
    policies = data["policies"]
    # capacity mode (H100 on GCP): a zone's capacity takes every node, so reshape is left out
    assert set(policies) == {"restart", "multi-zone", "deadline", "on-demand"}
    restart, on_demand = policies["restart"]["fit"], policies["on-demand"]["fit"]
    for p in (10, 50, 90):
        assert f"time_h_p{p}" in restart and f"cost_usd_p{p}" in restart
    assert list(restart["zones"]) == [data["market"]["zones"][0]["zone"]]  # the best zone
    assert len(policies["multi-zone"]["zones"]) == 13
    assert restart["cost_usd_p50"] < 0.4 * on_demand["cost_usd_p50"]
    assert on_demand["preemptions_mean"] == 0.0 and on_demand["met_deadline"] == 1.0
    assert data["market"]["availability_source"] == "h100-gcp-2025-10"
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert "P10 / P50 / P90" in out and "zones used" in out and "capacity goes" in out


def test_simulate_replays_a_plain_trace_beside_the_fit_for_the_gpu_named(tmp_path: Path) -> None:
    trace = tmp_path / "zone-a" / "full.json"
    trace.parent.mkdir()
    trace.write_text(json.dumps({"metadata": {"gap_seconds": 600},
                                 "data": ([0] * 30 + [1] * 6) * 20}))
    out_json = tmp_path / "sim.json"
    code, out, _ = run_cli(["simulate", "--model", "gpt3-125m", "--tokens", "1e10", "--cluster",
                            "h100:2x8", "--spot", "--trace", str(trace), "--policy", "restart",
                            "--runs", "3", "--json", str(out_json)])
    assert code == 0, out
    data = json.loads(out_json.read_text())
    entry = data["policies"]["restart"]
    assert entry["trace"] is not None and entry["fit"]["runs"] == entry["trace"]["runs"] == 3
    assert [z["zone"] for z in data["market"]["zones"]] == ["zone-a"]
    assert "trace" in out and "fit" in out


def test_simulate_reads_a_cloud_cluster_file_with_its_provider_and_prices(tmp_path: Path) -> None:
    out_json = tmp_path / "sim.json"
    code, out, _ = run_cli(["simulate", "--model", "gpt3-125m", "--tokens", "2e9", "--cluster",
                            str(EXAMPLES / "clusters" / "cloud-a100-spot.toml"), "--spot",
                            "--policy", "restart", "--runs", "2", "--json", str(out_json)])
    assert code == 0, out
    data = json.loads(out_json.read_text())
    assert data["market"]["provider"] == "aws-spot"
    assert data["market"]["zones"][0]["spot_node_usd_per_h"] == 8 * 1.6  # the file's price
    # no A100 capacity data on AWS: the L4 run's zones stand in, and the output says so
    assert any("stands in" in note for note in data["market"]["notes"])


def test_simulate_refuses_an_unknown_zone_and_names_the_known_ones() -> None:
    code, _, err = run_cli(["simulate", "--model", "gpt3-125m", "--tokens", "2e9", "--cluster",
                            "h100:2x8", "--spot", "--zones", "us-moon1-a"])
    assert code == 2
    assert "unknown zone us-moon1-a for h100 on gcp-spot; known: asia-south2-b" in err


def test_simulate_names_the_trace_file_and_field_that_are_wrong(tmp_path: Path) -> None:
    bad = tmp_path / "full.json"
    bad.write_text(json.dumps({"metadata": {}, "data": [0, 1]}))
    code, _, err = run_cli(["simulate", "--model", "gpt3-125m", "--tokens", "2e9", "--cluster",
                            "h100:2x8", "--spot", "--trace", str(bad)])
    assert code == 2 and f"trace {bad}: metadata.gap_seconds: missing" in err


def test_advise_returns_a_pareto_front_with_policy_zones_and_plan(tmp_path: Path) -> None:
    out_json = tmp_path / "advise.json"
    code, out, _ = run_cli(["advise", "--model", "gpt3-125m", "--tokens", "2e9", "--runs", "2",
                            "--deadline", "5", "--json", str(out_json)])
    assert code == 0
    data = json.loads(out_json.read_text())
    front = data["pareto"]
    assert front
    for option in front:
        assert {"time_h", "cost_usd", "policy", "zones", "gpus", "plan"} <= set(option)
        assert option["plan"]["world_size"] == option["gpus"] and option["time_h_p90"] <= 5
    times = [o["time_h"] for o in front]
    costs = [o["cost_usd"] for o in front]
    assert times == sorted(times) and costs == sorted(costs, reverse=True)
    assert data["recommended"] in front and "recommended (*)" in out


def test_advise_refuses_an_impossible_deadline_with_a_way_out() -> None:
    code, _, err = run_cli(["advise", "--model", "gpt3-125m", "--tokens", "2e9", "--runs", "1",
                            "--deadline", "0.001"])
    assert code == 2
    assert "no option trains 2e+09 tokens of gpt3-125m within --deadline 0.001 h; raise " \
        "--deadline, or train fewer tokens" in err


def test_simulate_names_a_negative_seed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:  # argparse's own exit, usage line first
        main(["simulate", "--model", "gpt3-125m", "--tokens", "1e9", "--cluster", "h100:1x8",
              "--seed", "-5"])
    assert exited.value.code == 2
    assert "argument --seed: must be 0 or more, got -5" in capsys.readouterr().err
