"""GPipe, 1F1B and interleaved 1F1B as per-rank action lists (compute actions only).

The orders are torch.distributed.pipelining's (``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B``); ``tests/unit/test_schedule_torch.py`` compares them action for action.
Stage ``s`` of an interleaved schedule runs on rank ``s % p`` (looped placement).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from meshmorph.schedule.action import Action, Kind


class ScheduleShapeError(ValueError):
    """A (schedule, pp, micro-batches, chunks) combination the schedule cannot run."""


def gpipe(p: int, m: int) -> list[list[Action]]:
    """All forwards, then all backwards, on every rank."""
    return [[Action(Kind.F, r, j) for j in range(m)] + [Action(Kind.B, r, j) for j in range(m)]
            for r in range(p)]


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    """PipeDream-flush 1F1B: rank r runs p - 1 - r warm-up forwards, then one forward and one
    backward in turn, then the remaining backwards."""
    orders = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        order = [Action(Kind.F, r, j) for j in range(warmup)]
        for j in range(warmup, m):
            order += [Action(Kind.F, r, j), Action(Kind.B, r, j - warmup)]
        order += [Action(Kind.B, r, j) for j in range(m - warmup, m)]
        orders.append(order)
    return orders


def rounds(p: int, m: int, what: str) -> int:
    """Micro-batches per round of torch's interleaved schedules: m // max(1, m // p); m must
    split into whole rounds."""
    number_of_rounds = max(1, m // p)
    if m % number_of_rounds:
        raise ScheduleShapeError(
            f"{what} needs the {m} micro-batches to split into {number_of_rounds} equal rounds "
            f"(max(1, m // pp) with pp {p}); use a multiple of {number_of_rounds}, e.g. "
            f"{number_of_rounds * (m // number_of_rounds)}")
    return m // number_of_rounds


def looped_1f1b(p: int, m: int, v: int, *, warmup_factor: int, zero_bubble: bool
                ) -> list[list[Action]]:
    """torch's ``_get_1f1b_rank_ops`` for v chunks per rank in rounds of micro-batches:
    interleaved 1F1B (warm-up factor 2, full backwards) or ZB-H1 / interleaved zero bubble
    (factor 1, input-gradient backwards, rank r delays its weight gradients by r backwards)."""
    # with one chunk per rank the rounds do not change the order (torch still checks them)
    per_round = rounds(p, m, "interleaved zero bubble" if zero_bubble else "interleaved 1F1B") \
        if v > 1 else m
    total = m * v
    backward = Kind.I if zero_bubble else Kind.B
    orders = []
    for r in range(p):
        # warm-up: (v - 1) rounds for the last rank, warmup_factor more per hop before it
        warmup = min((v - 1) * per_round + warmup_factor * (p - 1 - r), total)

        def fwd_stage(step: int, r: int = r) -> int:
            return (step // per_round) % v * p + r

        def bwd_stage(step: int, r: int = r, warmup: int = warmup) -> int:
            return (v - 1 - ((step - warmup) // per_round) % v) * p + r

        orders.append(_rank_ops(r, warmup, total, backward, fwd_stage, bwd_stage,
                                delay_weights=r if zero_bubble else None))
    return orders


def _rank_ops(r: int, warmup: int, total: int, backward: Kind, fwd_stage: Callable[[int], int],
              bwd_stage: Callable[[int], int], delay_weights: int | None) -> list[Action]:
    counters: dict[tuple[Kind, int], int] = defaultdict(int)
    order: list[Action] = []

    def add(kind: Kind, stage: int) -> None:
        order.append(Action(kind, stage, counters[kind, stage]))
        counters[kind, stage] += 1

    backward_steps: list[int] = []
    weights_done = 0
    for step in range(total + warmup):  # warm-up F, then F and B in turn, then cool-down B
        if step < total:
            add(Kind.F, fwd_stage(step))
        if step >= warmup:
            add(backward, bwd_stage(step))
            backward_steps.append(step)
            if delay_weights is not None and step - warmup >= delay_weights:
                add(Kind.W, bwd_stage(backward_steps[weights_done]))
                weights_done += 1
    while delay_weights is not None and weights_done < len(backward_steps):
        add(Kind.W, bwd_stage(backward_steps[weights_done]))
        weights_done += 1
    return order


def interleaved(p: int, m: int, v: int) -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al. 2021) over v chunks per rank, torch's flexible rounds."""
    return looped_1f1b(p, m, v, warmup_factor=2, zero_bubble=False)
