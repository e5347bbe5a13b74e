"""Calibration against every published run (cost/calibration.py, bench/calibrate.py)."""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest

from meshmorph.cost import CostModel
from meshmorph.cost.calibration import (
    FIT_SPACE,
    FitSpace,
    coefficient,
    errors,
    fit,
    h100_500w,
    leave_one_out,
    predicted_tflops,
    published_oom_runs,
    published_runs,
)
from meshmorph.cost.coefficients import CostCoefficients
from meshmorph.spec.gpus import gpu
from meshmorph.spec.model import Recompute
from meshmorph.spec.transformer import TransformerShape, build_transformer

RUNS = published_runs()
MEGATRON = [run for run in RUNS if run.source != "torchtitan_runs.json"]
TORCHTITAN = [run for run in RUNS if run.source == "torchtitan_runs.json"]


def test_every_published_source_is_read_with_its_layout() -> None:
    assert len(RUNS) == 46
    assert (len(MEGATRON), len(TORCHTITAN), len(published_oom_runs())) == (32, 14, 2)
    assert {run.source for run in RUNS} == {"narayanan2021_table1.json",
                                             "megatron_readme_tables.json",
                                             "torchtitan_runs.json"}
    for run in RUNS:
        assert run.plan.tp * run.plan.pp * run.plan.dp == run.cluster.world_size, run.id
        assert run.plan.global_batch == run.plan.dp * run.plan.micro_batch * run.plan.num_microbatches


@pytest.mark.parametrize("run", RUNS, ids=[run.id for run in RUNS])
def test_runs_that_really_ran_are_never_predicted_out_of_memory(run) -> None:
    estimate = CostModel(run.model, run.cluster).estimate(run.plan)
    assert estimate.fits, (run.id, estimate.peak_memory_gib)


@pytest.mark.parametrize("run", published_oom_runs(), ids=[r.id for r in published_oom_runs()])
def test_runs_that_ran_out_of_memory_are_predicted_not_to_fit(run) -> None:
    estimate = CostModel(run.model, run.cluster).estimate(run.plan)
    assert not estimate.fits, (run.id, estimate.peak_memory_gib)


def test_torchtitan_h100_runs_use_the_500w_hbm2e_part_described_in_toml() -> None:
    part = h100_500w()
    assert (part.memory_gib, part.hbm_gbps, part.sm_count) == (96, 2400, 132)
    assert 835 < part.peak_tflops["bf16"] < gpu("h100").peak_tflops["bf16"]
    assert gpu("h100").memory_gib == 80  # the catalog's H100 is not bent to these runs
    h100 = [run for run in TORCHTITAN if "H100" in run.cluster.groups[0].gpu.description]
    assert len(h100) == 6 and all(run.cluster.groups[0].gpu == part for run in h100)


def test_torchtitan_runs_state_their_checkpointing_compile_and_async_tp() -> None:
    by_id = {run.id: run for run in TORCHTITAN}
    layer = by_id["tt-2404-llama3-8b-64xa100-fsdp64-sac-layer-bf16"].plan.recompute_of_layer()
    assert layer[1:33] == [Recompute.NONE, Recompute.FULL] * 16
    assert by_id["tt-2412-llama3-8b-8gpu-fsdp-bf16"].eager
    assert not by_id["tt-2412-llama3-8b-8gpu-fsdp-compile-bf16"].eager
    asynctp = by_id["tt-2506-asynctp-llama3-8b-64gpu-fsdp8-tp8-asynctp-compile-bf16"].plan
    assert (asynctp.tp, asynctp.dp, asynctp.zero, asynctp.tp_comm_overlap) == (8, 8, 3, True)
    # the published throughput is compared as the step's hardware FLOPs over its step time
    run = by_id["tt-2412-llama3-8b-8gpu-fsdp-bf16"]
    est = CostModel(run.model, run.cluster).estimate(run.plan)
    assert est.tokens_per_s / 8 / run.published_tokens_per_s_per_gpu == pytest.approx(
        est.tflops_per_gpu / run.published_tflops)


def test_per_op_selective_checkpointing_keeps_every_other_matmul() -> None:
    shape = TransformerShape(name="x", arch="llama", num_layers=2, hidden_size=512,
                             num_heads=8, num_kv_heads=2, ffn_hidden_size=1536, vocab_size=1024,
                             seq_len=256, selective="op")
    block = build_transformer(shape).layers[1]
    h, h_kv, f = 512, 128, 1536
    assert block.recompute_flops_per_token[Recompute.SELECTIVE] == 2.0 * (h * h_kv + h * h + h * f)
    kept = block.activation[Recompute.SELECTIVE]
    assert kept.shared + kept.split == 8 * h + 2 * h_kv + 2 * f
    spec = build_transformer(shape)
    assert TransformerShape.from_spec(spec, seq_len=128).selective == "op"
    with pytest.raises(ValueError, match="selective"):
        TransformerShape(name="x", arch="gpt", num_layers=2, hidden_size=512, num_heads=8,
                         vocab_size=1024, seq_len=256, selective="op")


def test_default_coefficients_within_15_percent_of_every_run_and_6_percent_on_average() -> None:
    # the shipped defaults are the Megatron-LM fit; torchtitan's runs need the fitted eager
    # passes and the 500 W H100's own ceiling (bench/calibrate.py)
    errs = errors(MEGATRON, CostCoefficients())
    worst = max(zip(errs, MEGATRON, strict=True), key=lambda pair: abs(pair[0]))
    assert abs(worst[0]) <= 0.15, (worst[1].id, worst[0])
    assert statistics.fmean(abs(e) for e in errs) <= 0.06


def _fake(truth: CostCoefficients):
    """Published figures made by the model itself with known coefficients."""
    small = [run for run in RUNS if run.plan.pp == 1]
    table = {run.id: predicted_tflops(run, truth) for run in small}
    return [replace(run, published_tflops=table[run.id]) for run in small]


def test_fit_recovers_the_coefficients_that_made_the_data() -> None:
    truth = replace(CostCoefficients(), matmul_efficiency=0.55, elementwise_passes=2.5,
                    link_efficiency=0.75, eager_elementwise_passes=9.0,
                    gpu_matmul_efficiency=(("h100-96g-hbm2e-500w", 0.5),))
    runs = _fake(truth)
    fitted = fit(runs, FIT_SPACE, CostCoefficients())
    for name in FIT_SPACE.names:
        assert coefficient(fitted, name) == pytest.approx(coefficient(truth, name), rel=0.03), name
    assert max(abs(e) for e in errors(runs, fitted)) < 1e-3


def test_leave_one_out_refits_without_the_run_it_predicts() -> None:
    runs = _fake(replace(CostCoefficients(), matmul_efficiency=0.5))[:4]
    # one run made 20% faster than the model can be: only its own fit can chase it
    runs[0] = replace(runs[0], published_tflops=runs[0].published_tflops * 1.2)
    space = FitSpace(names=("matmul_efficiency",), lower=(0.3,), upper=(1.0,))
    in_sample = errors(runs, fit(runs, space, CostCoefficients()))[0]
    loo = leave_one_out(runs, space, CostCoefficients())
    assert loo[0][0] == pytest.approx(1 / 1.2 - 1, abs=1e-3)  # fitted on the other three
    assert abs(loo[0][0]) > abs(in_sample)
    assert all(abs(err) < 0.2 for err, _ in loo[1:])
