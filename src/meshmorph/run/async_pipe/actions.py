"""One rank's action list for the asynchronous executor, from meshmorph.schedule's generators.

An action is ``F`` (forward of a micro-batch: receive the input from the previous stage, compute,
send the output on), ``B`` (its backward: receive the output gradient, back-propagate, send the
input gradient back) or ``U`` (this stage's optimizer step); the three orders are
``async_1f1b`` (PipeDream), ``two_bw`` (PipeDream-2BW) and ``sync_1f1b`` (flushed). Under
``async_1f1b`` stage ``k`` of ``p`` runs ``w = p - 1 - k`` warm-up forwards and steps after every
backward, so its forward of micro-batch ``j`` sees the weights after ``j - w`` updates: ``w``
steps stale. ``staleness`` reads off a list how many of the stage's own updates fall between each
forward and its backward (per micro-batch: the warm-up ones are less stale than the worst case
``schedule.async_1f1b.staleness`` gives), the ``s`` a weight prediction extrapolates over.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from meshmorph.schedule.action import Action as ScheduleAction
from meshmorph.schedule.action import Kind
from meshmorph.schedule.async_1f1b import async_one_f_one_b
from meshmorph.schedule.one_f_one_b import one_f_one_b


class Action(NamedTuple):
    """One thing a stage does; ``micro_batch`` is the update's index for ``U``."""

    kind: str
    """``F``, ``B`` or ``U``."""
    micro_batch: int
    """Micro-batch of ``F``/``B`` (global index over the run); update number for ``U``."""


def _check(p: int, k: int, n: int) -> None:
    if p < 1 or not 0 <= k < p:
        raise ValueError(f"stage {k} of {p} stages: need 0 <= stage < stages")
    if n < 0:
        raise ValueError(f"{n} micro-batches: need at least 0")


def _rank_list(order: Sequence[ScheduleAction], first: int = 0, updates: int = 0) -> list[Action]:
    """A rank's schedule actions with micro-batches shifted by ``first`` and STEPs numbered."""
    out = []
    for action in order:
        if action.kind == Kind.STEP:
            out.append(Action("U", updates))
            updates += 1
        else:
            out.append(Action(str(action.kind), first + action.microbatch))
    return out


def async_1f1b(p: int, k: int, n: int) -> list[Action]:
    """Stage ``k`` of ``p``: 1F1B without flush over ``n`` micro-batches, a step after each B."""
    _check(p, k, n)
    return _rank_list(async_one_f_one_b(p, n)[k]) if n else []


def two_bw(p: int, k: int, n: int, m: int) -> list[Action]:
    """PipeDream-2BW: 1F1B without flush, a step after every ``m`` backwards (``n % m == 0``)."""
    _check(p, k, n)
    if m < 1 or n % m:
        raise ValueError(f"2BW steps every {m} micro-batches: {n} micro-batches must be a "
                         f"multiple of it; change the step count or num_microbatches")
    return _rank_list(async_one_f_one_b(p, n, microbatches_per_step=m)[k]) if n else []


def sync_1f1b(p: int, k: int, steps: int, m: int, *, first: int = 0,
              first_update: int = 0) -> list[Action]:
    """Synchronous 1F1B: ``steps`` steps of ``m`` micro-batches each, flushed, one ``U`` per step
    (micro-batches numbered from ``first``, updates from ``first_update``)."""
    _check(p, k, steps)
    if m < 1:
        raise ValueError(f"num_microbatches must be at least 1, got {m}")
    one_step = [*one_f_one_b(p, m)[k], ScheduleAction(Kind.STEP, k, m - 1)]
    out: list[Action] = []
    for step in range(steps):
        out += _rank_list(one_step, first + step * m, first_update + step)
    return out


def staleness(actions: list[Action]) -> dict[int, int]:
    """Micro-batch -> how many ``U`` of this stage run between its ``F`` and its ``B``."""
    updates = 0
    at_forward: dict[int, int] = {}
    out: dict[int, int] = {}
    for action in actions:
        if action.kind == "F":
            at_forward[action.micro_batch] = updates
        elif action.kind == "B":
            out[action.micro_batch] = updates - at_forward.pop(action.micro_batch)
        elif action.kind == "U":
            updates += 1
    if at_forward:
        raise ValueError(f"micro-batches {sorted(at_forward)} go forward but never backward")
    return out


def drain_point(p: int, j: int) -> int:
    """After every stage's B(j) in ``async_1f1b``, stage 0 has forwarded micro-batches up to
    ``j + p - 1``: a switch to flushing there finishes exactly those (the async stream ends with
    micro-batch ``j + p - 1``); returns how many micro-batches the async stream then holds."""
    return j + p
