"""The layerwise stage program equals a brute force over every per-layer assignment."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace
from types import SimpleNamespace

import pytest

from meshmorph.cost.model import CostModel
from meshmorph.cost.rank_terms import device_reserve_bytes
from meshmorph.cost.segments import chunk_segments
from meshmorph.cost.transition import transition
from meshmorph.plan.search import search_per_layer
from meshmorph.plan.space import SearchOptions
from meshmorph.plan.strategy_dp import solve_stage
from meshmorph.spec.gpus import GPUSpec
from meshmorph.spec.model import Recompute
from meshmorph.spec.plan import LayerStrategy, Plan
from tests.helpers.layer_terms import a100_cost, layer_terms

MODES = (Recompute.NONE, Recompute.FULL)


def stage_cost(cost: CostModel, plan: Plan, pp_rank: int, start: int, stop: int,
               strategies: list[LayerStrategy], recompute: tuple[Recompute, ...],
               gpu: GPUSpec) -> SimpleNamespace:
    """Rank ``pp_rank`` holding layers [start, stop) under ``strategies``, as
    ``CostModel.estimate`` prices it (its chunk's segments and tail, its memory): ``busy_s(m)``
    its own step time, ``memory_bytes`` its peak."""
    stage = replace(plan.stages[pp_rank], start=start, stop=stop, recompute=tuple(recompute),
                    layer_strategies=tuple(strategies))
    listed = replace(plan, stages=tuple(stage if k == pp_rank else s
                                        for k, s in enumerate(plan.stages)))
    segments = chunk_segments(cost.model, listed, pp_rank)
    time, pieces = cost.stage_time(listed, segments, gpu)
    parts = list(zip(segments, pieces, strict=True))
    sync, optimizer, _ = cost.rank_tails(listed, pp_rank, parts, gpu)
    memory = cost.segments_memory(listed, pp_rank, segments, gpu).total
    return SimpleNamespace(busy_s=lambda m: m * (time.fwd_s + time.bwd_s) + sync + optimizer,
                           memory_bytes=memory)


def _brute(cost: CostModel, plan: Plan, pp_rank: int, start: int, stop: int,
           strategies: list[LayerStrategy],
           ends: tuple[int, int] | None = None) -> list[tuple[float, float]]:
    """Every assignment's (time, memory), added up here from the per-layer terms; with ``ends``
    (tp, zero) the first and last layer only under strategies of that pair."""
    gpu = cost.default_gpu()
    m = plan.num_microbatches
    tied = start == 0 and stop == cost.model.num_layers
    options = []
    for index in range(start, stop):
        modes = [r for r in MODES if r in cost.model.layers[index].activation]
        offered = [s for s in strategies if ends is None or index not in (start, stop - 1)
                   or (s.tp, s.zero) == ends]
        options.append([(s, r, layer_terms(cost, plan, pp_rank, index, s, r, gpu,
                                           drop_tied=tied and index == stop - 1))
                        for s in offered for r in modes])
    out = []
    for pick in itertools.product(*options):
        time = sum(m * (t.fwd_s + t.bwd_s) + t.tail_s for _, _, t in pick)
        for (a, _, _), (b, _, _) in itertools.pairwise(pick):
            step = transition(cost, a, b, plan.dp * plan.micro_batch, plan.dtype, gpu,
                              sequence_parallel=plan.sequence_parallel)
            time += m * (step.fwd_s + step.bwd_s)
        memory = (sum(t.param_bytes + t.stored_bytes + t.loss_bytes for _, _, t in pick)
                  + max(t.working_bytes for _, _, t in pick)
                  + max(t.gather_bytes for _, _, t in pick) + device_reserve_bytes(cost, gpu))
        out.append((time, memory))
    return out


def _best(assignments: list[tuple[float, float]], cap: float) -> float | None:
    """The least time of the assignments whose memory fits ``cap``."""
    return min((time for time, memory in assignments if memory <= cap), default=None)


CASES = [(seed, name, devices, pp) for seed, (name, devices, pp) in enumerate(
    [("gpt-tiny", 4, 1), ("llama-tiny", 4, 1), ("gpt-tiny", 8, 1), ("llama-tiny", 8, 2),
     ("gpt-tiny", 8, 2), ("gpt-tiny", 4, 2), ("llama-tiny", 8, 1)])]


def _case(seed: int, name: str, devices: int, pp: int):  # type: ignore[no-untyped-def]
    rng = random.Random(seed)
    cost = a100_cost(name, devices)
    model = cost.model
    zeros = 1 if pp == 1 else 2  # keeps the brute force to some 10^4 assignments
    strategies = [LayerStrategy(tp=t, dp=devices // t, zero=z)
                  for t in (1, 2, 4) for z in sorted(rng.sample([0, 1, 2, 3], zeros))]
    plan = Plan(model=model.name, seq_len=model.seq_len, global_batch=devices * 2 * pp, tp=1,
                dp=devices, pp=pp, micro_batch=1, num_microbatches=2 * pp).with_even_stages(model)
    k = rng.randrange(pp)
    return rng, cost, plan, k, plan.stages[k], strategies


@pytest.mark.parametrize(("seed", "name", "devices", "pp"), CASES)
def test_stage_program_equals_brute_force_under_random_memory_caps(seed: int, name: str,
                                                                   devices: int, pp: int) -> None:
    rng, cost, plan, k, stage, strategies = _case(seed, name, devices, pp)
    gpu = cost.default_gpu()
    every = _brute(cost, plan, k, stage.start, stage.stop, strategies)
    free = _best(every, float("inf"))
    assert free is not None
    # caps between the least and the most memory a uniform assignment needs, and one below
    # everything: some assignments do not fit, and at the last none does
    uniform = sorted(stage_cost(cost, plan, k, stage.start, stage.stop, [s] * stage.num_layers,
                                (Recompute.NONE,) * stage.num_layers, gpu).memory_bytes
                     for s in strategies)
    caps = [rng.uniform(uniform[0], uniform[-1]), uniform[0] * rng.uniform(0.9, 1.0),
            device_reserve_bytes(cost, gpu)]
    for cap in [float("inf"), *caps]:
        expected = _best(every, cap)
        got = solve_stage(cost, plan, k, stage.start, stage.stop, strategies, MODES, gpu,
                          memory_cap_bytes=cap)
        if expected is None:
            assert got is None
            continue
        assert got is not None, f"program found nothing under cap {cap}"
        assert got.busy_s == pytest.approx(expected, rel=1e-12)
        # the assignment it returns costs that much by the cost model's own stage sum
        again = stage_cost(cost, plan, k, stage.start, stage.stop, got.strategies,
                           got.recompute, gpu)
        assert again.busy_s(plan.num_microbatches) == pytest.approx(got.busy_s, rel=1e-12)
        assert again.memory_bytes <= cap * (1 + 1e-12)
    assert _best(every, caps[-1]) is None


@pytest.mark.parametrize(("seed", "name", "devices", "pp"),
                         [case for case in CASES if case[3] == 1])
def test_stage_program_with_sequence_parallelism_equals_brute_force(seed: int, name: str,
                                                                     devices: int,
                                                                     pp: int) -> None:
    """The same with sequence parallelism: every transition an all-to-all (cost/transition.py),
    in the program as in the brute force and in ``stage_cost``; the ends pinned to each tp in
    turn, so that optima change tp inside the stage."""
    rng, cost, plan, k, stage, strategies = _case(seed, name, devices, pp)
    # the same stage micro-batch in a tp 2 data layout (a plan at tp 1 has no sequence split)
    plan = replace(plan, tp=2, dp=devices // 2, micro_batch=2, sequence_parallel=True)
    assert plan.sequence_parallel
    gpu = cost.default_gpu()
    for ends in sorted({(s.tp, s.zero) for s in strategies}):
        every = _brute(cost, plan, k, stage.start, stage.stop, strategies, ends)
        caps = sorted(memory for _, memory in every)
        for cap in (float("inf"), caps[len(caps) // 3], caps[len(caps) // 10]):
            expected = _best(every, cap)
            got = solve_stage(cost, plan, k, stage.start, stage.stop, strategies, MODES, gpu,
                              memory_cap_bytes=cap, ends=ends)
            assert got is not None and expected is not None
            assert got.busy_s == pytest.approx(expected, rel=1e-12), (ends, cap)
            again = stage_cost(cost, plan, k, stage.start, stage.stop, got.strategies,
                               got.recompute, gpu)
            assert again.busy_s(plan.num_microbatches) == pytest.approx(got.busy_s, rel=1e-12)


def test_some_random_cap_makes_the_best_assignment_slower() -> None:
    """The caps bind: under at least one seeded cap the optimum is slower than without one."""
    slower = 0
    for case in CASES:
        rng, cost, plan, k, stage, strategies = _case(*case)
        gpu = cost.default_gpu()
        free = solve_stage(cost, plan, k, stage.start, stage.stop, strategies, MODES, gpu)
        assert free is not None
        tight = solve_stage(cost, plan, k, stage.start, stage.stop, strategies, MODES, gpu,
                            memory_cap_bytes=free.memory_bytes * 0.999)
        slower += tight is not None and tight.busy_s > free.busy_s
    assert slower >= 1


def test_single_stage_search_step_equals_its_stage_time_and_beats_uniform() -> None:
    cost = a100_cost("gpt-tiny", 4)
    options = SearchOptions(pp_degrees=(1,), recompute=MODES, zero_stages=(0, 3))
    result = search_per_layer(cost.model, cost.cluster, global_batch=8, cost=cost,
                              options=replace(options, runnable_only=False))
    assert result.uniform_estimate is not None
    assert result.estimates[0].step_time_s <= result.uniform_estimate.step_time_s
    plan = result.plans[0]
    strategies = [s for st in plan.stages
                  for s in (st.layer_strategies or
                            (LayerStrategy(tp=plan.tp, dp=plan.dp, zero=plan.zero),) * st.num_layers)]
    again = stage_cost(cost, plan, 0, 0, cost.model.num_layers, strategies,
                       plan.stages[0].recompute, cost.default_gpu())
    assert result.estimates[0].step_time_s == pytest.approx(again.busy_s(plan.num_microbatches),
                                                            rel=1e-12)


def _search_brute(cost: CostModel, global_batch: int, zero: int) -> float | None:
    """The least step over every stage micro-batch, sequence parallelism on and off and every
    per-layer assignment (pp = 1: the step is the stage's own time, checked above), from
    ``_brute``'s sums."""
    model, devices = cost.model, cost.cluster.world_size
    best = None
    for sequences, sp in itertools.product(
            (d for d in range(1, global_batch + 1) if global_batch % d == 0), (False, True)):
        strategies = [LayerStrategy(tp=t, dp=devices // t, zero=zero if devices // t > 1 else 0)
                      for t in (1, 2, 4) if devices % t == 0 and sequences % (devices // t) == 0
                      and model.num_kv_heads % t == 0 and model.num_heads % t == 0
                      and model.ffn_hidden_size % t == 0 and (not sp or model.seq_len % t == 0)]
        split = [s for s in strategies if s.tp > 1]
        if not strategies or (sp and not split):
            continue
        first = split[0] if sp else strategies[0]  # a sequence split needs a tp > 1 layout
        plan = Plan(model=model.name, seq_len=model.seq_len, global_batch=global_batch,
                    tp=first.tp, dp=first.dp, zero=first.zero,
                    micro_batch=sequences // first.dp, num_microbatches=global_batch // sequences,
                    sequence_parallel=sp)
        assert plan.sequence_parallel == sp
        every = _brute(cost, plan, 0, 0, model.num_layers, strategies)
        found = _best(every, cost.default_gpu().memory_bytes)
        if found is not None and (best is None or found < best):
            best = found
    return best


# brute force's optimum without a memory cap (moved 7e-7 relative when a flash attention core got
# its own share of the GEMM ceiling)
FREE_STEP_S = {"gpt-tiny": 1.901267296780948e-04, "llama-tiny": 1.9026601693310235e-04}


@pytest.mark.parametrize(("name", "memory_gib"), [
    ("gpt-tiny", None), ("gpt-tiny", 1.0539928), ("gpt-tiny", 1.0537819),
    ("llama-tiny", None), ("llama-tiny", 1.0539224), ("llama-tiny", 1.0538169)])
def test_whole_search_equals_brute_force_over_batches_and_assignments(name: str,
                                                                      memory_gib: float | None
                                                                      ) -> None:
    """pp = 1, 4 devices, every stage micro-batch; the capped devices (about 1.054 GiB, the
    context and reserve nearly all of it) make the optimum slower than without a cap."""
    cost = a100_cost(name, 4, memory_gib)
    options = SearchOptions(pp_degrees=(1,), recompute=MODES, zero_stages=(3,),
                            max_micro_batch=8)
    expected = _search_brute(cost, 8, 3)
    assert expected is not None
    if memory_gib is None:
        assert expected == pytest.approx(FREE_STEP_S[name], rel=1e-9)
    else:
        assert expected > FREE_STEP_S[name] * 1.005  # the cap binds
    result = search_per_layer(cost.model, cost.cluster, global_batch=8, cost=cost,
                              options=replace(options, runnable_only=False))
    assert result.estimates[0].step_time_s == pytest.approx(expected, rel=1e-12)
    assert result.estimates[0].fits
