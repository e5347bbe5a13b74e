"""Layerwise plans (a tp/dp/ZeRO per layer) train like one device, and hold and send what the
cost model predicts.

A part of the 4-process ``world4`` job trains every layout below for three steps (each rank
rebuilds its engine per layout) and writes losses, gradient norms, final parameters and every rank's
measured state of the first step; each test then checks one layout against the float64
one-device run with the equivalence matrix's rule (tests/dist/test_equivalence.py: every
figure within K x its one-device fp32 noise), and the example's state against
cost/rank_state.py (within 2%, per rank).

- ``example``: examples/plans/layerwise-gpt-small.json as committed (gpt-small, dp4 ->
  tp2 x dp2 -> ZeRO-3 dp4 -> dp4, one micro-batch);
- ``gpt_tp4_zero123_tied``: data cut tp2 x dp2, a tied embedding and head (one matrix) under
  ZeRO-1 dp4, then tp4 x dp1, ZeRO-1 tp2 x dp2, ZeRO-2 dp4, ZeRO-3 tp2 x dp2; two
  micro-batches;
- ``llama_gathers_tokens_and_labels``: data cut dp4, an untied tp2 x dp2 embedding (ZeRO-3) and
  head (tokens and labels all-gathered into their layout), ZeRO-3 tp2 x dp2, ZeRO-1 dp4, full
  recompute, ZeRO-2 tp2 x dp2 with selective recompute;
- ``llama_pp2_1f1b_mixed_stages``, ``llama_pp2_gpipe_tp_data``: two pipeline stages of 2 ranks,
  each stage's layers under their own strategies, activations handed over in the data layout
  (dp2, and tp2);
- ``llama_bf16_mixed``, ``llama_bf16_pp2_1f1b``: bf16 (autocast and FSDP2's mixed precision side
  by side), held to the matrix's bf16 rule against the bf16 one-device run.

The same job then checkpoints (run/checkpoint.py, DCP): ``gpt_tp4_zero123_tied`` trains four
steps and saves after the second; a fresh layerwise engine loads the checkpoint and trains steps
3-4 to the uninterrupted run's losses bit for bit, and a uniform tp2 x dp2 ZeRO-3 engine loads
the same checkpoint (DCP reshards), holds exactly the saved weights and continues within fp32
rounding.
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch

from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.model import ModelSpec, Recompute
from meshmorph.spec.plan import LayerStrategy, Plan
from tests.helpers.harness import (
    each_case,
    rank_reports,
    reported_run,
    state_gaps,
    train_and_report,
)
from tests.helpers.oracle import (
    FLOOR_BF16,
    K_BF16,
    OPTIM,
    Expectation,
    bf16_not_shown,
    fp32_expectation,
    violations,
)
from tests.helpers.reference import deviation, reference_run
from tests.helpers.world import Part, collect, part_folder

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


def _mixed_stages(model: ModelSpec, stages: list[list[tuple[int, int, int]]], **kw: object
                  ) -> Plan:
    plan = Plan(model=model.name, seq_len=model.seq_len, dtype="fp32", pp=len(stages), **kw  # type: ignore[arg-type]
                ).with_even_stages(model)
    return replace(plan, stages=tuple(
        replace(stage, layer_strategies=tuple(LayerStrategy(tp=t, dp=d, zero=z)
                                              for t, d, z in strategies))
        for stage, strategies in zip(plan.stages, stages, strict=True)))


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
        "llama_pp2_1f1b_mixed_stages": (llama, _mixed_stages(
            llama, [[(2, 1, 0), (1, 2, 3), (1, 2, 1)], [(2, 1, 0), (1, 2, 2), (2, 1, 0)]],
            dp=2, schedule="1f1b", micro_batch=1, num_microbatches=4, global_batch=8)),
        "llama_pp2_gpipe_tp_data": (llama, _mixed_stages(
            llama, [[(1, 2, 2), (2, 1, 0), (1, 2, 0)], [(1, 2, 3), (1, 2, 1), (1, 2, 0)]],
            tp=2, schedule="gpipe", micro_batch=2, num_microbatches=2, global_batch=4)),
        "llama_bf16_mixed": (llama, replace(_mixed(
            llama, [(2, 2, 3), (1, 4, 0), (2, 2, 0), (1, 4, 2), (1, 4, 1), (2, 2, 0)],
            dp=4, micro_batch=1, num_microbatches=2, global_batch=8), dtype="bf16")),
        "llama_bf16_pp2_1f1b": (llama, replace(_mixed_stages(
            llama, [[(2, 1, 0), (1, 2, 3), (1, 2, 1)], [(1, 2, 2), (2, 1, 0), (1, 2, 0)]],
            dp=2, schedule="1f1b", micro_batch=1, num_microbatches=4, global_batch=8),
            dtype="bf16")),
    }


def batches(model: ModelSpec, plan: Plan) -> list[torch.Tensor]:
    """STEPS global batches of tokens, LongTensor[global_batch, s + 1]."""
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(0, model.vocab_size, (plan.global_batch, model.seq_len + 1),
                          generator=gen) for _ in range(STEPS)]


def _train(model: ModelSpec, plan: Plan, out: Path, rank: int) -> None:
    from meshmorph.run.engine.train_engine import build_engine

    engine = build_engine(model, plan, OPTIM, seed=SEED, device=torch.device("cpu"))
    assert engine.summed  # every segment's data parallelism runs layer by layer
    train_and_report(engine, plan, batches(model, plan), out, rank, state=True)


CKPT_LAYOUT = "gpt_tp4_zero123_tied"
"""The layerwise plan the checkpoint scenario saves: plain, tp, ZeRO-1, ZeRO-2 and ZeRO-3
parameters and a tied matrix, six optimizers over one chunk."""
CKPT_STEPS, CKPT_AT = 4, 2
"""The checkpoint scenario trains CKPT_STEPS steps and saves after step CKPT_AT."""


def ckpt_uniform(model: ModelSpec, plan: Plan) -> Plan:
    """The uniform plan the layerwise checkpoint is resumed under (tp2 x dp2, ZeRO-3)."""
    return Plan(model=model.name, seq_len=model.seq_len, dtype=plan.dtype, tp=2, dp=2, zero=3,
                micro_batch=plan.micro_batch, num_microbatches=plan.num_microbatches,
                global_batch=plan.global_batch).with_even_stages(model)


def _full_params(engine: object) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in engine.model_parts[0].named_parameters()}  # type: ignore[attr-defined]


def _checkpoint(out: Path, rank: int) -> None:
    """Train the layerwise plan CKPT_STEPS steps, saving after CKPT_AT; load the checkpoint into
    a fresh layerwise engine and into a uniform one (DCP reshards) and train the rest."""
    from meshmorph.run.checkpoint import load_checkpoint, save_checkpoint, verify_checkpoint
    from meshmorph.run.engine.train_engine import build_engine

    model, plan = layouts()[CKPT_LAYOUT]
    gen = torch.Generator().manual_seed(99)
    data = [torch.randint(0, model.vocab_size, (plan.global_batch, model.seq_len + 1),
                          generator=gen) for _ in range(CKPT_STEPS)]

    def steps(engine: object, first: int, stop: int = CKPT_STEPS) -> list[float]:
        share = plan.global_batch // engine.dp_size  # type: ignore[attr-defined]
        lo = engine.dp_rank * share  # type: ignore[attr-defined]
        return [engine.step(batch[lo:lo + share])  # type: ignore[attr-defined]
                for batch in data[first:stop]]

    engine = build_engine(model, plan, OPTIM, seed=SEED, device=torch.device("cpu"))
    through = steps(engine, 0, CKPT_AT)
    folder = save_checkpoint(engine, out / "ckpt", step=CKPT_AT,
                             consumed_samples=CKPT_AT * plan.global_batch, plan=plan.to_dict(),
                             keep=1)
    saved = _full_params(engine)
    through += steps(engine, CKPT_AT)
    del engine
    collect()
    info = verify_checkpoint(folder)
    resumed = build_engine(model, plan, OPTIM, seed=SEED + 1, device=torch.device("cpu"))
    load_checkpoint(resumed, info)
    after = steps(resumed, CKPT_AT)
    del resumed
    collect()
    uniform = build_engine(model, ckpt_uniform(model, plan), OPTIM, seed=SEED + 1,
                           device=torch.device("cpu"))
    load_checkpoint(uniform, info)
    loaded = _full_params(uniform)
    resharded = steps(uniform, CKPT_AT)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "through": through, "resumed": after, "resharded": resharded,
        "params_equal": sorted(saved) == sorted(loaded)
        and all(torch.equal(saved[k], loaded[k]) for k in saved)}))


def layerwise_part(rank: int, world_size: int, out: Path) -> None:
    """On every rank: every layout in turn, then the checkpoint scenario; one process group."""
    runs = [(name, partial(_train, model, plan)) for name, (model, plan) in layouts().items()]
    each_case(rank, out, [(name, partial(run, rank=rank)) for name, run in
                          [*runs, ("checkpoint", _checkpoint)]])


WORLD_PARTS = [Part("layerwise_equivalence", layerwise_part, world=WORLD, timeout_s=300)]


@pytest.fixture(scope="module")
def results(world4: Path) -> Path:
    return part_folder(world4, "layerwise_equivalence")


def _reports(out: Path) -> list[dict]:
    return rank_reports(out, WORLD)


def _expectation(model: ModelSpec, plan: Plan) -> Expectation:
    """The equivalence matrix's truth and noise for ``plan``'s precision: the fp64 one-device run
    and three fp32 ones (fp32), or the bf16 one-device run and its distance from fp64 (bf16)."""
    data = batches(model, plan)
    if plan.dtype == "bf16":
        fp64 = reference_run(model, OPTIM, data, seed=SEED, micro_batch=plan.micro_batch,
                             precision="fp64")
        bf16 = reference_run(model, OPTIM, data, seed=SEED, micro_batch=plan.micro_batch,
                             precision="bf16")
        return Expectation(bf16, "bf16 one-device", fp64, deviation(bf16, fp64, OPTIM), K_BF16,
                           FLOOR_BF16)
    return fp32_expectation(model, data, micro_batch=plan.micro_batch, seed=SEED)


@pytest.mark.dist
@pytest.mark.timeout(120, func_only=True)
@pytest.mark.parametrize("name", list(layouts()))
def test_layerwise_plan_matches_one_device_within_measured_noise(name: str,
                                                                 results: Path) -> None:
    model, plan = layouts()[name]
    run = reported_run(results / name, WORLD)
    expectation = _expectation(model, plan)
    found = violations(run, expectation)
    if plan.dtype == "bf16":
        why = bf16_not_shown(run, expectation)
        found += [why] if why else []
    assert not found, f"{name}: {len(found)} figures out of tolerance:\n" + "\n".join(found)


@pytest.mark.dist
@pytest.mark.timeout(120, func_only=True)
@pytest.mark.parametrize("name", list(layouts()))
def test_layerwise_state_matches_prediction_per_rank(name: str, results: Path) -> None:
    from meshmorph.cost.rank_state import predict_rank_state

    model, plan = layouts()[name]
    gaps = state_gaps([(rank, report["state"], predict_rank_state(model, plan, rank))
                       for rank, report in enumerate(_reports(results / name))], TOLERANCE)
    assert not gaps, "\n".join(gaps)


RESHARD_REL = 1e-6
"""Loss gap allowed after resuming under the uniform plan: the same weights and moments, another
summation order in fp32 (measured: 2e-8)."""


@pytest.mark.dist
@pytest.mark.timeout(120, func_only=True)
def test_layerwise_checkpoint_resumes_exactly_and_reshards_into_a_uniform_plan(
        results: Path) -> None:
    reports = _reports(results / "checkpoint")
    for rank, report in enumerate(reports):
        assert report == reports[0], f"rank {rank} reports other figures than rank 0"
    report = reports[0]
    rest = report["through"][CKPT_AT:]
    assert report["resumed"] == rest, "the resumed layerwise run left the uninterrupted one"
    assert report["params_equal"], "the uniform plan loaded other parameters than were saved"
    for step, (got, want) in enumerate(zip(report["resharded"], rest, strict=True),
                                       start=CKPT_AT + 1):
        assert abs(got - want) <= RESHARD_REL * want, (
            f"step {step}: the uniform plan resumed at loss {got}, the layerwise run {want}")
