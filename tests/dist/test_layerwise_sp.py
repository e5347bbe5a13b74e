"""Layerwise plans with sequence parallelism, and a tied embedding and head split across
pipeline stages, train like one device and hold and send exactly what the cost model predicts.

A part of the 4-process ``world4`` job trains every layout below for three steps (the harness of
tests/dist/test_layerwise_equivalence.py: each rank rebuilds its engine per layout and writes
losses, gradient norms, final parameters and its measured state of the first step); each test
then checks one layout against the float64 one-device run with the equivalence matrix's rule,
and every rank's state line against cost/rank_state.py byte for byte.

- ``llama_sp_tp124_mixed_zero``: sequence parallelism, data cut tp2 x dp2, layers at tp 1, 2 and
  4 (ZeRO 0 to 3, full and selective recompute): every kind of move between sequence-split
  layouts (tp 2 -> 4, 4 -> 1, 1 -> 2, 2 -> 1, 1 -> 4). llama-tiny's 2 kv heads do not split 4
  ways, so this one runs llama-tiny with 4 kv heads (``llama-tiny-mha``, the same shape
  otherwise);
- ``llama_sp_pp2_1f1b``: sequence parallelism on two 1F1B pipeline stages of two ranks, the
  hidden state handed over split along the sequence in the data layout (tp2);
- ``gpt_tied_pp2_1f1b``: gpt-tiny (tied embedding and head) on two 1F1B stages, both ends
  vocabulary-parallel at tp2 (two copies of one matrix, gradients summed over the pair);
- ``gpt_tied_pp2_gpipe_sp_zero3``: the same model under GPipe with sequence parallelism, both
  ends under ZeRO-3 over dp2 (each copy sharded by FSDP2 on its own stage);
- ``llama_sp_pp2_1f1b_bf16``: sequence parallelism on two 1F1B stages in bf16, layers at tp2 and
  ZeRO-0/1 dp2 (autocast in every layer; the all-to-alls move bf16 hidden states), against the
  bf16 one-device run under autocast;
- ``llama_sp_tp12_zero2_bf16``: sequence parallelism at pp 1 in bf16 with every layer under
  FSDP2's mixed precision (ZeRO-2 and ZeRO-3 at tp2 x dp2 and tp1 x dp4, a vocabulary-parallel
  embedding, the head at tp1), against the one-device run on bf16 parameters.

bf16 layouts are held to ``test_layerwise_schedules.bf16_expectation``.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch

from meshmorph.spec.catalog import MODEL_CATALOG, catalog_model
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan
from meshmorph.spec.transformer import build_transformer
from tests.dist.test_layerwise_equivalence import (
    SEQ,
    WORLD,
    _mixed,
    _mixed_stages,
    _reports,
    _train,
)
from tests.dist.test_layerwise_schedules import expectation
from tests.helpers.harness import each_case, reported_run, state_gaps
from tests.helpers.oracle import bf16_not_shown, violations
from tests.helpers.world import Part, part_folder


def layouts() -> dict[str, tuple[ModelSpec, Plan]]:
    gpt, llama = catalog_model("gpt-tiny", seq_len=SEQ), catalog_model("llama-tiny", seq_len=SEQ)
    mha = build_transformer(replace(MODEL_CATALOG["llama-tiny"], name="llama-tiny-mha",
                                    num_kv_heads=4)).with_seq_len(SEQ)
    return {
        "llama_sp_tp124_mixed_zero": (mha, _mixed(
            mha, [(2, 2, 1), (4, 1, 0), (1, 4, 2), (2, 2, 3), (1, 4, 1), (4, 1, 0)],
            ["none", "full", "none", "selective", "none", "none"],
            tp=2, dp=2, micro_batch=2, num_microbatches=2, global_batch=8,
            sequence_parallel=True)),
        "llama_sp_pp2_1f1b": (llama, _mixed_stages(
            llama, [[(2, 1, 0), (1, 2, 3), (2, 1, 0)], [(1, 2, 1), (2, 1, 0), (1, 2, 2)]],
            tp=2, schedule="1f1b", micro_batch=2, num_microbatches=4, global_batch=8,
            sequence_parallel=True)),
        "gpt_tied_pp2_1f1b": (gpt, _mixed_stages(
            gpt, [[(2, 1, 0), (1, 2, 1), (1, 2, 2)], [(1, 2, 3), (1, 2, 0), (2, 1, 0)]],
            dp=2, schedule="1f1b", micro_batch=1, num_microbatches=4, global_batch=8)),
        "gpt_tied_pp2_gpipe_sp_zero3": (gpt, _mixed_stages(
            gpt, [[(1, 2, 3), (2, 1, 0), (1, 2, 0)], [(2, 1, 0), (1, 2, 2), (1, 2, 3)]],
            tp=2, schedule="gpipe", micro_batch=2, num_microbatches=2, global_batch=4,
            sequence_parallel=True)),
        "llama_sp_pp2_1f1b_bf16": (llama, replace(_mixed_stages(
            llama, [[(2, 1, 0), (1, 2, 1), (2, 1, 0)], [(1, 2, 0), (2, 1, 0), (1, 2, 1)]],
            tp=2, schedule="1f1b", micro_batch=2, num_microbatches=4, global_batch=8,
            sequence_parallel=True), dtype="bf16")),
        "llama_sp_tp12_zero2_bf16": (llama, replace(_mixed(
            llama, [(2, 2, 2), (1, 4, 3), (2, 2, 2), (1, 4, 2), (2, 2, 3), (1, 4, 2)],
            tp=2, dp=2, micro_batch=2, num_microbatches=2, global_batch=8,
            sequence_parallel=True), dtype="bf16")),
    }


def sp_part(rank: int, world_size: int, out: Path) -> None:
    """On every rank: every layout in turn, one process group."""
    each_case(rank, out, [(name, partial(_train, model, plan, rank=rank))
                          for name, (model, plan) in layouts().items()])


WORLD_PARTS = [Part("layerwise_sp", sp_part, world=WORLD, timeout_s=240)]


@pytest.fixture(scope="module")
def results(world4: Path) -> Path:
    return part_folder(world4, "layerwise_sp")


def test_layouts_are_what_they_claim() -> None:
    """The layouts exercise what the module docstring says (sequence parallelism kept on, tied
    ends apart), and the runtime's rule accepts them."""
    from meshmorph.spec.runnable import layerwise_refusal

    for name, (model, plan) in layouts().items():
        assert layerwise_refusal(model, plan) is None, name
        assert plan.sequence_parallel == ("_sp_" in name), name
        assert (model.tied_embeddings and plan.pp > 1) == name.startswith("gpt_tied"), name
    tps = {s.tp for s in layouts()["llama_sp_tp124_mixed_zero"][1].stages[0]
           .layer_strategies or ()}
    assert tps == {1, 2, 4}


@pytest.mark.dist
@pytest.mark.timeout(120, func_only=True)
@pytest.mark.parametrize("name", list(layouts()))
def test_layerwise_sp_and_tied_plans_match_one_device(name: str, results: Path) -> None:
    model, plan = layouts()[name]
    run = reported_run(results / name, WORLD)
    params = run.params
    if model.tied_embeddings and plan.pp > 1:  # the head's copy holds the embedding's value
        assert torch.equal(params["head.out.weight"], params["embed.tok.weight"]), \
            f"{name}: the tied head's copy left the embedding"
    truth = expectation(model, plan)
    found = violations(run, truth)
    if plan.dtype == "bf16":  # it must show bf16 rounding at all
        why = bf16_not_shown(run, truth)
        found += [why] if why else []
    assert not found, f"{name}: {len(found)} figures out of tolerance:\n" + "\n".join(found)


@pytest.mark.dist
@pytest.mark.timeout(120, func_only=True)
@pytest.mark.parametrize("name", list(layouts()))
def test_layerwise_sp_and_tied_state_equals_prediction(name: str, results: Path) -> None:
    from meshmorph.cost.rank_state import predict_rank_state

    model, plan = layouts()[name]
    gaps = state_gaps([(rank, report["state"], predict_rank_state(model, plan, rank))
                       for rank, report in enumerate(_reports(results / name))], 0)
    assert not gaps, "\n".join(gaps)
