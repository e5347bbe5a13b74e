"""One job under several policies, simulated from the fitted processes and, where a trace is
given, replayed from it beside them: the figures ``meshmorph simulate`` prints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from meshmorph.predict.market import Market
from meshmorph.predict.overheads import Overheads
from meshmorph.predict.policy import SINGLE_ZONE, Policy
from meshmorph.predict.simulate import RunResult, SimulationConfig, simulate_run, summarize
from meshmorph.predict.training_job import TrainingJob


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """What to simulate."""

    job: TrainingJob
    """The training run."""
    market: Market
    """Its zones, prices and processes."""
    overheads: Overheads
    """Start-up, restart and checkpoint costs."""
    policies: tuple[Policy, ...]
    """Policies to compare."""
    runs: int = 20
    """Seeded runs per policy (P10/P50/P90 over them)."""
    seed: int = 0
    """First seed."""
    deadline_h: float | None = None
    """Deadline, hours (the deadline policy and the share of runs that meet it)."""
    replay: bool = False
    """Also replay the market's recorded traces (one start tick per seed)."""


@dataclass(slots=True)
class PolicyResult:
    """A policy's figures from the fits and, with a trace, from the replay."""

    policy: Policy
    """The policy."""
    model: dict[str, Any]
    """Summary over the runs drawn from the fitted processes."""
    replay: dict[str, Any] | None = None
    """Summary over the replays of the trace (None: no trace)."""
    example: RunResult | None = None
    """The first run (for the timeline chart)."""
    zones: list[str] = field(default_factory=list)
    """Zones the policy may use (single-zone policies: the best one)."""


def _runs(scenario: Scenario, policy: Policy, replay: bool) -> list[RunResult]:
    config = SimulationConfig(policy=policy, deadline_h=scenario.deadline_h, replay=replay)
    return [simulate_run(scenario.job, scenario.market, scenario.overheads, config, seed)
            for seed in range(scenario.seed, scenario.seed + scenario.runs)]


def run_scenario(scenario: Scenario) -> list[PolicyResult]:
    """Every policy's P10/P50/P90 time and cost (and the replay's beside it)."""
    out = []
    for policy in scenario.policies:
        model = _runs(scenario, policy, replay=False)
        replay = _runs(scenario, policy, replay=True) if scenario.replay else None
        zones = [z.name for z in scenario.market.zones]
        out.append(PolicyResult(
            policy=policy, model=summarize(model, scenario.deadline_h),
            replay=summarize(replay, scenario.deadline_h) if replay else None,
            example=(replay or model)[0],
            zones=zones[:1] if policy in SINGLE_ZONE else
            ([] if policy is Policy.ON_DEMAND else zones)))
    return out
