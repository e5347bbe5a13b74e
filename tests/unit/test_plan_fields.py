"""A plan file's fields: switches are bools and stages a list of objects, or the Plan says
which field is wrong."""

from __future__ import annotations

import pytest

from meshmorph.spec.plan import BOOL_FIELDS, Plan, PlanError


@pytest.mark.parametrize("field", BOOL_FIELDS)
def test_a_switch_that_is_not_a_bool_is_refused_by_name(field: str) -> None:
    data = Plan(model="gpt-tiny", seq_len=64, global_batch=1).to_dict()
    for bad in ("yes", 1, None):
        with pytest.raises(PlanError, match=f"{field} must be true or false"):
            Plan.from_dict({**data, field: bad})


@pytest.mark.parametrize("stages", [{}, "all", [1, 2], {"layers": [0, 4]}])
def test_plan_stages_that_are_not_a_list_of_objects_are_refused(stages: object) -> None:
    data = {"model": "gpt-tiny", "seq_len": 32, "global_batch": 1, "stages": stages}
    with pytest.raises(PlanError, match="'stages' must be a list of objects"):
        Plan.from_dict(data)
