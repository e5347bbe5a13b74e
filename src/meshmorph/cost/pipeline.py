"""The cost model's view of pipeline schedules: a thin wrapper over ``meshmorph.schedule``.

The op orders are the schedule package's action lists (torch's orders: GPipe, 1F1B, interleaved
1F1B, ZB-H1, and any other name ``schedule.registry`` knows) and the timing is its one event
simulator (``schedule.simulator``: a memoised max-plus replay, so the makespan never decreases
when a stage gets slower; the planner's bounds rely on it). Here an op is (kind, chunk,
micro-batch) with kind F, B or W; in zero-bubble schedules B is the input-gradient backward
(the schedule package's I) and W the weight gradient. With F = B = W and m >= p, ZB-H1 gives the
paper's bubble (p - 1)(F + B - W), a third of 1F1B's.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from meshmorph.schedule.registry import SPLIT_BACKWARD, schedule_actions
from meshmorph.schedule.simulator import Program, Timeline, replay, schedule_program
from meshmorph.spec.plan import Schedule

Op = tuple[str, int, int]  # (kind, chunk, micro-batch)

__all__ = ["Op", "Timeline", "bubble_closed_form", "schedule_ops", "simulate"]


def schedule_ops(schedule: Schedule, p: int, m: int, v: int = 1) -> list[list[Op]]:
    """The op order of every pipeline rank (B is the input-gradient backward in split ones)."""
    return [[("B" if a.kind == "I" else str(a.kind), a.stage, a.microbatch) for a in order]
            for order in schedule_actions(str(schedule), p, m, v)]


@lru_cache(maxsize=256)
def _shape(schedule: Schedule, p: int, m: int, v: int) -> tuple[Program, int, bool, list[float]]:
    """(compiled program, chunks, split backward?, zero durations of the STEP block and the
    blocks before it, for schedules that list optimizer steps), cached for the planner."""
    name = str(schedule)
    program = schedule_program(name, p, m, v)
    split = name in SPLIT_BACKWARD
    steps = name == "async"  # the one schedule whose priced list carries optimizer steps
    tail = [0.0] * ((1 if split else 3) * program.stages) if steps else []
    return program, program.stages, split, tail


def simulate(schedule: Schedule, p: int, m: int, fwd_s: Sequence[float], bwd_s: Sequence[float],
             *, v: int = 1, wgrad_s: Sequence[float] | None = None,
             p2p_s: Sequence[float] | None = None, keep_ops: bool = False) -> Timeline:
    """Simulate one step. Per chunk c (``p * v`` of them): forward ``fwd_s[c]``, backward
    ``bwd_s[c]`` (input gradient only when ``wgrad_s`` is given, for zero-bubble) and the
    weight-gradient time ``wgrad_s[c]``; ``p2p_s[c]`` is the transfer from chunk c to c+1."""
    program, chunks, split, tail = _shape(schedule, p, m, v)
    if len(fwd_s) != chunks or len(bwd_s) != chunks:
        raise ValueError(f"need {chunks} chunk times, got {len(fwd_s)} and {len(bwd_s)}")
    if split:
        if wgrad_s is None:
            raise ValueError(f"the {schedule} schedule needs wgrad_s")
        bwd = list(bwd_s)
        # durations: fwd + bwd + wgrad + igrad (the given backward is the input gradient, I)
        durations = list(fwd_s) + bwd + list(wgrad_s) + bwd
    else:
        durations = list(fwd_s) + list(bwd_s)  # F and B only: the W and I blocks are not read
    if tail:  # optimizer steps (asynchronous schedules) are free here
        durations += tail
    comm = list(p2p_s) if p2p_s is not None else [0.0] * chunks
    timeline = replay(program, durations, comm, keep_ops)
    if keep_ops and split:
        ops = tuple((k, "B" if kind == "I" else kind, c, j, start, end)
                    for k, kind, c, j, start, end in timeline.ops)
        return Timeline(timeline.makespan_s, timeline.rank_end_s, timeline.rank_busy_s, ops,
                        timeline.peak_activations)
    return timeline


def bubble_closed_form(schedule: Schedule, p: int, m: int, v: int = 1) -> float:
    """Bubble as a fraction of the ideal time for equal stages (Narayanan et al. 2021)."""
    if p == 1:
        return 0.0
    if schedule == Schedule.INTERLEAVED:
        return (p - 1) / (v * m)  # (p-1)/(v·m)
    return (p - 1) / m  # (p-1)/m for GPipe and 1F1B
