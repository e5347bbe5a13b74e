"""GEMM efficiency by shape and dtype (cost/gemm.py) and the memory-bound term of a layer."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshmorph.cost import CostModel
from meshmorph.cost.coefficients import CostCoefficients
from meshmorph.cost.gemm import gemm_time, layer_efficiency, layer_gemms, wave_efficiency
from meshmorph.spec.cluster import parse_cluster
from meshmorph.spec.gpus import gpu
from meshmorph.spec.model import Recompute
from meshmorph.spec.plan import Plan
from meshmorph.spec.transformer import TransformerShape, build_transformer


def test_wave_efficiency_counts_the_idle_slots_of_the_last_wave() -> None:
    # 16 x 18 = 288 tiles of 128 on 108 SMs: 3 waves, 288 / 324 busy
    assert wave_efficiency(2048, 2304, 128, 108) == pytest.approx(288 / 324)
    assert wave_efficiency(2048, 6912, 128, 108) == pytest.approx(1.0)  # 864 = 8 full waves
    assert wave_efficiency(100, 100, 128, 108) == pytest.approx(1 / 108)  # one tile, one SM
    assert wave_efficiency(2048, 2304, 128, 0) == 1.0  # unknown SM count: no quantisation


def test_gemm_time_is_compute_bound_for_big_gemms_and_memory_bound_for_skinny_ones() -> None:
    a100 = gpu("a100-80g")
    big = gemm_time(8192, 8192, 8192, a100, "bf16", 2, 0.6, 128)  # 4096 tiles: 38 waves, 0.998
    assert big == pytest.approx(2 * 8192**3 / (312e12 * 0.6 * 4096 / (38 * 108)))
    # M = 1: a matrix-vector product reads the whole K x N weight at HBM speed
    skinny = gemm_time(1, 8192, 8192, a100, "bf16", 2, 0.6, 128)
    assert skinny == pytest.approx(2 * (8192 + 8192 * 8192 + 8192) / 2039e9)


def test_fp8_and_fp32_peaks_come_from_the_catalog() -> None:
    h100 = gpu("h100")
    times = {d: gemm_time(8192, 8192, 8192, h100, d, 2, 0.6, 128) for d in ("fp8", "bf16", "fp32")}
    assert times["bf16"] / times["fp8"] == pytest.approx(1978.9 / 989.4)
    assert times["fp32"] / times["bf16"] == pytest.approx(989.4 / 67.0)


def _gpt(hidden: int = 2304, heads: int = 24, seq: int = 2048, flash: bool = True):
    return build_transformer(TransformerShape(name="g", arch="gpt", num_layers=4,
                                              hidden_size=hidden, num_heads=heads,
                                              vocab_size=51200, seq_len=seq,
                                              flash_attention=flash))


def test_gpt_block_gemms_are_qkv_proj_fc1_fc2_split_by_tp() -> None:
    model = _gpt()
    block = model.layers[1]
    h = 2304
    assert layer_gemms(model, block, 1) == ((3 * h, h), (h, h), (4 * h, h), (h, 4 * h))
    assert layer_gemms(model, block, 2) == ((3 * h // 2, h), (h, h // 2), (2 * h, h), (h, 2 * h))
    assert layer_gemms(model, model.layers[0], 1) == ()  # embedding: a lookup, no GEMM


def test_layer_efficiency_never_exceeds_the_ceiling_and_drops_for_thin_tp_shards() -> None:
    model = _gpt(hidden=6144, heads=48)
    block, a100 = model.layers[1], gpu("a100-80g")
    effs = {tp: layer_efficiency(model, block, tp, 2048, a100, "fp16", 2, 0.63, 128)
            for tp in (1, 8)}
    assert all(e <= 0.63 + 1e-12 for e in effs.values())
    assert effs[8] < effs[1]


def test_a_flash_attention_core_does_its_causal_half_at_its_own_rate() -> None:
    flash, kept = _gpt(), _gpt(flash=False)
    a100, tokens, ceiling = gpu("a100-80g"), 2048, 0.63
    assert flash.layers[1].flash_attention and not kept.layers[1].flash_attention
    gemms = sum(gemm_time(tokens, n, k, a100, "bf16", 2, ceiling, 128)
                for n, k in layer_gemms(flash, flash.layers[1], 1))
    total = flash.layers[1].fwd_flops_per_token * tokens
    core = total - sum(2.0 * tokens * n * k for n, k in layer_gemms(flash, flash.layers[1], 1))
    peak = 312e12

    def seconds(model, share: float) -> float:  # type: ignore[no-untyped-def]
        eff = layer_efficiency(model, model.layers[1], 1, tokens, a100, "bf16", 2, ceiling, 128,
                               attention_efficiency=share)
        return total / (peak * eff)

    # scores kept: the whole s x s core at the ceiling, whatever the share
    assert seconds(kept, 0.65) == pytest.approx(gemms + core / (peak * ceiling))
    # flash: half the core's FLOPs at the share of the ceiling; 0.5 prices as the whole core did
    assert seconds(flash, 0.65) == pytest.approx(gemms + core / 2 / (peak * ceiling * 0.65))
    assert seconds(flash, 0.5) == pytest.approx(seconds(kept, 0.65))


def test_flash_attention_runs_faster_on_the_a100_than_on_hopper_relative_to_gemms() -> None:
    coef = CostCoefficients()
    shares = dict(coef.gpu_flash_attention_efficiency)
    assert shares["a100-80g"] > coef.flash_attention_efficiency  # FA2 near its GEMMs
    model = _gpt()
    costs = {}
    for name in ("a100-80g", "h100"):
        coster = CostModel(model, parse_cluster(f"{name}:1x1")).layer_coster("bf16")
        assert coster.attention_efficiency(name) == shares.get(name, 0.44)
        costs[name] = coster.layer(1, gpu(name), 1, 1, False, Recompute.NONE)
    assert costs["a100-80g"].fwd_s > costs["h100"].fwd_s  # and the H100 is still the faster part


def test_memory_bound_passes_add_time_proportional_to_saved_activations() -> None:
    model = _gpt()
    cluster = parse_cluster("a100-80g:1x1")
    plan = Plan(model="g", seq_len=2048, global_batch=1, micro_batch=1, num_microbatches=1,
                dtype="bf16").with_even_stages(model, Recompute.NONE)
    base = CostCoefficients(elementwise_passes=0.0)
    block = 1
    costs = {}
    for passes in (0.0, 3.0, 6.0):
        cost = CostModel(model, cluster, replace(base, elementwise_passes=passes))
        costs[passes] = cost.layer_coster("bf16").layer(block, cluster.groups[0].gpu, 1, 1, False,
                                                   Recompute.NONE)
    act = costs[0.0].activation_bytes  # bytes of this micro-batch, no recompute
    one_pass = act / 2039e9
    assert costs[3.0].fwd_s - costs[0.0].fwd_s == pytest.approx(one_pass)
    assert costs[3.0].bwd_s - costs[0.0].bwd_s == pytest.approx(2 * one_pass)
    assert costs[6.0].fwd_s - costs[0.0].fwd_s == pytest.approx(2 * one_pass)
    assert CostModel(model, cluster).estimate(plan).fits


def test_selective_recompute_repeats_only_the_attention_cores_memory_traffic() -> None:
    model = _gpt(flash=False)  # attention that keeps its scores: selective recompute drops them
    cluster = parse_cluster("a100-80g:1x1")
    coster = CostModel(model, cluster, CostCoefficients(elementwise_passes=3.0)).layer_coster("bf16")
    a100 = cluster.groups[0].gpu
    none, sel, full = (coster.layer(1, a100, 1, 1, False, r)
                       for r in (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL))
    dropped = none.activation_bytes - sel.activation_bytes  # the attention core's scores
    assert dropped > 0
    peak_eff = model.layers[1].recompute_flops_per_token[Recompute.SELECTIVE] * 2048
    # the recompute costs its FLOPs plus one memory pass over what selective did not keep
    assert sel.recompute_s > dropped / 2039e9
    assert sel.recompute_s - dropped / 2039e9 == pytest.approx(
        peak_eff / (312e12 * layer_efficiency(model, model.layers[1], 1, 2048, a100, "bf16", 2,
                                              0.63, 128)))
    assert full.recompute_s > sel.recompute_s
