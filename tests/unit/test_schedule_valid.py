"""Every generated schedule is a valid pipeline step (F before B before W per stage, matching
send/recv pairs, no deadlock), and the checker catches each kind of broken list."""

from __future__ import annotations

import pytest

from meshmorph.schedule import Action, Kind, schedule_actions, stage_to_rank
from meshmorph.schedule.async_1f1b import staleness
from meshmorph.schedule.one_f_one_b import ScheduleShapeError
from meshmorph.schedule.validate import DeadlockError, ScheduleError, check_schedule, with_comms

F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W  # noqa: E741


def _cases() -> list[tuple[str, int, int, int]]:
    cases = []
    for p in (1, 2, 3, 4, 6):
        for m in (1, 2, 3, 4, 5, 8, 12):
            cases += [("gpipe", p, m, 1), ("1f1b", p, m, 1), ("zb", p, m, 1), ("zbv", p, m, 2),
                      ("async", p, m, 1)]
            if m % max(1, m // p) == 0:
                cases += [("interleaved", p, m, v) for v in (2, 3)]
            if m >= 2 * p:
                cases.append(("dualpipev", p, m, 2))
    return cases


@pytest.mark.parametrize("with_p2p", [False, True])
def test_every_generated_schedule_is_valid_with_and_without_send_recv(with_p2p: bool) -> None:
    checked = 0
    for name, p, m, v in _cases():
        orders = schedule_actions(name, p, m, v, steps=True)
        ranks = stage_to_rank(name, p, v)
        check_schedule(with_comms(orders, ranks) if with_p2p else orders, ranks, m)
        checked += 1
    assert checked == 258


def test_with_comms_pairs_every_cross_rank_hop_and_skips_the_v_turn() -> None:
    ranks = stage_to_rank("zbv", 2, 2)  # stages 0, 1, 2, 3 on ranks 0, 1, 1, 0
    assert ranks == (0, 1, 1, 0)
    orders = with_comms(schedule_actions("zbv", 2, 1, 2), ranks)
    # stage 1 -> 2 stays on rank 1 (no send); 0 -> 1 and 2 -> 3 cross ranks, both ways
    assert [[str(a) for a in order] for order in orders] == [
        ["0F0", "0SEND_F0", "3RECV_F0", "3F0", "3I0", "3SEND_B0", "3W0", "0RECV_B0", "0I0", "0W0"],
        ["1RECV_F0", "1F0", "2F0", "2SEND_F0", "2RECV_B0", "2I0", "2W0", "1I0", "1SEND_B0", "1W0"]]


def test_backward_before_its_forward_is_refused() -> None:
    orders = [[Action(B, 0, 0), Action(F, 0, 0)]]
    with pytest.raises(ScheduleError, match="out of order"):
        check_schedule(orders, (0,), 1)


def test_weight_gradient_before_its_input_gradient_is_refused() -> None:
    orders = [[Action(F, 0, 0), Action(W, 0, 0), Action(I, 0, 0)]]
    with pytest.raises(ScheduleError, match="F before B \\(or I\\) before W"):
        check_schedule(orders, (0,), 1)


def test_missing_receive_is_refused() -> None:
    orders = with_comms(schedule_actions("1f1b", 2, 2), (0, 1))
    orders[1] = [a for a in orders[1] if a != Action(Kind.RECV_F, 1, 1)]
    with pytest.raises(ScheduleError, match="rank 1's sends and receives do not match"):
        check_schedule(orders, (0, 1), 2)


def test_crossed_micro_batch_orders_deadlock() -> None:
    # rank 0 waits for micro-batch 0's gradient before sending micro-batch 1's activation;
    # rank 1 wants micro-batch 1 first
    orders = [[Action(F, 0, 0), Action(B, 0, 0), Action(F, 0, 1), Action(B, 0, 1)],
              [Action(F, 1, 1), Action(B, 1, 1), Action(F, 1, 0), Action(B, 1, 0)]]
    with pytest.raises(DeadlockError, match=r"\{0: '0B0', 1: '1F1'\}"):
        check_schedule(orders, (0, 1), 2)


def test_async_staleness_is_p_minus_1_minus_stage() -> None:
    for p in (2, 3, 4, 6):
        assert staleness(schedule_actions("async", p, 4 * p)) == {s: p - 1 - s for s in range(p)}


def test_synchronous_schedules_have_no_staleness() -> None:
    for name in ("gpipe", "1f1b", "zb"):
        assert set(staleness(schedule_actions(name, 4, 8, steps=True)).values()) == {0}


def test_bad_shapes_name_the_constraint() -> None:
    with pytest.raises(ScheduleShapeError, match="needs at least 2 x pp = 8 micro-batches"):
        schedule_actions("dualpipev", 4, 6, 2)
    with pytest.raises(ScheduleShapeError, match="split into 2 equal rounds"):
        schedule_actions("interleaved", 4, 9, 2)
    with pytest.raises(ScheduleShapeError, match="unknown pipeline schedule 'pipedream'"):
        schedule_actions("pipedream", 4, 8)
