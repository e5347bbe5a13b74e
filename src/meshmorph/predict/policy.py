"""What a run does when spot capacity comes and goes: the policies and their decisions.

- ``restart``: one zone (the best of ``--zones``); a lost node is replaced there when capacity
  allows, and training restarts cold from the last checkpoint.
- ``reshape``: one zone; training goes on on the survivors after a move priced by Reshape's planner
  (``reshape_cost.py``) and grows back as replacements arrive. Where the zone's capacity goes all
  at once (capacity mode) nobody survives: it is ``restart``.
- ``multi-zone``: the best zone with capacity; when the job's zone has none, move to the best zone
  that has it now (restart there from the checkpoint), else wait.
- ``deadline``: ``multi-zone``, then on-demand from ``switch_time_s`` (the idea of "Can't Be Late",
  NSDI '24): the last moment at which the steps not yet checkpointed can still be done on on-demand
  nodes with the longest start-up, cold restart, checkpoint read and writes the simulator can draw.
  On-demand nodes are never preempted, so a deadline on-demand alone meets is never missed.
- ``on-demand``: on-demand nodes only.

Zones are ranked by spot price over the share of time with capacity (``Zone.cost_per_useful_hour``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from meshmorph.predict.market import Zone


class Policy(StrEnum):
    """What a run does when spot capacity comes and goes."""

    RESTART = "restart"
    RESHAPE = "reshape"
    MULTI_ZONE = "multi-zone"
    DEADLINE = "deadline"
    ON_DEMAND = "on-demand"


SINGLE_ZONE = (Policy.RESTART, Policy.RESHAPE)
"""Policies that stay in one zone."""
ON_DEMAND = "on-demand"
"""Where on-demand nodes run (the target of a switch)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadlineBound:
    """The worst case of finishing on on-demand nodes from the last checkpoint."""

    step_s: float
    """On-demand step time on all nodes, seconds."""
    start_s: float
    """Longest on-demand VM start-up plus the longest cold restart, seconds."""
    load_s: float
    """Reading the checkpoint back, seconds."""
    write_s: float
    """One checkpoint write, seconds."""
    interval_s: float
    """Seconds of training between checkpoints on on-demand nodes."""

    def finish_s(self, steps_left: float) -> float:
        """Worst-case seconds to train ``steps_left`` steps on on-demand nodes from a checkpoint."""
        compute = steps_left * self.step_s
        writes = max(math.ceil(compute / self.interval_s) - 1, 0) * self.write_s
        return self.start_s + self.load_s + compute + writes

    def switch_time_s(self, deadline_s: float, steps_left: float) -> float:
        """The last moment to leave spot with ``steps_left`` steps not yet checkpointed."""
        return deadline_s - self.finish_s(steps_left)


def choose_zone(policy: Policy, zones: Sequence[Zone], current: str | None,
                up: Callable[[str], bool]) -> str:
    """The zone to run in now: single-zone policies keep the best zone; the others stay where
    capacity is, else go to the best zone that has it now, else stay (and wait)."""
    best = zones[0].name
    if policy in SINGLE_ZONE:
        return best
    if current is not None and current != ON_DEMAND and up(current):
        return current
    waiting = current if current not in (None, ON_DEMAND) else best
    return next((zone.name for zone in zones if up(zone.name)), waiting)
