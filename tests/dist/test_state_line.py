"""Each rank holds and sends what the cost model says, and the ZeRO stages differ as defined.

A part of the 4-process ``world4`` job runs every layout (each rank rebuilds its engine per
layout), takes one step, and writes the ``state`` line through ``write_state_line`` into a metrics file
per layout; each test then reads one layout's line and checks every rank's measured figures
against the prediction beside it (within 2%), or the stages against each other.

The rows cover each chunk placement: one chunk per rank, looped (interleaved) and the V of zbv
and dualpipev, whose turn (chunks pp - 1 and pp on one rank) sends nothing and whose rank 0
holds the tied embedding and the head as two copies summed without a collective.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch

from meshmorph.run.config import OptimConfig
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.model import ModelSpec, Recompute
from meshmorph.spec.plan import Plan
from meshmorph.spec.transformer import TransformerShape, build_transformer
from tests.helpers.harness import each_case, state_gaps
from tests.helpers.world import Part, part_folder

WORLD = 4
SEQ = 16
SEED = 5
TOLERANCE = 0.02
OPTIM = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=1, decay_steps=10, grad_clip=1.0)


def _model(name: str = "gpt-tiny") -> ModelSpec:
    if name == "gpt-deep":
        return build_transformer(TransformerShape(name="gpt-deep", arch="gpt", num_layers=8,
                                                  hidden_size=32, num_heads=4, vocab_size=128,
                                                  seq_len=SEQ))
    return catalog_model(name, seq_len=SEQ)


def _plan(model: str = "gpt-tiny", recompute: Recompute = Recompute.NONE, **kw: object) -> Plan:
    fields: dict[str, object] = {"dtype": "fp32", "num_microbatches": 2, **kw}
    dp = int(fields.get("dp", 1))  # type: ignore[call-overload]
    fields.setdefault("global_batch", dp * int(fields["num_microbatches"]))  # type: ignore[call-overload]
    return Plan(model=model, seq_len=SEQ, **fields).with_even_stages(_model(model), recompute)  # type: ignore[arg-type]


LAYOUTS: dict[str, Plan] = {
    "dp4_zero0": _plan(dp=4, zero=0),
    "dp4_zero1": _plan(dp=4, zero=1),
    "dp4_zero2": _plan(dp=4, zero=2),
    "dp4_zero3": _plan(dp=4, zero=3),
    "tp2_dp2_zero1": _plan(tp=2, dp=2, zero=1),
    "pp2_dp2_zero1": _plan(pp=2, dp=2, zero=1, num_microbatches=4),
    "tp2_pp2": _plan(tp=2, pp=2, num_microbatches=4),
    "dp4_zero2_bf16": _plan(dp=4, zero=2, dtype="bf16"),
    "dp4_zero1_bf16": _plan(dp=4, zero=1, dtype="bf16"),
    "dp4_zero1_bf16_sync_after": _plan(dp=4, zero=1, dtype="bf16", overlap_grad_reduce=False,
                                       overlap_param_gather=False),
    "dp4_zero1_bf16_reduce": _plan(dp=4, zero=1, dtype="bf16", reduce_dtype="bf16"),
    "tp2_dp2_zero1_bf16": _plan(tp=2, dp=2, zero=1, dtype="bf16"),
    "tp2_dp2_zero2": _plan(tp=2, dp=2, zero=2),
    "tp2_pp2_bf16": _plan(tp=2, pp=2, num_microbatches=4, dtype="bf16"),
    "tp2_dp2_sp_zero1": _plan(tp=2, dp=2, zero=1, sequence_parallel=True),
    "pp2_dp2_zero3_bf16": _plan(pp=2, dp=2, zero=3, num_microbatches=4, dtype="bf16"),
    # tied embedding and head in one chunk at dp 1: the head's gradient comes first, so the
    # vocabulary-parallel embedding keeps no double-size gradient
    "tp4": _plan(tp=4),
    # full recompute: torch's checkpoint stops once the MLP's row-parallel input is back, so
    # the MLP output's all-reduce (or reduce-scatter) runs once, the attention's twice
    "tp2_dp2_zero1_full": _plan(tp=2, dp=2, zero=1, recompute=Recompute.FULL),
    "tp2_dp2_sp_full": _plan(tp=2, dp=2, sequence_parallel=True, recompute=Recompute.FULL),
    # an untied vocabulary-parallel embedding accumulates into its double-size gradient
    # between micro-batches (ZeRO-1's peak)
    "llama_tp2_dp2_sp_zero1": _plan("llama-tiny", tp=2, dp=2, zero=1, sequence_parallel=True),
    # V placement (rank r holds chunks r and 2pp - 1 - r): the turn of the V, chunks pp - 1 and
    # pp, is on one rank and passes its activation without a send; under pp 2 the tied
    # embedding and head both sit on pipeline rank 0
    "zbv_pp2_dp2_llama": _plan("llama-tiny", pp=2, dp=2, vpp=2, schedule="zbv",
                               num_microbatches=4),
    "zbv_pp2_dp2": _plan(pp=2, dp=2, vpp=2, schedule="zbv", num_microbatches=4),
    "dualpipev_pp2_dp2_zero1": _plan(pp=2, dp=2, vpp=2, zero=1, schedule="dualpipev",
                                     num_microbatches=4),
    "zbv_pp2_dp2_zero2": _plan(pp=2, dp=2, vpp=2, zero=2, schedule="zbv", num_microbatches=4),
    "dualpipev_pp2_tp2": _plan(pp=2, tp=2, vpp=2, schedule="dualpipev", num_microbatches=4),
    # pp 4: ranks 1 and 2 have four neighbours on other ranks, rank 3 (the turn) two
    "dualpipev_pp4_deep": _plan("gpt-deep", pp=4, vpp=2, schedule="dualpipev",
                                num_microbatches=8),
    # looped placement (chunk c on rank c mod pp): every chunk boundary crosses ranks
    "interleaved_pp2_dp2": _plan(pp=2, dp=2, vpp=2, schedule="interleaved",
                                 num_microbatches=4),
}


def _one_layout(name: str, plan: Plan, rank: int, folder: Path) -> None:
    from meshmorph.run.engine.state_line import write_state_line
    from meshmorph.run.engine.train_engine import build_engine
    from meshmorph.run.metrics import MetricsLogger

    model = _model(plan.model)
    engine = build_engine(model, plan, OPTIM, seed=SEED, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, model.vocab_size, (plan.global_batch // plan.dp, SEQ + 1),
                           generator=generator)
    engine.step(tokens)
    metrics = MetricsLogger(folder, enabled=rank == 0, total_steps=1, start_step=0,
                            tokens_per_step=1)
    write_state_line(engine, metrics)
    write_state_line(engine, metrics)  # a second call writes nothing
    metrics.close()


def state_part(rank: int, world_size: int, out: Path) -> None:
    """Every layout in turn: one step, then the state line (twice) into its metrics file."""
    each_case(rank, out, [(name, partial(_one_layout, name, plan, rank))
                          for name, plan in LAYOUTS.items()])


WORLD_PARTS = [Part("state_line", state_part, world=WORLD, timeout_s=420)]


@pytest.fixture(scope="module")
def state_lines(world4: Path) -> dict[str, list[dict] | str]:
    """Per layout: every rank's state record, or what went wrong."""
    out = part_folder(world4, "state_line")
    lines: dict[str, list[dict] | str] = {}
    for name in LAYOUTS:
        errors = sorted((out / name).glob("error*.txt"))
        if errors:
            lines[name] = "\n".join(e.read_text() for e in errors)
            continue
        records = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text()
                   .splitlines() if line.strip()]
        lines[name] = (records[0]["ranks"] if len(records) == 1 else
                       f"{name}: expected one state line, got {len(records)}")
    return lines


def _ranks(state_lines: dict[str, list[dict] | str], layout: str) -> list[dict]:
    ranks = state_lines[layout]
    assert not isinstance(ranks, str), ranks
    return ranks


@pytest.mark.dist
@pytest.mark.timeout(60, func_only=True)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_rank_holds_and_sends_what_the_cost_model_predicts(
        state_lines: dict[str, list[dict] | str], layout: str) -> None:
    ranks = _ranks(state_lines, layout)
    assert [r["rank"] for r in ranks] == list(range(WORLD))
    misses = state_gaps([(r["rank"], r["measured"], r["predicted"]) for r in ranks], TOLERANCE)
    assert not misses, f"{layout}:\n" + "\n".join(misses)


def _rank0(state_lines: dict[str, list[dict] | str], layout: str) -> dict:
    return _ranks(state_lines, layout)[0]["measured"]


@pytest.mark.dist
@pytest.mark.timeout(60, func_only=True)
def test_zero_stages_hold_what_their_definitions_say_at_dp4(
        state_lines: dict[str, list[dict] | str]) -> None:
    z0, z1, z2, z3 = (_rank0(state_lines, f"dp4_zero{k}") for k in range(4))
    whole = z0["params_bytes"]
    # ZeRO-1 and 2 (FSDP2): fp32 master and gradient shards, plus the gathered copy (fp32 here)
    # kept to the step's end; ZeRO-3 everything sharded
    assert z1["params_bytes"] == z2["params_bytes"] == whole + whole // 4
    assert z1["grads_bytes"] == z2["grads_bytes"] == z3["grads_bytes"] == whole // 4
    assert z1["optimizer_bytes"] * 4 == z0["optimizer_bytes"] == 2 * whole
    assert z2["params_bytes"] > z3["params_bytes"] == whole // 4
    # between micro-batches ZeRO-1 accumulates whole gradients, ZeRO-2 reduces every micro-batch
    assert z1["peak_state_bytes"] == whole + whole // 4 + whole + z1["optimizer_bytes"]
    assert z2["peak_state_bytes"] == whole + whole // 4 + whole // 4 + z2["optimizer_bytes"]
    # traffic (m = 2): ZeRO-0 all-reduces the gradients; ZeRO-1 reduce-scatters them once and
    # gathers the parameters once; ZeRO-2 reduce-scatters every micro-batch, ZeRO-3 also gathers
    # twice per micro-batch
    assert z0["comm_bytes"]["all_gather"] == 0
    assert z1["comm_bytes"].get("all_reduce", 0) < whole // 100  # the loss and the norm only
    assert z1["comm_bytes"]["all_gather"] == z2["comm_bytes"]["all_gather"] == whole // 4
    assert z1["comm_bytes"]["reduce_scatter"] == whole
    assert z3["comm_bytes"]["all_gather"] == 4 * (whole // 4)
    assert z2["comm_bytes"]["reduce_scatter"] == z3["comm_bytes"]["reduce_scatter"] == 2 * whole


@pytest.mark.dist
@pytest.mark.timeout(60, func_only=True)
def test_bf16_zero1_holds_6_plus_12_over_dp_bytes_per_parameter_like_megatron(
        state_lines: dict[str, list[dict] | str]) -> None:
    # Megatron-LM's distributed optimizer: a bf16 parameter (2) and an fp32 gradient buffer (4)
    # whole, the fp32 master and both moments (12) sharded; one reduce-scatter of the fp32
    # gradients and one all-gather of the bf16 parameters per step
    params = _rank0(state_lines, "dp4_zero0")["params_bytes"] / 4  # fp32 parameters
    for name in ("dp4_zero1_bf16", "dp4_zero1_bf16_sync_after"):
        z1 = _rank0(state_lines, name)
        assert z1["peak_state_bytes"] == pytest.approx((6 + 12 / 4) * params, rel=0.02), name
        assert z1["params_bytes"] + z1["grads_bytes"] + z1["optimizer_bytes"] == \
            pytest.approx((2 + 16 / 4) * params, rel=0.02), name
        assert z1["comm_bytes"]["reduce_scatter"] == pytest.approx(4 * params, rel=0.02), name
        assert z1["comm_bytes"]["all_gather"] == pytest.approx(2 * params / 4, rel=0.02), name
        assert z1["comm_bytes"].get("all_reduce", 0) < params / 100, name
    # a bf16 reduction halves the gradient buffer and the reduce-scatter
    half = _rank0(state_lines, "dp4_zero1_bf16_reduce")
    assert half["peak_state_bytes"] == pytest.approx((4 + 12 / 4) * params, rel=0.02)
    assert half["comm_bytes"]["reduce_scatter"] == pytest.approx(2 * params, rel=0.02)


@pytest.mark.dist
@pytest.mark.timeout(60, func_only=True)
def test_bf16_zero2_keeps_16_bit_gathered_copies_and_reduces_in_fp32(
        state_lines: dict[str, list[dict] | str]) -> None:
    fp32, bf16 = _rank0(state_lines, "dp4_zero2"), _rank0(state_lines, "dp4_zero2_bf16")
    shard = fp32["grads_bytes"]  # a quarter of the fp32 parameters
    assert bf16["params_bytes"] == shard + 2 * shard  # fp32 shard + bf16 whole copy (4 shards / 2)
    assert bf16["comm_bytes"]["all_gather"] * 2 == fp32["comm_bytes"]["all_gather"]
    assert bf16["comm_bytes"]["reduce_scatter"] == fp32["comm_bytes"]["reduce_scatter"]
