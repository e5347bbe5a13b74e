"""The spot simulator on cases a person can compute by hand, and its P50/P90 over seeds."""

from __future__ import annotations

import math

import pytest

from meshmorph.predict.cloud_catalog import Provider
from meshmorph.predict.market import Market, Zone
from meshmorph.predict.overheads import Overheads
from meshmorph.predict.policy import Policy
from meshmorph.predict.reshape_cost import reshape_move
from meshmorph.predict.revocation import Hazard
from meshmorph.predict.simulate import SimulationConfig, simulate_run, summarize
from meshmorph.predict.spot_data import PreemptionMode
from meshmorph.predict.traces import ZoneTrace
from meshmorph.predict.training_job import TrainingJob
from meshmorph.spec.catalog import load_model
from meshmorph.spec.cluster import parse_cluster

NODE_PRICE = 16.0  # USD per node-hour (8 GPUs at 2 USD)
VM_START, COLD, WARM, CKPT_FIXED = 60.0, 80.0, 20.0, 5.0
STEPS, PER_SEGMENT = 100, 10


def job(steps: int = STEPS, nodes: int = 2) -> TrainingJob:
    return TrainingJob(model=load_model("gpt3-125m"), cluster=parse_cluster(f"h100:{nodes}x8"),
                       global_batch=64, total_steps=steps)


def overheads() -> Overheads:
    return Overheads(vm_start_s=VM_START, cold_restart_s=COLD, warm_restart_s=WARM,
                     checkpoint_fixed_s=CKPT_FIXED)


def market(mode: PreemptionMode = PreemptionMode.LIFETIME, notice_s: float = 0.0,
           trace: tuple[bool, ...] | None = None, rate_per_h: float = 0.0) -> Market:
    """One zone, always with capacity unless a trace is given; lifetimes never end (or at a
    constant rate)."""
    hazard = Hazard(name="z", edges_h=(0.0,), rates_per_h=(), tail_rate_per_h=rate_per_h,
                    notice_s=notice_s)
    zone = Zone(name="z", availability=None, lifetime=hazard, spot_node_usd_per_h=NODE_PRICE,
                on_demand_node_usd_per_h=4 * NODE_PRICE,
                trace=ZoneTrace(zone="z", states=trace) if trace else None)
    return Market(gpu="h100", provider=Provider(name="p", notice_s=notice_s), mode=mode,
                  zones=(zone,), replay_tick_s=600.0)


def config(policy: Policy, step_s: float, **kw: object) -> SimulationConfig:
    # an interval of exactly PER_SEGMENT steps between checkpoints
    return SimulationConfig(policy=policy, checkpoint_interval_s=PER_SEGMENT * step_s, **kw)


def plain_time_s(step: float, write: float) -> float:
    checkpoints = math.ceil(STEPS / PER_SEGMENT) - 1  # none after the last step
    return VM_START + COLD + STEPS * step + checkpoints * write


def test_no_preemption_takes_steps_times_step_time_plus_checkpoints_and_costs_time_times_price() -> None:
    j = job()
    step, write = j.step_time_s(2), overheads().checkpoint_write_s(j.checkpoint_bytes, 2)
    run = simulate_run(j, market(), overheads(), config(Policy.RESTART, step))
    expected = plain_time_s(step, write)
    assert run.time_s == pytest.approx(expected, rel=1e-12)
    # billed from the moment the VMs run: 2 nodes x (time - start-up) x price
    assert run.cost_usd == pytest.approx(2 * (expected - VM_START) / 3600 * NODE_PRICE, rel=1e-12)
    assert (run.preemptions, run.lost_steps, run.zone_compute_s.keys()) == (0, 0.0, {"z"})


def test_one_preemption_mid_segment_loses_half_a_segment_and_pays_one_restart() -> None:
    j = job()
    step, write = j.step_time_s(2), overheads().checkpoint_write_s(j.checkpoint_bytes, 2)
    segment = PER_SEGMENT * step
    at = VM_START + COLD + (segment + write) + 0.5 * segment  # halfway through segment 2
    run = simulate_run(j, market(), overheads(), config(Policy.RESTART, step,
                                                        revocations_s=((0, at),)))
    load = j.checkpoint_bytes / (2 * 1e9)  # both nodes read their shard at 1 GB/s
    assert run.lost_steps == pytest.approx(PER_SEGMENT / 2, rel=1e-9)
    assert run.preemptions == 1
    assert run.time_s == pytest.approx(plain_time_s(step, write) + 0.5 * segment + VM_START
                                       + COLD + load, rel=1e-12)
    node_s = 2 * (run.time_s - VM_START) - VM_START  # node 0 unbilled while it restarts
    assert run.cost_usd == pytest.approx(node_s / 3600 * NODE_PRICE, rel=1e-12)


def test_a_notice_long_enough_for_a_checkpoint_loses_only_the_notice_window() -> None:
    j = job(steps=20_000)
    step = j.step_time_s(2)
    notice = overheads().checkpoint_write_s(j.checkpoint_bytes, 2) + 1.0
    at = VM_START + COLD + 2 * notice  # no checkpoint yet
    one = SimulationConfig(policy=Policy.RESTART, checkpoint_interval_s=20_000 * step,
                           revocations_s=((0, at),))
    run = simulate_run(j, market(notice_s=notice), overheads(), one)
    assert run.lost_steps == pytest.approx(notice / step, rel=1e-9)
    bare = simulate_run(j, market(), overheads(), one)  # without it: back to the start
    assert bare.lost_steps == pytest.approx(2 * notice / step, rel=1e-9)


def test_capacity_gone_for_half_an_hour_stops_every_node_and_restarts_when_it_returns() -> None:
    j = job(steps=20_000)
    step, write = j.step_time_s(2), overheads().checkpoint_write_s(j.checkpoint_bytes, 2)
    trace = (True,) * 6 + (False,) * 3 + (True,) * 1000  # 1 h up, 30 min down, then up
    cfg = config(Policy.RESTART, step, replay=True, trace_offset_ticks=0)
    run = simulate_run(j, market(PreemptionMode.CAPACITY, trace=trace), overheads(), cfg)
    assert run.preemptions == 2  # both nodes, at 3600 s
    segment = PER_SEGMENT * step + write
    saved = PER_SEGMENT * math.floor((3600 - VM_START - COLD) / segment)
    back = 5400 + VM_START + COLD + j.checkpoint_bytes / 2e9  # up at 5400 s, start, restart, load
    left = j.total_steps - saved
    assert run.time_s == pytest.approx(back + left * step + (math.ceil(left / PER_SEGMENT) - 1)
                                       * write, rel=1e-9)
    waits = [e for e in run.timeline if e[2] == "wait"]
    assert waits[0][0] == pytest.approx(3600) and waits[0][1] == pytest.approx(5400 + VM_START)


def test_reshape_continues_on_the_survivor_at_the_move_reshape_prices_and_grows_back() -> None:
    j = job(steps=2000)
    step = j.step_time_s(2)
    at = VM_START + COLD + 5 * step
    run = simulate_run(j, market(), overheads(), config(Policy.RESHAPE, step,
                                                        revocations_s=((1, at),)))
    shrink, grow = reshape_move(j, 2, 1), reshape_move(j, 1, 2)
    assert shrink is not None and grow is not None
    # the lost node held pieces nobody else has: back to the checkpoint (the start), read it
    read = j.checkpoint_bytes / 1e9 if shrink.from_checkpoint else 0.0
    one_node = [e for e in run.timeline if e[2] == "compute" and e[3] == 1]
    assert one_node[0][0] == pytest.approx(at + WARM + shrink.move_s + read, rel=1e-12)
    back = [e for e in run.timeline if e[2] == "compute" and e[3] == 2 and e[0] > at]
    # the replacement starts at once (capacity is there); the job grows once it is up, after the
    # checkpoint being written (if any), with a warm restart and the move back to two nodes
    up_again = at + VM_START
    write = overheads().checkpoint_write_s(j.checkpoint_bytes, 1)
    assert up_again + WARM + grow.move_s - 1e-9 <= back[0][0] <= \
        up_again + write + WARM + grow.move_s + 1e-9
    assert run.reshapes == 2
    restart = simulate_run(j, market(), overheads(), config(Policy.RESTART, step,
                                                            revocations_s=((1, at),)))
    assert run.time_s < restart.time_s


def test_p50_and_p90_agree_within_3_and_6_percent_over_two_seed_ranges() -> None:
    j = TrainingJob(model=load_model("gpt3-1.3b"), cluster=parse_cluster("h100:8x8"),
                    global_batch=256, total_steps=60_000)
    m = market(rate_per_h=0.1)
    cfg = SimulationConfig(policy=Policy.RESTART)
    a = summarize([simulate_run(j, m, overheads(), cfg, s) for s in range(40)])
    b = summarize([simulate_run(j, m, overheads(), cfg, s) for s in range(1000, 1040)])
    assert a["preemptions_mean"] > 2  # the runs do see preemptions
    assert a["time_h_p10"] <= a["time_h_p50"] <= a["time_h_p90"]
    assert a["time_h_p50"] == pytest.approx(b["time_h_p50"], rel=0.03)
    assert a["time_h_p90"] == pytest.approx(b["time_h_p90"], rel=0.06)
    assert a["cost_usd_p50"] == pytest.approx(b["cost_usd_p50"], rel=0.03)
