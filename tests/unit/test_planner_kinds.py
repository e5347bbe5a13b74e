"""Kinds the planner and the specs name by string are enums that still read and write as strings."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from meshmorph.plan.space import SearchOptions
from meshmorph.spec import catalog_model
from meshmorph.spec.model import Arch
from meshmorph.spec.plan import DType, Plan, PlanError
from meshmorph.spec.transformer import TransformerShape, build_transformer


def test_plan_dtypes_are_enums_equal_to_their_strings_and_round_trip_through_json() -> None:
    plan = Plan(model="gpt3-125m", seq_len=2048, global_batch=4, dp=4, dtype="fp16",
                reduce_dtype="bf16")
    assert plan.dtype is DType.FP16 and plan.reduce_dtype is DType.BF16
    assert plan.dtype == "fp16" and {"fp16": 2}[plan.dtype] == 2
    data = json.loads(plan.to_json())
    assert (data["dtype"], data["reduce_dtype"]) == ("fp16", "bf16")
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.dtype is DType.FP16
    assert [DType(d).bytes for d in ("bf16", "fp16", "fp32")] == [2, 2, 4]


@pytest.mark.parametrize("field,value", [("dtype", "fp4"), ("reduce_dtype", "float32"),
                                         ("schedule", "1F1B"), ("dtype", 16)])
def test_plan_refuses_an_unknown_kind_naming_the_field_and_the_choices(field: str,
                                                                       value: object) -> None:
    with pytest.raises(PlanError, match=f"{field} must be one of .*got {value!r}"):
        Plan(model="m", seq_len=8, global_batch=1, **{field: value})


def test_search_options_convert_the_dtype_and_refuse_unknown_ones() -> None:
    assert SearchOptions(dtype="fp32").dtype is DType.FP32
    with pytest.raises(ValueError, match="dtype must be one of bf16, fp16, fp32, fp8, got 'int8'"):
        SearchOptions(dtype="int8")


def test_model_arch_is_an_enum_from_catalog_and_shapes() -> None:
    assert catalog_model("gpt3-125m").arch is Arch.GPT
    assert catalog_model("llama3-8b").arch is Arch.LLAMA
    model = build_transformer(TransformerShape(name="t", arch="llama", num_layers=2,
                                               hidden_size=64, num_heads=2, vocab_size=128,
                                               seq_len=16))
    assert model.arch is Arch.LLAMA and model.arch == "llama"
    with pytest.raises(ValueError, match="arch must be one of gpt, llama, custom, got 'bert'"):
        replace(model, arch="bert")
