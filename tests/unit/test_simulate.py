"""The transient-cloud simulator on cases a person can compute by hand, and its P50/P90 over seeds."""

from __future__ import annotations

import math

import pytest

from meshmorph.predict.overheads import Overheads
from meshmorph.predict.revocation import Hazard
from meshmorph.predict.simulate import SimulationConfig, simulate_run, summarize
from meshmorph.predict.training_job import TrainingJob
from meshmorph.spec.catalog import load_model
from meshmorph.spec.cluster import parse_cluster

PRICE = 2.0  # USD per GPU-hour
VM_START, COLD, WARM, CKPT_FIXED = 60.0, 80.0, 20.0, 5.0
STEPS, PER_SEGMENT = 100, 10


def job(steps: int = STEPS) -> TrainingJob:
    return TrainingJob(model=load_model("gpt3-125m"), cluster=parse_cluster("h100:2x8"),
                       global_batch=64, total_steps=steps, price_per_gpu_hour=PRICE)


def overheads() -> Overheads:
    return Overheads(vm_start_s=VM_START, request_s=45.0, cold_restart_s=COLD,
                     warm_restart_s=WARM, checkpoint_fixed_s=CKPT_FIXED)


def never(notice_s: float = 0.0) -> Hazard:
    return Hazard(name="never", edges_h=(0.0,), rates_per_h=(), notice_s=notice_s)


def config(strategy: str, step_s: float, revocations=None) -> SimulationConfig:  # type: ignore[no-untyped-def]
    # an interval of exactly PER_SEGMENT steps between checkpoints
    return SimulationConfig(strategy=strategy, checkpoint_interval_s=PER_SEGMENT * step_s,
                            revocations_s=revocations)


def plain_time_s(j: TrainingJob, step: float, write: float) -> float:
    checkpoints = math.ceil(STEPS / PER_SEGMENT) - 1  # none after the last step
    return VM_START + COLD + STEPS * step + checkpoints * write


def test_no_revocation_takes_steps_times_step_time_plus_checkpoints_and_costs_time_times_price() -> None:
    j = job()
    step = j.step_time_s(2)
    write = overheads().checkpoint_write_s(j.checkpoint_bytes, 2)
    run = simulate_run(j, never(), overheads(), config("on-demand", step))
    expected = plain_time_s(j, step, write)
    assert run.time_s == pytest.approx(expected, rel=1e-12)
    # billed from the moment the VMs run: 16 GPUs x (time - start-up) x price
    assert run.cost_usd == pytest.approx(16 * (expected - VM_START) / 3600 * PRICE, rel=1e-12)
    assert (run.revocations, run.lost_steps) == (0, 0.0)


def test_one_revocation_mid_segment_loses_half_a_segment_and_pays_one_restart() -> None:
    j = job()
    step = j.step_time_s(2)
    write = overheads().checkpoint_write_s(j.checkpoint_bytes, 2)
    segment = PER_SEGMENT * step
    at = VM_START + COLD + (segment + write) + 0.5 * segment  # halfway through segment 2
    run = simulate_run(j, never(), overheads(), config("restart", step, ((0, at),)))
    load = j.checkpoint_bytes / (2 * 1e9)  # both nodes read their shard at 1 GB/s
    extra = 0.5 * segment + VM_START + COLD + load
    assert run.lost_steps == pytest.approx(PER_SEGMENT / 2, rel=1e-9)
    assert run.revocations == 1
    assert run.time_s == pytest.approx(plain_time_s(j, step, write) + extra, rel=1e-12)
    # node 0 is not billed while its replacement starts
    node_s = 2 * (run.time_s - VM_START) - VM_START
    assert run.cost_usd == pytest.approx(8 * node_s / 3600 * PRICE, rel=1e-12)


def test_a_notice_long_enough_for_a_checkpoint_loses_only_the_notice_window() -> None:
    j = job(steps=20_000)
    step = j.step_time_s(2)
    notice = overheads().checkpoint_write_s(j.checkpoint_bytes, 2) + 1.0
    at = VM_START + COLD + 2 * notice  # no checkpoint yet: the only one is at the end
    one_segment = SimulationConfig(strategy="restart", checkpoint_interval_s=20_000 * step,
                                   revocations_s=((0, at),))
    run = simulate_run(j, never(notice), overheads(), one_segment)
    assert run.lost_steps == pytest.approx(notice / step, rel=1e-9)
    # without the notice the job falls back to its start
    bare = simulate_run(j, never(), overheads(), one_segment)
    assert bare.lost_steps == pytest.approx(2 * notice / step, rel=1e-9)


def test_reshape_keeps_training_on_the_survivor_until_the_replacement_arrives() -> None:
    j = job(steps=2000)
    step = j.step_time_s(2)
    at = VM_START + COLD + 5 * step
    run = simulate_run(j, never(), overheads(), config("reshape", step, ((1, at),)))
    one_node = [e for e in run.timeline if e[2] == "compute" and e[3] == 1]
    move_s = j.checkpoint_bytes / 1 / (12.5 * 8 * 1e9)  # the state over one node's NICs
    # on one node from the warm restart until the replacement (45 s after the revocation) is up
    assert min(e[0] for e in one_node) == pytest.approx(at + WARM + move_s, rel=1e-12)
    assert max(e[1] for e in one_node) <= at + 45.0
    # back on two nodes once the replacement is up, after the checkpoint being written (if any),
    # a warm restart and moving half the state to it
    write = overheads().checkpoint_write_s(j.checkpoint_bytes, 1)
    grow_s = WARM + j.checkpoint_bytes / 2 / (12.5 * 8 * 1e9)
    back = [e for e in run.timeline if e[2] == "compute" and e[3] == 2 and e[0] > at]
    assert at + 45.0 + grow_s <= back[0][0] <= at + 45.0 + write + grow_s
    restart = simulate_run(j, never(), overheads(), config("restart", step, ((1, at),)))
    assert run.time_s < restart.time_s


def test_p50_and_p90_agree_within_3_and_6_percent_over_two_seed_ranges() -> None:
    model, cluster = load_model("gpt3-1.3b"), parse_cluster("h100:8x8")
    j = TrainingJob(model=model, cluster=cluster, global_batch=256, total_steps=60_000,
                    price_per_gpu_hour=PRICE)
    hazard = Hazard(name="k80-like", rates_per_h=(0.24, 0.0, 0.076, 0.006, 0.013, 0.024, 0.011),
                    max_runtime_h=24.0, notice_s=30.0)
    a = summarize([simulate_run(j, hazard, Overheads(), SimulationConfig(), s) for s in range(40)])
    b = summarize([simulate_run(j, hazard, Overheads(), SimulationConfig(), s)
                   for s in range(1000, 1040)])
    assert a["revocations_mean"] > 2  # the runs do see revocations (3.1 per run measured)
    assert a["time_h_p50"] == pytest.approx(b["time_h_p50"], rel=0.03)
    assert a["time_h_p90"] == pytest.approx(b["time_h_p90"], rel=0.06)
    assert a["cost_usd_p50"] == pytest.approx(b["cost_usd_p50"], rel=0.03)
