"""Activation memory as meshmorph's runtime holds it, and what the head and the embedding cost
at the ends of a pipeline, checked by hand.

- Attention: the runtime runs ``F.scaled_dot_product_attention`` (flash / memory-efficient
  kernels), which keeps no s x s scores, and has no dropout: a GPT block keeps 32 s b h bytes
  (16-bit). Megatron-LM 2021 (the calibration runs) kept the scores and dropout masks:
  s b h (34 + 5 a s / h), Korthikanti et al. 2022 Table 2.
- The head's loss holds 8 V bytes per token (fp32) beside what it keeps, while it runs, on the
  rank with the head only.
- A tied embedding's gradient is all-reduced between the first and the last pipeline rank.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshmorph.cost import comm
from meshmorph.cost.calibration import published_runs
from meshmorph.cost.model import CostModel
from meshmorph.cost.rank_terms import LOSS_BLOCK_BYTES, head_loss_bytes, rank_memory_terms
from meshmorph.schedule.table import Schedule
from meshmorph.spec.catalog import MODEL_CATALOG, catalog_model
from meshmorph.spec.cluster import parse_cluster
from meshmorph.spec.model import LayerKind, Recompute
from meshmorph.spec.plan import Plan
from meshmorph.spec.transformer import build_transformer

# gpt3-1.3b: h 2048, a 16, f 4h, s 2048, V 50257 padded to 50304
H, A, S, F, VP = 2048, 16, 2048, 8192, 50304


def _block_bytes(flash: bool | None, dropout: bool, mode: Recompute = Recompute.NONE,
                 tp: int = 1) -> float:
    shape = replace(MODEL_CATALOG["gpt3-1.3b"], flash_attention=flash, dropout=dropout)
    return build_transformer(shape).layers[1].activation[mode].per_rank(tp, False)


def test_a_catalog_gpt_block_keeps_no_scores_and_no_dropout_masks() -> None:
    block = catalog_model("gpt3-1.3b").layers[1].activation
    # LN inputs 4h + qkv input 2h + fc1 input 2h = 8h whole on every tp rank;
    # Q, K 4h + V 2h + out-proj input 2h + GeLU in 2f + GeLU out 2f split by tp
    assert block[Recompute.NONE].shared == 8 * H == 16_384
    assert block[Recompute.NONE].split == 8 * H + 4 * F == 49_152
    # selective recompute saves nothing more where a flash kernel keeps no scores
    assert block[Recompute.SELECTIVE] == block[Recompute.NONE]
    # per micro-batch of one sequence: 32 s b h = 128 MiB per block
    assert block[Recompute.NONE].per_rank(1, False) * S == 32 * S * H == 134_217_728


def test_the_same_block_with_and_without_flash_by_hand() -> None:
    flash = _block_bytes(True, dropout=False)
    scores = _block_bytes(False, dropout=False)  # softmax output 2as kept per token
    megatron = _block_bytes(False, dropout=True)  # Korthikanti: 34h + 5as
    assert flash == 32 * H
    assert scores == 32 * H + 2 * A * S == 65_536 + 65_536
    assert megatron == 34 * H + 5 * A * S == 69_632 + 163_840
    # with tp 2 only the split part and the scores halve
    assert _block_bytes(False, dropout=True, tp=2) == 10 * H + (24 * H + 5 * A * S) / 2
    # the default (None) is flash: the runtime's SDPA
    assert _block_bytes(None, dropout=False) == flash


def test_every_catalog_model_is_priced_with_flash_and_without_dropout() -> None:
    for name in MODEL_CATALOG:
        spec = catalog_model(name)
        block = next(layer for layer in spec.layers if layer.kind == LayerKind.BLOCK)
        assert block.activation[Recompute.NONE] == block.activation[Recompute.SELECTIVE], name
        assert block.activation[Recompute.NONE].shared == 8 * spec.hidden_size, name
        assert spec.layers[0].activation[Recompute.NONE].shared == 8.0, name  # token ids


def test_the_published_megatron_runs_keep_scores_and_dropout_masks() -> None:
    for run in (r for r in published_runs() if r.source != "torchtitan_runs.json"):
        h, a, s = run.model.hidden_size, run.model.num_heads, run.model.seq_len
        block = run.model.layers[1].activation[Recompute.NONE]
        assert block.shared + block.split == 34 * h + 5 * a * s, run.id
        # the embedding keeps its dropout mask (h) and the token ids
        assert run.model.layers[0].activation[Recompute.NONE].shared == h + 8, run.id


def test_a_new_sequence_length_keeps_flash_and_dropout() -> None:
    megatron = published_runs()[0].model
    longer = megatron.with_seq_len(2 * megatron.seq_len)
    h, a, s = longer.hidden_size, longer.num_heads, longer.seq_len
    block = longer.layers[1].activation[Recompute.NONE]
    assert block.shared + block.split == 34 * h + 5 * a * s
    flash = catalog_model("gpt3-1.3b", seq_len=4096).layers[1].activation[Recompute.NONE]
    assert flash.shared + flash.split == 32 * H


# --- the head and the embedding at the ends of a pipeline --------------------------------------
def _pp2(model_name: str = "gpt3-1.3b", *, tp: int = 1, schedule: Schedule = Schedule.ONE_F_ONE_B,
         vpp: int = 1, zero: int = 0, dp: int = 1, micro_batch: int = 2) -> tuple[CostModel, Plan]:
    model = catalog_model(model_name)
    plan = Plan(model=model_name, seq_len=model.seq_len, global_batch=8 * dp, tp=tp, pp=2, dp=dp,
                zero=zero, micro_batch=micro_batch, num_microbatches=8 // micro_batch,
                schedule=schedule, vpp=vpp).with_even_stages(model)
    return CostModel(model, parse_cluster("a100-80g:1x8")), plan


@pytest.mark.parametrize("tp", [1, 2])
def test_the_loss_buffers_sit_on_the_rank_with_the_head_only(tp: int) -> None:
    cost, plan = _pp2(tp=tp)
    gpu = cost.default_gpu()
    # over vocabulary shards (tp 2): 8 bytes per (padded) logit, the fp32 copy of the logits and
    # their gradient, b s V / t; over whole logits (tp 1): the bf16 product and one row block's
    # two fp32 temporaries (run/model/loss.py)
    loss = 8 * VP * 2 * S / tp if tp > 1 else 2 * VP * 2 * S + 2 * LOSS_BLOCK_BYTES
    assert head_loss_bytes(cost, plan, 1) == loss
    assert head_loss_bytes(cost, plan, 0) == 0.0
    reserve = cost.coef.context_bytes + cost.coef.memory_reserve_fraction * gpu.memory_bytes
    assert rank_memory_terms(cost, plan, 0, gpu).reserved_bytes == reserve
    assert rank_memory_terms(cost, plan, 1, gpu).reserved_bytes == reserve + loss
    estimate = cost.estimate(plan)
    assert estimate.memory[1].reserved - estimate.memory[0].reserved == loss


def test_the_tied_embedding_gradient_is_all_reduced_between_the_end_ranks() -> None:
    cost, plan = _pp2(tp=2)
    gpu = cost.default_gpu()
    link = cost.group_link(gpu, plan.world_size)
    nbytes = VP * H / 2 * 4  # the tp rank's share of the embedding, fp32 gradients
    by_hand = 2 * link.latency_s + nbytes / link.bandwidth_bps  # ring all-reduce, n = 2
    assert cost.tied_embedding_sync_s(plan, 0, gpu) == pytest.approx(by_hand, rel=1e-12)
    assert cost.tied_embedding_sync_s(plan, 1, gpu) == pytest.approx(by_hand, rel=1e-12)
    assert comm.all_reduce(2, nbytes, link) == pytest.approx(by_hand, rel=1e-12)
    assert cost.estimate(plan).breakdown_s["embedding_sync"] == pytest.approx(by_hand, rel=1e-12)
    # a 16-bit reduction (Megatron-LM 2021) sends half; ZeRO-2 sends the 1/dp shard
    half = cost.tied_embedding_sync_s(replace(plan, reduce_dtype="bf16"), 0, gpu)
    assert half == pytest.approx(2 * link.latency_s + nbytes / 2 / link.bandwidth_bps, rel=1e-12)


def test_no_tied_sync_without_a_tied_pipeline() -> None:
    cost, plan = _pp2("llama2-7b")  # untied head
    assert cost.tied_embedding_sync_s(plan, 0, cost.default_gpu()) == 0.0
    assert cost.estimate(plan).breakdown_s["embedding_sync"] == 0.0
    cost, plan = _pp2(schedule=Schedule.ZBV, vpp=2)  # a V: rank 0 holds embedding and head
    assert cost.tied_embedding_sync_s(plan, 0, cost.default_gpu()) == 0.0
    model = catalog_model("gpt3-1.3b")
    one = Plan(model="gpt3-1.3b", seq_len=S, global_batch=1).with_even_stages(model)
    assert CostModel(model, parse_cluster("a100-80g:1x8")).estimate(one) \
        .breakdown_s["embedding_sync"] == 0.0


def test_the_tied_sync_lengthens_the_step_by_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    cost, plan = _pp2()
    estimate = cost.estimate(plan)
    sync = estimate.breakdown_s["embedding_sync"]
    monkeypatch.setattr(CostModel, "tied_embedding_sync_s", lambda *args: 0.0)
    without = _pp2()[0].estimate(plan)
    assert sync > 0
    # with pp 2 both ranks hold an end: each tail grows by the sync
    assert estimate.step_time_s == pytest.approx(without.step_time_s + sync, rel=1e-12)
