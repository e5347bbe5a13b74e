"""Profile: JSON round trip, the alpha-beta fit, and the cost model reading measured figures."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from meshmorph.cost import CostModel, Profile
from meshmorph.cost.profile import layer_key
from meshmorph.profile.alpha_beta import AlphaBeta, fit_alpha_beta, ring_link
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.cluster import parse_cluster
from meshmorph.spec.plan import Plan

MODEL = catalog_model("gpt-tiny")  # 6 layers: embedding, 4 blocks, head; seq 32


def _profile(micro_batch: int = 1, fwd_s: float = 0.010, bwd_s: float = 0.020) -> Profile:
    rows = {layer_key(MODEL.name, MODEL.seq_len, micro_batch, "fp32", i):
            {"fwd_s": fwd_s, "bwd_s": bwd_s, "spread": 0.1} for i in range(MODEL.num_layers)}
    return Profile(layer_times=rows, processes=2, cores=2, source="hand-made")


def _plan(**kw: object) -> Plan:
    base = dict(model=MODEL.name, seq_len=MODEL.seq_len, global_batch=4, micro_batch=1,
                num_microbatches=4, dtype="fp32")
    base.update(kw)
    return Plan(**base).with_even_stages(MODEL)  # type: ignore[arg-type]


def test_profile_round_trips_through_json_exactly(tmp_path: Path) -> None:
    profile = replace(_profile(), gemm_flops_per_s={"fp32:256x256x256": 5.5e10},
                      collectives={"all_reduce/2": {"alpha_s": 1e-4, "beta_s_per_byte": 2e-9,
                                                    "r2": 0.99}},
                      optimizer_s_per_param=3e-9, optimizer_fixed_s=1e-3, load_avg=1.5)
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == profile


def test_profile_with_an_unknown_key_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "p.json").write_text(json.dumps({"source": "x", "gemm_tflops": 1}))
    with pytest.raises(ValueError, match="unknown keys \\['gemm_tflops'\\]"):
        Profile.load(tmp_path / "p.json")


@pytest.mark.parametrize(("content", "problem"), [
    (b'{"source":', "is not valid JSON"), (b"\xb5\x00\xff", "is not text"),
    (b"[1, 2]", "must hold a JSON object, got list")])
def test_a_broken_profile_file_is_refused_naming_it_and_a_way_out(
        tmp_path: Path, content: bytes, problem: str) -> None:
    (tmp_path / "p.json").write_bytes(content)
    with pytest.raises(ValueError, match=f"profile file .*p.json {problem}.*meshmorph profile"):
        Profile.load(tmp_path / "p.json")


def test_alpha_beta_fit_recovers_alpha_and_beta_from_noisy_timings() -> None:
    rng = np.random.default_rng(0)
    sizes = np.repeat([4e3, 6.5e4, 1e6, 4e6, 1.6e7], 5)
    seconds = 2e-4 + 1e-9 * sizes
    seconds *= 1 + rng.normal(0, 0.01, sizes.shape)
    fit = fit_alpha_beta(sizes.tolist(), seconds.tolist())
    assert fit.alpha_s == pytest.approx(2e-4, rel=0.15)
    assert fit.beta_s_per_byte == pytest.approx(1e-9, rel=0.02)
    assert fit.r2 > 0.99


def test_alpha_beta_fit_needs_two_message_sizes() -> None:
    with pytest.raises(ValueError, match="two message sizes"):
        fit_alpha_beta([1e6, 1e6], [1e-3, 1.1e-3])


def test_ring_link_of_an_all_reduce_fit_reproduces_the_fitted_time() -> None:
    fit = AlphaBeta(alpha_s=6e-4, beta_s_per_byte=1.5e-9, r2=1.0)
    hop_s, bandwidth = ring_link("all_reduce", 4, fit)
    assert hop_s == pytest.approx(1e-4)  # 6e-4 / (2 * 3)
    assert bandwidth == pytest.approx(1.5 / 1.5e-9)  # 2 * 3 / 4 per 1.5e-9 s/B
    # the ring formula with these figures gives back the fitted line
    nbytes = 8e6
    ring = 2 * 3 * hop_s + 2 * 3 / 4 * nbytes / bandwidth
    assert ring == pytest.approx(fit.time_s(nbytes))


def test_cost_model_uses_the_profiled_layer_times_for_a_profiled_micro_batch() -> None:
    cluster = parse_cluster("cpu:1x1")
    est = CostModel(MODEL, cluster, profile=_profile()).estimate(_plan())
    # 4 micro-batches x 6 layers x (10 ms forward + 20 ms backward)
    assert est.breakdown_s["compute"] == pytest.approx(4 * 6 * 0.030)


def test_cost_model_divides_profiled_layer_times_by_tp() -> None:
    cluster = parse_cluster("cpu:1x2")
    profile = replace(_profile(), processes=1, cores=4)
    est = CostModel(MODEL, cluster, profile=profile).estimate(_plan(tp=2))
    assert est.breakdown_s["compute"] == pytest.approx(4 * 6 * 0.030 / 2)


def test_cost_model_falls_back_to_the_catalog_for_an_unprofiled_micro_batch() -> None:
    cluster = parse_cluster("cpu:1x1")
    plan = _plan(micro_batch=2, num_microbatches=2)
    with_profile = CostModel(MODEL, cluster, profile=_profile(micro_batch=1)).estimate(plan)
    catalog = CostModel(MODEL, cluster).estimate(plan)
    assert with_profile.breakdown_s["compute"] == catalog.breakdown_s["compute"]
    assert not _profile(micro_batch=1).covers(MODEL.name, MODEL.seq_len, 2, "fp32", MODEL.num_layers)


def test_cost_model_prices_dp_gradient_all_reduce_with_the_measured_fit() -> None:
    cluster = parse_cluster("cpu:1x2")
    fit = {"alpha_s": 1e-3, "beta_s_per_byte": 1e-9, "r2": 1.0}
    profile = replace(_profile(), collectives={"all_reduce/2": fit})
    est = CostModel(MODEL, cluster, profile=profile).estimate(_plan(dp=2, num_microbatches=2))
    grads_bytes = 4 * CostModel(MODEL, cluster).chunk_params(0, MODEL.num_layers, 1)  # fp32
    # gradient all-reduce + the loss and gradient-norm scalars, none hidden (2 processes, 2 cores)
    expected = 1e-3 + 1e-9 * grads_bytes + 2 * (1e-3 + 8e-9)
    assert est.breakdown_s["dp_comm_exposed"] == pytest.approx(expected, rel=1e-6)


def test_cost_model_uses_the_measured_optimizer_tail() -> None:
    cluster = parse_cluster("cpu:1x1")
    profile = replace(_profile(), optimizer_s_per_param=2e-9, optimizer_fixed_s=5e-3)
    est = CostModel(MODEL, cluster, profile=profile).estimate(_plan())
    params = CostModel(MODEL, cluster).chunk_params(0, MODEL.num_layers, 1)
    assert est.breakdown_s["optimizer"] == pytest.approx(5e-3 + 2e-9 * params)


def test_cost_model_prices_zero3_per_fsdp_unit_with_the_measured_fsdp_fits() -> None:
    # gpt-tiny: 4 blocks + the chunk's root = 5 FSDP2 units; ZeRO-3 gathers twice and
    # reduce-scatters once per unit and micro-batch, each call paying the fit's alpha
    cluster = parse_cluster("cpu:1x2")
    gather = {"alpha_s": 2e-3, "beta_s_per_byte": 3e-9, "r2": 1.0}
    scatter = {"alpha_s": 5e-3, "beta_s_per_byte": 7e-9, "r2": 1.0}
    profile = replace(_profile(), collectives={"fsdp_all_gather/2": gather,
                                               "fsdp_reduce_scatter/2": scatter})
    plan = _plan(dp=2, zero=3, num_microbatches=2, global_batch=4)
    est = CostModel(MODEL, cluster, profile=profile).estimate(plan)
    params = CostModel(MODEL, cluster).chunk_params(0, MODEL.num_layers, 1)
    per_microbatch = 2 * (5 * 2e-3 + 3e-9 * 4 * params) + (5 * 5e-3 + 7e-9 * 4 * params)
    assert est.breakdown_s["zero3_comm_exposed"] == pytest.approx(2 * per_microbatch, rel=1e-6)


def test_cost_model_prices_zero2_gather_once_per_step_and_scatter_per_microbatch() -> None:
    cluster = parse_cluster("cpu:1x2")
    gather = {"alpha_s": 2e-3, "beta_s_per_byte": 3e-9, "r2": 1.0}
    scatter = {"alpha_s": 5e-3, "beta_s_per_byte": 7e-9, "r2": 1.0}
    profile = replace(_profile(), collectives={"fsdp_all_gather/2": gather,
                                               "fsdp_reduce_scatter/2": scatter})
    plan = _plan(dp=2, zero=2, num_microbatches=2, global_batch=4)
    est = CostModel(MODEL, cluster, profile=profile).estimate(plan)
    params = CostModel(MODEL, cluster).chunk_params(0, MODEL.num_layers, 1)
    assert est.breakdown_s["zero3_comm_exposed"] == pytest.approx(
        2 * (5 * 5e-3 + 7e-9 * 4 * params), rel=1e-6)
    # the once-per-step gather of every unit sits in the tail (no scalar all-reduce fit given)
    assert est.breakdown_s["dp_comm_exposed"] == pytest.approx(5 * 2e-3 + 3e-9 * 4 * params,
                                                               rel=1e-6)


def test_without_fsdp_fits_zero3_keeps_the_plain_collective_fits() -> None:
    cluster = parse_cluster("cpu:1x2")
    fit = {"alpha_s": 1e-3, "beta_s_per_byte": 1e-9, "r2": 1.0}
    plain = replace(_profile(), collectives={"all_gather/2": fit, "reduce_scatter/2": fit})
    fsdp = replace(plain, collectives={**plain.collectives, "fsdp_all_gather/2": fit,
                                       "fsdp_reduce_scatter/2": fit})
    plan = _plan(dp=2, zero=3, num_microbatches=2, global_batch=4)
    a = CostModel(MODEL, cluster, profile=plain).estimate(plan).breakdown_s["zero3_comm_exposed"]
    b = CostModel(MODEL, cluster, profile=fsdp).estimate(plan).breakdown_s["zero3_comm_exposed"]
    # the plain path merges a unit's two gathers into one call: 5 fewer alphas per micro-batch
    assert b - a == pytest.approx(2 * 5 * 1e-3, rel=1e-6)
