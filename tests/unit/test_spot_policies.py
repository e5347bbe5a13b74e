"""Policies: deadline-aware never misses a deadline that on-demand alone meets; multi-zone is never
slower than the best single zone on a replayed trace; zones ranked by price per useful hour."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshmorph.predict.availability import fit_zone
from meshmorph.predict.cloud_catalog import Provider
from meshmorph.predict.market import Market, Zone
from meshmorph.predict.overheads import Overheads
from meshmorph.predict.policy import ON_DEMAND, DeadlineBound, Policy, choose_zone
from meshmorph.predict.revocation import Hazard
from meshmorph.predict.simulate import SimulationConfig, simulate_run
from meshmorph.predict.spot_data import PreemptionMode
from meshmorph.predict.traces import ZoneTrace
from meshmorph.predict.training_job import TrainingJob
from meshmorph.spec.catalog import load_model
from meshmorph.spec.cluster import parse_cluster

TICK_S = 600.0
JOB = TrainingJob(model=load_model("gpt3-125m"), cluster=parse_cluster("h100:2x8"),
                  global_batch=64, total_steps=600_000)  # about 4 h of steps


def zone(name: str, states: tuple[bool, ...], price: float) -> Zone:
    """A zone whose capacity is a recorded trace, fitted and replayable."""
    return Zone(name=name, availability=fit_zone(name, [states], TICK_S, "test"),
                lifetime=Hazard(name=name, edges_h=(0.0,), rates_per_h=(), notice_s=30.0),
                spot_node_usd_per_h=price, on_demand_node_usd_per_h=4 * price,
                trace=ZoneTrace(zone=name, states=states))


def market(*zones: Zone) -> Market:
    ranked = sorted(zones, key=lambda z: (z.cost_per_useful_hour, z.name))
    return Market(gpu="h100", provider=Provider(name="p", notice_s=30.0),
                  mode=PreemptionMode.CAPACITY, zones=tuple(ranked), replay_tick_s=TICK_S)


def flaky(up: int, down: int, ticks: int = 2000) -> tuple[bool, ...]:
    """``up`` ticks with capacity, ``down`` without, repeated."""
    return tuple((i % (up + down)) < up for i in range(ticks))


def overheads() -> Overheads:
    return Overheads()  # measured draws: the deadline bound uses their maxima


def on_demand_bound_h() -> float:
    o = overheads()
    bound = DeadlineBound(step_s=float(JOB.step_time_s(2)),  # type: ignore[arg-type]
                          start_s=o.vm_start_max_s(False) + o.cold_restart_max_s(),
                          load_s=o.load_s(JOB.checkpoint_bytes, 2),
                          write_s=o.checkpoint_write_s(JOB.checkpoint_bytes, 2),
                          interval_s=4 * 3600.0)
    return bound.finish_s(JOB.total_steps) / 3600


@settings(max_examples=12, deadline=None)
@given(slack=st.floats(1.0, 2.5), up=st.integers(1, 12), down=st.integers(1, 24),
       seed=st.integers(0, 1000))
def test_deadline_aware_never_misses_a_deadline_on_demand_alone_meets(
        slack: float, up: int, down: int, seed: int) -> None:
    deadline = slack * on_demand_bound_h()
    m = market(zone("a", flaky(up, down), 10.0), zone("b", flaky(down, up), 11.0))
    for replay in (False, True):
        run = simulate_run(JOB, m, overheads(), SimulationConfig(
            policy=Policy.DEADLINE, deadline_h=deadline, replay=replay), seed)
        assert run.finished and run.time_s <= deadline * 3600 + 1e-6


def test_deadline_aware_stays_on_spot_when_there_is_slack_and_saves_money() -> None:
    m = market(zone("a", (True,) * 2000, 10.0))
    cfg = SimulationConfig(policy=Policy.DEADLINE, deadline_h=10 * on_demand_bound_h())
    run = simulate_run(JOB, m, overheads(), cfg, 0)
    on_demand = simulate_run(JOB, m, overheads(), SimulationConfig(policy=Policy.ON_DEMAND), 0)
    assert run.switched_at_s is None and run.cost_usd < 0.3 * on_demand.cost_usd


def test_deadline_aware_switches_to_on_demand_where_spot_never_comes() -> None:
    m = market(zone("a", (False,) * 2000, 10.0))
    deadline = 1.2 * on_demand_bound_h()
    run = simulate_run(JOB, m, overheads(), SimulationConfig(policy=Policy.DEADLINE,
                                                            deadline_h=deadline), 0)
    assert run.switched_at_s is not None and run.time_s <= deadline * 3600
    assert set(run.zone_compute_s) == {ON_DEMAND}


@pytest.mark.parametrize("offset", [0, 37, 400, 1234])
def test_multi_zone_is_never_slower_than_the_best_single_zone_on_a_replayed_trace(
        offset: int) -> None:
    a = zone("a", flaky(18, 6), 10.0)   # 3 h up, 1 h down
    b = zone("b", flaky(6, 18), 9.0)    # 1 h up, 3 h down, cheaper
    c = zone("c", tuple(((i + 9) % 24) < 12 for i in range(2000)), 9.5)  # up when a is down
    m = market(a, b, c)
    multi = simulate_run(JOB, m, overheads(), SimulationConfig(
        policy=Policy.MULTI_ZONE, replay=True, trace_offset_ticks=offset), 1)
    singles = [simulate_run(JOB, market(z), overheads(), SimulationConfig(
        policy=Policy.RESTART, replay=True, trace_offset_ticks=offset), 1) for z in (a, b, c)]
    assert multi.finished and multi.time_s <= min(s.time_s for s in singles)
    assert multi.moves >= 1


def test_zones_are_ranked_by_price_per_useful_hour_and_multi_zone_goes_where_capacity_is() -> None:
    m = market(zone("cheap-rare", flaky(1, 9), 5.0), zone("dear-always", (True,) * 2000, 12.0))
    assert [z.name for z in m.zones] == ["dear-always", "cheap-rare"]  # 12 / 1.0 < 5 / 0.1
    up = {"dear-always": False, "cheap-rare": True}
    assert choose_zone(Policy.MULTI_ZONE, m.zones, None, up.__getitem__) == "cheap-rare"
    assert choose_zone(Policy.RESTART, m.zones, None, up.__getitem__) == "dear-always"
    assert choose_zone(Policy.MULTI_ZONE, m.zones, "cheap-rare", lambda z: False) == "cheap-rare"


def test_the_deadline_bound_counts_start_read_steps_and_writes() -> None:
    bound = DeadlineBound(step_s=2.0, start_s=100.0, load_s=10.0, write_s=5.0, interval_s=50.0)
    assert bound.finish_s(100) == 100 + 10 + 200 + 3 * 5  # 200 s of steps: 3 writes between
    assert bound.switch_time_s(1000.0, 100) == 1000 - 325
    assert math.isclose(bound.finish_s(0), 110.0)
