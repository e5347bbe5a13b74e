"""The per-rank state and traffic prediction (cost/rank_state.py) against numbers worked out by
hand for gpt-tiny (V 256, h 64, ffn 256, 4 blocks, tied head, seq 16): 217,472 parameters, a
block 49,984 (norms 4 x 64, q/k/v/o 4 x (64 x 64 + 64), fc1 256 x 64 + 256, fc2 64 x 256 + 64),
the embedding 256 x 64 + 16 x 64 = 17,408, the head's norm 128."""

from __future__ import annotations

import pytest

from meshmorph.cost.rank_state import predict_peak_bytes, predict_rank_state, predict_ranks
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan

SEQ = 16
WHOLE = 217_472
"""gpt-tiny's parameters, the tied head counted once."""


@pytest.fixture(scope="module")
def gpt() -> ModelSpec:
    return catalog_model("gpt-tiny", seq_len=SEQ)


def _plan(model: ModelSpec, **kw: object) -> Plan:
    fields: dict[str, object] = {"dtype": "fp32", "num_microbatches": 2, **kw}
    fields.setdefault("global_batch", int(fields.get("dp", 1)) * int(fields["num_microbatches"]))  # type: ignore[call-overload]
    return Plan(model=model.name, seq_len=SEQ, **fields).with_even_stages(model)  # type: ignore[arg-type]


def test_zero0_dp4_holds_16_bytes_per_parameter_and_all_reduces_fp32_gradients(gpt: ModelSpec) -> None:
    state = predict_rank_state(gpt, _plan(gpt, dp=4, zero=0), 3)
    assert (state["params_bytes"], state["grads_bytes"], state["optimizer_bytes"]) == (
        4 * WHOLE, 4 * WHOLE, 8 * WHOLE)
    # gradients + the loss (float64); no sharded gradient, so no gradient-norm collective
    assert state["comm_bytes"] == {"all_reduce": 4 * WHOLE + 8, "all_gather": 0,
                                   "reduce_scatter": 0, "send_recv": 0, "broadcast": 0}


def test_zero1_dp4_reduce_scatters_once_and_gathers_the_updated_parameters_once(
        gpt: ModelSpec) -> None:
    state = predict_rank_state(gpt, _plan(gpt, dp=4, zero=1), 0)
    # at the end of backward: the fp32 quarter plus the gathered (fp32) copy, a quarter of the
    # gradients and of the moments; between the two micro-batches the whole gradients
    assert (state["params_bytes"], state["grads_bytes"], state["optimizer_bytes"]) == (
        WHOLE + 4 * WHOLE, WHOLE, 2 * WHOLE)
    assert state["peak_state_bytes"] == 5 * WHOLE + 4 * WHOLE + 2 * WHOLE
    assert state["comm_bytes"]["all_gather"] == WHOLE  # 4 bytes x a quarter, once
    assert state["comm_bytes"]["reduce_scatter"] == 4 * WHOLE  # once, not per micro-batch
    assert state["comm_bytes"]["all_reduce"] == 8 + 32  # loss + gradient-norm classes over dp


def test_bf16_zero1_dp4_is_megatrons_distributed_optimizer(gpt: ModelSpec) -> None:
    state = predict_rank_state(gpt, _plan(gpt, dp=4, zero=1, dtype="bf16"), 3)
    assert state["peak_state_bytes"] == (6 + 12 / 4) * WHOLE  # bf16 2 + fp32 grads 4 + 12 / dp
    assert state["comm_bytes"]["all_gather"] == 2 * WHOLE // 4  # bf16 parameters
    assert state["comm_bytes"]["reduce_scatter"] == 4 * WHOLE  # fp32 gradients


def test_zero3_dp3_pads_every_dim0_shard_and_the_last_rank_owns_fewer_rows(gpt: ModelSpec) -> None:
    # padded shard elements: embedding 86 x 64 + 6 x 64, a block 17,052 (rows 64 -> 22,
    # 256 -> 86), the head's norm 2 x 22: 5,888 + 4 x 17,052 + 44 = 74,140
    padded = 74_140
    plan = _plan(gpt, dp=3, zero=3)
    first, last = predict_rank_state(gpt, plan, 0), predict_rank_state(gpt, plan, 2)
    assert first["params_bytes"] == last["params_bytes"] == 4 * padded
    assert first["grads_bytes"] == 4 * padded
    # moments on owned rows: ranks 0 and 1 own full chunks, rank 2 the rest (rows 64 -> 20,
    # 256 -> 84, 16 -> 4): 5,632 + 4 x 15,880 + 40 = 69,192 elements
    assert first["optimizer_bytes"] == 8 * padded
    assert last["optimizer_bytes"] == 8 * 69_192
    assert 2 * padded + 69_192 == WHOLE
    # gathered in forward and backward of m = 2 micro-batches; reduce-scatter inputs are 3 shards
    assert last["comm_bytes"]["all_gather"] == 4 * 4 * padded
    assert last["comm_bytes"]["reduce_scatter"] == 2 * 4 * 3 * padded
    assert last["comm_bytes"]["all_reduce"] == 8 + 32  # loss + gradient-norm classes over dp


def test_zero2_bf16_keeps_a_bf16_gathered_copy_and_reduces_in_fp32(gpt: ModelSpec) -> None:
    state = predict_rank_state(gpt, _plan(gpt, dp=4, zero=2, dtype="bf16"), 1)
    assert state["params_bytes"] == WHOLE + 2 * WHOLE  # fp32 quarter + whole bf16 copy
    assert state["grads_bytes"] == WHOLE
    assert state["comm_bytes"]["all_gather"] == 2 * WHOLE // 4  # once per step, bf16
    assert state["comm_bytes"]["reduce_scatter"] == 2 * 4 * WHOLE  # fp32, each micro-batch


def test_zero2_fp16_reduce_dtype_halves_the_reduce_scatter(gpt: ModelSpec) -> None:
    plan = _plan(gpt, dp=4, zero=2, dtype="bf16", reduce_dtype="bf16")
    assert predict_rank_state(gpt, plan, 0)["comm_bytes"]["reduce_scatter"] == 2 * 2 * WHOLE


def test_tp2_pp2_ranks_hold_their_stage_and_send_megatron_activations(gpt: ModelSpec) -> None:
    plan = _plan(gpt, tp=2, pp=2, num_microbatches=4)
    # stage 0: embedding split by vocabulary (128 x 64 + 16 x 64 = 9,216) + 2 blocks of 25,184
    first = predict_rank_state(gpt, plan, 1)
    assert first["params_bytes"] == 4 * 59_584
    assert first["grads_bytes"] == 4 * 59_584 + 4 * 8_192  # the embedding's doubled grad storage
    bsh = 1 * SEQ * 64 * 4  # one micro-batch's hidden state, fp32 bytes
    # embedding 1 + per block 2 forward + 4 backward, 4 micro-batches; the tied embedding's
    # gradient; loss, gradient-norm classes over tp, norm over pp
    assert first["comm_bytes"]["all_reduce"] == 4 * bsh * (1 + 2 * 6) + 4 * 8_192 + 8 + 32 + 8
    assert first["comm_bytes"]["send_recv"] == 4 + 4 * bsh  # handshake + activations forward
    # stage 1: 2 blocks, the head's norm and its copy of the embedding shard
    last = predict_rank_state(gpt, plan, 2)
    assert last["params_bytes"] == 4 * (2 * 25_184 + 128 + 8_192)
    # the logits stay vocabulary halves: loss_parallel's three fp32 all-reduces of one value per
    # token (max, sum of exponentials, target log-probability) replace their all-gather
    assert last["comm_bytes"]["all_gather"] == 0
    assert last["comm_bytes"]["all_reduce"] == 4 * bsh * (1 + 2 * 6) + 4 * 8_192 + 8 + 32 + 8 \
        + 4 * 3 * SEQ * 4


def test_estimate_ranks_list_every_rank_in_order(gpt: ModelSpec) -> None:
    plan = _plan(gpt, tp=2, pp=2, num_microbatches=4)
    ranks = predict_ranks(gpt, plan)
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert ranks[2]["params_bytes"] == predict_rank_state(gpt, plan, 2)["params_bytes"]


def test_a_rank_outside_the_plan_is_refused(gpt: ModelSpec) -> None:
    with pytest.raises(ValueError, match="rank 4 is outside the plan's 4 ranks"):
        predict_rank_state(gpt, _plan(gpt, dp=4), 4)


def test_predicted_peak_is_the_rank_memory_without_the_reserve(gpt: ModelSpec) -> None:
    from meshmorph.cost.model import CostModel
    from meshmorph.spec.cluster import parse_cluster

    plan = _plan(gpt, dp=4, zero=3)
    cost = CostModel(gpt, parse_cluster("h100:1x4"))
    memory = cost.rank_memory(plan, 0, [(0, gpt.num_layers, plan.stages[0].recompute)],
                              cost.default_gpu())
    peak = predict_peak_bytes(gpt, plan, 0, "h100")
    assert peak == memory.total - memory.reserved
    # ZeRO-3 state (4 + 4 + 8 bytes over 4 ranks) is part of it
    assert peak > 4 * WHOLE
