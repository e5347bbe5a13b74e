"""Layerwise plans the runtime cannot run are refused before any process starts, and the state
prediction for layerwise plans follows each layer's own strategy."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from meshmorph.cost.layerwise_state import predict_layerwise_rank_state
from meshmorph.cost.rank_state import predict_rank_state
from meshmorph.elastic.layout import layout_of
from meshmorph.run.engine import validate_plan
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


def test_layerwise_pipelines_under_other_schedules_are_refused() -> None:
    for schedule, kw in (("interleaved", {"vpp": 2}), ("zb", {})):
        plan = Plan(model="llama-tiny", seq_len=16, dp=2, pp=2, global_batch=8,
                    num_microbatches=4, dtype="fp32", schedule=schedule,
                    **kw).with_even_stages(_llama())  # type: ignore[arg-type]
        plan = replace(plan, stages=tuple(replace(stage, layer_strategies=tuple(
            LayerStrategy(tp=1, dp=2, zero=0) for _ in range(stage.stop - stage.start)))
            for stage in plan.stages))
        with pytest.raises(PlanError, match="gpipe or 1f1b with one chunk"):
            validate_plan(_llama(), plan, 4)


def test_a_tied_embedding_in_a_layerwise_pipeline_is_refused() -> None:
    plan = _mixed(PP2_MIXED, dp=2, pp=2, global_batch=4)
    with pytest.raises(PlanError, match="need untied embeddings"):
        validate_plan(_gpt(), plan, 4)


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
            got = predict_layerwise_rank_state(model, layerwise, rank)
            want = predict_rank_state(model, flat, rank)
            for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
                assert got[key] == pytest.approx(want[key]), (uniform, rank, key)
            assert got["comm_bytes"]["send_recv"] == pytest.approx(  # type: ignore[index]
                want["comm_bytes"]["send_recv"]), (uniform, rank)  # type: ignore[index]


def test_a_stage_ending_in_another_tp_moves_its_output_back_to_the_data_layout() -> None:
    model = _llama()
    base = predict_layerwise_rank_state(model, _mixed_llama([(1, 2, 0)] * 6, dp=2, pp=2,
                                                            global_batch=4), 0)
    mixed = predict_layerwise_rank_state(model, _mixed_llama(
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


def test_sequence_parallel_layerwise_plans_are_refused() -> None:
    plan = _mixed([(2, 2, 0)] * 6, tp=2, dp=2, micro_batch=2, sequence_parallel=True)
    with pytest.raises(PlanError, match="sequence parallelism"):
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
            got = predict_layerwise_rank_state(model, layerwise, rank)
            want = predict_rank_state(model, flat, rank)
            for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
                assert got[key] == pytest.approx(want[key]), (strategy, rank, key)
            assert got["comm_bytes"]["reduce_scatter"] == pytest.approx(  # type: ignore[index]
                want["comm_bytes"]["reduce_scatter"])  # type: ignore[index]


def test_a_layer_moved_to_tp2_adds_its_activation_gathers() -> None:
    model = _gpt()
    base = predict_layerwise_rank_state(model, _mixed(UNIFORM_DP4), 0)
    mixed = predict_layerwise_rank_state(
        model, _mixed([(1, 4, 0), (1, 4, 0), (2, 2, 0), (1, 4, 0), (1, 4, 0), (1, 4, 0)]), 0)
    # into tp 2: the forward all-gather sends this rank's B / 4 = 1 sequence (16 x 64 fp32) per
    # micro-batch; out of it: the backward all-gather sends the gradient of its 1 sequence of
    # the dp-4 layer after it (each gathers B / 2 = 2 sequences)
    m, s, h = 2, 16, 64
    gathered = mixed["comm_bytes"]["all_gather"] - base["comm_bytes"]["all_gather"]  # type: ignore[index]
    assert gathered == m * (1 + 1) * s * h * 4
