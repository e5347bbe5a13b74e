"""``StageSolver.fits`` answers exactly ``stage(...) is not None`` (the stage-reach test's shortcut),
and the all-none stage memory both read is ``CostModel.rank_memory``'s.

Every stage range on every pipeline rank of every configuration of small models whose memory
binds (long sequences, small GPUs), with a fresh solver for each side so neither reads the
other's cache; the outcomes must include stages that fit and stages that do not.
"""

from __future__ import annotations

import pytest

from meshmorph.cost.model import CostModel
from meshmorph.cost.rank_terms import rank_memory_terms
from meshmorph.plan.fastest_layers import cluster_gpu
from meshmorph.plan.space import SearchOptions, configurations
from meshmorph.plan.stage_recompute import StageSolver
from meshmorph.spec.cluster import parse_cluster
from meshmorph.spec.model import Recompute
from meshmorph.spec.transformer import TransformerShape, build_transformer

CASES = [
    # (arch, blocks, hidden, heads, seq_len, cluster, batch, recompute modes)
    ("gpt", 8, 4096, 32, 8192, "v100-32g:1x4", 8, tuple(Recompute)),
    ("llama", 10, 4096, 32, 16384, "a100-40g:1x4", 8, tuple(Recompute)),
    ("gpt", 6, 6144, 48, 8192, "a100-40g:1x2+v100-32g:1x2", 4, tuple(Recompute)),
    ("llama", 8, 4096, 32, 16384, "v100-32g:1x4", 8, (Recompute.NONE, Recompute.FULL)),
    ("gpt", 8, 4096, 32, 16384, "v100-32g:1x4", 8, (Recompute.NONE, Recompute.SELECTIVE)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}b-{c[4]}-{c[5]}")
def test_fits_is_stage_not_none(case: tuple) -> None:
    arch, blocks, hidden, heads, seq_len, cluster_text, batch, modes = case
    model = build_transformer(TransformerShape(name="tiny", arch=arch, num_layers=blocks,
                                               hidden_size=hidden, num_heads=heads,
                                               vocab_size=32000, seq_len=seq_len))
    cluster = parse_cluster(cluster_text)
    cost = CostModel(model, cluster)
    options = SearchOptions(max_micro_batch=2, recompute=modes, pp_degrees=(2, 4))
    outcomes = {True: 0, False: 0}
    for config in configurations(model, cluster, batch, options):
        plan = config.plan
        if plan.num_chunks > plan.pp:
            continue  # interleaved: blocks split evenly, no stage search
        gpus = [cluster_gpu(cost, name) for name in config.rank_gpus]
        timed = StageSolver(cost, plan, gpus, modes)
        quick = StageSolver(cost, plan, gpus, modes)
        L = model.num_layers
        for k in range(plan.pp):
            for start in range(L):
                for stop in range(start + 1, L + 1):
                    expected = timed.stage(k, start, stop) is not None
                    # the fits test's all-none memory is CostModel.rank_memory's, to rounding
                    none = cost.rank_memory(plan, k, [(start, stop, (Recompute.NONE,) * (
                        stop - start))], gpus[k]).total
                    shortcut = quick.none_total(rank_memory_terms(cost, plan, k, gpus[k]),
                                                start, stop, gpus[k])
                    assert abs(shortcut - none) <= 1e-12 * none, (shortcut, none)
                    assert quick.fits(k, start, stop) == expected, (
                        f"{plan.tp=} {plan.pp=} {plan.dp=} zero {plan.zero} mb "
                        f"{plan.micro_batch} {plan.schedule} rank {k} layers [{start}, {stop})")
                    outcomes[expected] += 1
    assert outcomes[True] and outcomes[False], outcomes
