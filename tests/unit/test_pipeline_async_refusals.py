"""``meshmorph run`` refuses, before any process starts, the async plans its executor cannot run."""

from __future__ import annotations

import pytest

from meshmorph.run.engine.train_engine import validate_plan
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.plan import Plan, PlanError


def _plan(**kw: object) -> Plan:
    model = catalog_model("gpt-tiny", 32)
    fields: dict = dict(model="gpt-tiny", seq_len=32, global_batch=8, pp=2, micro_batch=2,
                        num_microbatches=4, schedule="async", weight_prediction="stash",
                        dtype="fp32")
    fields.update(kw)
    return Plan(**fields).with_even_stages(model)


def test_one_chunk_per_rank_runs() -> None:
    validate_plan(catalog_model("gpt-tiny", 32), _plan(), 2)


@pytest.mark.parametrize("kw,world,match", [
    (dict(dp=2, global_batch=16), 4, "tp 1 and dp 1, got tp 1 dp 2; set tp = dp = 1"),
    (dict(tp=2), 4, "tp 1 and dp 1, got tp 2 dp 1"),
    (dict(dtype="fp16"), 2, "no fp16 loss scaling"),
    (dict(pp=1, global_batch=8), 1, "needs pp >= 2"),
])
def test_other_layouts_are_refused_naming_the_constraint(kw: dict, world: int,
                                                          match: str) -> None:
    with pytest.raises(PlanError, match=match):
        validate_plan(catalog_model("gpt-tiny", 32), _plan(**kw), world)
