"""One step of a pipeline rank: an ``Action`` (kind, stage, micro-batch).

Kinds: F forward; B full backward (input and weight gradient together); I backward of the input
gradient only (zero-bubble schedules); W backward of the weight gradient (after its I);
SEND_F/RECV_F the activation from stage s to s + 1; SEND_B/RECV_B the gradient from stage s to
s - 1; STEP the optimizer step of a stage (after micro-batch ``microbatch``'s gradient).
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple


class ScheduleError(ValueError):
    """Action lists that are not a valid pipeline step; the message names the broken rule."""


class DeadlockError(ScheduleError):
    """Every unfinished rank waits on an action no rank can run next."""


class Kind(StrEnum):
    """What an action does."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the zero-bubble papers' name for the input-gradient backward
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    STEP = "STEP"


COMMS = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
"""Point-to-point actions."""


class Action(NamedTuple):
    """One action of one pipeline rank."""

    kind: Kind
    """What the action does."""
    stage: int
    """Global index of the model chunk (stage) it runs on."""
    microbatch: int
    """Index of the micro-batch."""

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def with_steps(orders: list[list[Action]], stages_of_rank: list[list[int]],
               microbatches: int) -> list[list[Action]]:
    """Append each stage's optimizer STEP (after the last micro-batch) to its rank's list."""
    return [order + [Action(Kind.STEP, s, microbatches - 1) for s in stages]
            for order, stages in zip(orders, stages_of_rank, strict=True)]
