"""Layerwise plans the runtime cannot run are refused before any process starts, and the state
prediction for layerwise plans follows each layer's own strategy."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from meshmorph.cost.rank_state import predict_rank_state
from meshmorph.elastic.moves.layout import layout_of
from meshmorph.run.engine.train_engine import validate_plan
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import LayerStrategy, Plan, PlanError

EXAMPLE = Path(__file__).parents[2] / "examples" / "plans" / "layerwise-gpt-small.json"


def _gpt() -> ModelSpec:
    return catalog_model("gpt-tiny", seq_len=16)


def _mixed(strategies: list[tuple[int, int, int]], **kw: object) -> Plan:
    fields: dict[str, object] = {"dp": 4, "global_batch": 8, "num_microbatches": 2,
                                 "dtype": "fp32", **kw}
    plan = Plan(model="gpt-tiny", seq_len=16, **fields).with_even_stages(_gpt())  # type: ignore[arg-type]
    stages = tuple(replace(stage, layer_strategies=tuple(
        LayerStrategy(tp=t, dp=d, zero=z)
        for t, d, z in strategies[stage.start:stage.stop])) for stage in plan.stages)
    return replace(plan, stages=stages)


UNIFORM_DP4 = [(1, 4, 0)] * 6


def test_the_committed_example_is_accepted() -> None:
    validate_plan(catalog_model("gpt-small"), Plan.load(EXAMPLE), 4)


def _llama() -> ModelSpec:
    return catalog_model("llama-tiny", seq_len=16)


def _mixed_llama(strategies: list[tuple[int, int, int]], **kw: object) -> Plan:
    plan = _mixed(strategies, **kw)
    return replace(plan, model="llama-tiny")


PP2_MIXED = [(1, 2, 0), (2, 1, 0), (1, 2, 3), (2, 1, 0), (1, 2, 2), (1, 2, 1)]


def test_a_pipeline_of_layerwise_stages_is_accepted_under_gpipe_and_1f1b() -> None:
    for schedule in ("gpipe", "1f1b"):
        plan = _mixed_llama(PP2_MIXED, dp=2, pp=2, global_batch=4, schedule=schedule)
        validate_plan(_llama(), plan, 4)


SPLIT_MIXED = [(1, 2, 0), (2, 1, 0), (1, 2, 2), (2, 1, 0), (1, 2, 1), (1, 2, 2)]
"""Mixed layers without ZeRO-3: every pipeline schedule runs them."""
SHAPES = [("zb", 1), ("interleaved", 2), ("zbv", 2), ("dualpipev", 2)]


@pytest.mark.parametrize(("schedule", "vpp"), SHAPES)
def test_layerwise_pipelines_run_under_zero_bubble_interleaved_and_v(schedule: str,
                                                                     vpp: int) -> None:
    plan = _mixed_llama(SPLIT_MIXED, dp=2, pp=2, vpp=vpp, global_batch=8, num_microbatches=4,
                        schedule=schedule)
    assert len(plan.stages) == 2 * vpp
    validate_plan(_llama(), plan, 4)


@pytest.mark.parametrize(("schedule", "vpp"), SHAPES)
def test_a_zero3_layer_is_refused_only_under_a_split_backward_schedule(schedule: str,
                                                                       vpp: int) -> None:
    plan = _mixed_llama(PP2_MIXED, dp=2, pp=2, vpp=vpp, global_batch=8, num_microbatches=4,
                        schedule=schedule)  # layer 2: ZeRO-3 over dp 2
    if schedule == "interleaved":  # one full backward per micro-batch: FSDP2's own hooks
        validate_plan(_llama(), plan, 4)
        return
    with pytest.raises(PlanError, match=f"layer 2 .* ZeRO-3 over dp 2 under schedule {schedule}"):
        validate_plan(_llama(), plan, 4)
    zero2 = [(t, d, 2 if z == 3 else z) for t, d, z in PP2_MIXED]  # the way out it names
    validate_plan(_llama(), _mixed_llama(zero2, dp=2, pp=2, vpp=vpp, global_batch=8,
                                         num_microbatches=4, schedule=schedule), 4)


def test_async_layerwise_pipelines_are_refused() -> None:
    plan = _mixed_llama(SPLIT_MIXED, dp=2, pp=2, global_batch=8, num_microbatches=4,
                        schedule="async")
    from meshmorph.spec.runnable import check_layerwise_runnable as validate_layerwise

    with pytest.raises(PlanError, match="run the schedules gpipe, 1f1b, zb, interleaved, zbv"):
        validate_layerwise(_llama(), plan)


def test_v_chunks_on_one_rank_hand_over_without_a_send() -> None:
    """Under zbv the middle rank holds chunks 1 and 2, neighbours on one rank: their sends are
    the two pipeline ends only; interleaved places neighbours on other ranks."""
    model = _llama()
    bsh = 1 * 16 * 64 * 4  # micro_batch x seq x hidden, fp32
    sends = {}
    for schedule in ("zbv", "interleaved"):
        plan = _mixed_llama(SPLIT_MIXED, dp=2, pp=2, vpp=2, global_batch=8, num_microbatches=4,
                            schedule=schedule)
        sends[schedule] = [predict_rank_state(model, plan, r)["comm_bytes"]["send_recv"]  # type: ignore[index]
                           for r in (0, 2)]
    m, handshake = 4, 4
    # zbv: rank 0 holds chunks 0 and 3 (one neighbour each), the middle rank 1 and 2
    assert sends["zbv"] == [2 * (handshake + m * bsh)] * 2
    # interleaved: chunks 0, 2 on rank 0 (1 + 2 neighbours), 1, 3 on rank 1 (2 + 1)
    assert sends["interleaved"] == [3 * (handshake + m * bsh)] * 2


def test_a_zero2_layer_under_zb_reduce_scatters_once_per_step() -> None:
    model = _llama()
    kw = dict(dp=2, pp=2, global_batch=8, num_microbatches=4)
    zb = predict_rank_state(model, _mixed_llama(SPLIT_MIXED, schedule="zb", **kw), 0)
    one = predict_rank_state(model, _mixed_llama(SPLIT_MIXED, schedule="1f1b", **kw),
                                       0)
    # 1f1b: FSDP2's hooks reduce-scatter the ZeRO-2 layer after each of the 4 micro-batches
    assert one["comm_bytes"]["reduce_scatter"] == 4 * zb["comm_bytes"]["reduce_scatter"] > 0  # type: ignore[index]
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert zb[key] == one[key]


def test_a_tied_embedding_in_a_layerwise_pipeline_runs_under_one_layout_for_both_ends() -> None:
    plan = _mixed(PP2_MIXED, dp=2, pp=2, global_batch=4)
    ends = plan.stages[0].layer_strategies[0], plan.stages[-1].layer_strategies[-1]  # type: ignore[index]
    assert ends[0] != ends[1]
    with pytest.raises(PlanError, match="same tp and ZeRO stage"):
        validate_plan(_gpt(), plan, 4)
    alike = [PP2_MIXED[-1], *PP2_MIXED[1:]]  # the embedding under the head's layout
    validate_plan(_gpt(), _mixed(alike, dp=2, pp=2, global_batch=4), 4)


def test_a_layerwise_pipeline_of_one_strategy_predicts_what_the_uniform_pipeline_does() -> None:
    model = _llama()
    for uniform in ({"dp": 2}, {"dp": 2, "zero": 1}, {"dp": 2, "zero": 3},
                    {"tp": 2, "dp": 1, "micro_batch": 2}):
        tp, dp, zero = uniform.get("tp", 1), uniform["dp"], uniform.get("zero", 0)
        layerwise = _mixed_llama([(tp, dp, zero)] * 6, pp=2, global_batch=4,
                                 **uniform)  # type: ignore[arg-type]
        flat = replace(layerwise, stages=tuple(replace(s, layer_strategies=None)
                                               for s in layerwise.stages))
        for rank in range(4):
            got = predict_rank_state(model, layerwise, rank)
            want = predict_rank_state(model, flat, rank)
            for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
                assert got[key] == pytest.approx(want[key]), (uniform, rank, key)
            assert got["comm_bytes"]["send_recv"] == pytest.approx(  # type: ignore[index]
                want["comm_bytes"]["send_recv"]), (uniform, rank)  # type: ignore[index]


def test_a_stage_ending_in_another_tp_moves_its_output_back_to_the_data_layout() -> None:
    model = _llama()
    base = predict_rank_state(model, _mixed_llama([(1, 2, 0)] * 6, dp=2, pp=2,
                                                            global_batch=4), 0)
    mixed = predict_rank_state(model, _mixed_llama(
        [(1, 2, 0), (1, 2, 0), (2, 1, 0), (1, 2, 0), (1, 2, 0), (1, 2, 0)], dp=2, pp=2,
        global_batch=4), 0)
    # stage 0's last layer runs tp 2: the forward all-gather into it sends this rank's one
    # sequence (16 x 64 fp32) per micro-batch, and leaving it for the data layout (tp 1) the
    # backward all-gather sends the gradient of the one sequence of the data layout's block
    m, s, h = 2, 16, 64
    gathered = mixed["comm_bytes"]["all_gather"] - base["comm_bytes"]["all_gather"]  # type: ignore[index]
    assert gathered == m * (1 + 1) * s * h * 4


def test_a_tied_embedding_and_head_under_different_strategies_are_refused() -> None:
    plan = _mixed([(1, 4, 0), (2, 2, 0), (2, 2, 0), (1, 4, 0), (1, 4, 0), (2, 2, 0)])
    with pytest.raises(PlanError, match="ties its embedding and head"):
        validate_plan(_gpt(), plan, 4)


def test_a_tied_embedding_sharded_by_fsdp_is_refused() -> None:
    plan = _mixed([(1, 4, 3), (2, 2, 0), (2, 2, 0), (1, 4, 0), (1, 4, 0), (1, 4, 3)])
    with pytest.raises(PlanError, match="zero 0 or 1"):
        validate_plan(_gpt(), plan, 4)


def test_sequence_parallel_layerwise_plans_run() -> None:
    plan = _mixed([(2, 2, 0), (1, 4, 0), (2, 2, 0), (4, 1, 0), (2, 2, 0), (2, 2, 0)], tp=2,
                  dp=2, micro_batch=2, sequence_parallel=True)
    assert plan.sequence_parallel
    validate_plan(_gpt(), plan, 4)


def test_elastic_layouts_refuse_layerwise_plans() -> None:
    with pytest.raises(PlanError, match="layer_strategies"):
        layout_of(_gpt(), _mixed(UNIFORM_DP4))


def test_one_strategy_for_every_layer_holds_what_the_uniform_plan_holds() -> None:
    model = _gpt()
    for strategy, uniform in (((1, 4, 0), {"dp": 4}), ((1, 4, 1), {"dp": 4, "zero": 1}),
                              ((1, 4, 3), {"dp": 4, "zero": 3})):
        layerwise = _mixed([strategy] * 6, **uniform)
        flat = replace(layerwise, stages=tuple(replace(s, layer_strategies=None)
                                               for s in layerwise.stages))
        for rank in range(4):
            got = predict_rank_state(model, layerwise, rank)
            want = predict_rank_state(model, flat, rank)
            for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
                assert got[key] == pytest.approx(want[key]), (strategy, rank, key)
            assert got["comm_bytes"]["reduce_scatter"] == pytest.approx(  # type: ignore[index]
                want["comm_bytes"]["reduce_scatter"])  # type: ignore[index]


def test_a_layer_moved_to_tp2_adds_its_activation_gathers() -> None:
    model = _gpt()
    base = predict_rank_state(model, _mixed(UNIFORM_DP4), 0)
    mixed = predict_rank_state(
        model, _mixed([(1, 4, 0), (1, 4, 0), (2, 2, 0), (1, 4, 0), (1, 4, 0), (1, 4, 0)]), 0)
    # into tp 2: the forward all-gather sends this rank's B / 4 = 1 sequence (16 x 64 fp32) per
    # micro-batch; out of it: the backward all-gather sends the gradient of its 1 sequence of
    # the dp-4 layer after it (each gathers B / 2 = 2 sequences)
    m, s, h = 2, 16, 64
    gathered = mixed["comm_bytes"]["all_gather"] - base["comm_bytes"]["all_gather"]  # type: ignore[index]
    assert gathered == m * (1 + 1) * s * h * 4
