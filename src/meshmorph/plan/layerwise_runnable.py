"""Which layerwise plans the layerwise runtime runs: one rule read by the search and the runtime.

``plan --layerwise`` offers by default only what run/layerwise_engine.py runs, and the engine's
``validate_layerwise`` refuses a plan by calling ``check_layerwise_runnable`` here, so the two
cannot drift. Pure Python (no torch): the planner imports it.

The runtime runs a plan with per-layer strategies when

- pp = 1, or pp > 1 under GPipe or 1F1B with one chunk per pipeline rank;
- the model does not tie its embedding and head, or pp = 1 and the two layers share tp and ZeRO
  stage, a ZeRO stage below 2 when they have dp > 1 (FSDP2 cannot shard one matrix for two
  layers run apart);
- the step is synchronous (no ``async``), without sequence parallelism, in fp32 or bf16;
- every stage lists its layer strategies (or none does), and every two tp degrees of the plan
  nest (one divides the other).
"""

from __future__ import annotations

from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import LayerStrategy, Plan, PlanError, Schedule

RUNNABLE_PIPELINE_SCHEDULES = (Schedule.GPIPE, Schedule.ONE_F_ONE_B)
"""The pipeline schedules a layerwise plan with pp > 1 runs (one chunk per pipeline rank, one
backward per micro-batch)."""


def runnable_shape_refusal(model: ModelSpec, plan: Plan) -> str | None:
    """Why no plan of ``plan``'s shape (pp, vpp, schedule, sequence parallelism, dtype) may list
    per-layer strategies, naming a way out; None when some may."""
    if plan.num_chunks > plan.pp or (plan.pp > 1
                                     and plan.schedule not in RUNNABLE_PIPELINE_SCHEDULES):
        return (f"layerwise plans run pp 1, or pp > 1 under schedule gpipe or 1f1b with one "
                f"chunk per pipeline rank (this one has pp {plan.pp}, vpp {plan.vpp}, schedule "
                f"{plan.schedule}); set schedule '1f1b' and vpp 1, or drop layer_strategies")
    if plan.pp > 1 and model.tied_embeddings:
        return (f"{model.name} ties its embedding and head, which a layerwise pipeline puts on "
                "different stages under their own layouts; layerwise plans with pp > 1 need "
                "untied embeddings (a llama-style model), or plan pp 1")
    if plan.schedule == Schedule.ASYNC:
        return "layerwise plans run the synchronous step; use schedule '1f1b'"
    if plan.sequence_parallel:
        return "layerwise plans do not run sequence parallelism; set it false"
    if plan.dtype == "fp16":
        return "layerwise plans run fp32 or bf16 (no fp16 loss scaling); use bf16"
    return None


def tied_ends_refusal(model: ModelSpec, embed: LayerStrategy, head: LayerStrategy) -> str | None:
    """Why a model's embedding and head may not run under ``embed`` and ``head`` (a tied matrix
    needs one layout, not sharded by FSDP2); None when they may."""
    if not model.tied_embeddings:
        return None
    if (embed.tp, embed.zero) != (head.tp, head.zero):
        return (f"{model.name} ties its embedding and head (one matrix), but they have tp "
                f"{embed.tp} / zero {embed.zero} and tp {head.tp} / zero {head.zero}; give both "
                "layers the same tp and ZeRO stage")
    if embed.zero >= 2 and embed.dp > 1:
        return (f"{model.name} ties its embedding and head, and FSDP2 cannot shard one matrix "
                f"for two layers run apart (zero {embed.zero}); give the embedding and head "
                "zero 0 or 1")
    return None


def tp_degrees_of(plan: Plan) -> set[int]:
    """Every tp degree a layerwise plan's layers use, and the plan's own (its data layout)."""
    return {plan.tp} | {s.tp for stage in plan.stages for s in stage.layer_strategies or ()}


def layerwise_refusal(model: ModelSpec, plan: Plan) -> str | None:
    """Why the layerwise runtime refuses ``plan`` (a plan listing layer strategies), naming a way
    out; None when it runs it."""
    shape = runnable_shape_refusal(model, plan)
    if shape is not None:
        return shape
    if any(stage.layer_strategies is None for stage in plan.stages):
        return ("a layerwise plan lists layer_strategies on every stage or on none; give the "
                "other stages theirs (one per layer: the stage's tp/dp/zero)")
    degrees = sorted(tp_degrees_of(plan))
    for low, high in zip(degrees, degrees[1:], strict=False):
        if high % low:
            return (f"layer tp degrees {low} and {high} do not nest; the runtime moves "
                    "activations only between tp's where one divides the other")
    first, last = plan.stages[0].layer_strategies, plan.stages[-1].layer_strategies
    assert first is not None and last is not None
    return tied_ends_refusal(model, first[0], last[-1])


def check_layerwise_runnable(model: ModelSpec, plan: Plan) -> None:
    """Raise PlanError naming the rule ``plan`` fails (``layerwise_refusal``), if any."""
    refusal = layerwise_refusal(model, plan)
    if refusal is not None:
        raise PlanError(refusal)


def layerwise_runnable(model: ModelSpec, plan: Plan) -> bool:
    """Whether meshmorph runs ``plan``: a plan without layer strategies runs on the regular
    engine; one with them must pass ``layerwise_refusal``."""
    if not any(stage.layer_strategies is not None for stage in plan.stages):
        return True
    return layerwise_refusal(model, plan) is None
