"""``plan --layerwise`` offers only plans meshmorph runs, by the rule the runtime itself reads, and
never returns a plan slower than the regular planner's best."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from meshmorph.cost.model import CostModel
from meshmorph.plan.search import REGULAR, SearchResult, search, search_per_layer
from meshmorph.plan.space import SearchOptions
from meshmorph.schedule.table import Schedule
from meshmorph.spec.catalog import catalog_model, load_model
from meshmorph.spec.cluster import parse_cluster
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import LayerStrategy, Plan, PlanError
from meshmorph.spec.runnable import (
    RUNNABLE_PIPELINE_SCHEDULES,
    layerwise_refusal,
    layerwise_runnable,
)


def _choose(model: ModelSpec, cluster: object, batch: int, options: SearchOptions,
            cost: CostModel) -> SearchResult:
    """What ``plan --layerwise`` returns: the faster of the two spaces' best plans."""
    return search(model, cluster, global_batch=batch,  # type: ignore[arg-type]
                  options=replace(options, layerwise=True), cost=cost)


def _tokens(result: SearchResult) -> float:
    return result.estimates[0].tokens_per_s


def _plans(model: ModelSpec) -> list[Plan]:
    """Plans of 4 devices over many shapes and per-layer assignments, runnable or not."""
    out = []
    shapes = [dict(pp=1, dp=4), dict(pp=2, dp=2, schedule="gpipe"),
              dict(pp=2, dp=2, schedule="1f1b"), dict(pp=2, dp=2, schedule="zb"),
              dict(pp=2, dp=2, schedule="interleaved", vpp=2),
              dict(pp=2, dp=2, schedule="zbv", vpp=2), dict(pp=1, dp=4, dtype="fp16"),
              dict(pp=1, dp=2, tp=2, sequence_parallel=True), dict(pp=1, dp=4, schedule="async")]
    layers = model.num_layers
    for shape in shapes:
        devices = 4 // shape["pp"]
        plan = Plan(model=model.name, seq_len=model.seq_len, global_batch=8,
                    num_microbatches=2, micro_batch=4 // shape["dp"],
                    **{"dtype": "fp32", **shape}  # type: ignore[arg-type]
                    ).with_even_stages(model)
        choices = [LayerStrategy(tp=t, dp=devices // t, zero=z) for t in (1, 2)
                   if devices % t == 0 for z in ((0, 1, 2, 3) if devices // t > 1 else (0,))]
        for embed, head in itertools.product(choices, repeat=2):
            body = choices[len(out) % len(choices)]
            strategies = [embed] + [body] * (layers - 2) + [head]
            stages = tuple(replace(st, layer_strategies=tuple(strategies[st.start:st.stop]))
                           for st in plan.stages)
            out.append(replace(plan, stages=stages))
        if plan.pp > 1:  # one stage without its strategies
            out.append(replace(out[-1], stages=(replace(out[-1].stages[0],
                                                        layer_strategies=None),
                                                *out[-1].stages[1:])))
    return out


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_the_predicate_agrees_with_the_runtime_validation(name: str) -> None:
    from meshmorph.spec.runnable import check_layerwise_runnable as validate_layerwise

    model = catalog_model(name, seq_len=16)
    plans = _plans(model)
    verdicts = []
    for plan in plans:
        try:
            validate_layerwise(model, plan)
            runs = True
        except PlanError as exc:
            runs = False
            assert str(exc) == layerwise_refusal(model, plan)
        assert layerwise_runnable(model, plan) == runs, plan
        verdicts.append(runs)
    assert any(verdicts) and not all(verdicts)  # both kinds among the plans


def test_the_wide_search_picks_a_v_plan_and_the_default_a_runnable_one() -> None:
    model = load_model("llama2-7b", 2048)
    cluster = parse_cluster("a100-80g:2x8")
    cost = CostModel(model, cluster)
    options = SearchOptions(top_k=1)
    wide = search_per_layer(model, cluster, global_batch=64, cost=cost,
                            options=replace(options, runnable_only=False))
    assert (wide.plans[0].schedule.v_shape or wide.plans[0].schedule.split_backward)
    default = search_per_layer(model, cluster, global_batch=64, options=options, cost=cost)
    assert default.runnable
    assert default.plans[0].pp == 1 or default.plans[0].schedule in RUNNABLE_PIPELINE_SCHEDULES
    assert not default.plans[0].sequence_parallel
    assert default.estimates[0].step_time_s >= wide.estimates[0].step_time_s  # a smaller space


def test_every_synchronous_pipeline_schedule_is_runnable() -> None:
    assert set(RUNNABLE_PIPELINE_SCHEDULES) == set(Schedule) - {Schedule.ASYNC}


def test_the_default_search_offers_the_v_plan_the_wide_one_picks() -> None:
    from meshmorph.spec.runnable import check_layerwise_runnable as validate_layerwise

    model = load_model("llama2-7b", 2048)
    cluster = parse_cluster("a100-80g:2x8")
    cost = CostModel(model, cluster)
    options = SearchOptions(top_k=1)
    wide = search_per_layer(model, cluster, global_batch=64, cost=cost,
                            options=replace(options, runnable_only=False))
    assert wide.plans[0].schedule.v_shape and not wide.plans[0].sequence_parallel
    default = search_per_layer(model, cluster, global_batch=64, options=options, cost=cost)
    assert default.runnable and default.plans[0].schedule.v_shape
    assert default.estimates[0].step_time_s == wide.estimates[0].step_time_s
    if any(st.layer_strategies for st in default.plans[0].stages):
        validate_layerwise(model, default.plans[0])


@pytest.mark.parametrize("schedule", ["zb", "zbv", "dualpipev"])
def test_split_backward_searches_offer_no_zero3_layer(schedule: str) -> None:
    """Under a schedule that splits backward, the default search gives no layer ZeRO-3 over
    dp > 1 (the runtime refuses it): with only ZeRO-3 allowed, every layer runs dp 1."""
    model = catalog_model("llama-tiny")
    cluster = parse_cluster("a100-80g:1x4")
    options = SearchOptions(top_k=1, zero_stages=(3,), schedules=(Schedule(schedule),),
                            pp_degrees=(2,))
    result = search_per_layer(model, cluster, global_batch=8, options=options)
    plan = result.plans[0]
    assert result.runnable and plan.schedule == schedule and plan.pp == 2
    layers = [s for st in plan.stages for s in st.layer_strategies or ()] or \
        [LayerStrategy(tp=plan.tp, dp=plan.dp, zero=plan.zero)]
    assert all(s.zero != 3 or s.dp == 1 for s in layers), layers
    assert layerwise_runnable(model, plan)


def test_the_sequence_parallel_plan_the_wide_search_picks_is_runnable_and_offered() -> None:
    from meshmorph.spec.runnable import check_layerwise_runnable as validate_layerwise

    model = load_model("llama2-7b")  # seq 4096
    cluster = parse_cluster("a100-40g:1x4")
    cost = CostModel(model, cluster)
    options = SearchOptions(top_k=1)
    wide = search_per_layer(model, cluster, global_batch=16, cost=cost,
                            options=replace(options, runnable_only=False))
    assert wide.runnable and wide.plans[0].sequence_parallel
    validate_layerwise(model, wide.plans[0])
    default = search_per_layer(model, cluster, global_batch=16, options=options, cost=cost)
    assert default.runnable and default.plans[0].sequence_parallel
    validate_layerwise(model, default.plans[0])
    assert default.estimates[0].step_time_s == pytest.approx(wide.estimates[0].step_time_s, rel=1e-12)


def _tied(pp: int, embed: LayerStrategy, head: LayerStrategy, **kw: object) -> tuple[ModelSpec,
                                                                                    Plan]:
    model = catalog_model("gpt-tiny", seq_len=16)
    devices = 4 // pp
    plan = Plan(model=model.name, seq_len=16, global_batch=8, dp=devices, pp=pp,
                micro_batch=8 // devices // 2, num_microbatches=2, dtype="fp32",
                **kw).with_even_stages(model)  # type: ignore[arg-type]
    body = LayerStrategy(tp=1, dp=devices, zero=0)
    strategies = [embed] + [body] * (model.num_layers - 2) + [head]
    return model, replace(plan, stages=tuple(
        replace(st, layer_strategies=tuple(strategies[st.start:st.stop])) for st in plan.stages))


def test_a_tied_embedding_and_head_run_apart_under_one_layout() -> None:
    zero3, zero1, tp2 = (LayerStrategy(tp=1, dp=2, zero=3), LayerStrategy(tp=1, dp=2, zero=1),
                         LayerStrategy(tp=2, dp=1, zero=0))
    for schedule in ("gpipe", "1f1b"):  # two copies on two stages: FSDP2 may shard each
        assert layerwise_refusal(*_tied(2, zero3, zero3, schedule=schedule)) is None
        assert layerwise_refusal(*_tied(2, tp2, tp2, schedule=schedule)) is None
        assert "same tp and ZeRO" in str(layerwise_refusal(*_tied(2, tp2, zero1,
                                                                  schedule=schedule)))
        assert "same tp and ZeRO" in str(layerwise_refusal(*_tied(2, zero1, zero3,
                                                                  schedule=schedule)))
    for schedule in ("zb", "interleaved"):  # the two copies are kept equal under gpipe/1f1b
        refusal = layerwise_refusal(*_tied(2, tp2, tp2, schedule=schedule))
        assert refusal is not None and "gpipe or 1f1b" in refusal
    # in one chunk it is one matrix for two modules, which FSDP2 does not shard
    one = LayerStrategy(tp=1, dp=4, zero=3)
    assert "zero 0 or 1" in str(layerwise_refusal(*_tied(1, one, one)))
    assert layerwise_refusal(*_tied(1, LayerStrategy(tp=1, dp=4, zero=1),
                                    LayerStrategy(tp=1, dp=4, zero=1))) is None


def test_sequence_parallelism_runs_where_every_layer_tp_divides_the_sequence() -> None:
    model = catalog_model("llama-tiny", seq_len=6)
    plan = Plan(model=model.name, seq_len=6, global_batch=8, tp=2, dp=2, micro_batch=2,
                num_microbatches=2, dtype="fp32", sequence_parallel=True
                ).with_even_stages(model)

    def assigned(tps: list[int]) -> Plan:
        return replace(plan, stages=(replace(plan.stages[0], layer_strategies=tuple(
            LayerStrategy(tp=t, dp=4 // t, zero=0) for t in tps)),))

    assert layerwise_refusal(model, assigned([2, 1, 2, 1, 2, 2])) is None
    model8 = catalog_model("llama-tiny", seq_len=8)
    assert layerwise_refusal(model8, replace(assigned([2, 1, 2, 1, 2, 2]), seq_len=8)) is None
    assert plan.sequence_parallel
    mha = replace(model, num_kv_heads=4)  # tp 4 must split the heads; 4 does not divide 6
    refusal = layerwise_refusal(mha, assigned([2, 4, 2, 1, 2, 2]))
    assert refusal is not None and "does not divide" in refusal and "sequence" in refusal


@pytest.mark.parametrize("zeros", [(0, 3), (3,), (2,)])
def test_a_tied_embedding_gets_one_runnable_layout_for_embedding_and_head(zeros: tuple) -> None:
    from meshmorph.spec.runnable import check_layerwise_runnable as validate_layerwise

    model = catalog_model("gpt-tiny")
    cluster = parse_cluster("a100-80g:1x4")
    cost = CostModel(model, cluster)
    options = SearchOptions(top_k=1, zero_stages=zeros, max_micro_batch=8)
    wide = search_per_layer(model, cluster, global_batch=8, cost=cost,
                            options=replace(options, runnable_only=False))
    default = search_per_layer(model, cluster, global_batch=8, options=options, cost=cost)
    assert default.runnable
    if any(st.layer_strategies for st in default.plans[0].stages):
        validate_layerwise(model, default.plans[0])
    assert default.estimates[0].step_time_s >= wide.estimates[0].step_time_s


def test_the_regular_plan_is_returned_where_it_is_faster() -> None:
    model = load_model("llama2-7b", 2048)
    cluster = parse_cluster("a100-80g:2x8")
    cost = CostModel(model, cluster)
    choice = _choose(model, cluster, 64, SearchOptions(top_k=1), cost)
    assert choice.layerwise is not None and choice.regular is not None
    assert _tokens(choice.regular) > choice.layerwise.estimates[0].tokens_per_s
    assert choice.source == REGULAR and choice.runnable
    assert choice.plans[0] == choice.regular.plans[0]
    assert all(st.layer_strategies is None for st in choice.plans[0].stages)
    assert choice.estimates[0].tokens_per_s == _tokens(choice.regular)


def test_the_layerwise_plan_is_returned_where_it_is_faster() -> None:
    model = load_model("llama2-7b", 2048)
    cluster = parse_cluster("a100-40g:1x8")
    cost = CostModel(model, cluster)
    choice = _choose(model, cluster, 16, SearchOptions(top_k=1), cost)
    assert choice.layerwise is not None and choice.regular is not None
    best = max(choice.layerwise.estimates[0].tokens_per_s, _tokens(choice.regular))
    assert choice.estimates[0].tokens_per_s == best
    assert choice.source == ("layerwise" if choice.layerwise.estimates[0].tokens_per_s
                             > _tokens(choice.regular) else REGULAR)


def test_fp16_layerwise_search_is_refused_and_the_regular_plan_returned() -> None:
    model = catalog_model("llama-tiny")
    cluster = parse_cluster("a100-80g:1x4")
    cost = CostModel(model, cluster)
    options = SearchOptions(top_k=1, dtype="fp16")
    with pytest.raises(PlanError, match="fp32 or bf16"):
        search_per_layer(model, cluster, global_batch=8, options=options, cost=cost)
    choice = _choose(model, cluster, 8, options, cost)
    assert choice.source == REGULAR and choice.layerwise is None
    assert "fp16" in choice.errors["layerwise"]
