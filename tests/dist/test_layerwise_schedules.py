"""Layerwise plans under the zero-bubble, interleaved, ZBV and DualPipeV schedules train like one
device, and every rank holds and sends what the cost model predicts.

A part of the 4-process ``world4`` job trains every layout below for three steps (llama-tiny,
pp 2 of two ranks each, layers under their own tp/dp/ZeRO inside each chunk) and writes losses,
gradient norms, final parameters and every rank's measured state of the first step. Each test then holds
a layout to the equivalence matrix's rule against the float64 one-device run
(tests/dist/test_layerwise_equivalence.py) and every rank's state to
cost/rank_state.py (within 2%).

- ``zb_pp2``: ZB-H1, one chunk per rank, a ZeRO-2 layer beside tp2 and ZeRO-0/1 ones in each
  stage (ZeRO-2 reduced once after the last weight-gradient pass);
- ``zb_pp2_tp_data``: ZB-H1 with the batch cut tp2 (dp 1), dp2 ZeRO-2 layers inside;
- ``interleaved_pp2_vpp2``: chunk c on rank c % 2, ZeRO-3 and ZeRO-2 layers (full backward);
- ``zbv_pp2``: rank r holds chunks r and 3 - r, the last chunk (head) on rank 0;
- ``dualpipev_pp2``: the same V under DualPipeV, the batch cut tp2;
- ``zbv_pp2_bf16``: the V under ZBV in bf16, layers at tp2 and ZeRO-0/1 dp2 (autocast in every
  layer), against the bf16 one-device run under autocast;
- ``dualpipev_pp2_bf16``: the V under DualPipeV in bf16 over a tp2 data layout, autocast in
  every layer, against the same run;
- ``zb_pp2_zero2_bf16``: ZB-H1 in bf16 with every layer ZeRO-2 over dp2 (FSDP2's
  MixedPrecisionPolicy in every layer, gradients accumulated over the step and reduce-scattered
  after the last weight pass), against the one-device run on bf16 parameters
  (``reference.py``'s ``bf16_params``).

A bf16 layout is held to the one-device run that computes as its layers do
(``bf16_expectation``): autocast where no layer runs under FSDP2's mixed precision, bf16
parameters where every layer does; the rows here are one or the other.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch

from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import LayerStrategy, Plan
from tests.dist.test_layerwise_equivalence import (
    SEED,
    TOLERANCE,
    WORLD,
    _expectation,
    _reports,
    batches,
)
from tests.helpers.harness import each_case, reported_run, state_gaps, train_and_report
from tests.helpers.oracle import (
    FLOOR_BF16,
    K_BF16,
    OPTIM,
    Expectation,
    bf16_not_shown,
    violations,
)
from tests.helpers.reference import deviation, reference_run
from tests.helpers.world import Part, part_folder

SEQ = 16


def _chunks(model: ModelSpec, chunks: list[list[tuple[int, int, int]]], **kw: object) -> Plan:
    """A plan of even chunks (``kw``: pp, vpp, schedule, batch), chunk c's layers under
    ``chunks[c]`` (tp, dp, zero)."""
    plan = Plan(model=model.name, seq_len=model.seq_len, dtype="fp32", **kw  # type: ignore[arg-type]
                ).with_even_stages(model)
    assert len(plan.stages) == len(chunks)
    return replace(plan, stages=tuple(
        replace(stage, layer_strategies=tuple(LayerStrategy(tp=t, dp=d, zero=z)
                                              for t, d, z in strategies))
        for stage, strategies in zip(plan.stages, chunks, strict=True)))


def layouts() -> dict[str, tuple[ModelSpec, Plan]]:
    llama = catalog_model("llama-tiny", seq_len=SEQ)  # embedding, 4 blocks, head
    batch = dict(micro_batch=1, num_microbatches=4, global_batch=8)
    return {
        "zb_pp2": (llama, _chunks(
            llama, [[(2, 1, 0), (1, 2, 2), (1, 2, 1)], [(1, 2, 2), (2, 1, 0), (1, 2, 0)]],
            pp=2, dp=2, schedule="zb", **batch)),
        "zb_pp2_tp_data": (llama, _chunks(
            llama, [[(1, 2, 2), (2, 1, 0), (1, 2, 0)], [(1, 2, 1), (1, 2, 2), (2, 1, 0)]],
            pp=2, tp=2, schedule="zb", micro_batch=2, num_microbatches=2, global_batch=4)),
        "interleaved_pp2_vpp2": (llama, _chunks(
            llama, [[(1, 2, 3), (2, 1, 0)], [(1, 2, 2)], [(2, 1, 0)], [(1, 2, 1), (2, 1, 0)]],
            pp=2, vpp=2, dp=2, schedule="interleaved", **batch)),
        "zbv_pp2": (llama, _chunks(
            llama, [[(2, 1, 0), (1, 2, 2)], [(1, 2, 1)], [(1, 2, 2)], [(1, 2, 0), (2, 1, 0)]],
            pp=2, vpp=2, dp=2, schedule="zbv", **batch)),
        "dualpipev_pp2": (llama, _chunks(
            llama, [[(1, 2, 2), (1, 2, 1)], [(2, 1, 0)], [(1, 2, 0)], [(2, 1, 0), (1, 2, 2)]],
            pp=2, vpp=2, tp=2, schedule="dualpipev", micro_batch=2, num_microbatches=4,
            global_batch=8)),
        "zbv_pp2_bf16": (llama, replace(_chunks(
            llama, [[(2, 1, 0), (1, 2, 1)], [(1, 2, 1)], [(2, 1, 0)], [(1, 2, 0), (2, 1, 0)]],
            pp=2, vpp=2, dp=2, schedule="zbv", **batch), dtype="bf16")),
        "dualpipev_pp2_bf16": (llama, replace(_chunks(
            llama, [[(1, 2, 1), (2, 1, 0)], [(2, 1, 0)], [(1, 2, 0)], [(2, 1, 0), (1, 2, 1)]],
            pp=2, vpp=2, tp=2, schedule="dualpipev", micro_batch=2, num_microbatches=4,
            global_batch=8), dtype="bf16")),
        "zb_pp2_zero2_bf16": (llama, replace(_chunks(
            llama, [[(1, 2, 2)] * 3, [(1, 2, 2)] * 3], pp=2, dp=2, schedule="zb", **batch),
            dtype="bf16")),
    }


def _fsdp_precision(plan: Plan) -> list[bool]:
    """For each layer, whether FSDP2's MixedPrecisionPolicy sets its compute dtype (ZeRO-2/3
    over dp > 1, as ``run.parallelize.uses_fsdp_precision``) rather than autocast."""
    return [s.dp > 1 and s.zero >= 2 for stage in plan.stages
            for s in stage.layer_strategies or ()]


def bf16_expectation(model: ModelSpec, plan: Plan) -> Expectation:
    """The bf16 one-device run computing as ``plan``'s layers do: under autocast where none runs
    under FSDP2's mixed precision, on bf16 parameters (``bf16_params``) where all do; a plan
    mixing the two has no one-device run that computes as it does, and is refused here."""
    fsdp = _fsdp_precision(plan)
    if any(fsdp) and not all(fsdp):
        raise ValueError("a bf16 plan mixing autocast and FSDP2 mixed-precision layers has no "
                         "exact one-device oracle; make it one or the other")
    precision = "bf16_params" if all(fsdp) else "bf16"
    data = batches(model, plan)
    fp64 = reference_run(model, OPTIM, data, seed=SEED, micro_batch=plan.micro_batch,
                         precision="fp64")
    bf16 = reference_run(model, OPTIM, data, seed=SEED, micro_batch=plan.micro_batch,
                         precision=precision)
    name = f"bf16 one-device ({'bf16 parameters' if all(fsdp) else 'autocast'})"
    return Expectation(bf16, name, fp64, deviation(bf16, fp64, OPTIM), K_BF16, FLOOR_BF16)


def expectation(model: ModelSpec, plan: Plan) -> Expectation:
    """fp32: the float64 one-device run (the layerwise matrix's rule); bf16: ``bf16_expectation``."""
    return bf16_expectation(model, plan) if plan.dtype == "bf16" else _expectation(model, plan)


def _train(model: ModelSpec, plan: Plan, out: Path, rank: int) -> None:
    from meshmorph.run.engine.train_engine import build_engine

    engine = build_engine(model, plan, OPTIM, seed=SEED, device=torch.device("cpu"))
    assert engine.summed  # every segment's data parallelism runs layer by layer
    assert len(engine.model_parts) == plan.vpp
    train_and_report(engine, plan, batches(model, plan), out, rank, state=True)


def schedules_part(rank: int, world_size: int, out: Path) -> None:
    """On every rank: every layout in turn, one process group."""
    each_case(rank, out, [(name, partial(_train, model, plan, rank=rank))
                          for name, (model, plan) in layouts().items()])


WORLD_PARTS = [Part("layerwise_schedules", schedules_part, world=WORLD, timeout_s=240)]


@pytest.fixture(scope="module")
def results(world4: Path) -> Path:
    return part_folder(world4, "layerwise_schedules")


@pytest.mark.dist
@pytest.mark.timeout(120, func_only=True)
@pytest.mark.parametrize("name", list(layouts()))
def test_schedule_plan_matches_one_device_within_measured_noise(name: str,
                                                                results: Path) -> None:
    model, plan = layouts()[name]
    run = reported_run(results / name, WORLD)
    assert len(run.params) == len(dict(_one_device_names(model))), \
        "a chunk's parameters are missing"
    truth = expectation(model, plan)
    found = violations(run, truth)
    if plan.dtype == "bf16":  # it must show bf16 rounding at all
        why = bf16_not_shown(run, truth)
        found += [why] if why else []
    assert not found, f"{name}: {len(found)} figures out of tolerance:\n" + "\n".join(found)


def _one_device_names(model: ModelSpec) -> list[tuple[str, None]]:
    from meshmorph.run.model.decoder import build_chunk

    chunk = build_chunk(model, 0, model.num_layers, seed=SEED, device="meta")
    return [(name, None) for name, _ in chunk.named_parameters()]


@pytest.mark.dist
@pytest.mark.timeout(120, func_only=True)
@pytest.mark.parametrize("name", list(layouts()))
def test_schedule_plan_state_matches_prediction_per_rank(name: str, results: Path) -> None:
    from meshmorph.cost.rank_state import predict_rank_state

    model, plan = layouts()[name]
    gaps = state_gaps([(rank, report["state"], predict_rank_state(model, plan, rank))
                       for rank, report in enumerate(_reports(results / name))], TOLERANCE)
    assert not gaps, "\n".join(gaps)
