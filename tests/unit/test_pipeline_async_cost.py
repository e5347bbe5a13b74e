"""Asynchronous 1F1B priced by the event simulator, and the memory of its weight copies."""

from __future__ import annotations

import pytest

from meshmorph.cost.model import CostModel
from meshmorph.cost.pipeline import async_steady_step, simulate, weight_copies
from meshmorph.plan.search import PlanDoesNotFit, search
from meshmorph.plan.space import SearchOptions
from meshmorph.schedule.table import Schedule
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.cluster import parse_cluster
from meshmorph.spec.plan import Plan


@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 8), (3, 1)])
def test_equal_stages_steady_step_has_no_flush_bubble(p: int, m: int) -> None:
    t = async_steady_step(p, m, [1.0] * p, [2.0] * p, step_s=[0.5] * p)
    assert t.makespan_s == pytest.approx(m * 3.5)  # m x (F + B + STEP): no fill, no drain
    assert t.bubble_fraction == pytest.approx(0.0)
    flushed = simulate(Schedule.ONE_F_ONE_B, p, max(m, p), [1.0] * p, [2.0] * p).makespan_s
    assert t.makespan_s / m < flushed / max(m, p) or p == 1


def test_unequal_stages_are_paced_by_the_slowest_and_the_others_wait() -> None:
    fwd, bwd = [1.0, 1.0, 3.0, 1.0], [2.0, 2.0, 6.0, 2.0]
    t = async_steady_step(4, 8, fwd, bwd)
    assert t.makespan_s == pytest.approx(8 * 9.0)  # the slowest stage's F + B per micro-batch
    assert t.rank_busy_s[2] == pytest.approx(t.makespan_s)
    assert t.bubble_fraction == pytest.approx(1 - (3 * 3 + 9) / (4 * 9))


def test_transfers_on_the_critical_loop_show_in_the_steady_state() -> None:
    # stage 0 -> 1 -> 0 with 1 s each way: the loop F0 -> F1 -> B1 -> B0 holds two micro-batches
    base = async_steady_step(2, 4, [1.0, 1.0], [1.0, 1.0])
    slow = async_steady_step(2, 4, [1.0, 1.0], [1.0, 1.0], p2p_s=[5.0, 0.0])
    assert slow.makespan_s > base.makespan_s


@pytest.mark.parametrize("mode,expected", [("none", (0, 0, 0, 0)), ("stash", (4, 3, 2, 1)),
                                           ("sgd", (4, 3, 2, 1)), ("adam", (4, 3, 2, 1)),
                                           ("2bw", (2, 2, 2, 1))])
def test_weight_copies_per_rank(mode: str, expected: tuple[int, ...]) -> None:
    assert tuple(weight_copies(Schedule.ASYNC, mode, 4, k, 8) for k in range(4)) == expected
    assert weight_copies(Schedule.ASYNC, mode, 4, 0, 2) == min(expected[0], 2)  # m in flight
    assert weight_copies(Schedule.ONE_F_ONE_B, "none", 4, 0, 8) == 0


def _plan(mode: str) -> Plan:
    model = catalog_model("gpt3-1.3b")
    return Plan(model=model.name, seq_len=model.seq_len, global_batch=8, pp=4,
                num_microbatches=8, schedule=Schedule.ASYNC,
                weight_prediction=mode).with_even_stages(model)


def test_stashed_copies_add_fp32_weights_per_micro_batch_in_flight() -> None:
    cost = CostModel(catalog_model("gpt3-1.3b"), parse_cluster("h100:1x4"))
    none = cost.estimate(_plan("none"))
    for mode, copies in (("stash", (4, 3, 2, 1)), ("2bw", (2, 2, 2, 1))):
        est = cost.estimate(_plan(mode))
        assert est.step_time_s == none.step_time_s
        for k, (a, b) in enumerate(zip(est.memory, none.memory, strict=True)):
            params = b.grads / 4.0  # fp32 gradients: 4 bytes per parameter
            assert a.total - b.total == pytest.approx(copies[k] * 4.0 * params)


def test_async_step_prices_one_optimizer_step_per_micro_batch() -> None:
    cost = CostModel(catalog_model("gpt3-1.3b"), parse_cluster("h100:1x4"))
    plan = _plan("none")
    gpu = cost.stage_gpu(plan.stages[0])
    once = [cost.rank_tail(plan, cost.chunk_params(s.start, s.stop, 1), 0.0, gpu)[1]
            for s in plan.stages]
    est = cost.estimate(plan)
    assert any(est.breakdown_s["optimizer"] == pytest.approx(8 * t) for t in once)
    assert min(once) > 0


def test_planner_refuses_async_where_the_weight_copies_do_not_fit() -> None:
    model, cluster = catalog_model("gpt3-2.7b"), parse_cluster("v100-16g:1x4")

    def best(mode: str) -> float:
        options = SearchOptions(schedules=(Schedule.ASYNC,), pp_degrees=(4,), tp_degrees=(1,),
                                zero_stages=(0,), max_micro_batch=1, weight_prediction=mode)
        result = search(model, cluster, global_batch=8, options=options)
        assert all(p.weight_prediction == mode for p in result.plans)
        return result.estimates[0].step_time_s

    assert best("none") > 0  # stale weights fit 16 GB per stage
    for mode in ("stash", "2bw", "sgd"):  # their copies do not, whatever the recompute
        with pytest.raises(PlanDoesNotFit):
            best(mode)


def test_v_schedules_in_flight_equals_the_simulated_peak_of_their_lists() -> None:
    from meshmorph.cost.rank_terms import in_flight_microbatches
    from meshmorph.schedule.simulator import schedule_program

    for schedule in (Schedule.ZBV, Schedule.DUALPIPEV):
        for p in range(2, 7):  # (pp 1 holds one micro-batch: gradient accumulation)
            for m in range(2 * p if schedule == Schedule.DUALPIPEV else 1, 4 * p + 2):
                peaks = schedule_program(str(schedule), p, m, 2).peak_activations
                assert [in_flight_microbatches(schedule, p, k, m, 2) for k in range(p)] == \
                    [peak / 2 for peak in peaks], (schedule, p, m)
