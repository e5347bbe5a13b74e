"""Layerwise plans (a tp/dp/ZeRO per layer) train like one device, and hold and send what the
cost model predicts.

One spawned 4-process gloo job trains every layout below for three steps (each rank rebuilds
its engine per layout) and writes losses, gradient norms, final parameters and every rank's
measured state of the first step; each test then checks one layout against the float64
one-device run with the equivalence matrix's rule (tests/dist/test_equivalence.py: every
figure within K x its one-device fp32 noise), and the example's state against
cost/layerwise_state.py (within 2%, per rank).

- ``example``: examples/plans/layerwise-gpt-small.json as committed (gpt-small, dp4 ->
  tp2 x dp2 -> ZeRO-3 dp4 -> dp4, one micro-batch);
- ``gpt_tp4_zero123_tied``: data cut tp2 x dp2, a tied embedding and head (one matrix) under
  ZeRO-1 dp4, then tp4 x dp1, ZeRO-1 tp2 x dp2, ZeRO-2 dp4, ZeRO-3 tp2 x dp2; two
  micro-batches;
- ``llama_gathers_tokens_and_labels``: data cut dp4, an untied tp2 x dp2 embedding (ZeRO-3) and
  head (tokens and labels all-gathered into their layout), ZeRO-3 tp2 x dp2, ZeRO-1 dp4, full
  recompute, ZeRO-2 tp2 x dp2 with selective recompute.
"""

from __future__ import annotations

import gc
import json
import traceback
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from reference import ReferenceRun, deviation, reference_run
from test_equivalence import FLOOR_FP32, K_FP32, OPTIM, Expectation, _worst, violations

from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.model import ModelSpec, Recompute
from meshmorph.spec.plan import LayerStrategy, Plan

WORLD = 4
STEPS = 3
SEED = 7
SEQ = 16
TOLERANCE = 0.02
"""The state line's measured vs predicted figures, per rank (as tests/dist/test_state_line.py)."""
EXAMPLE = Path(__file__).parents[2] / "examples" / "plans" / "layerwise-gpt-small.json"


def _mixed(model: ModelSpec, strategies: list[tuple[int, int, int]], recompute: list[str] | None
           = None, **kw: object) -> Plan:
    plan = Plan(model=model.name, seq_len=model.seq_len, dtype="fp32", **kw).with_even_stages(model)  # type: ignore[arg-type]
    stage = plan.stages[0]
    modes = tuple(Recompute(r) for r in recompute) if recompute else stage.recompute
    return replace(plan, stages=(replace(stage, recompute=modes, layer_strategies=tuple(
        LayerStrategy(tp=t, dp=d, zero=z) for t, d, z in strategies)),))


def layouts() -> dict[str, tuple[ModelSpec, Plan]]:
    gpt, llama = catalog_model("gpt-tiny", seq_len=SEQ), catalog_model("llama-tiny", seq_len=SEQ)
    return {
        "example": (catalog_model("gpt-small"), Plan.load(EXAMPLE)),
        "gpt_tp4_zero123_tied": (gpt, _mixed(
            gpt, [(1, 4, 1), (4, 1, 0), (2, 2, 1), (1, 4, 2), (2, 2, 3), (1, 4, 1)],
            tp=2, dp=2, micro_batch=2, num_microbatches=2, global_batch=8)),
        "llama_gathers_tokens_and_labels": (llama, _mixed(
            llama, [(2, 2, 3), (2, 2, 3), (1, 4, 1), (1, 4, 0), (2, 2, 2), (2, 2, 0)],
            ["none", "none", "none", "full", "selective", "none"],
            dp=4, micro_batch=1, num_microbatches=2, global_batch=8)),
    }


def batches(model: ModelSpec, plan: Plan) -> list[torch.Tensor]:
    """STEPS global batches of tokens, LongTensor[global_batch, s + 1]."""
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(0, model.vocab_size, (plan.global_batch, model.seq_len + 1),
                          generator=gen) for _ in range(STEPS)]


def _train(model: ModelSpec, plan: Plan, out: Path, rank: int) -> None:
    from torch.distributed.tensor import DTensor

    from meshmorph.run import state_line
    from meshmorph.run.engine import build_engine
    from meshmorph.run.layerwise_engine import LayerwiseEngine

    engine = build_engine(model, plan, OPTIM, seed=SEED, device=torch.device("cpu"))
    assert isinstance(engine, LayerwiseEngine)
    share = plan.global_batch // plan.dp
    losses, norms = [], []
    for batch in batches(model, plan):
        losses.append(engine.step(batch[engine.dp_rank * share:(engine.dp_rank + 1) * share]))
        norms.append(engine.grad_norm_last())
    params = {}
    for name, param in engine.model_parts[0].named_parameters(remove_duplicate=False):
        full = param.full_tensor() if isinstance(param, DTensor) else param
        params[name] = full.detach().clone()
    if rank == 0:
        torch.save(params, out / "params.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(
        {"losses": losses, "grad_norms": norms, "state": state_line.measured_state(engine)}))


def job(rank: int, world_size: int, result_dir: str) -> None:
    """Spawned on every rank: every layout in turn, one process group."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    for name, (model, plan) in layouts().items():
        out = Path(result_dir) / name
        out.mkdir(parents=True, exist_ok=True)
        try:
            _train(model, plan, out, rank)
        except Exception:
            (out / f"error{rank}.txt").write_text(traceback.format_exc())
            print(f"rank {rank} layout {name} failed:\n{traceback.format_exc()}", flush=True)
        gc.collect()
        dist.barrier()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from spawn import spawn

    torch.set_num_threads(1)
    result_dir = tmp_path_factory.mktemp("layerwise")
    spawn(job, WORLD, (str(result_dir),), timeout_s=400, collective_timeout_s=60)
    return result_dir


def _reports(out: Path) -> list[dict]:
    errors = sorted(out.glob("error*.txt"))
    assert not errors, "\n".join(e.read_text() for e in errors)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _expectation(model: ModelSpec, plan: Plan) -> Expectation:
    data = batches(model, plan)
    fp64 = reference_run(model, OPTIM, data, seed=SEED, micro_batch=plan.micro_batch,
                         precision="fp64")
    fp32 = [reference_run(model, OPTIM, data, seed=SEED, micro_batch=mb, precision="fp32")
            for mb in sorted({1, plan.micro_batch, plan.global_batch})]
    return Expectation(fp64, "fp64 one-device", fp64,
                       _worst([deviation(run, fp64, OPTIM) for run in fp32]), K_FP32, FLOOR_FP32)


@pytest.mark.dist
@pytest.mark.timeout(480)
@pytest.mark.parametrize("name", list(layouts()))
def test_layerwise_plan_matches_one_device_within_measured_noise(name: str,
                                                                 results: Path) -> None:
    model, plan = layouts()[name]
    reports = _reports(results / name)
    for rank, report in enumerate(reports):  # every rank returns the same loss and norm
        assert report["losses"] == reports[0]["losses"], f"rank {rank} reports other losses"
        assert report["grad_norms"] == reports[0]["grad_norms"], f"rank {rank}: other norms"
    run = ReferenceRun(tuple(reports[0]["losses"]), tuple(reports[0]["grad_norms"]),
                       torch.load(results / name / "params.pt"))
    found = violations(run, _expectation(model, plan))
    assert not found, f"{name}: {len(found)} figures out of tolerance:\n" + "\n".join(found)


@pytest.mark.dist
@pytest.mark.timeout(480)
@pytest.mark.parametrize("name", list(layouts()))
def test_layerwise_state_matches_prediction_per_rank(name: str, results: Path) -> None:
    from meshmorph.cost.layerwise_state import predict_layerwise_rank_state

    model, plan = layouts()[name]
    gaps = []
    for rank, report in enumerate(_reports(results / name)):
        measured = report["state"]
        predicted = predict_layerwise_rank_state(model, plan, rank)
        pairs = [(key, measured[key], predicted[key])
                 for key in ("params_bytes", "grads_bytes", "optimizer_bytes")]
        pairs += [(kind, measured["comm_bytes"].get(kind, 0), predicted["comm_bytes"][kind])
                  for kind in predicted["comm_bytes"]]
        pairs += [(kind, sent, 0) for kind, sent in measured["comm_bytes"].items()
                  if kind not in predicted["comm_bytes"]]
        for key, got, want in pairs:
            if abs(got - want) > TOLERANCE * max(abs(want), 1):
                gaps.append(f"rank {rank} {key}: measured {got:,} vs predicted {want:,.0f}")
    assert not gaps, "\n".join(gaps)
