"""Plan JSON round-trips exactly; bad plans are refused with messages that name the mismatch."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshmorph.schedule.table import Schedule
from meshmorph.spec.model import Recompute
from meshmorph.spec.plan import Plan, PlanError, StagePlan
from meshmorph.spec.transformer import TransformerShape, build_transformer

MODEL = build_transformer(TransformerShape(name="gpt-6h", arch="gpt", num_layers=4,
                                           hidden_size=384, num_heads=6, vocab_size=1000,
                                           seq_len=256))


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    tp, pp, dp = (draw(st.integers(1, 4)) for _ in range(3))
    schedule = draw(st.sampled_from(tuple(Schedule)))
    vpp = draw(st.integers(2, 3)) if schedule == Schedule.INTERLEAVED else \
        2 if schedule in (Schedule.ZBV, Schedule.DUALPIPEV) else 1  # a V: two chunks per rank
    micro_batch, m = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    chunks = pp * vpp
    num_layers = chunks + draw(st.integers(0, 6))
    cuts = sorted(draw(st.sets(st.integers(1, num_layers - 1), min_size=chunks - 1,
                               max_size=chunks - 1))) if chunks > 1 else []
    bounds = [0, *cuts, num_layers]
    gpu = st.none() | st.sampled_from(("h100", "a100-80g", "v100-32g"))
    stages = tuple(
        StagePlan(start=bounds[i], stop=bounds[i + 1],
                  recompute=tuple(draw(st.lists(st.sampled_from(tuple(Recompute)),
                                                min_size=bounds[i + 1] - bounds[i],
                                                max_size=bounds[i + 1] - bounds[i]))),
                  gpu=draw(gpu))
        for i in range(chunks))
    figures = st.floats(allow_nan=False, allow_infinity=False)
    predicted = draw(st.none() | st.dictionaries(st.sampled_from(("step_time_s", "mfu", "tokens_per_s")),
                                                 figures))
    return Plan(model=draw(st.sampled_from(("gpt2-small", "llama-7b", "configs/x.json"))),
                seq_len=draw(st.integers(1, 8192)), global_batch=dp * micro_batch * m, tp=tp,
                pp=pp, dp=dp, zero=draw(st.integers(0, 3)), micro_batch=micro_batch,
                num_microbatches=m, schedule=schedule, vpp=vpp,
                sequence_parallel=draw(st.booleans()) and tp > 1,
                dtype=draw(st.sampled_from(("bf16", "fp16", "fp32"))), stages=stages,
                predicted=predicted)


@settings(max_examples=200, deadline=None)
@given(plan=plans())
def test_plan_json_round_trips_exactly(plan: Plan) -> None:
    text = plan.to_json()
    back = Plan.from_json(text)
    assert back == plan
    assert back.predicted == plan.predicted  # not part of ==, so checked on its own
    assert back.to_json() == text
    assert json.loads(text)["world_size"] == plan.tp * plan.pp * plan.dp


def _plan(**changes) -> Plan:  # type: ignore[no-untyped-def]
    base = Plan(model="gpt-6h", seq_len=256, global_batch=4, tp=2, pp=2, dp=2, num_microbatches=2)
    return replace(base.with_even_stages(MODEL), **changes)


def test_from_dict_refuses_unknown_keys_and_names_them() -> None:
    data = _plan().to_dict()
    data["pipline_parallel"] = 4
    with pytest.raises(PlanError, match="unknown keys: pipline_parallel"):
        Plan.from_dict(data)


def test_from_dict_refuses_a_world_size_that_is_not_the_product_of_degrees() -> None:
    data = _plan().to_dict()
    data["world_size"] = 16
    with pytest.raises(PlanError, match=r"world_size 16 but tp x pp x dp = 8"):
        Plan.from_dict(data)


def test_load_reads_the_first_plan_of_a_search_report(tmp_path) -> None:  # type: ignore[no-untyped-def]
    plan = _plan()
    path = tmp_path / "plans.json"
    path.write_text(json.dumps({"plans": [plan.to_dict(), _plan(zero=3).to_dict()]}))
    assert Plan.load(path) == plan
    with pytest.raises(PlanError, match="does not exist"):
        Plan.load(tmp_path / "missing.json")


def test_check_against_names_degrees_that_do_not_make_the_world_size() -> None:
    with pytest.raises(PlanError, match=r"tp 2 x pp 2 x dp 2 = 8 ranks, but the job has 6"):
        _plan().check_against(MODEL, world_size=6)
    _plan().check_against(MODEL, world_size=8)


def test_check_against_names_stages_that_do_not_cover_the_layers() -> None:
    plan = _plan()
    short = replace(plan, stages=(plan.stages[0], StagePlan(
        start=plan.stages[1].start, stop=MODEL.num_layers - 1,
        recompute=plan.stages[1].recompute[:-1])))
    with pytest.raises(PlanError, match=r"cover layers \[0, 5\) but model gpt-6h has 6 layers"):
        short.check_against(MODEL)
    gap = replace(plan, stages=(plan.stages[0], StagePlan(
        start=plan.stages[1].start + 1, stop=MODEL.num_layers,
        recompute=plan.stages[1].recompute[1:])))
    with pytest.raises(PlanError, match=r"stage 1 starts at layer 4, expected 3"):
        gap.check_against(MODEL)
    with pytest.raises(PlanError, match="lists no stages"):
        replace(plan, stages=()).check_against(MODEL)


def test_check_against_names_a_tp_that_does_not_divide_the_heads() -> None:
    plan = replace(_plan(), tp=4)
    with pytest.raises(PlanError, match="tp 4 does not divide num_heads 6"):
        plan.check_against(MODEL)


def test_check_against_names_a_layer_that_cannot_use_its_recompute() -> None:
    plan = _plan()
    first = plan.stages[0]
    embed_full = replace(first, recompute=(Recompute.FULL, *first.recompute[1:]))
    with pytest.raises(PlanError, match="layer embed cannot use recompute 'full'"):
        replace(plan, stages=(embed_full, plan.stages[1])).check_against(MODEL)


def test_plan_refuses_inconsistent_batch_and_schedule_at_construction() -> None:
    with pytest.raises(PlanError, match=r"global_batch 9 != dp 2 x micro_batch 1 x "
                                        r"num_microbatches 4 = 8"):
        Plan(model="m", seq_len=8, global_batch=9, dp=2, num_microbatches=4)
    with pytest.raises(PlanError, match="vpp 2 > 1 needs schedule 'interleaved'"):
        Plan(model="m", seq_len=8, global_batch=4, pp=2, vpp=2, num_microbatches=4)
    with pytest.raises(PlanError, match="needs num_microbatches >= pp"):
        replace(_plan(num_microbatches=1, global_batch=2), schedule=Schedule.ONE_F_ONE_B) \
            .check_against(MODEL)
