"""The terms the planner's bounds read (cost/rank_terms.py) reassemble CostModel's own figures.

The bounds and the stage search never redo the cost model's memory or tail arithmetic: they
call ``rank_memory_terms`` and ``rank_tail_s``. These tests prove that those add up to exactly
what ``CostModel.rank_memory`` and ``CostModel.assemble`` compute, for every ZeRO stage,
dtype, schedule and pipeline rank, so a change to the cost model that the terms miss fails here.
"""

from __future__ import annotations

import random

import pytest

from meshmorph.cost.coefficients import CostCoefficients
from meshmorph.cost.model import CostModel
from meshmorph.cost.rank_terms import least_rank_tail_s, rank_memory_terms, rank_tail_s
from meshmorph.schedule.table import Schedule
from meshmorph.spec import catalog_model, parse_cluster
from meshmorph.spec.model import Recompute
from meshmorph.spec.plan import Plan
from meshmorph.spec.transformer import TransformerShape, build_transformer


def _random_plans(rng: random.Random, count: int):  # type: ignore[no-untyped-def]
    for _ in range(count):
        arch = rng.choice(("gpt", "llama"))
        blocks = rng.randint(2, 8)
        model = build_transformer(TransformerShape(
            name="tiny", arch=arch, num_layers=blocks, hidden_size=rng.choice((128, 256)),
            num_heads=rng.choice((2, 4)), vocab_size=rng.choice((512, 8000)),
            seq_len=rng.choice((512, 2048))))
        tp, dp = rng.choice((1, 2)), rng.choice((1, 2, 4))
        pp = rng.choice([p for p in (1, 2, 4) if p <= blocks])
        m = rng.choice((pp, 2 * pp))
        schedule = Schedule.ONE_F_ONE_B if pp == 1 else rng.choice(
            (Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.ZERO_BUBBLE))
        plan = Plan(model="tiny", seq_len=model.seq_len, global_batch=dp * m, tp=tp, pp=pp,
                    dp=dp, zero=rng.choice((0, 1, 2, 3)), micro_batch=1, num_microbatches=m,
                    schedule=schedule, sequence_parallel=rng.random() < 0.5,
                    dtype=rng.choice(("bf16", "fp16", "fp32")),
                    reduce_dtype=rng.choice(("fp32", "bf16")))
        plan = plan.with_even_stages(model)
        stages = []
        for stage in plan.stages:  # a random recompute per layer
            modes = tuple(rng.choice([m for m in Recompute if m in model.layers[i].activation])
                          for i in range(stage.start, stage.stop))
            stages.append(type(stage)(start=stage.start, stop=stage.stop, recompute=modes))
        yield model, Plan(**{**{f: getattr(plan, f) for f in plan.__dataclass_fields__},
                             "stages": tuple(stages)})


@pytest.mark.parametrize("cluster", ["a100-40g:1x8", "cpu:2x4"])
def test_rank_memory_terms_add_up_to_rank_memory_for_random_plans(cluster: str) -> None:
    rng = random.Random(7)
    spec = parse_cluster(cluster)
    gpu = spec.groups[0].gpu
    checked = 0
    for model, plan in _random_plans(rng, 60):
        cost = CostModel(model, spec)
        coster = cost.coster(plan)
        for k, stage in enumerate(plan.stages):
            layers = [coster.layer(i, gpu, plan.micro_batch, plan.tp, plan.sequence_parallel, mode)
                      for i, mode in zip(range(stage.start, stage.stop), stage.recompute,
                                         strict=True)]
            terms = rank_memory_terms(cost, plan, k, gpu)
            predicted = terms.total(
                params=cost.chunk_params(stage.start, stage.stop, plan.tp),
                stored=sum(c.activation_bytes for c in layers),
                working=max(c.working_bytes for c in layers),
                largest_layer_params=max(cost.chunk_params(i, i + 1, plan.tp)
                                         for i in range(stage.start, stage.stop)))
            memory = cost.rank_memory(plan, k, [(stage.start, stage.stop, stage.recompute)], gpu)
            assert predicted == pytest.approx(memory.total, rel=1e-12), (plan, k)
            assert terms.in_flight == memory.in_flight_microbatches
            assert terms.budget_bytes == gpu.memory_bytes
            checked += 1
    assert checked >= 100


def test_rank_tail_is_the_tail_assemble_adds_to_the_critical_rank() -> None:
    rng = random.Random(11)
    spec = parse_cluster("a100-40g:2x4")
    gpu = spec.groups[0].gpu
    # with half the sync hideable, the overlap window decides how much of it is exposed
    coefficients = CostCoefficients(dp_overlap=0.5)
    seen_sync = 0
    for model, plan in _random_plans(rng, 80):
        cost = CostModel(model, spec, coefficients)
        estimate = cost.estimate(plan)
        tails = []
        for stage in plan.stages:
            time = cost.chunk_time(plan, stage.start, stage.stop, stage.recompute, gpu)
            tails.append(rank_tail_s(cost, plan, time, gpu))
            # the least tail of a rank holding these parameters is at most its real tail plus
            # its exposed per-micro-batch ZeRO traffic
            least = least_rank_tail_s(cost, plan, time.params, gpu)
            assert least <= tails[-1] + plan.num_microbatches * time.zero3_comm_s * (1 + 1e-12)
        added = estimate.breakdown_s["dp_comm_exposed"] + estimate.breakdown_s["optimizer"]
        assert any(added == pytest.approx(t, rel=1e-12) for t in tails), (plan, added, tails)
        seen_sync += estimate.breakdown_s["dp_comm_exposed"] > 0
    assert seen_sync >= 20  # the data-parallel sync really is part of what was compared


def test_rank_memory_terms_on_a_catalog_model_show_the_zero_stages_apart() -> None:
    model = catalog_model("llama3-70b")
    spec = parse_cluster("h100:8x8")
    cost = CostModel(model, spec)
    gpu = spec.groups[0].gpu
    per_param = {}
    for zero in (0, 1, 2, 3):
        plan = Plan(model=model.name, seq_len=model.seq_len, global_batch=64, tp=8, dp=8,
                    zero=zero, micro_batch=1, num_microbatches=8)
        per_param[zero] = rank_memory_terms(cost, plan, 0, gpu).bytes_per_param
        assert per_param[zero] == cost.held(plan).at_peak
    assert per_param[0] > per_param[1] > per_param[3]
    assert per_param[2] > per_param[3]
