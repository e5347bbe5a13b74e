"""The overlap switches of a Plan, priced by hand: off, the collective is fully exposed; on, the
overlap formula (a share hidden up to the compute beside it, the last gradient bucket never,
hidden seconds slowing compute by ``overlap_slowdown``); and the planner choosing them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshmorph.cost import comm
from meshmorph.cost.coefficients import CostCoefficients
from meshmorph.cost.model import CostModel
from meshmorph.cost.profile import Profile
from meshmorph.plan.brute_force import brute_force
from meshmorph.plan.search import search
from meshmorph.plan.space import SearchOptions
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.cluster import parse_cluster
from meshmorph.spec.model import Recompute
from meshmorph.spec.plan import Plan, PlanError

MODEL = catalog_model("gpt3-1.3b", seq_len=1024)
CLUSTER = parse_cluster("a100-80g:1x8")


def _plan(**kw: object) -> Plan:
    fields: dict[str, object] = {"dp": 2, "global_batch": 4, "num_microbatches": 2, **kw}
    return Plan(model=MODEL.name, seq_len=1024, **fields).with_even_stages(MODEL)  # type: ignore[arg-type]


def test_overlap_formula_by_hand() -> None:
    # 10 s of traffic, 40% may hide, 3 s of compute beside it, 1 s never hides
    assert comm.overlapped([(10.0, 0.4)], 3.0, 0.0) == pytest.approx(7.0)
    assert comm.overlapped([(10.0, 0.4)], 30.0, 0.0) == pytest.approx(6.0)
    assert comm.overlapped([(10.0, 1.0)], 30.0, 0.0, least_exposed_s=1.0) == pytest.approx(1.0)
    # hidden seconds slow the compute: 3 s hidden at slowdown 0.2 add 0.6 s
    assert comm.overlapped([(10.0, 0.4)], 3.0, 0.2) == pytest.approx(7.6)
    assert comm.overlapped([(10.0, 0.0)], 30.0, 0.2) == pytest.approx(10.0)  # off: all exposed
    for window in (0.0, 2.0, 5.0, 100.0):  # one part, no slowdown: the old exposed()
        assert comm.overlapped([(4.0, 0.7)], window, 0.0) == pytest.approx(
            max(4.0 * (1.0 - 0.7), 4.0 - window, 0.0))


def test_gradient_reduction_off_is_fully_exposed_and_on_follows_the_bucket_formula() -> None:
    cost = CostModel(MODEL, CLUSTER)
    gpu = cost.default_gpu()
    params = cost.chunk_params(0, MODEL.num_layers, 1)
    link = cost.group_link(gpu, 2)
    reduce = comm.all_reduce(2, params * 4, link)  # fp32 gradients, ZeRO-0
    off = _plan(overlap_grad_reduce=False)
    on = _plan()
    for window in (0.0, 0.01, 10.0):
        assert cost.rank_tail(off, params, window, gpu)[0] == pytest.approx(reduce)
    coef = cost.coef
    last = reduce * coef.grad_bucket_bytes / (params * 4)  # the last 25 MiB bucket
    for window in (0.0, 0.01, 10.0):
        hidden = min(reduce * coef.dp_overlap, window, reduce - last)
        expected = reduce - hidden + coef.overlap_slowdown * hidden
        assert cost.rank_tail(on, params, window, gpu)[0] == pytest.approx(expected)
    assert cost.rank_tail(on, params, 10.0, gpu)[0] < cost.rank_tail(off, params, 10.0, gpu)[0]
    # the estimate: on is faster by what hides, and the breakdown says so
    est_on, est_off = cost.estimate(on), cost.estimate(off)
    assert est_off.breakdown_s["dp_comm_exposed"] == pytest.approx(reduce)
    assert est_on.step_time_s < est_off.step_time_s
    assert est_on.memory == est_off.memory  # DDP's buckets are the gradients: no memory


def test_zero3_prefetch_hides_gathers_and_holds_one_more_unit() -> None:
    cost = CostModel(MODEL, CLUSTER)
    gpu = cost.default_gpu()
    plans = {(pf, ogr): _plan(zero=3, fsdp_prefetch=pf, overlap_grad_reduce=ogr)
             for pf in (True, False) for ogr in (True, False)}
    params = cost.chunk_params(0, MODEL.num_layers, 1)
    gathers, scatter = cost.microbatch_dp_traffic(plans[True, True], params, gpu)
    assert gathers > 0 and scatter > 0
    times = {k: cost.chunk_time(p, 0, MODEL.num_layers, p.stages[0].recompute, gpu)
             for k, p in plans.items()}
    assert times[False, False].zero3_comm_s == pytest.approx(gathers + scatter)  # all exposed
    f = times[False, False].fwd_s - gathers / 2  # the forward's compute
    share, slow = cost.coef.zero3_overlap, cost.coef.overlap_slowdown
    hidden_f = min(gathers / 2 * share, f)
    assert times[True, False].fwd_s - f == pytest.approx(gathers / 2 - hidden_f * (1 - slow))
    assert times[True, True].zero3_comm_s < times[True, False].zero3_comm_s \
        < times[False, False].zero3_comm_s
    # memory: one more gathered unit (the largest block, in the compute dtype) with prefetch
    on, off = cost.estimate(plans[True, True]), cost.estimate(plans[False, True])
    block = max(cost.chunk_params(i, i + 1, 1) for i in range(MODEL.num_layers))
    assert on.memory[0].buffers - off.memory[0].buffers == pytest.approx(block * 2)


def test_tp_comm_overlap_hides_at_most_the_ring_steps_after_the_first() -> None:
    cost = CostModel(MODEL, CLUSTER)
    gpu = cost.default_gpu()
    off = _plan(tp=2, dp=1, global_batch=2, sequence_parallel=True)
    on = replace(off, tp_comm_overlap=True)
    lay_off = cost.layer_coster("bf16").layer(1, gpu, 1, 2, True, Recompute.NONE)
    lay_on = cost.layer_coster("bf16", tp_comm_overlap=True).layer(1, gpu, 1, 2, True, Recompute.NONE)
    fwd_comm = lay_off.fwd_s - lay_on.fwd_s  # what overlap saved in forward
    total = MODEL.layers[1].tp_allreduces_fwd * comm.all_reduce(
        2, 1024 * MODEL.hidden_size * 2, cost.intra[gpu.name])
    hidden = min(total * cost.coef.tp_overlap / 2, lay_off.fwd_s - total)
    assert fwd_comm == pytest.approx(hidden * (1 - cost.coef.overlap_slowdown))
    assert cost.estimate(on).step_time_s < cost.estimate(off).step_time_s
    # userbuffers: tp_overlap_buffers x b s h in the compute dtype, reserved on every rank
    extra = cost.estimate(on).memory[0].reserved - cost.estimate(off).memory[0].reserved
    assert extra == pytest.approx(cost.coef.tp_overlap_buffers * 1024 * MODEL.hidden_size * 2)
    with pytest.raises(PlanError, match="sequence_parallel"):
        replace(off, sequence_parallel=False, tp_comm_overlap=True)


def test_oversubscribed_cpu_profile_keeps_every_switch_without_overlap() -> None:
    cost = CostModel(MODEL, CLUSTER, profile=Profile(cores=2, processes=2))
    for kw in ({"zero": 0}, {"zero": 3}):
        on, off = _plan(**kw), _plan(fsdp_prefetch=False, overlap_grad_reduce=False, **kw)
        assert cost.estimate(on).step_time_s == pytest.approx(cost.estimate(off).step_time_s)


def _tight_cluster(budget_gib: float) -> object:
    cluster = parse_cluster("a100-80g:1x4")
    group = cluster.groups[0]
    return replace(cluster, groups=(replace(group, gpu=replace(group.gpu, memory_gib=budget_gib)),))


def test_planner_prefetches_when_it_pays_and_not_when_memory_forbids() -> None:
    model = catalog_model("gpt3-1.3b", seq_len=1024)
    options = SearchOptions(top_k=1, pp_degrees=(1,), tp_degrees=(1,), zero_stages=(3,),
                            recompute=(Recompute.NONE,), max_micro_batch=1, tolerance=0.0)
    base = CostModel(model, _tight_cluster(80))
    plan = Plan(model=model.name, seq_len=1024, dp=4, zero=3, global_batch=4) \
        .with_even_stages(model)
    need_on = base.estimate(plan).memory[0].total
    need_off = base.estimate(replace(plan, fsdp_prefetch=False)).memory[0].total
    assert need_off < need_on
    # the allocator reserve is a share of the budget: the budget between the two needs
    reserve = base.coef.memory_reserve_fraction
    fixed = [need - reserve * 80 * 2**30 for need in (need_on, need_off)]
    between = sum(fixed) / 2 / (1 - reserve) / 2**30
    for budget, expected in ((80.0, True), (between, False)):
        cluster = _tight_cluster(budget)
        found = search(model, cluster, global_batch=4, options=options)
        assert found.plans[0].fsdp_prefetch is expected, budget
        brute_plan, brute = brute_force(model, cluster, global_batch=4, options=options)
        assert brute_plan.fsdp_prefetch is expected
        assert found.estimates[0].step_time_s == pytest.approx(brute.step_time_s)
    # the planner tries both only where they trade memory for time
    options_both = SearchOptions(top_k=1, pp_degrees=(1,), zero_stages=(0, 3))
    from meshmorph.plan.space import configurations
    configs = list(configurations(model, _tight_cluster(80), 4, options_both))
    assert {c.plan.fsdp_prefetch for c in configs if c.plan.zero == 0} == {True}
    assert {c.plan.fsdp_prefetch for c in configs if c.plan.zero == 3 and c.plan.dp > 1} \
        == {True, False}


def test_old_plan_json_loads_with_the_switch_defaults() -> None:
    data = _plan().to_dict()
    for key in ("overlap_grad_reduce", "tp_comm_overlap", "fsdp_prefetch"):
        del data[key]
    plan = Plan.from_dict(data)
    assert (plan.overlap_grad_reduce, plan.tp_comm_overlap, plan.fsdp_prefetch) == \
        (True, False, True)
    assert Plan.from_json(_plan(fsdp_prefetch=False).to_json()).fsdp_prefetch is False


def test_coefficients_bounds() -> None:
    with pytest.raises(ValueError, match="overlap_slowdown"):
        CostCoefficients(overlap_slowdown=1.0)


def test_planner_weighs_tp_comm_overlap_against_its_buffers_as_brute_force_does() -> None:
    model = catalog_model("gpt3-1.3b", seq_len=1024)
    options = SearchOptions(top_k=1, pp_degrees=(1,), tp_degrees=(2,), zero_stages=(0,),
                            sequence_parallel=(True,), tp_comm_overlap=(False, True),
                            recompute=(Recompute.NONE,), max_micro_batch=1, tolerance=0.0)
    base = CostModel(model, _tight_cluster(80))
    plan = Plan(model=model.name, seq_len=1024, tp=2, dp=2, global_batch=2,
                sequence_parallel=True).with_even_stages(model)
    need_off = base.estimate(plan).memory[0].total
    need_on = base.estimate(replace(plan, tp_comm_overlap=True)).memory[0].total
    assert need_on > need_off
    reserve = base.coef.memory_reserve_fraction
    fixed = [need - reserve * 80 * 2**30 for need in (need_on, need_off)]
    between = sum(fixed) / 2 / (1 - reserve) / 2**30
    for budget, expected in ((80.0, True), (between, False)):
        cluster = _tight_cluster(budget)
        found = search(model, cluster, global_batch=2, options=options)
        assert found.plans[0].tp_comm_overlap is expected, budget
        brute_plan, brute = brute_force(model, cluster, global_batch=2, options=options)
        assert brute_plan.tp_comm_overlap is expected
        assert found.estimates[0].step_time_s == pytest.approx(brute.step_time_s)
    # by default the planner leaves it off (the runtime cannot run it)
    default = search(model, _tight_cluster(80), global_batch=2,
                     options=replace(options, tp_comm_overlap=(False,)))
    assert default.plans[0].tp_comm_overlap is False
