"""The configuration bounds hold on the catalog's large models, on clusters they train on.

For a seeded sample of configurations of gpt3-175b, llama3-70b, llama3-405b and llama2-13b,
every lower bound (cheap, memory, fill, the split table's) is at most the step of the best plan
the stage search finds for that configuration (a plan that exists, so at least the optimum),
and a configuration whose memory bound is infinite really has no plan that fits: the stage
search without a node cap finds none.
"""

from __future__ import annotations

import math
import random

import pytest

from meshmorph.cost.model import CostModel
from meshmorph.plan.bounds import ConfigBounds
from meshmorph.plan.solve_config import solve_config
from meshmorph.plan.space import SearchOptions, configurations
from meshmorph.spec import catalog_model, parse_cluster

CASES = [
    ("gpt3-175b", "a100-80g:128x8", 1536),
    ("llama3-70b", "h100:8x8", 512),
    ("llama3-405b", "h100:2048x8", 2048),
    ("llama2-13b", "h100:4x8+a100-80g:4x8", 256),
]
SAMPLE = 12
"""Configurations per model whose bounds are checked against a solved plan."""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,cluster,batch", CASES, ids=[c[0] for c in CASES])
def test_every_bound_is_at_most_the_best_plan_of_sampled_configurations(
        name: str, cluster: str, batch: int) -> None:
    model, spec = catalog_model(name), parse_cluster(cluster)
    options = SearchOptions(tolerance=0.0, max_nodes=200)
    cost = CostModel(model, spec)
    bounds = ConfigBounds(cost, options.recompute)
    configs = list(configurations(model, spec, batch, options))
    rng = random.Random(name)
    rng.shuffle(configs)
    checked = infinite = 0
    ratios = []
    for config in configs:
        memory = bounds.memory_bound(config)
        if memory == math.inf:
            if infinite < 3:  # cheap: no stage fits, so the search ends at once
                infinite += 1
                exact = SearchOptions(tolerance=0.0, max_nodes=None)
                result = solve_config(cost, config, exact, math.inf, bounds)
                assert result.best is None, (config.plan, result.best)
            continue
        if checked == SAMPLE:
            continue
        result = solve_config(cost, config, options, math.inf, bounds)
        if result.best is None:
            continue  # the capped search found nothing here: nothing to compare with
        plan, estimate = result.best
        assert cost.estimate(plan).step_time_s == pytest.approx(estimate.step_time_s, rel=1e-12)
        best = estimate.step_time_s * (1 + 1e-9)
        cheap = bounds.lower_bound(config)
        filled = bounds.fill_bound(config, max(cheap, memory))
        assert cheap <= best, ("cheap", config.plan, cheap, best)
        assert memory <= best, ("memory", config.plan, memory, best)
        assert filled <= best, ("fill", config.plan, filled, best)
        assert bounds(config) <= best
        table = bounds.split_table(config)
        if table is not None:
            assert table.rest[0][table.run.count] == pytest.approx(memory, rel=1e-12)
        ratios.append(filled / estimate.step_time_s)
        checked += 1
    print(name, "checked", checked, "infinite", infinite, "ratios", [round(r, 3) for r in sorted(ratios)])
    assert checked == SAMPLE and infinite >= 1, (checked, infinite)
    # the bounds are not vacuous: on the median sampled configuration they reach most of the step
    assert sorted(ratios)[len(ratios) // 2] > 0.5, ratios
