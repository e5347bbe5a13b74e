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
from meshmorph.schedule.v_shape import dualpipev, v_stages, zbv

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev", "async")
"""gpipe, 1f1b, interleaved (v chunks per rank, looped), zb (ZB-H1), zbv and dualpipev (V shape,
two chunks per rank), async (1F1B without flush, a STEP after every backward)."""
V_SHAPED = frozenset({"zbv", "dualpipev"})
"""Schedules whose rank r holds stages r and 2p - 1 - r."""
SPLIT_BACKWARD = frozenset({"zb", "zbv", "dualpipev"})
"""Schedules with input-gradient (I) and weight-gradient (W) backward actions."""


def chunks_per_rank(name: str, v: int) -> int:
    """Model chunks (stages) each rank holds: 2 for V shapes, v for interleaved, else 1."""
    _check_name(name)
    if name in V_SHAPED:
        if v not in (1, 2):
            raise ScheduleShapeError(f"{name} holds exactly 2 chunks per rank, got vpp {v}")
        return 2
    if v != 1 and name != "interleaved":
        raise ScheduleShapeError(f"vpp {v} > 1 needs schedule 'interleaved', not '{name}'")
    return v


def stage_to_rank(name: str, p: int, v: int = 1) -> tuple[int, ...]:
    """The pipeline rank of every stage: looped (s % p) or V (r and 2p - 1 - r on rank r)."""
    chunks = chunks_per_rank(name, v)
    if name in V_SHAPED:
        ranks = [0] * (2 * p)
        for r in range(p):
            for s in v_stages(p, r):
                ranks[s] = r
        return tuple(ranks)
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
    if name == "async":  # steps are part of the schedule itself
        return tuple(tuple(order) for order in async_one_f_one_b(p, m))
    orders = {"gpipe": lambda: gpipe(p, m), "1f1b": lambda: one_f_one_b(p, m),
              "interleaved": lambda: interleaved(p, m, chunks),
              "zb": lambda: zero_bubble_h1(p, m),
              "zbv": lambda: zbv(p, m), "dualpipev": lambda: dualpipev(p, m)}[name]()
    if steps:
        ranks = stage_to_rank(name, p, v)
        orders = with_steps(orders, [[s for s, k in enumerate(ranks) if k == r] for r in range(p)],
                            m)
    return tuple(tuple(order) for order in orders)


def _check_name(name: str) -> None:
    if name not in SCHEDULE_NAMES:
        raise ScheduleShapeError(f"unknown pipeline schedule {name!r}; use one of "
                                 f"{', '.join(SCHEDULE_NAMES)}")
