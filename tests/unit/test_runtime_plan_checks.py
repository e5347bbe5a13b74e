"""Plans the runtime refuses before any process starts, with a message that says what to do."""

from __future__ import annotations

import pytest

from meshmorph.run.engine.train_engine import validate_plan
from meshmorph.schedule.table import Schedule
from meshmorph.spec.catalog import catalog_model
from meshmorph.spec.plan import Plan, PlanError


def _zb(zero: int) -> Plan:
    model = catalog_model("gpt-tiny", seq_len=16)
    return Plan(model=model.name, seq_len=16, pp=2, dp=2, zero=zero, global_batch=8,
                num_microbatches=4, schedule=Schedule.ZERO_BUBBLE).with_even_stages(model)


def test_zero_bubble_with_zero3_is_refused_naming_the_stages_that_work() -> None:
    with pytest.raises(PlanError, match="zero-bubble schedule with ZeRO-3 .* use zero 2"):
        validate_plan(catalog_model("gpt-tiny", seq_len=16), _zb(3), 4)


def test_zero_bubble_with_zero2_is_accepted() -> None:
    validate_plan(catalog_model("gpt-tiny", seq_len=16), _zb(2), 4)
