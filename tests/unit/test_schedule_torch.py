"""meshmorph's action lists equal torch.distributed.pipelining's own schedule generators, compute
action for compute action, on every rank (torch's orders built without a process group)."""

from __future__ import annotations

from unittest import mock

import pytest

pytest.importorskip("torch")
import torch.distributed.pipelining.schedules as torch_schedules  # noqa: E402
from torch.distributed.pipelining.stage import PipelineStage  # noqa: E402

from meshmorph.schedule import schedule_actions  # noqa: E402

_KIND = {torch_schedules.FORWARD: "F", torch_schedules.FULL_BACKWARD: "B",
         torch_schedules.BACKWARD_INPUT: "I", torch_schedules.BACKWARD_WEIGHT: "W"}


def torch_orders(cls: type, p: int, m: int, per_rank: int) -> list[list[str]]:
    """The compute actions torch's schedule class lists for each rank (overlapped F+B pairs of
    DualPipeV as F then B; bubbles, gradient reductions and comms left out)."""
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod = 0, p, None
    stage.num_stages = p * per_rank
    single = issubclass(cls, torch_schedules.PipelineScheduleSingle)
    schedule = cls(stage if single else [stage] * per_rank, m)
    orders = []
    for r in range(p):
        listed = []
        for action in schedule.pipeline_order[r]:
            if action is None:
                continue
            overlap = action.computation_type == torch_schedules.OVERLAP_F_B
            for a in action.sub_actions if overlap else (action,):
                if a.computation_type in _KIND:
                    listed.append(f"{a.stage_index}{_KIND[a.computation_type]}{a.microbatch_index}")
        orders.append(listed)
    return orders


def ours(name: str, p: int, m: int, v: int = 1) -> list[list[str]]:
    return [[str(a) for a in order] for order in schedule_actions(name, p, m, v)]


SHAPES = [(p, m) for p in (2, 3, 4) for m in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12)]


@pytest.mark.parametrize("p,m", SHAPES)
def test_gpipe_equals_torch_schedule_gpipe(p: int, m: int) -> None:
    assert ours("gpipe", p, m) == torch_orders(torch_schedules.ScheduleGPipe, p, m, 1)


@pytest.mark.parametrize("p,m", [(p, m) for p, m in SHAPES if m >= p])
def test_1f1b_equals_torch_schedule_1f1b_with_its_last_rank_listing_corrected(p: int, m: int
                                                                                ) -> None:
    theirs = torch_orders(torch_schedules.Schedule1F1B, p, m, 1)
    mine = ours("1f1b", p, m)
    assert mine[:-1] == theirs[:-1]
    # torch's listing of the last rank numbers its forwards from 1 (execution is right)
    fixed = [f"{a.split('F')[0]}F{int(a.split('F')[1]) - 1}" if "F" in a else a
             for a in theirs[-1]]
    assert mine[-1] == fixed


def _rounds_ok(p: int, m: int) -> bool:
    return m % max(1, m // p) == 0


@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("p,m", [(p, m) for p, m in SHAPES if _rounds_ok(p, m)])
def test_interleaved_equals_torch_interleaved_1f1b_including_m_not_a_multiple_of_p(
        p: int, m: int, v: int) -> None:
    assert ours("interleaved", p, m, v) == torch_orders(torch_schedules.ScheduleInterleaved1F1B,
                                                        p, m, v)


@pytest.mark.parametrize("p,m", [(p, m) for p, m in SHAPES if _rounds_ok(p, m)])
def test_zb_h1_equals_torch_interleaved_zero_bubble_with_one_chunk_per_rank(p: int, m: int
                                                                            ) -> None:
    assert ours("zb", p, m) == torch_orders(torch_schedules.ScheduleInterleavedZeroBubble,
                                            p, m, 1)


@pytest.mark.parametrize("p,m", SHAPES)
def test_zbv_equals_torch_zbv_zero_bubble(p: int, m: int) -> None:
    assert ours("zbv", p, m, 2) == torch_orders(torch_schedules.ScheduleZBVZeroBubble, p, m, 2)


@pytest.mark.parametrize("p,m", [(p, m) for p, m in SHAPES if m >= 2 * p])
def test_dualpipev_equals_torch_dualpipev_with_overlapped_pairs_in_order(p: int, m: int) -> None:
    assert ours("dualpipev", p, m, 2) == torch_orders(torch_schedules.ScheduleDualPipeV, p, m, 2)
