"""Pipeline schedules as data: per-rank action lists, their validity, and one event simulator.

Pure Python (no torch): the cost model prices every schedule through ``simulator.simulate``,
``meshmorph timeline`` draws it, and the tests check the lists against torch's own generators.
"""

from meshmorph.schedule.action import Action, Kind
from meshmorph.schedule.registry import SCHEDULE_NAMES, schedule_actions, stage_to_rank
from meshmorph.schedule.simulator import StageTimes, Timeline, simulate_actions

__all__ = ["SCHEDULE_NAMES", "Action", "Kind", "StageTimes", "Timeline", "schedule_actions",
           "simulate_actions", "stage_to_rank"]
