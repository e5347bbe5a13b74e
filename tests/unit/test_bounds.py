"""The planner's configuration bounds never exceed what the configuration can reach.

Every configuration of tiny instances is scored by brute force (every partition and recompute
assignment); its bound must not be above the fastest plan that fits, must be infinite only when
none fits, and the split table's bound for all ranks must equal the configuration's memory bound.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshmorph.cost.model import CostModel
from meshmorph.plan.block_run import block_run
from meshmorph.plan.bounds import ConfigBounds
from meshmorph.plan.brute_force import candidate_plans
from meshmorph.plan.partition_search import interleaved_block_counts
from meshmorph.plan.rank_bound import grouped_least_max, least_max
from meshmorph.plan.relaxations import least_extra_time as _least_extra
from meshmorph.plan.relaxations import recompute_hull as _hull
from meshmorph.plan.solve_config import counts_times, even_estimate
from meshmorph.plan.space import SearchOptions, configurations
from meshmorph.schedule.table import Schedule
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.cluster import parse_cluster
from meshmorph.spec.model import Recompute
from meshmorph.spec.transformer import TransformerShape, build_transformer


def test_recompute_relaxation_takes_the_cheapest_bytes_first() -> None:
    # selective saves 10 bytes for 1 s, full 30 bytes for 9 s: per byte selective is cheaper
    hull = _hull([(0.0, 0.0), (10.0, 1.0), (30.0, 9.0)])
    assert hull == [(0.0, 0.0), (10.0, 1.0), (30.0, 9.0)]
    assert _least_extra(hull, 0.0, 3) == 0.0
    assert _least_extra(hull, 15.0, 3) == pytest.approx(1.5)  # 1.5 blocks' worth of selective
    assert _least_extra(hull, 40.0, 2) == pytest.approx(2 * (1.0 + 10.0 * 8.0 / 20.0))
    assert _least_extra(hull, 61.0, 2) == math.inf  # more than all-full frees
    assert _least_extra(hull, 1.0, 0) == math.inf
    # a mode dearer per byte than a mix of the others drops out of the hull
    assert _hull([(0.0, 0.0), (10.0, 5.0), (30.0, 9.0)]) == [(0.0, 0.0), (30.0, 9.0)]


@settings(max_examples=16, deadline=None, derandomize=True)
@given(arch=st.sampled_from(("gpt", "llama")), blocks=st.integers(2, 4),
       seq_len=st.sampled_from((2048, 8192)), hidden=st.sampled_from((256, 512)),
       cluster=st.sampled_from(("cpu:1x4", "a100-40g:1x4", "a100-40g:1x2+v100-32g:1x2")),
       batch=st.sampled_from((4, 8)))
@pytest.mark.timeout(300)
def test_bound_is_below_every_configurations_brute_force_best(
        arch: str, blocks: int, seq_len: int, hidden: int, cluster: str, batch: int) -> None:
    model = build_transformer(TransformerShape(name="tiny", arch=arch, num_layers=blocks,
                                               hidden_size=hidden, num_heads=8, vocab_size=8000,
                                               seq_len=seq_len))
    spec = parse_cluster(cluster)
    options = SearchOptions(max_micro_batch=2, max_vpp=2, tolerance=0.0, max_nodes=None,
                            dtype="fp32" if cluster.startswith("cpu") else "bf16")
    cost = CostModel(model, spec)
    bounds = ConfigBounds(cost, options.recompute)
    checked = infinite = 0
    for config in configurations(model, spec, batch, options):
        best = math.inf
        for plan in candidate_plans(model, config, options):
            estimate = cost.estimate(plan)
            if estimate.fits:
                best = min(best, estimate.step_time_s)
        bound = bounds(config)
        assert bound <= best * (1 + 1e-9), (config.plan, bound, best)
        busiest = bounds.busiest_memory_bound(config, 0.0)
        ends = bounds.ends_memory_bound(config, busiest)
        assert ends <= bounds.memory_bound(config) * (1 + 1e-12), (config.plan, busiest, ends)
        filled = bounds.fill_bound(config, bound)
        assert bound <= filled <= best * (1 + 1e-9), (config.plan, filled, best)
        whole = bounds.integer_fill_bound(config, filled)
        assert filled <= whole <= best * (1 + 1e-9), (config.plan, whole, best)
        for limit in (0.9 * best, 0.99 * best, 1.1 * best, 2 * bound):
            # with the incumbents' limit the bounds may stop there, never above the best
            if not filled < limit < math.inf:
                continue
            stopped = bounds.fill_bound(config, bound, limit)
            assert min(filled, limit) * (1 - 1e-3) <= stopped <= best * (1 + 1e-9), \
                (config.plan, limit, stopped, filled, best)
            windowed = bounds.integer_fill_bound(config, filled, limit)
            assert min(whole, limit) <= windowed * (1 + 1e-12), (config.plan, limit, windowed)
            assert windowed <= best * (1 + 1e-9), (config.plan, limit, windowed, best)
        if bound == math.inf:
            infinite += 1
        table = bounds.split_table(config)
        if table is not None:
            assert table.rest[0][table.run.count] == pytest.approx(bounds.memory_bound(config))
            for limit in (0.9 * best, best):  # a window as the stage search's limit sets it
                windowed = bounds.split_table(config, limit) if limit < math.inf else None
                for _, fill in windowed.fill if windowed is not None else ():
                    assert fill[0][table.run.count] <= best * (1 + 1e-9), (config.plan, limit)
            if best < math.inf:
                assert table.balanced and sum(table.balanced) == table.run.count
        checked += 1
    assert checked > 0


def test_bound_is_infinite_exactly_when_nothing_fits() -> None:
    # 2 GPT blocks at 8192 tokens on one 4 GiB CPU process: no recompute makes them fit
    model = build_transformer(TransformerShape(name="tiny", arch="gpt", num_layers=2,
                                               hidden_size=256, num_heads=8, vocab_size=32000,
                                               seq_len=8192))
    spec = parse_cluster("cpu:1x1")
    options = SearchOptions(max_micro_batch=2, dtype="fp32")
    cost = CostModel(model, spec)
    bounds = ConfigBounds(cost, options.recompute)
    configs = list(configurations(model, spec, 16, options))
    assert configs
    for config in configs:
        assert bounds(config) == math.inf
        assert not any(cost.estimate(plan).fits for plan in candidate_plans(model, config, options))


def test_search_options_refuse_a_node_budget_below_one() -> None:
    with pytest.raises(ValueError, match="max_nodes must be at least 1"):
        SearchOptions(max_nodes=0)
    assert SearchOptions(max_nodes=None).max_nodes is None


def test_fill_bounds_read_the_warm_up_and_the_drain() -> None:
    # 8 llama blocks on pp 4 with m = 8 micro-batches: the fill and drain are a large share of
    # the step. The whole-block fill bound must stay below the brute-force best and, reading
    # each rank's warm-up forwards, its deferred W ops and the chain to the loss and back, come
    # within 5% of it (the bounds without them were 7-12% below)
    model = build_transformer(TransformerShape(name="tiny", arch="llama", num_layers=8,
                                               hidden_size=1024, num_heads=8, vocab_size=32000,
                                               seq_len=2048))
    spec = parse_cluster("h100:1x8")
    options = SearchOptions(max_micro_batch=1, tolerance=0.0, max_nodes=None,
                            schedules=(Schedule.ZERO_BUBBLE, Schedule.ONE_F_ONE_B),
                            zero_stages=(1,), recompute=(Recompute.NONE,))
    cost = CostModel(model, spec)
    bounds = ConfigBounds(cost, options.recompute)
    checked = set()
    for config in configurations(model, spec, 8, options):
        plan = config.plan
        if (plan.tp, plan.pp, plan.num_microbatches) != (2, 4, 8):
            continue
        best = min(cost.estimate(p).step_time_s for p in candidate_plans(model, config, options))
        bound = bounds.integer_fill_bound(config, bounds.fill_bound(config, bounds(config)))
        assert 0.95 * best <= bound <= best * (1 + 1e-9), (plan.schedule, bound, best)
        checked.add(plan.schedule)
    assert checked == {Schedule.ZERO_BUBBLE, Schedule.ONE_F_ONE_B}


def test_interleaved_bound_reads_the_fill_rank_by_rank() -> None:
    # 8 llama blocks in chunks of one, m = 4-16 micro-batches on pp 2-4 x vpp 2: the
    # interleaved bubble is a large share of the step. The bound must stay below the brute-force
    # best and, reading each rank's fill and warm-up, come within 1% of it (the bounds before
    # it, the busiest rank's work and the chain through every layer, were 7-42% below)
    model = build_transformer(TransformerShape(name="tiny", arch="llama", num_layers=8,
                                               hidden_size=1024, num_heads=8, vocab_size=32000,
                                               seq_len=2048))
    spec = parse_cluster("h100:1x8")
    options = SearchOptions(max_micro_batch=1, tolerance=0.0, max_nodes=None, max_vpp=2,
                            schedules=(Schedule.INTERLEAVED,), zero_stages=(1,),
                            recompute=(Recompute.NONE, Recompute.FULL))
    cost = CostModel(model, spec)
    bounds = ConfigBounds(cost, options.recompute)
    checked = 0
    for config in configurations(model, spec, 16, options):
        if config.plan.vpp == 1:
            continue
        best = min(cost.estimate(p).step_time_s for p in candidate_plans(model, config, options))
        floor = bounds(config)
        bound = bounds.fill_bound(config, floor)
        assert 0.99 * best <= bound <= best * (1 + 1e-9), (config.plan, floor, bound, best)
        checked += 1
    assert checked == 8


@pytest.mark.parametrize(("blocks", "seq_len", "cluster"), [(16, 4096, "v100-16g:1x4"),
                                                              (10, 8192, "a100-40g:1x4")])
def test_busiest_rank_bound_rests_on_h_growing_with_micro_batches_in_flight(
        blocks: int, seq_len: int, cluster: str) -> None:
    # GPT blocks where memory forces recompute (or nothing fits), and under 1F1B the ranks
    # keep 4, 3, 2, 1 micro-batches in flight. The cheap bounds take a bare rank with the
    # fewest in flight for the ranks they do not read: h must grow with them, the bounds must
    # stay below the memory bound, the busiest one must rise above the bound without memory
    model = build_transformer(TransformerShape(name="tiny", arch="gpt", num_layers=blocks,
                                               hidden_size=4096, num_heads=32, vocab_size=1024,
                                               seq_len=seq_len))
    spec = parse_cluster(cluster)
    options = SearchOptions(max_micro_batch=2, schedules=(Schedule.ZERO_BUBBLE,
                                                          Schedule.ONE_F_ONE_B),
                            zero_stages=(0, 1))
    cost = CostModel(model, spec)
    bounds = ConfigBounds(cost, options.recompute)
    run = block_run(model)
    assert run is not None
    raised = 0
    for config in configurations(model, spec, 8, options):
        plan = config.plan
        if plan.pp < 3:
            continue
        gpu = config.rank_gpus[1]
        for n in range(1, run.count + 1):
            h = [bounds._rank(plan, run, 1, gpu, float(f)).h(n) for f in range(1, plan.pp + 1)]
            assert h == sorted(h), (plan, n, h)
        busiest = bounds.busiest_memory_bound(config, 0.0)
        ends = bounds.ends_memory_bound(config, 0.0)
        memory = bounds.memory_bound(config)
        assert busiest <= ends * (1 + 1e-12) and ends <= memory * (1 + 1e-12), \
            (plan, busiest, ends, memory)
        raised += busiest > bounds.lower_bound(config)
    assert raised


def test_a_rank_bound_is_not_shared_with_an_asynchronous_rank_holding_weight_copies() -> None:
    # under allow_async with stashed weights, async rank k keeps min(m, pp - k) micro-batches in
    # flight as 1F1B's rank k does, but also that many fp32 weight copies: bounding the async
    # configurations first must not change a 1F1B configuration's memory bound
    model = build_transformer(TransformerShape(name="tiny", arch="llama", num_layers=8,
                                               hidden_size=4096, num_heads=32, vocab_size=32000,
                                               seq_len=4096))
    spec = parse_cluster("a100-40g:1x8")
    options = SearchOptions(allow_async=True, weight_prediction="stash", zero_stages=(0, 1))
    cost = CostModel(model, spec)
    configs = list(configurations(model, spec, 64, options))
    first = ConfigBounds(cost, options.recompute)
    for config in configs:
        if config.plan.schedule == Schedule.ASYNC:
            first.memory_bound(config)
    fresh = ConfigBounds(cost, options.recompute)
    synchronous = [c for c in configs if c.plan.schedule == Schedule.ONE_F_ONE_B]
    assert synchronous
    assert [first.memory_bound(c) for c in synchronous] == \
        [fresh.memory_bound(c) for c in synchronous]


def test_rank_bound_reads_the_gradient_sync_its_window_cannot_hide() -> None:
    # qwen2.5-32b at 4096 tokens on 48 x 8 H100, batch 192, without a pipeline: a rank holds
    # 1-8 billion parameters and reduces their gradients over dp 48-192 across nodes, longer
    # than the last backward it may hide behind. Under ZeRO-1 the memory bound must stay at or
    # below the plan's step and, reading that exposed sync (and each collective's latency once,
    # not per billion parameters), come within 0.1% of it where no recompute is needed (the
    # least tail alone was up to 26% below)
    model = catalog_model("qwen2.5-32b", 4096)
    spec = parse_cluster("h100:48x8")
    options = SearchOptions()
    cost = CostModel(model, spec)
    bounds = ConfigBounds(cost, options.recompute)
    checked = 0
    for config in configurations(model, spec, 192, options):
        if config.plan.pp != 1 or config.plan.zero != 1:
            continue
        _, estimate = even_estimate(cost, config, Recompute.NONE)
        if not estimate.fits:
            continue  # recompute's fractions are relaxed: not this test's concern
        bound, step = bounds.memory_bound(config), estimate.step_time_s
        assert 0.999 * step <= bound <= step * (1 + 1e-9), (config.plan, bound, step)
        checked += 1
    assert checked >= 4


def test_interleaved_bound_stays_below_every_split_under_zero3_on_mixed_gpus() -> None:
    # llama2-13b on 4 x 8 A100 + 4 x 8 H100, ZeRO-3 interleaved over pp 4 x vpp 3: every rank
    # gathers and scatters within each micro-batch. Rank 0 runs that traffic with its own
    # actions, so a later rank's chain back to rank 0 is followed only by rank 0's sync and
    # optimizer (adding all of its least tail there overshoots the step by up to 0.05%)
    model = catalog_model("llama2-13b")
    spec = parse_cluster("h100:4x8+a100-80g:4x8")
    options = SearchOptions(schedules=(Schedule.INTERLEAVED,), zero_stages=(3,), max_vpp=3)
    cost = CostModel(model, spec)
    bounds = ConfigBounds(cost, options.recompute)
    checked = 0
    for config in configurations(model, spec, 256, options):
        plan = config.plan
        if (plan.tp, plan.pp, plan.vpp, plan.micro_batch) != (2, 4, 3, 2):
            continue
        work = bounds.layer_work(config)
        splits = interleaved_block_counts(model.num_blocks, plan.num_chunks)
        for mode, bound in zip(options.recompute, work.filled_s(splits, options.recompute),
                               strict=True):
            for at, counts in enumerate(splits):
                gpus, times, stages = counts_times(cost, config, counts, mode)
                step = cost.assemble(replace(plan, stages=stages), gpus, times).step_time_s
                assert bound[at] <= step, (config.rank_gpus, mode, counts, bound[at], step)
                checked += 1
    assert checked >= 12


@pytest.mark.parametrize(("name", "cluster", "batch"), [("llama3-8b", "h100:2x8", 32),
                                                        ("gpt3-1.3b", "a100-40g:2x8", 64)])
def test_v_bound_stays_below_the_even_split_and_reads_the_bubble(name: str, cluster: str,
                                                                  batch: int) -> None:
    # the V schedules try their even split per recompute mode: the bound of each mode stays at
    # or below that plan's step, and with few micro-batches per rank (their chain through every
    # chunk and back, each chunk's m forwards one at a time) it rises well above the bounds
    # before it (which leave out the V's fill)
    model, spec = catalog_model(name), parse_cluster(cluster)
    options = SearchOptions(schedules=(Schedule.ZBV, Schedule.DUALPIPEV))
    cost = CostModel(model, spec)
    bounds = ConfigBounds(cost, options.recompute)
    rise = 0.0
    for config in configurations(model, spec, batch, options):
        if not config.plan.schedule.v_shape:
            continue
        work = bounds.layer_work(config)
        for mode in options.recompute:
            step = even_estimate(cost, config, mode)[1].step_time_s
            assert work.v_filled_s(mode) <= step, (config.plan, mode)
        before = max(bounds.lower_bound(config), bounds.memory_bound(config))
        if before < math.inf:
            rise = max(rise, bounds.fill_bound(config, before) / before)
    assert rise > 1.2


def test_the_ends_bound_reads_the_ranks_that_hold_the_embedding_and_the_head() -> None:
    # gpt3-175b on 1,024 A100s, deep pipelines: the ranks holding the embedding or the head
    # (and under 1F1B the most micro-batches in flight) often bind, so reading them as they are
    # lifts the bound above the busiest bare rank's, never above the memory bound
    model, spec = catalog_model("gpt3-175b"), parse_cluster("a100-80g:128x8")
    options = SearchOptions(pp_degrees=(16, 32), tp_degrees=(8,), max_micro_batch=2)
    bounds = ConfigBounds(CostModel(model, spec), options.recompute)
    raised = checked = 0
    for config in configurations(model, spec, 1536, options):
        busiest = bounds.busiest_memory_bound(config, 0.0)
        ends = bounds.ends_memory_bound(config, 0.0)
        memory = bounds.memory_bound(config)
        assert busiest <= ends * (1 + 1e-12) and ends <= memory * (1 + 1e-12), \
            (config.plan, busiest, ends, memory)
        raised += ends > busiest * 1.01
        checked += 1
    assert checked > 20 and raised > checked // 4, (raised, checked)


class _Sequence:
    """A rank bound's h, as ``least_max`` and ``grouped_least_max`` read it."""

    def __init__(self, values: list[float]):
        self.values = values

    def h(self, n: int) -> float:
        return self.values[n] if n < len(self.values) else math.inf


@settings(max_examples=200, deadline=None, derandomize=True)
@given(data=st.data())
def test_grouped_greedy_equals_the_greedy_over_every_rank(data: st.DataObject) -> None:
    # groups of ranks sharing one h take the greedy's next block all at once: the least max of
    # the whole split must be the per-rank greedy's, to the last bit
    count = data.draw(st.integers(0, 40))
    groups = []
    for _ in range(data.draw(st.integers(1, 4))):
        steps = data.draw(st.lists(st.sampled_from((0.0, 0.5, 1.0, 2.5, math.inf)),
                                   min_size=1, max_size=count + 2))
        values = [1.0]
        for step in steps:
            values.append(values[-1] + step)
        groups.append((_Sequence(values), data.draw(st.integers(1, 5)),
                       data.draw(st.integers(0, 1))))
    ranks = [rank for rank, copies, _ in groups for _ in range(copies)]
    least = [fewest for _, copies, fewest in groups for _ in range(copies)]
    table, _ = least_max(ranks, least, count)  # type: ignore[arg-type]
    assert grouped_least_max(groups, count) == table[count]  # type: ignore[arg-type]


def test_windowed_stage_tables_keep_every_cut_at_the_limit() -> None:
    # llama3-8b on 32 H100s at pp 8 and 16: with a limit, the stage search's fill tables read
    # only the splits within each rank's reach; every entry must stay at least the full table's
    # or the limit, whichever is less, so that no branch the full tables cut at the limit is
    # kept (and the windows must be narrower than the blocks somewhere)
    model, spec = catalog_model("llama3-8b"), parse_cluster("h100:4x8")
    options = SearchOptions(pp_degrees=(8, 16), tp_degrees=(1,), max_micro_batch=1,
                            schedules=(Schedule.ONE_F_ONE_B, Schedule.ZERO_BUBBLE))
    bounds = ConfigBounds(CostModel(model, spec), options.recompute)
    narrowed = checked = 0
    for config in configurations(model, spec, 256, options):
        full = bounds.split_table(config)
        floor = bounds.memory_bound(config)
        if full is None or not floor < math.inf:
            continue
        for limit in (1.05 * floor, 1.3 * floor):
            windowed = bounds.split_table(config, limit)
            assert windowed is not None
            for (_, tables), (_, reference) in zip(windowed.fill, full.fill, strict=True):
                for row, ref in zip(tables, reference, strict=True):
                    for value, exact in zip(row, ref, strict=True):
                        assert value >= min(exact, limit) * (1 - 1e-12), (config.plan, limit)
                        narrowed += value < exact
            checked += 1
    assert checked > 4 and narrowed, (checked, narrowed)
