"""``CostModel.assemble_below`` (and ``reaches_bound``, before a plan is built) proves a step
not below the bound before simulating it (a rank's fill, work and drain with its tail, and
memory first where asked): whatever it cuts, the simulated step reaches the bound, for every
schedule and any chunk times."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from meshmorph.cost.layer_cost import PieceCost
from meshmorph.cost.model import CostModel
from meshmorph.plan.partition_search import interleaved_block_counts, stages_of_counts
from meshmorph.schedule.table import Schedule
from meshmorph.spec import catalog_model, parse_cluster
from meshmorph.spec.model import Recompute
from meshmorph.spec.plan import Plan

SHAPES = [  # (schedule, pp, vpp)
    (Schedule.GPIPE, 4, 1), (Schedule.ONE_F_ONE_B, 4, 1), (Schedule.ZERO_BUBBLE, 4, 1),
    (Schedule.ONE_F_ONE_B, 3, 1), (Schedule.ZERO_BUBBLE, 3, 1),
    (Schedule.INTERLEAVED, 2, 2), (Schedule.ZBV, 2, 2), (Schedule.DUALPIPEV, 2, 2),
]
SHARES = (0.5, 0.9, 0.99, 0.999, 1.0, 1.001, 1.01, 1.1)
"""Bounds as shares of the simulated step: cut exactly those at or below 1."""


@pytest.mark.parametrize("schedule,pp,vpp", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_a_step_cut_before_simulation_reaches_the_bound(schedule: Schedule, pp: int, vpp: int,
                                                         m: int) -> None:
    if schedule in (Schedule.GPIPE, Schedule.DUALPIPEV) and m < 2 * pp or \
            schedule == Schedule.INTERLEAVED and m % pp:
        m = pp * 2  # the shapes these schedules run
    model = catalog_model("gpt-tiny")
    cost = CostModel(model, parse_cluster("h100:1x8"))
    rng = random.Random(f"{schedule}{pp}{m}")
    answered = 0  # steps the precheck proved without a simulation
    for draw in range(12):
        plan = Plan(model="gpt-tiny", seq_len=model.seq_len, global_batch=2 * m, tp=1, pp=pp,
                    dp=2, zero=draw % 4, micro_batch=1, num_microbatches=m,
                    schedule=schedule, vpp=vpp).with_even_stages(model)
        gpus = [cost.default_gpu()] * plan.num_chunks
        times = []
        for stage in plan.stages:  # alike stages on even draws: the tight cases
            f, b, w = (0.5, 0.6, 0.4) if draw % 2 == 0 else \
                (rng.uniform(0.01, 1.0), rng.uniform(0.01, 1.0), rng.uniform(0.0, 0.5))
            params = cost.chunk_params(stage.start, stage.stop, plan.tp)
            times.append(PieceCost(f, b + w, b, w, f, 0.0, 0.0, 0.0, 0.0, params))
        estimate = cost.assemble(plan, gpus, times)
        step = estimate.step_time_s
        for share in SHARES:
            bound = step * share
            cut_before = cost.prechecks_cut
            below = cost.assemble_below(plan, gpus, times, bound)
            assert (below is None) == (step >= bound), (draw, share)
            assert below is None or below.step_time_s == step
            cut = cost.prechecks_cut - cut_before
            assert cut == 0 or below is None, (draw, share)  # it counts only what it answered
            simulated = cost.assemble_below(plan, gpus, times, bound, precheck=False)
            assert (simulated is None) == (below is None), (draw, share)
            assert cost.prechecks_cut == cut_before + cut  # the same answer, without it
            answered += cut
            spans = [(stage.start, stage.stop) for stage in plan.stages]
            if cost.reaches_bound(plan, gpus, times, spans, bound):
                assert step >= bound, (draw, share)
            fitting = cost.assemble_below(plan, gpus, times, bound, fitting=True)
            assert (fitting is None) == (step >= bound or not estimate.fits)
    assert answered, "the precheck proved no step without simulating it"


def test_stages_fit_decides_memory_as_assemble_does_before_the_plan_is_built() -> None:
    # llama3-8b on 8 x 80 GB: interleaved chunks of every split and recompute mode, some that
    # fit and some that do not; the check on the bare configuration's plan and the stages must
    # agree with the memory of the plan built from them
    model = catalog_model("llama3-8b")
    cost = CostModel(model, parse_cluster("a100-80g:1x8"))
    base = Plan(model="llama3-8b", seq_len=model.seq_len, global_batch=64, tp=1, pp=4, dp=2,
                zero=1, micro_batch=2, num_microbatches=16, schedule=Schedule.INTERLEAVED, vpp=2)
    gpus = [cost.default_gpu()] * base.num_chunks
    outcomes = set()
    for counts in interleaved_block_counts(model.num_blocks, base.num_chunks):
        for mode in Recompute:
            stages = stages_of_counts(model, counts, mode)
            fits = cost.estimate(replace(base, stages=stages)).fits
            assert cost.stages_fit(base, gpus, stages) == fits, (counts, mode)
            outcomes.add(fits)
    assert outcomes == {True, False}
