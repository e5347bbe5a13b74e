"""cost.pipeline.simulate against the closed forms it must reproduce, and its monotonicity.

Times are small whole numbers of seconds so that every sum is exact in floating point.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshmorph.cost.pipeline import simulate
from meshmorph.schedule.registry import schedule_actions
from meshmorph.schedule.table import Schedule


def schedule_ops(schedule: Schedule, p: int, m: int, v: int = 1) -> list[list[tuple[str, int, int]]]:
    """The (kind, chunk, micro-batch) order of every pipeline rank (B is the input-gradient
    backward in split ones)."""
    return [[("B" if a.kind == "I" else str(a.kind), a.stage, a.microbatch) for a in order]
            for order in schedule_actions(str(schedule), p, m, v)]


def bubble_closed_form(schedule: Schedule, p: int, m: int, v: int = 1) -> float:
    """Bubble as a fraction of the ideal time for equal stages (Narayanan et al. 2021)."""
    if p == 1:
        return 0.0
    if schedule == Schedule.INTERLEAVED:
        return (p - 1) / (v * m)  # (p-1)/(v·m)
    return (p - 1) / m  # (p-1)/m for GPipe and 1F1B


@pytest.mark.parametrize("schedule", [Schedule.GPIPE, Schedule.ONE_F_ONE_B])
@pytest.mark.parametrize("p,m", [(2, 2), (2, 7), (3, 3), (4, 4), (4, 8), (4, 13), (6, 12)])
def test_equal_stages_bubble_is_p_minus_1_over_m_of_ideal(schedule: Schedule, p: int, m: int) -> None:
    f, b = 1.0, 2.0
    timeline = simulate(schedule, p, m, [f] * p, [b] * p)
    ideal = m * (f + b)
    assert timeline.makespan_s == (m + p - 1) * (f + b)  # ideal + (p - 1)(f + b)
    assert (timeline.makespan_s - ideal) / ideal == pytest.approx(bubble_closed_form(schedule, p, m),
                                                                  rel=1e-12)
    assert timeline.rank_busy_s == (ideal,) * p


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 3, 6), (3, 2, 3), (3, 3, 9), (4, 2, 8),
                                   (4, 3, 12), (6, 2, 12)])
def test_interleaved_equal_chunks_bubble_is_p_minus_1_over_v_m(p: int, v: int, m: int) -> None:
    # a rank's layers take f = 6, b = 12 per micro-batch, split into v equal chunks of f/v, b/v
    f, b = 6.0, 12.0
    timeline = simulate(Schedule.INTERLEAVED, p, m, [f / v] * (p * v), [b / v] * (p * v), v=v)
    ideal = m * (f + b)
    assert timeline.makespan_s == pytest.approx(ideal + (p - 1) * (f + b) / v, rel=1e-12)
    assert (timeline.makespan_s - ideal) / ideal == pytest.approx((p - 1) / (v * m), rel=1e-12)
    assert bubble_closed_form(Schedule.INTERLEAVED, p, m, v) == pytest.approx((p - 1) / (v * m))


@pytest.mark.parametrize("p,m", [(2, 2), (2, 5), (3, 3), (3, 7), (4, 4), (4, 8), (5, 10)])
def test_zero_bubble_h1_with_f_equal_b_equal_w_has_bubble_p_minus_1_times_f_plus_b_minus_w(
        p: int, m: int) -> None:
    f = bg = w = 1.0
    timeline = simulate(Schedule.ZERO_BUBBLE, p, m, [f] * p, [bg] * p, wgrad_s=[w] * p)
    assert timeline.makespan_s == m * (f + bg + w) + (p - 1) * (f + bg - w)
    # a third of 1F1B's bubble (p - 1)(F + B + W) at the same F, B + W
    one_f_one_b = simulate(Schedule.ONE_F_ONE_B, p, m, [f] * p, [bg + w] * p)
    assert (one_f_one_b.makespan_s - m * 3 * f) == 3 * (timeline.makespan_s - m * 3 * f)


def test_zero_bubble_runs_the_runtime_order() -> None:
    # ScheduleInterleavedZeroBubble with one chunk per rank: 1F1B's F/B, each B followed by the
    # W of the backward pp_rank places earlier, the last pp_rank W ops at the end
    orders = schedule_ops(Schedule.ZERO_BUBBLE, 3, 4)
    text = [" ".join(f"{kind}{j}" for kind, _, j in order) for order in orders]
    assert text[0] == "F0 F1 F2 B0 W0 F3 B1 W1 B2 W2 B3 W3"
    assert text[1] == "F0 F1 B0 F2 B1 W0 F3 B2 W1 B3 W2 W3"
    assert text[2] == "F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3"


@pytest.mark.parametrize("fwd,bwd,m", [
    ([1.0, 3.0, 2.0], [2.0, 5.0, 1.0], 4),
    ([4.0, 1.0, 1.0, 2.0], [1.0, 1.0, 6.0, 3.0], 6),
    ([2.0, 2.0], [7.0, 1.0], 1),
    ([5.0, 1.0, 3.0, 1.0, 2.0], [3.0, 2.0, 8.0, 1.0, 1.0], 9),
])
def test_gpipe_unequal_stages_is_the_flow_shop_formula(fwd: list[float], bwd: list[float],
                                                       m: int) -> None:
    timeline = simulate(Schedule.GPIPE, len(fwd), m, fwd, bwd)
    # forward flow shop then backward flow shop of m identical jobs
    assert timeline.makespan_s == sum(fwd) + sum(bwd) + (m - 1) * (max(fwd) + max(bwd))


@pytest.mark.parametrize("p,m", [(2, 3), (3, 5), (4, 4)])
def test_gpipe_point_to_point_delays_add_two_per_stage_boundary(p: int, m: int) -> None:
    f, b, c = 1.0, 2.0, 0.5
    base = simulate(Schedule.GPIPE, p, m, [f] * p, [b] * p).makespan_s
    with_p2p = simulate(Schedule.GPIPE, p, m, [f] * p, [b] * p, p2p_s=[c] * p).makespan_s
    # micro-batch 0 crosses p - 1 boundaries forward and p - 1 backward
    assert with_p2p == base + 2 * (p - 1) * c


@pytest.mark.parametrize("schedule", [Schedule.ONE_F_ONE_B, Schedule.ZERO_BUBBLE])
def test_one_f_one_b_point_to_point_delay_on_the_critical_chain_adds(schedule: Schedule) -> None:
    # p = 2, m = 2: F0 F1 on rank 0; rank 1 waits c for each activation and rank 0 for each grad
    f, b, w, c = 1.0, 2.0, 1.0, 0.25
    kwargs = {"wgrad_s": [w, w]} if schedule == Schedule.ZERO_BUBBLE else {}
    base = simulate(schedule, 2, 2, [f, f], [b, b], **kwargs).makespan_s
    delayed = simulate(schedule, 2, 2, [f, f], [b, b], p2p_s=[c, c], **kwargs).makespan_s
    assert delayed - base == pytest.approx(2 * c, rel=1e-12)


def _grid() -> list[tuple[Schedule, int, int, int]]:
    cases = []
    for p in range(1, 7):
        for m in range(1, 13):
            cases += [(Schedule.GPIPE, p, m, 1), (Schedule.ONE_F_ONE_B, p, m, 1),
                      (Schedule.ZERO_BUBBLE, p, m, 1)]
            if m % p == 0:
                cases += [(Schedule.INTERLEAVED, p, m, v) for v in (1, 2, 3)]
    return cases


def test_no_schedule_deadlocks_and_every_op_runs_once_over_a_grid() -> None:
    for schedule, p, m, v in _grid():
        chunks = p * v
        fwd = [1.0 + (c % 3) for c in range(chunks)]
        bwd = [2.0 + (c % 2) for c in range(chunks)]
        wgrad = [1.0] * chunks if schedule == Schedule.ZERO_BUBBLE else None
        timeline = simulate(schedule, p, m, fwd, bwd, v=v, wgrad_s=wgrad, keep_ops=True)
        kinds = "FBW" if schedule == Schedule.ZERO_BUBBLE else "FB"
        ran = sorted((kind, c, j) for _, kind, c, j, _, _ in timeline.ops)
        expected = sorted((kind, c, j) for kind in kinds for c in range(chunks) for j in range(m))
        assert ran == expected, (schedule, p, m, v)
        work = m * (sum(fwd) + sum(bwd) + (sum(wgrad) if wgrad else 0.0))
        assert sum(timeline.rank_busy_s) == pytest.approx(work), (schedule, p, m, v)
        orders = schedule_ops(schedule, p, m, v)
        ops_per_mb = 3 if schedule == Schedule.ZERO_BUBBLE else 2
        assert all(len(order) == ops_per_mb * m * v for order in orders), (schedule, p, m, v)


@st.composite
def pipelines(draw: st.DrawFn) -> tuple:
    schedule = draw(st.sampled_from(tuple(Schedule)))
    p = draw(st.integers(1, 4))
    v = draw(st.integers(2, 3)) if schedule == Schedule.INTERLEAVED else \
        2 if schedule.v_shape else 1
    m = p * draw(st.integers(1, 3)) if schedule == Schedule.INTERLEAVED else \
        draw(st.integers(2 * p if schedule == Schedule.DUALPIPEV else 1, 8))
    chunks = p * v
    times = st.lists(st.integers(1, 9).map(float), min_size=chunks, max_size=chunks)
    fwd, bwd, wgrad = draw(times), draw(times), draw(times)
    p2p = draw(st.lists(st.integers(0, 3).map(float), min_size=chunks, max_size=chunks))
    kind = draw(st.sampled_from(("fwd", "bwd", "wgrad", "p2p")))
    which = draw(st.integers(0, chunks - 1))
    delta = float(draw(st.integers(1, 9)))
    return schedule, p, m, v, fwd, bwd, wgrad, p2p, kind, which, delta


@settings(max_examples=300, deadline=None)
@given(case=pipelines())
def test_makespan_never_decreases_when_one_stage_gets_slower(case: tuple) -> None:
    schedule, p, m, v, fwd, bwd, wgrad, p2p, kind, which, delta = case
    zb = schedule.split_backward

    def run(times: dict[str, list[float]]) -> float:
        return simulate(schedule, p, m, times["fwd"], times["bwd"], v=v,
                        wgrad_s=times["wgrad"] if zb else None, p2p_s=times["p2p"]).makespan_s

    times = {"fwd": fwd, "bwd": bwd, "wgrad": wgrad, "p2p": p2p}
    slower = {name: list(values) for name, values in times.items()}
    slower[kind][which] += delta
    assert run(slower) >= run(times)
