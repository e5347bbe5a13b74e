"""Every schedule meshmorph generates, by name: its action lists and where its stages run."""

from __future__ import annotations

from functools import lru_cache

from meshmorph.schedule.action import Action, with_steps
from meshmorph.schedule.async_1f1b import async_one_f_one_b
from meshmorph.schedule.one_f_one_b import (
    ScheduleShapeError,
    gpipe,
    interleaved,
    one_f_one_b,
    zero_bubble_h1,
)
from meshmorph.schedule.table import Schedule
from meshmorph.schedule.v_shape import dualpipev, zbv

MAX_PAIRS = 1 << 21
"""The most (stage, micro-batch) pairs an action list is generated for: beyond it generating
takes minutes (about 10 s a million on one core), and no plan needs it."""
SCHEDULE_NAMES = tuple(str(s) for s in Schedule)
"""Every schedule's name, in the table's order (schedule/table.py)."""


def chunks_per_rank(name: str, v: int) -> int:
    """Model chunks (stages) each rank holds: the table's fixed number, or ``v`` (interleaved);
    a V schedule also takes v 1 as its 2."""
    fixed = _schedule(name).info.chunks_per_rank
    if fixed is None:
        return v
    if v not in (1, fixed):
        if fixed == 2:
            raise ScheduleShapeError(f"{name} holds exactly 2 chunks per rank, got vpp {v}")
        raise ScheduleShapeError(f"vpp {v} > 1 needs schedule 'interleaved', not '{name}'")
    return fixed


def stage_to_rank(name: str, p: int, v: int = 1) -> tuple[int, ...]:
    """The pipeline rank of every stage: looped (s % p) or V (r and 2p - 1 - r on rank r)."""
    chunks = chunks_per_rank(name, v)
    if _schedule(name).v_shape:
        return tuple(min(s, 2 * p - 1 - s) for s in range(2 * p))
    return tuple(s % p for s in range(p * chunks))


def schedule_actions(name: str, p: int, m: int, v: int = 1, *, steps: bool = False
                     ) -> list[list[Action]]:
    """Per-rank action lists of schedule ``name`` for ``p`` ranks and ``m`` micro-batches
    (compute actions; with ``steps``, each stage's optimizer STEP too)."""
    return [list(order) for order in frozen_actions(name, p, m, v, steps)]


@lru_cache(maxsize=512)
def frozen_actions(name: str, p: int, m: int, v: int, steps: bool
                   ) -> tuple[tuple[Action, ...], ...]:
    """``schedule_actions`` as tuples, cached per shape (the simulator compiles them once)."""
    if p < 1 or m < 1:
        raise ScheduleShapeError(f"need pp >= 1 and micro-batches >= 1, got pp {p}, m {m}")
    chunks = chunks_per_rank(name, v)
    check_size(p, m, chunks, MAX_PAIRS)
    schedule = _schedule(name)
    if not schedule.info.flush:  # steps are part of the schedule itself
        return tuple(tuple(order) for order in async_one_f_one_b(p, m))
    orders = _GENERATORS[schedule](p, m, chunks)
    if steps:
        ranks = stage_to_rank(name, p, v)
        orders = with_steps(orders, [[s for s, k in enumerate(ranks) if k == r] for r in range(p)],
                            m)
    return tuple(tuple(order) for order in orders)


def check_size(p: int, m: int, chunks: int, limit: int, what: str = "a schedule") -> None:
    """Refuse ``p`` ranks x ``chunks`` x ``m`` micro-batches above ``limit`` pairs, naming them."""
    pairs = p * chunks * m
    if pairs > limit:
        raise ScheduleShapeError(
            f"pp {p:,} x {chunks} chunk(s) x {m:,} micro-batches = {pairs:,} (stage, micro-batch) "
            f"pairs is above the {limit:,} {what} takes; lower pp or the micro-batch count")


_GENERATORS = {
    Schedule.GPIPE: lambda p, m, v: gpipe(p, m),
    Schedule.ONE_F_ONE_B: lambda p, m, v: one_f_one_b(p, m),
    Schedule.INTERLEAVED: lambda p, m, v: interleaved(p, m, v),
    Schedule.ZERO_BUBBLE: lambda p, m, v: zero_bubble_h1(p, m),
    Schedule.ZBV: lambda p, m, v: zbv(p, m),
    Schedule.DUALPIPEV: lambda p, m, v: dualpipev(p, m),
}
"""The generator of each flushing schedule's per-rank action lists (p ranks, m micro-batches,
v chunks per rank)."""


def _schedule(name: str | Schedule) -> Schedule:
    try:
        return Schedule(name)
    except ValueError:
        raise ScheduleShapeError(f"unknown pipeline schedule {name!r}; use one of "
                                 f"{', '.join(SCHEDULE_NAMES)}") from None
