"""The cost model's terms against hand-computed values of the published formulas.

ZeRO model states (Rajbhandari et al. 2020), activation bytes per layer (Korthikanti et al. 2022,
Table 2), micro-batches in flight per schedule, ring collectives in the alpha-beta model, and
model / hardware FLOPs per token (Narayanan et al. 2021).
"""

from __future__ import annotations

import pytest

from meshmorph.cost import comm
from meshmorph.cost.model import CostModel
from meshmorph.cost.rank_terms import in_flight_microbatches
from meshmorph.schedule.table import Schedule
from meshmorph.spec.cluster import parse_cluster
from meshmorph.spec.gpus import gpu
from meshmorph.spec.model import Recompute
from meshmorph.spec.plan import Plan
from meshmorph.spec.transformer import TransformerShape, build_transformer

# Korthikanti's block: attention that keeps its scores, with dropout (as Megatron-LM 2021 ran)
GPT = build_transformer(TransformerShape(name="gpt-1k", arch="gpt", num_layers=4, hidden_size=1024,
                                         num_heads=16, vocab_size=50304, seq_len=2048,
                                         flash_attention=False, dropout=True, runtime=False))
A100 = gpu("a100-80g")


def _model_states(zero: int, d: int, dtype: str = "bf16") -> tuple[float, float]:
    """(params + grads + optimizer bytes, parameters) of the only rank of a one-stage plan."""
    cost = CostModel(GPT, parse_cluster("a100-80g:8x8"))
    plan = Plan(model="gpt-1k", seq_len=2048, global_batch=d, dp=d, zero=zero, dtype=dtype) \
        .with_even_stages(GPT)
    stage = plan.stages[0]
    memory = cost.rank_memory(plan, 0, [(stage.start, stage.stop, stage.recompute)], A100)
    return memory.params + memory.grads + memory.optimizer, float(GPT.num_params)


@pytest.mark.parametrize("zero,bytes_per_param", [
    (0, lambda d: 16.0),                 # DDP: fp32 master 4 + fp32 grad 4 + Adam m, v 8
    (1, lambda d: 2.0 + 16.0 / d),       # ZeRO-1 at the end of backward: gradients reduce-scattered
    (2, lambda d: 2.0 + 16.0 / d),       # ZeRO-2: grads and masters sharded; a bf16 copy stays whole
    (3, lambda d: 16.0 / d),             # ZeRO-3 everything
])
@pytest.mark.parametrize("d", [1, 8, 64])
def test_zero_model_state_bytes_per_parameter_as_the_runtime_holds_them(
        zero: int, bytes_per_param, d: int) -> None:  # type: ignore[no-untyped-def]
    states, psi = _model_states(zero, d)
    expected = bytes_per_param(d if zero else 1) * psi if d > 1 else 16.0 * psi
    assert states == pytest.approx(expected, rel=1e-12)


def _peak_states(zero: int, d: int, dtype: str = "bf16", reduce_dtype: str = "fp32") -> float:
    """Model-state bytes per parameter at their peak (``CostModel.held``: the states plus the
    transient bytes between micro-batches)."""
    plan = Plan(model="gpt-1k", seq_len=2048, global_batch=d * 2, dp=d, zero=zero, dtype=dtype,
                reduce_dtype=reduce_dtype, num_microbatches=2).with_even_stages(GPT)
    return CostModel.held(plan).at_peak


@pytest.mark.parametrize("d", [2, 8, 64])
def test_bf16_zero1_peaks_at_megatrons_distributed_optimizer_6_plus_12_over_d(d: int) -> None:
    # Megatron-LM's distributed optimizer: bf16 parameters 2 and fp32 gradient buffer 4 whole,
    # fp32 master and moments 12 sharded; a bf16 reduction keeps a 2-byte gradient buffer
    assert _peak_states(1, d) == pytest.approx(6.0 + 12.0 / d, rel=1e-12)
    assert _peak_states(1, d, reduce_dtype="bf16") == pytest.approx(4.0 + 12.0 / d, rel=1e-12)
    assert _peak_states(1, d, dtype="fp32") == pytest.approx(8.0 + 12.0 / d, rel=1e-12)


def test_zero_paper_7_5b_on_64_gpus_with_fp32_masters_is_120_46_17_2_gb() -> None:
    # the ZeRO paper's 120 / 31.4 / 16.6 / 1.9 GB keep 16-bit weights and gradients whole; with
    # fp32 masters (what torch runs) ZeRO-1 holds a bf16 working copy and whole fp32 gradients
    # at its peak, ZeRO-2 a bf16 working copy, ZeRO-0 and 3 the same
    gb = [round(_peak_states(zero, 64) * 7.5, 1) for zero in (0, 1, 2, 3)]
    assert gb == [135.0, 46.4, 16.9, 1.9]


def test_fp32_and_bf16_plans_hold_the_same_fp32_state_without_data_parallelism() -> None:
    for dtype in ("fp32", "bf16"):
        states, psi = _model_states(0, 1, dtype=dtype)
        assert states == pytest.approx(16.0 * psi, rel=1e-12)


# --- activations: Korthikanti et al. 2022, Table 2 (s b h per layer, 16-bit, FFN = 4h) ---------
S, B, H, A, T = 2048, 2, 1024, 16, 4


def _block_activation(tp: int, sp: bool, mode: Recompute, dtype: str = "bf16") -> float:
    coster = CostModel(GPT, parse_cluster("a100-80g:1x8")).layer_coster(dtype)
    return coster.layer(1, A100, B, tp, sp, mode).activation_bytes


@pytest.mark.parametrize("tp,sp,mode,expected", [
    (1, False, Recompute.NONE, S * B * H * (34 + 5 * A * S / H)),
    (T, False, Recompute.NONE, S * B * H * (10 + 24 / T + 5 * A * S / (H * T))),
    (T, True, Recompute.NONE, S * B * H / T * (34 + 5 * A * S / H)),
    (T, False, Recompute.SELECTIVE, S * B * H * (10 + 24 / T)),
    (T, True, Recompute.SELECTIVE, 34 * S * B * H / T),
    (1, False, Recompute.FULL, 2 * S * B * H),
    (T, False, Recompute.FULL, 2 * S * B * H),
    (T, True, Recompute.FULL, 2 * S * B * H / T),
], ids=["none", "tp", "tp-sp", "tp-selective", "tp-sp-selective", "full", "tp-full", "tp-sp-full"])
def test_block_activation_bytes_match_korthikanti_table_2(tp: int, sp: bool, mode: Recompute,
                                                          expected: float) -> None:
    assert _block_activation(tp, sp, mode) == pytest.approx(expected, rel=1e-12)


def test_fp32_activations_are_twice_the_16_bit_ones() -> None:
    assert _block_activation(1, False, Recompute.NONE, "fp32") == 2 * S * B * H * (34 + 5 * A * S / H)


def test_full_recompute_working_set_is_one_layer_without_recompute_minus_its_input() -> None:
    coster = CostModel(GPT, parse_cluster("a100-80g:1x8")).layer_coster("bf16")
    cost = coster.layer(1, A100, B, 1, False, Recompute.FULL)
    assert cost.working_bytes == pytest.approx(S * B * H * (34 + 5 * A * S / H) - 2 * S * B * H)


@pytest.mark.parametrize("p,k,m,v,expected", [
    (4, 0, 8, 1, 4.0), (4, 3, 8, 1, 1.0), (8, 2, 16, 1, 6.0), (4, 0, 2, 1, 2.0),  # 1F1B: p - k
])
def test_one_f_one_b_stage_k_holds_p_minus_k_micro_batches(p: int, k: int, m: int, v: int,
                                                          expected: float) -> None:
    assert in_flight_microbatches(Schedule.ONE_F_ONE_B, p, k, m, v) == expected


def test_gpipe_holds_all_m_micro_batches_and_no_pipeline_holds_one() -> None:
    assert in_flight_microbatches(Schedule.GPIPE, 4, 2, 12, 1) == 12.0
    assert in_flight_microbatches(Schedule.ONE_F_ONE_B, 1, 0, 12, 1) == 1.0
    assert in_flight_microbatches(Schedule.ZERO_BUBBLE, 4, 3, 12, 1) == 4.0


@pytest.mark.parametrize("p,v", [(2, 2), (4, 2), (4, 3), (8, 4)])
def test_interleaved_rank_0_holds_p_plus_p_minus_1_over_v(p: int, v: int) -> None:
    assert in_flight_microbatches(Schedule.INTERLEAVED, p, 0, 4 * p, v) == pytest.approx(
        p + (p - 1) / v, rel=1e-12)


def test_rank_memory_multiplies_layer_activations_by_micro_batches_in_flight() -> None:
    cost = CostModel(GPT, parse_cluster("a100-80g:1x8"))
    plan = Plan(model="gpt-1k", seq_len=2048, global_batch=16, pp=4, micro_batch=2,
                num_microbatches=8).with_even_stages(GPT, Recompute.SELECTIVE)
    stage = plan.stages[1]  # one block; rank 1 holds p - 1 = 3 micro-batches
    memory = cost.rank_memory(plan, 1, [(stage.start, stage.stop, stage.recompute)], A100)
    per_block = S * B * H * (10 + 24)  # selective, tp 1; plus the 5as working set of its backward
    assert stage.stop - stage.start == 1
    assert memory.in_flight_microbatches == 3.0
    assert memory.activations == pytest.approx(3 * per_block + 5 * A * S * S * B, rel=1e-12)


# --- collectives: ring algorithms, alpha-beta ---------------------------------------------------
LINK = comm.Link(latency_s=5e-6, bandwidth_bps=200e9)
M = 256e6


@pytest.mark.parametrize("n", [2, 4, 8, 64])
def test_ring_collectives_match_alpha_beta_formulas(n: int) -> None:
    alpha, beta = LINK.latency_s, LINK.bandwidth_bps
    assert comm.all_reduce(n, M, LINK) == pytest.approx(2 * (n - 1) * alpha + 2 * (n - 1) / n * M / beta,
                                                        rel=1e-12)
    assert comm.reduce_scatter(n, M, LINK) == pytest.approx((n - 1) * alpha + (n - 1) / n * M / beta,
                                                            rel=1e-12)
    assert comm.all_gather(n, M, LINK) == pytest.approx((n - 1) * alpha + (n - 1) / n * M / beta,
                                                        rel=1e-12)
    assert comm.all_reduce(n, M, LINK) == pytest.approx(
        comm.reduce_scatter(n, M, LINK) + comm.all_gather(n, M, LINK), rel=1e-12)


def test_point_to_point_is_alpha_plus_m_over_beta_and_one_rank_costs_nothing() -> None:
    assert comm.p2p(M, LINK) == pytest.approx(5e-6 + 256e6 / 200e9, rel=1e-12)
    assert comm.all_reduce(1, M, LINK) == 0.0
    assert comm.reduce_scatter(8, 0.0, LINK) == 0.0
    assert comm.p2p(0.0, LINK) == 0.0


def test_link_from_catalog_applies_efficiency_and_microseconds() -> None:
    from meshmorph.spec.gpus import link

    nvlink = comm.Link.from_spec(link("nvlink3"), 0.7)
    assert nvlink.latency_s == pytest.approx(5e-6)
    assert nvlink.bandwidth_bps == pytest.approx(300e9 * 0.7)


def test_exposed_communication_hides_at_most_the_overlap_share_and_the_compute() -> None:
    assert comm.overlapped([(10.0, 0.8)], 100.0, 0.0) == pytest.approx(2.0)  # overlap-limited
    assert comm.overlapped([(10.0, 0.8)], 3.0, 0.0) == pytest.approx(7.0)  # compute-limited
    assert comm.overlapped([(10.0, 0.0)], 100.0, 0.0) == 10.0


# --- FLOPs: Narayanan et al. 2021 ---------------------------------------------------------------
def test_model_flops_per_token_is_narayanan_72_b_s_l_h2() -> None:
    L, h, s, V = 4, 1024, 2048, 50304
    # 72 B s L h^2 (1 + s/(6h) + V/(12 L h)) per B*s tokens
    expected = 72 * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
    assert GPT.model_flops_per_token() == pytest.approx(expected, rel=1e-12)


def test_hardware_flops_with_full_recompute_are_narayanan_96_b_s_l_h2() -> None:
    L, h, s, V = 4, 1024, 2048, 50304
    cost = CostModel(GPT, parse_cluster("a100-80g:1x8"))
    plan = Plan(model="gpt-1k", seq_len=s, global_batch=8, dp=8).with_even_stages(GPT, Recompute.FULL)
    estimate = cost.estimate(plan)
    hw_flops = estimate.tflops_per_gpu * 1e12 * estimate.step_time_s * plan.world_size
    model_flops = estimate.model_tflops_per_gpu * 1e12 * estimate.step_time_s * plan.world_size
    tokens = 8 * s
    assert hw_flops == pytest.approx(96 * tokens * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h)),
                                     rel=1e-12)
    assert model_flops == pytest.approx(72 * tokens * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h)),
                                        rel=1e-12)
    assert estimate.mfu == pytest.approx(model_flops / estimate.step_time_s / (8 * 312e12), rel=1e-12)


def test_gpt_parameters_follow_narayanan_plus_the_final_layer_norm() -> None:
    L, h, s, V = 128, 25600, 2048, 51200
    model = build_transformer(TransformerShape(name="1T", arch="gpt", num_layers=L, hidden_size=h,
                                               num_heads=160, vocab_size=V, seq_len=s))
    # 12 L h^2 (1 + 13/(12h) + (V + s)/(12 L h)), plus the final LayerNorm's 2h
    narayanan = 12 * L * h**2 + 13 * L * h + (V + s) * h
    assert model.num_params == narayanan + 2 * h
    assert round(model.num_params / 1e9, 1) == 1008.0
