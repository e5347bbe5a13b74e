"""The search for the fastest Plan (the Plan noun itself lives in spec/). Imports no torch."""

from meshmorph.schedule.table import Schedule
from meshmorph.spec.plan import Plan, PlanError, StagePlan

__all__ = ["Plan", "PlanError", "Schedule", "StagePlan"]
