"""The runtime refuses an overlap switch it does not realise, before any process starts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from meshmorph.run.engine.train_engine import defers_grad_reduce, validate_plan
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.plan import Plan, PlanError, load_plan

MODEL = catalog_model("gpt-tiny", seq_len=16)


def _plan(**kw: object) -> Plan:
    fields: dict[str, object] = {"dp": 2, "global_batch": 4, "num_microbatches": 2, **kw}
    return Plan(model=MODEL.name, seq_len=16, **fields).with_even_stages(MODEL)  # type: ignore[arg-type]


def test_tp_comm_overlap_is_refused_on_cpu_naming_what_to_set() -> None:
    plan = _plan(tp=2, dp=1, global_batch=2, sequence_parallel=True, tp_comm_overlap=True,
                 compile=True)
    with pytest.raises(PlanError, match="CPU processes cannot run; set tp_comm_overlap false"):
        validate_plan(MODEL, plan, 2, cuda=False)


def test_tp_comm_overlap_runs_on_cuda_as_async_tp_of_compiled_blocks() -> None:
    """On CUDA ranks the plan runs as torch's async TP, which inductor applies to compiled
    blocks: refused without compile, accepted with it."""
    plan = _plan(tp=2, dp=1, global_batch=2, sequence_parallel=True, tp_comm_overlap=True)
    with pytest.raises(PlanError, match="set compile true"):
        validate_plan(MODEL, plan, 2, cuda=True)
    validate_plan(MODEL, replace(plan, compile=True), 2, cuda=True)
    # the other rules still hold on CUDA: a reduction after the backward under tp is refused
    with pytest.raises(PlanError, match="set overlap_grad_reduce true"):
        validate_plan(MODEL, _plan(tp=2, overlap_grad_reduce=False), 4, cuda=True)


def test_the_async_tp_example_plan_runs_on_two_cuda_ranks_only() -> None:
    path = Path(__file__).parents[2] / "examples" / "plans" / "gpt-tiny-tp2-async-tp.json"
    plan = load_plan(path)
    model = catalog_model(plan.model, seq_len=plan.seq_len)
    assert plan.tp_comm_overlap and plan.compile and plan.world_size == 2
    validate_plan(model, plan, 2, cuda=True)
    with pytest.raises(PlanError, match="CPU processes cannot run"):
        validate_plan(model, plan, 2, cuda=False)


@pytest.mark.parametrize("kw", [{"zero": 2}, {"zero": 3}, {"tp": 2}, {"pp": 2}])
def test_gradient_reduction_after_backward_is_refused_off_the_ddp_path(kw: dict) -> None:
    plan = _plan(overlap_grad_reduce=False, **kw)
    with pytest.raises(PlanError, match="set overlap_grad_reduce true"):
        validate_plan(MODEL, plan, plan.world_size)
    assert not defers_grad_reduce(plan)


def test_no_data_parallel_replica_has_nothing_to_refuse() -> None:
    plan = _plan(dp=1, global_batch=2, overlap_grad_reduce=False)
    validate_plan(MODEL, plan, 1)
    assert not defers_grad_reduce(plan)


@pytest.mark.parametrize("zero", [0, 1])
def test_gradient_reduction_after_backward_runs_on_ddp(zero: int) -> None:
    plan = _plan(zero=zero, overlap_grad_reduce=False)
    validate_plan(MODEL, plan, 2)
    assert defers_grad_reduce(plan)
    assert not defers_grad_reduce(_plan(zero=zero))


def test_fsdp_prefetch_off_runs() -> None:
    validate_plan(MODEL, _plan(zero=3, fsdp_prefetch=False), 2)
