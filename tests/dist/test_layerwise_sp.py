"""Layerwise plans with sequence parallelism, and a tied embedding and head split across
pipeline stages, train like one device and hold and send exactly what the cost model predicts.

One spawned 4-process gloo job trains every layout below for three steps (the harness of
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

import gc
import traceback
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch
from reference import ReferenceRun
from test_equivalence import bf16_not_shown, violations
from test_layerwise_equivalence import (
    SEQ,
    WORLD,
    _mixed,
    _mixed_stages,
    _reports,
    _train,
)
from test_layerwise_schedules import expectation

from meshmorph.spec.catalog import MODEL_CATALOG, catalog_model
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan
from meshmorph.spec.transformer import build_transformer


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


def job(rank: int, world_size: int, result_dir: str) -> None:
    """Spawned on every rank: every layout in turn, one process group."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    for name, (model, plan) in layouts().items():
        out = Path(result_dir) / name
        out.mkdir(parents=True, exist_ok=True)
        try:
            partial(_train, model, plan)(out, rank)
        except Exception:
            (out / f"error{rank}.txt").write_text(traceback.format_exc())
            print(f"rank {rank} layout {name} failed:\n{traceback.format_exc()}", flush=True)
        gc.collect()
        dist.barrier()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from spawn import spawn

    torch.set_num_threads(1)
    result_dir = tmp_path_factory.mktemp("layerwise_sp")
    spawn(job, WORLD, (str(result_dir),), timeout_s=300, collective_timeout_s=60)
    return result_dir


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
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(layouts()))
def test_layerwise_sp_and_tied_plans_match_one_device(name: str, results: Path) -> None:
    model, plan = layouts()[name]
    reports = _reports(results / name)
    for rank, report in enumerate(reports):  # every rank returns the same loss and norm
        assert report["losses"] == reports[0]["losses"], f"rank {rank} reports other losses"
        assert report["grad_norms"] == reports[0]["grad_norms"], f"rank {rank}: other norms"
    params: dict[str, torch.Tensor] = {}
    for path in sorted((results / name).glob("params_pp*.pt")):
        params.update(torch.load(path))
    if model.tied_embeddings and plan.pp > 1:  # the head's copy holds the embedding's value
        assert torch.equal(params["head.out.weight"], params["embed.tok.weight"]), \
            f"{name}: the tied head's copy left the embedding"
    run = ReferenceRun(tuple(reports[0]["losses"]), tuple(reports[0]["grad_norms"]), params)
    truth = expectation(model, plan)
    found = violations(run, truth)
    if plan.dtype == "bf16":  # it must show bf16 rounding at all
        why = bf16_not_shown(run, truth)
        found += [why] if why else []
    assert not found, f"{name}: {len(found)} figures out of tolerance:\n" + "\n".join(found)


@pytest.mark.dist
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(layouts()))
def test_layerwise_sp_and_tied_state_equals_prediction(name: str, results: Path) -> None:
    from meshmorph.cost.rank_state import predict_rank_state

    model, plan = layouts()[name]
    gaps = []
    for rank, report in enumerate(_reports(results / name)):
        measured = report["state"]
        predicted = predict_rank_state(model, plan, rank)
        pairs = [(key, measured[key], predicted[key])
                 for key in ("params_bytes", "grads_bytes", "optimizer_bytes")]
        kinds = set(predicted["comm_bytes"]) | set(measured["comm_bytes"])
        pairs += [(kind, measured["comm_bytes"].get(kind, 0), predicted["comm_bytes"].get(kind, 0))
                  for kind in sorted(kinds)]
        gaps += [f"rank {rank} {key}: measured {got:,} vs predicted {want:,.0f}"
                 for key, got, want in pairs if got != want]
    assert not gaps, "\n".join(gaps)
