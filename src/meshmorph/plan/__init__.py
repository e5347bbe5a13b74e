"""Plans and the search for the fastest one. Imports no torch."""

from meshmorph.plan.plan import Plan, PlanError, Schedule, StagePlan

__all__ = ["Plan", "PlanError", "Schedule", "StagePlan"]
