"""The planner's search space: divisor enumeration stays fast for huge batches."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from meshmorph.cost.model import CostModel
from meshmorph.plan.search import PlanDoesNotFit, search
from meshmorph.plan.space import SearchOptions, configurations, divisors
from meshmorph.spec import catalog_model, parse_cluster


def test_divisors_match_the_definition_with_and_without_a_cap() -> None:
    for n in range(1, 600):
        every = [d for d in range(1, n + 1) if n % d == 0]
        assert divisors(n) == every
        for cap in (1, 2, 7, 16, n // 2, n):
            assert divisors(n, up_to=cap) == [d for d in every if d <= cap], (n, cap)


def test_divisors_of_a_20_digit_number_take_microseconds() -> None:
    # 10^20 - 1 = 3^2 x 11 x 41 x 101 x 271 x 3541 x 9091 x 27961
    started = time.perf_counter()
    assert divisors(99_999_999_999_999_999_999, up_to=16) == [1, 3, 9, 11]
    assert divisors(2 ** 40)[-3:] == [2 ** 38, 2 ** 39, 2 ** 40]  # O(sqrt n): 2^20 steps
    assert time.perf_counter() - started < 2.0


def test_divisors_refuse_zero() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        divisors(0)


def test_a_huge_global_batch_enumerates_its_configurations_at_once() -> None:
    model = catalog_model("gpt3-125m")
    cluster = parse_cluster("h100:1x8")
    started = time.perf_counter()
    configs = list(configurations(model, cluster, 99_999_999_999_999_999_999,
                                  SearchOptions(max_micro_batch=16,
                                                max_microbatches=10 ** 30)))
    assert time.perf_counter() - started < 1.0
    # only dp 1 divides an odd batch on 8 GPUs: tp x pp = 8, micro-batches 1, 3, 9 and 11
    assert configs and {c.plan.dp for c in configs} == {1}
    assert {c.plan.micro_batch for c in configs} == {1, 3, 9, 11}


def test_a_batch_needing_too_many_micro_batches_on_every_layout_is_refused_at_once() -> None:
    model = catalog_model("gpt3-125m")
    cluster = parse_cluster("h100:1x8")
    started = time.perf_counter()
    with pytest.raises(PlanDoesNotFit, match="needs more than 65536 micro-batches per step .*"
                                             "raise max_micro_batch"):
        search(model, cluster, global_batch=99_999_999_999_999_999_999)
    assert time.perf_counter() - started < 1.0


def test_layouts_beyond_the_micro_batch_cap_are_left_out() -> None:
    model = catalog_model("gpt3-125m")
    cluster = parse_cluster("h100:1x8")
    options = SearchOptions(max_micro_batch=4, max_microbatches=64)
    configs = list(configurations(model, cluster, 1024, options))
    # 1024 sequences over dp ranks in micro-batches of b: m = 1024 / (dp b) <= 64
    assert configs and max(c.plan.num_microbatches for c in configs) == 64
    assert {c.plan.dp * c.plan.micro_batch for c in configs} == {16, 32}
    with pytest.raises(ValueError, match="max_microbatches must be at least 1"):
        SearchOptions(max_microbatches=0)


def test_a_pipeline_tries_zero_2_only_where_zero_1_is_not_tried() -> None:
    # under a pipeline ZeRO-2 prices and holds exactly as ZeRO-1 (torch pipelining
    # reduce-scatters the whole gradients once per step either way): the space keeps one
    model, cluster = catalog_model("gpt3-1.3b"), parse_cluster("a100-80g:2x8")
    every = list(configurations(model, cluster, 64, SearchOptions(max_micro_batch=4)))
    piped = {c.plan.zero for c in every if c.plan.pp > 1 and c.plan.dp > 1}
    assert piped == {0, 1, 3}
    assert {c.plan.zero for c in every if c.plan.pp == 1 and c.plan.dp > 1} == {0, 1, 2, 3}
    only_2 = list(configurations(model, cluster, 64,
                                 SearchOptions(max_micro_batch=4, zero_stages=(2,))))
    assert {c.plan.zero for c in only_2 if c.plan.pp > 1 and c.plan.dp > 1} == {2}
    # the premise: a pipeline plan and its ZeRO-2 twin have the same figures, every one
    cost = CostModel(model, cluster)
    checked = 0
    for config in every:
        plan = config.plan
        if plan.pp > 1 and plan.zero == 1 and plan.num_microbatches > 1 and checked < 12:
            plan = plan.with_even_stages(model)
            assert cost.estimate(plan).to_dict() == \
                cost.estimate(replace(plan, zero=2)).to_dict(), plan
            checked += 1
    assert checked == 12
