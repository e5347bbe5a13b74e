"""Asynchronous 1F1B without flush (PipeDream): each stage steps its optimizer right after
every backward, and the next micro-batches keep flowing, so there is no fill and drain per step.

Rank r holds stage r. It runs p - 1 - r warm-up forwards once, then one forward and one
backward in turn for ever (here: for ``m`` micro-batches), each backward followed by the stage's
STEP. Between F(j) and B(j) stage r steps p - 1 - r times: its weight staleness, which
``staleness`` reads off any action list (weight stashing and prediction use it).
"""

from __future__ import annotations

from collections.abc import Sequence

from meshmorph.schedule.action import Action, Kind
from meshmorph.schedule.one_f_one_b import one_f_one_b


def async_one_f_one_b(p: int, m: int, *, microbatches_per_step: int = 1) -> list[list[Action]]:
    """The 1F1B order of ``m`` micro-batches with a STEP after every ``microbatches_per_step``-th
    backward of each stage (and after the last one)."""
    if microbatches_per_step < 1:
        raise ValueError(f"microbatches_per_step must be >= 1, got {microbatches_per_step}")
    orders = []
    for order in one_f_one_b(p, m):
        steps: list[Action] = []
        for action in order:
            steps.append(action)
            j = action.microbatch
            if action.kind == Kind.B and ((j + 1) % microbatches_per_step == 0 or j == m - 1):
                steps.append(Action(Kind.STEP, action.stage, j))
        orders.append(steps)
    return orders


def staleness(orders: Sequence[Sequence[Action]]) -> dict[int, int]:
    """Per stage, the most optimizer STEPs of that stage between a micro-batch's forward and its
    backward (B or I): how many updates old the forward's weights are when its gradient lands."""
    worst: dict[int, int] = {}
    for order in orders:
        steps: dict[int, int] = {}
        at_forward: dict[tuple[int, int], int] = {}
        for action in order:
            s = action.stage
            if action.kind == Kind.STEP:
                steps[s] = steps.get(s, 0) + 1
            elif action.kind == Kind.F:
                at_forward[s, action.microbatch] = steps.get(s, 0)
                worst.setdefault(s, 0)
            elif action.kind in (Kind.B, Kind.I):
                lag = steps.get(s, 0) - at_forward[s, action.microbatch]
                worst[s] = max(worst.get(s, 0), lag)
    return dict(sorted(worst.items()))

