"""V-shaped schedules: two chunks per rank, rank r holding stages r and 2p - 1 - r.

- ZBV (Qi et al. 2023, section 6): zero-bubble V with split backwards (I, W); the order is
  torch's ``ScheduleZBVZeroBubble``.
- DualPipeV (DeepSeek-V3's DualPipe folded into a V): torch's ``ScheduleDualPipeV``; its
  overlapped forward+backward pairs are listed as the forward then the full backward (one
  device runs them one after the other here).
Both are compared action for action with torch in ``tests/unit/test_schedule_torch.py``.
"""

from __future__ import annotations

from collections import defaultdict

from meshmorph.schedule.action import Action, Kind
from meshmorph.schedule.one_f_one_b import ScheduleShapeError


def v_stages(p: int, r: int) -> tuple[int, int]:
    """The two stages of rank r in a V: going down (r) and coming back up (2p - 1 - r)."""
    return r, 2 * p - 1 - r


def zbv(p: int, m: int) -> list[list[Action]]:
    """ZB-V: warm-up of chunk-0 forwards, chunk-1 forwards with their I and W, then steady
    F/I/W on both chunks, then the cool-down of the remaining I and W."""
    n = max(2 * p - 1, m)  # torch plans with at least 2p - 1 micro-batches and drops the rest
    return [[a for a in _zbv_rank(p, n, r) if a.microbatch < m] for r in range(p)]


def _zbv_rank(p: int, n: int, r: int) -> list[Action]:
    c0, c1 = v_stages(p, r)
    count: dict[tuple[Kind, int], int] = defaultdict(int)
    order: list[Action] = []

    def add(kind: Kind, stage: int) -> None:
        order.append(Action(kind, stage, count[kind, stage]))
        count[kind, stage] += 1

    for _ in range(2 * (p - r) - 1):
        add(Kind.F, c0)
    for _ in range(r):
        add(Kind.F, c1)
        add(Kind.F, c0)
    for _ in range(p - r):
        add(Kind.F, c1)
        add(Kind.I, c1)
        add(Kind.W, c1)
    while count[Kind.F, c1] < count[Kind.F, c0] or count[Kind.F, c0] < n:
        if count[Kind.F, c0] < n:
            add(Kind.F, c0)
        add(Kind.I, c0)
        add(Kind.W, c0)
        add(Kind.F, c1)
        add(Kind.I, c1)
        add(Kind.W, c1)
    for _ in range(r):
        add(Kind.I, c0)
        add(Kind.I, c1)
    for _ in range(p - r):
        add(Kind.I, c0)
        add(Kind.W, c0)
    for stage in (c1, c0):  # the weight gradients still due
        while count[Kind.W, stage] < count[Kind.I, stage]:
            add(Kind.W, stage)
    return order


def dualpipev(p: int, m: int) -> list[list[Action]]:
    """DualPipeV in eight steps per rank (torch's ``ScheduleDualPipeV``); needs m >= 2p."""
    if m < 2 * p:
        raise ScheduleShapeError(f"dualpipev needs at least 2 x pp = {2 * p} micro-batches, got "
                                 f"{m}; raise the micro-batch count or use zbv")
    return [_dualpipev_rank(p, m, r) for r in range(p)]


def _dualpipev_rank(p: int, m: int, r: int) -> list[Action]:
    c0, c1 = v_stages(p, r)
    count: dict[tuple[Kind, int], int] = defaultdict(int)
    weights: list[tuple[int, int]] = []
    order: list[Action] = []

    def add(kind: Kind, stage: int) -> None:
        key = (Kind.I if kind == Kind.B else kind, stage)
        order.append(Action(kind, stage, count[key]))
        if kind == Kind.I:
            weights.append((stage, count[key]))
        count[key] += 1

    def weight() -> None:
        if weights:
            stage, mb = weights.pop(0)
            order.append(Action(Kind.W, stage, mb))

    def overlapped(forward_stage: int, backward_stage: int) -> None:
        add(Kind.F, forward_stage)
        add(Kind.B, backward_stage)

    for _ in range((p - r - 1) * 2):  # 1: F0
        add(Kind.F, c0)
    for _ in range(r + 1):  # 2: F0 F1
        add(Kind.F, c0)
        add(Kind.F, c1)
    for _ in range(p - r - 1):  # 3: I1 W F1
        add(Kind.I, c1)
        weight()
        add(Kind.F, c1)
    # 4: F0B1 - F1B0 (torch runs the last rank's first F0B1 apart, to shorten the bubble: in an
    # action list that is the same order)
    for _ in range(m - 2 * p + r + 1):
        overlapped(c0, c1)
        overlapped(c1, c0)
    for _ in range(p - r - 1):  # 5: B1 - F1B0
        add(Kind.B, c1)
        overlapped(c1, c0)
    split = False
    for i in range(r + 1):  # 6: B1 B0, the second half with split backwards
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        add(Kind.I if split else Kind.B, c1)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        add(Kind.I if split else Kind.B, c0)
    for _ in range(p - r - 1):  # 7: W B0
        weight()
        add(Kind.I if split else Kind.B, c0)
    for _ in range(r + 1):  # 8: W
        weight()
    return order
