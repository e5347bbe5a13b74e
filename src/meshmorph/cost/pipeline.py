"""The cost model's view of pipeline schedules: a thin wrapper over ``meshmorph.schedule``.

The op orders are the schedule package's action lists (torch's orders) and the timing is its one
event simulator (``schedule.simulator``: a memoised max-plus replay, so the makespan never
decreases when a stage gets slower; the planner's bounds rely on it). In zero-bubble schedules
the backward priced as B is the input gradient (the schedule package's I) and W the weight
gradient; with F = B = W and m >= p, ZB-H1 gives the paper's bubble (p - 1)(F + B - W), a third
of 1F1B's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import lru_cache
from typing import NamedTuple

from meshmorph.schedule.action import Kind
from meshmorph.schedule.registry import frozen_actions
from meshmorph.schedule.simulator import Program, Timeline, replay, schedule_program
from meshmorph.schedule.table import Schedule

ASYNC_WARMUP_STEPS = 2
"""Steps of ``m`` micro-batches simulated before the one an asynchronous plan is priced by."""


@lru_cache(maxsize=256)
def _shape(schedule: Schedule, p: int, m: int, v: int) -> tuple[Program, int, bool, list[float]]:
    """(compiled program, chunks, split backward?, zero durations of the STEP block and the
    blocks before it, for schedules that list optimizer steps), cached for the planner."""
    schedule = Schedule(schedule)
    program = schedule_program(str(schedule), p, m, v)
    split = schedule.split_backward
    steps = not schedule.info.flush  # the schedules whose priced list carries optimizer steps
    tail = [0.0] * ((1 if split else 3) * program.stages) if steps else []
    return program, program.stages, split, tail


Warmup = tuple[tuple[int, tuple[int, ...]], ...]


class RankDrain(NamedTuple):
    """What one rank's action list runs around its last backward (B, or I)."""

    w_before: int
    """W passes before it."""
    w_after: int
    """W passes after it."""
    chunk: int
    """Its model chunk."""
    microbatch: int
    """Its micro-batch."""
    before: tuple[tuple[int, int, int, int, int], ...]
    """(chunk, F, B, I, W) counts of the actions up to and including it, per chunk of the rank."""
    after: tuple[tuple[int, int, int, int, int], ...]
    """The same for the actions after it."""


Drain = tuple[RankDrain, ...]
_WARMUPS: dict[tuple[str, int, int, int], tuple[Warmup, Drain]] = {}


def known_warmup(schedule: Schedule, p: int, m: int, v: int = 1) -> Warmup | None:
    """``forwards_before_backward`` of a shape already simulated (its action list at hand),
    else None: a bound that reads it never generates a schedule it would not simulate."""
    known = _WARMUPS.get((str(schedule), p, m, v))
    return known[0] if known is not None else None


def known_drain(schedule: Schedule, p: int, m: int, v: int = 1) -> Drain | None:
    """Per rank of a shape already simulated, what its action list runs around its last
    backward (``RankDrain``), else None."""
    known = _WARMUPS.get((str(schedule), p, m, v))
    return known[1] if known is not None else None


def deferred_weight_passes(schedule: Schedule, p: int, m: int, v: int = 1) -> tuple[int, ...]:
    """Per rank, the weight-gradient (W) passes its action list runs after its last backward
    (``known_drain``, the list generated when not at hand): under a split backward the rest,
    m - that, run before the last input gradient. Zeros when the backward is not split."""
    if not Schedule(schedule).split_backward:
        return (0,) * p
    forwards_before_backward(schedule, p, m, v)
    drain = known_drain(schedule, p, m, v)
    assert drain is not None
    return tuple(rank.w_after for rank in drain)


def forwards_before_backward(schedule: Schedule, p: int, m: int, v: int = 1) -> Warmup:
    """Per rank, the stage (model chunk) of the first backward (B, or I under a split backward)
    its action list runs, and how many forwards of each stage it runs before it: its warm-up.
    The same walk records ``known_drain``."""
    key = (str(schedule), p, m, v)
    known = _WARMUPS.get(key)
    if known is not None:
        return known[0]
    out, drain = [], []
    stages = p * v
    backward = (Kind.B, Kind.I)
    for order in frozen_actions(str(schedule), p, m, v, False):
        first, count = stages - 1, [0] * stages
        for action in order:
            if action.kind in backward:
                first = action.stage
                break
            if action.kind == Kind.F:
                count[action.stage] += 1
        out.append((first, tuple(count)))
        last = max((i for i, a in enumerate(order) if a.kind in backward), default=len(order) - 1)
        drain.append(_rank_drain(order, last))
    if len(_WARMUPS) > 1024:
        _WARMUPS.clear()
    _WARMUPS[key] = (tuple(out), tuple(drain))
    return _WARMUPS[key][0]


_KINDS = (Kind.F, Kind.B, Kind.I, Kind.W)


def _rank_drain(order: Sequence, last: int) -> RankDrain:
    """``RankDrain`` of one rank's action list whose last backward is ``order[last]``."""
    chunks = sorted({a.stage for a in order})
    counts = [{c: [0, 0, 0, 0] for c in chunks}, {c: [0, 0, 0, 0] for c in chunks}]
    for i, action in enumerate(order):
        if action.kind in _KINDS:
            counts[i > last][action.stage][_KINDS.index(action.kind)] += 1
    before, after = ([(c, *n[c]) for c in chunks] for n in counts)
    at = order[last] if order else None
    return RankDrain(sum(n[4] for n in before), sum(n[4] for n in after),
                     at.stage if at else 0, at.microbatch if at else 0,
                     tuple(before), tuple(after))


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
        # durations: fwd + full backward + wgrad + igrad (the given backward is the input
        # gradient, I; a full B, as DualPipeV runs some, is I + W)
        full = [b + w for b, w in zip(bwd, wgrad_s, strict=True)]
        durations = list(fwd_s) + full + list(wgrad_s) + bwd
    else:
        durations = list(fwd_s) + list(bwd_s)  # F and B only: the W and I blocks are not read
    if tail:  # optimizer steps (asynchronous schedules) are free here
        durations += tail
    comm = list(p2p_s) if p2p_s is not None else [0.0] * chunks
    if Schedule(schedule).v_shape:  # the V's turn (chunk p - 1 to p) stays on one rank
        comm[p - 1] = 0.0
    timeline = replay(program, durations, comm, keep_ops)
    if Schedule(schedule).info.flush and (str(schedule), p, m, v) not in _WARMUPS:
        forwards_before_backward(schedule, p, m, v)  # its action list is at hand now
    if keep_ops and split:
        return replace(timeline, ops=tuple((k, "B" if kind == "I" else kind, c, j, start, end)
                                           for k, kind, c, j, start, end in timeline.ops))
    return timeline


def async_steady_step(p: int, m: int, fwd_s: Sequence[float], bwd_s: Sequence[float], *,
                      p2p_s: Sequence[float] | None = None,
                      step_s: Sequence[float] | None = None) -> Timeline:
    """One step of asynchronous 1F1B (no flush) in its steady state, through the event
    simulator: the action list of ``ASYNC_WARMUP_STEPS + 1`` steps of ``m`` micro-batches (plus
    ``p`` more, so that the priced step still has its forwards), a STEP of cost ``step_s[k]``
    after every backward, and per rank the window from the STEP after micro-batch
    ``2m - 1`` to the STEP after micro-batch ``3m - 1``. The fill is paid once per run, not
    per step, so it is outside the window. Each window holds the rank's m forwards, m backwards
    and m STEPs one after the other, so it is never below ``m x (f + b + step)``: the planner's
    steady-state bounds stay below it."""
    first = ASYNC_WARMUP_STEPS * m - 1  # the STEP that opens the priced window
    n = (ASYNC_WARMUP_STEPS + 1) * m + p
    program = schedule_program(str(Schedule.ASYNC), p, n)
    steps = list(step_s) if step_s is not None else [0.0] * p
    # durations: fwd + bwd + (wgrad, igrad: unread) + step, one block of p each
    durations = list(fwd_s) + list(bwd_s) + [0.0] * (2 * p) + steps
    comm = list(p2p_s) if p2p_s is not None else [0.0] * p
    ops = replay(program, durations, comm, keep_ops=True).ops
    opened, closed = [0.0] * p, [0.0] * p
    for rank, kind, _, j, _, end in ops:
        if kind == "STEP":
            if j == first:
                opened[rank] = end
            elif j == first + m:
                closed[rank] = end
    window = tuple(c - o for o, c in zip(opened, closed, strict=True))
    busy = tuple(m * (f + b + t) for f, b, t in zip(fwd_s, bwd_s, steps, strict=True))
    return Timeline(makespan_s=max(window), rank_end_s=window, rank_busy_s=busy, ops=())


def weight_copies(schedule: Schedule, weight_prediction: str, pp: int, pp_rank: int,
                  m: int) -> int:
    """Copies of a rank's weights held beside the weights themselves under asynchronous
    pipelining, as ``run/async_pipe/weights.py`` keeps them: ``stash``, ``sgd`` and ``adam`` take one
    copy per forward (the stashed or predicted weights) that its backward still reads, so one
    per micro-batch in flight (PipeDream's count: ``pp - pp_rank`` under 1F1B, at most ``m``);
    ``2bw`` one per weight version, two at most; ``none`` computes on the weights themselves."""
    if schedule != Schedule.ASYNC or weight_prediction == "none" or pp == 1:
        return 0
    in_flight = min(m, pp - pp_rank)
    if weight_prediction == "2bw":
        return min(2, in_flight)
    return in_flight
