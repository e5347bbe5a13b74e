"""The event simulator against the closed forms for uniform stages, peak activations per rank,
and the steady state of asynchronous 1F1B. Times are small whole numbers: every sum is exact."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshmorph.schedule import StageTimes, schedule_actions, simulate_actions
from meshmorph.schedule.simulator import local_transfers_zeroed, simulate_schedule

PM = [(2, 2), (2, 7), (3, 3), (4, 4), (4, 8), (4, 13), (6, 12)]


def uniform(stages: int, f: float, b: float, i: float | None = None, w: float | None = None,
            p2p: float = 0.0) -> StageTimes:
    return StageTimes([f] * stages, [b] * stages, igrad_s=None if i is None else [i] * stages,
                      wgrad_s=None if w is None else [w] * stages, p2p_s=[p2p] * stages)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", PM)
def test_gpipe_and_1f1b_bubble_fraction_is_p_minus_1_over_m_plus_p_minus_1(name: str, p: int,
                                                                           m: int) -> None:
    t = simulate_schedule(name, p, m, uniform(p, 1.0, 2.0))
    assert t.makespan_s == (m + p - 1) * 3.0
    # idle share of the makespan: (p - 1) / (m + p - 1), i.e. (p - 1) / m of the ideal time
    assert t.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-12)


@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 12), (4, 10)])
def test_interleaved_bubble_is_p_minus_1_over_v_of_a_micro_batch(p: int, m: int, v: int) -> None:
    # one rank's layers take f = 6, b = 12, split into v chunks; (4, 10) runs torch's rounds of 5
    t = simulate_schedule("interleaved", p, m, uniform(p * v, 6.0 / v, 12.0 / v), v=v)
    if m % p == 0:
        assert t.makespan_s == pytest.approx(m * 18.0 + (p - 1) * 18.0 / v, rel=1e-12)
    else:  # rounds of m // (m // p) micro-batches: never better than the closed form
        assert t.makespan_s >= m * 18.0 + (p - 1) * 18.0 / v


@pytest.mark.parametrize("p,m", PM)
def test_zb_h1_bubble_is_p_minus_1_times_f_plus_b_minus_w(p: int, m: int) -> None:
    t = simulate_schedule("zb", p, m, uniform(p, 1.0, 2.0, i=1.0, w=1.0))
    assert t.makespan_s == m * 3.0 + (p - 1) * (1.0 + 1.0 - 1.0)


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 16)])
def test_zbv_halves_zb_h1_bubble_at_the_same_work_per_rank(p: int, m: int) -> None:
    # a rank's layers: F = I = W = 2 under ZB-H1, two V chunks of 1 each under ZBV
    zbv = simulate_schedule("zbv", p, m, uniform(2 * p, 1.0, 2.0, i=1.0, w=1.0), v=2)
    zb = simulate_schedule("zb", p, m, uniform(p, 2.0, 4.0, i=2.0, w=2.0))
    assert zb.makespan_s - m * 6.0 == 2.0 * (p - 1)
    assert zbv.makespan_s - m * 6.0 == 1.0 * (p - 1)


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 12)])
def test_peak_activations_per_rank(p: int, m: int) -> None:
    def peaks(name: str, v: int = 1) -> tuple[int, ...]:
        stages = p * (2 if name in ("zbv", "dualpipev") else v)
        return simulate_schedule(name, p, m, uniform(stages, 1.0, 2.0, i=1.0, w=1.0),
                                 v=v).peak_activations

    assert peaks("gpipe") == (m,) * p
    assert peaks("1f1b") == tuple(p - r for r in range(p))
    assert peaks("async") == tuple(p - r for r in range(p))
    assert peaks("zb") == (p,) * p  # W delayed by r backwards on rank r: p held everywhere
    assert peaks("interleaved", 2) == tuple(p + 2 * (p - 1 - r) + 1 for r in range(p))
    assert peaks("zbv", 2) == (2 * p,) * p  # 2p half-size chunks: 1F1B's first-stage memory
    assert peaks("dualpipev", 2) == (2 * p + 1,) * p


def test_point_to_point_delays_add_on_every_cross_rank_hop_and_not_at_the_v_turn() -> None:
    p, m = 3, 4
    base = simulate_schedule("gpipe", p, m, uniform(p, 1.0, 2.0)).makespan_s
    delayed = simulate_schedule("gpipe", p, m, uniform(p, 1.0, 2.0, p2p=0.5)).makespan_s
    assert delayed == base + 2 * (p - 1) * 0.5
    assert local_transfers_zeroed("zbv", 3, 2, [0.5] * 6) == [0.5, 0.5, 0.0, 0.5, 0.5, 0.5]


def test_any_action_list_simulates_like_its_named_schedule() -> None:
    times = StageTimes([1.0, 3.0, 2.0], [2.0, 5.0, 1.0], p2p_s=[0.25, 0.5, 0.0])
    named = simulate_schedule("1f1b", 3, 5, times)
    listed = simulate_actions(schedule_actions("1f1b", 3, 5), times)
    assert listed == named
    # bottleneck bound: stage 0's first F and hop, 5 x (F + B) of stage 1, the hop and B back
    assert listed.makespan_s >= 1.0 + 0.25 + 5 * 8.0 + 0.25 + 2.0
    assert listed.makespan_s == 44.5  # rank 1 idles 1.0 beyond the bound (busy 40, ends 42.25)
    assert listed.rank_busy_s == (15.0, 40.0, 15.0)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_async_steady_state_has_no_bubble(p: int) -> None:
    m = 12 * p
    t = simulate_schedule("async", p, m, uniform(p, 1.0, 2.0, p2p=0.0))
    steps = sorted(end for rank, kind, _, _, _, end in t.ops if kind == "STEP" and rank == 0)
    assert len(steps) == m
    tail = steps[m // 2 - 1:]  # the steady state: the mean gap between the later STEPs
    assert (tail[-1] - tail[0]) / (len(tail) - 1) == 3.0  # F + B per micro-batch: no flush
    assert t.makespan_s == (m + p - 1) * 3.0  # the fill is paid once per run, not per step


def test_a_deadlocking_list_is_refused_by_the_simulator_naming_each_waiting_rank() -> None:
    from meshmorph.schedule import Action, Kind
    from meshmorph.schedule.validate import DeadlockError

    orders = [[Action(Kind.F, 0, 0), Action(Kind.B, 0, 0), Action(Kind.F, 0, 1),
               Action(Kind.B, 0, 1)],
              [Action(Kind.F, 1, 1), Action(Kind.B, 1, 1), Action(Kind.F, 1, 0),
               Action(Kind.B, 1, 0)]]
    with pytest.raises(DeadlockError, match=r"\{0: '0B0', 1: '1F1'\}"):
        simulate_actions(orders, uniform(2, 1.0, 2.0))


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(["zbv", "dualpipev", "async", "interleaved"]), p=st.integers(1, 4),
       rounds=st.integers(2, 4), data=st.data())
def test_step_time_never_falls_when_one_stage_gets_slower(name: str, p: int, rounds: int,
                                                          data: st.DataObject) -> None:
    v = 1 if name == "async" else 2
    m = p * rounds
    stages = p * v
    times = st.lists(st.integers(1, 9).map(float), min_size=stages, max_size=stages)
    fwd, bwd, igrad, wgrad = (data.draw(times) for _ in range(4))
    p2p = data.draw(st.lists(st.integers(0, 3).map(float), min_size=stages, max_size=stages))
    which, delta = data.draw(st.integers(0, stages - 1)), float(data.draw(st.integers(1, 9)))
    field = data.draw(st.sampled_from(["fwd", "bwd", "igrad", "wgrad", "p2p"]))
    base = {"fwd": fwd, "bwd": bwd, "igrad": igrad, "wgrad": wgrad, "p2p": p2p}
    slower = {k: list(x) for k, x in base.items()}
    slower[field][which] += delta

    def step(t: dict[str, list[float]]) -> float:
        return simulate_schedule(name, p, m, StageTimes(t["fwd"], t["bwd"], t["igrad"], t["wgrad"],
                                                        t["p2p"]), v=v, keep_ops=False).makespan_s

    assert step(slower) >= step(base)
