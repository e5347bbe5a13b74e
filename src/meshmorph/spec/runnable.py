"""What the runtime runs: one place for every rule, read by the planners and by ``meshmorph run``.

Context parallelism: meshmorph prices and plans cp > 1, it does not run it.

torch's ``context_parallel`` (torch.distributed.tensor.experimental) rotates K/V through
``scaled_dot_product_attention``'s flash and memory-efficient CUDA kernels; meshmorph's runtime
trains on CPU processes over gloo as well, and its models, meshes and checkpoints have no
sequence dimension split yet. So ``meshmorph run`` and the elastic layouts refuse a plan with
cp > 1 before anything starts, and the planners the runtime calls search cp 1 only.

Layer strategies: which layerwise plans the runtime runs, one rule read by the search and the runtime.

``plan --layerwise`` offers by default only what run/engine/layerwise_engine.py runs, and the engine's
``validate_layerwise`` refuses a plan by calling ``check_layerwise_runnable`` here, so the two
cannot drift. Pure Python (no torch): the planner imports it.

The runtime runs a plan with per-layer strategies when

- pp = 1, or pp > 1 under GPipe, 1F1B or zero-bubble (ZB-H1) with one chunk per pipeline
  rank, interleaved 1F1B (vpp > 1, chunk c on rank c % pp), or ZBV and DualPipeV (vpp 2, rank r
  holding chunks r and 2 pp - 1 - r);
- under the schedules that split backward into input- and weight-gradient passes (zb, zbv,
  dualpipev), no layer runs ZeRO-3 over more than one rank (torch pipelining's weight pass
  would miss the gathered parameters FSDP2 frees after forward; run/engine/layerwise_pipeline.py);
- the model does not tie its embedding and head, or the two layers share tp and ZeRO stage
  (under pp > 1, with schedule gpipe or 1f1b, the last stage's head keeps its own copy of the
  embedding, laid out alike, and the two copies' gradients are summed), with a ZeRO stage below 2 when they have dp > 1 and
  sit in one chunk (FSDP2 cannot shard one matrix for two layers run apart);
- with sequence parallelism, every layer's tp degree divides the sequence length (each tp rank
  holds s / tp positions of the hidden state; a tp 1 layer holds whole sequences);
- the step is synchronous (no ``async``), in fp32 or bf16;
- every stage lists its layer strategies (or none does), and every two tp degrees of the plan
  nest (one divides the other).
"""

from __future__ import annotations

from meshmorph.schedule.table import Schedule
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import LayerStrategy, Plan, PlanError

RUNNABLE_PIPELINE_SCHEDULES = (Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.ZERO_BUBBLE,
                               Schedule.INTERLEAVED, Schedule.ZBV, Schedule.DUALPIPEV)
"""The pipeline schedules a layerwise plan with pp > 1 runs: one chunk per pipeline rank (gpipe,
1f1b, zb), vpp chunks per rank (interleaved) or two in a V (zbv, dualpipev)."""

TIED_PIPELINE_SCHEDULES = (Schedule.GPIPE, Schedule.ONE_F_ONE_B)
"""The schedules a layerwise pipeline (pp > 1) of a model with a tied embedding and head runs:
one chunk per rank, the head's copy on the last rank."""


def runnable_shape_refusal(model: ModelSpec, plan: Plan) -> str | None:
    """Why no plan of ``plan``'s shape (pp, vpp, schedule, sequence parallelism, dtype) may list
    per-layer strategies, naming a way out; None when some may."""
    if plan.pp > 1 and plan.schedule not in RUNNABLE_PIPELINE_SCHEDULES:
        names = ", ".join(str(s) for s in RUNNABLE_PIPELINE_SCHEDULES)
        return (f"layerwise plans with pp > 1 run the schedules {names} (this one has pp "
                f"{plan.pp}, vpp {plan.vpp}, schedule {plan.schedule}); set one of them, or "
                "drop layer_strategies")
    if model.tied_embeddings and plan.pp > 1 and plan.schedule not in TIED_PIPELINE_SCHEDULES:
        return (f"{model.name} ties its embedding and head; layerwise pipelines keep the two "
                "copies equal under schedule gpipe or 1f1b (this one has "
                f"{plan.schedule}); set one of them, or plan pp 1")
    if plan.schedule == Schedule.ASYNC:
        return "layerwise plans run the synchronous step; use schedule '1f1b'"
    if plan.dtype == "fp16":
        return "layerwise plans run fp32 or bf16 (no fp16 loss scaling); use bf16"
    return None


def tied_ends_refusal(model: ModelSpec, embed: LayerStrategy, head: LayerStrategy, *,
                      apart: bool = False) -> str | None:
    """Why a model's embedding and head may not run under ``embed`` and ``head`` (a tied matrix
    needs one layout; in one chunk it is one parameter, which FSDP2 does not shard); None when
    they may. ``apart``: the two layers are in different chunks (pp > 1), each holding its own
    copy."""
    if not model.tied_embeddings:
        return None
    if (embed.tp, embed.zero) != (head.tp, head.zero):
        return (f"{model.name} ties its embedding and head (one matrix), but they have tp "
                f"{embed.tp} / zero {embed.zero} and tp {head.tp} / zero {head.zero}; give both "
                "layers the same tp and ZeRO stage")
    if embed.zero >= 2 and embed.dp > 1 and not apart:
        return (f"{model.name} ties its embedding and head, and FSDP2 cannot shard one matrix "
                f"for two layers run apart (zero {embed.zero}); give the embedding and head "
                "zero 0 or 1")
    return None


def split_backward_refusal(plan: Plan) -> str | None:
    """Why a layer of ``plan`` may not run under its split-backward schedule (zb, zbv,
    dualpipev): ZeRO-3 over more than one rank; None when every layer may."""
    if plan.pp == 1 or not plan.schedule.split_backward:
        return None
    for chunk, stage in enumerate(plan.stages):
        for offset, strategy in enumerate(stage.layer_strategies or ()):
            if strategy.zero == 3 and strategy.dp > 1:
                return (f"layer {stage.start + offset} (chunk {chunk}) runs ZeRO-3 over dp "
                        f"{strategy.dp} under schedule {plan.schedule}, whose split backward "
                        "loses ZeRO-3's weight gradients in torch pipelining; give it zero 2, "
                        "or use schedule 1f1b or interleaved")
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
    split = split_backward_refusal(plan)
    if split is not None:
        return split
    degrees = sorted(tp_degrees_of(plan))
    for low, high in zip(degrees, degrees[1:], strict=False):
        if high % low:
            return (f"layer tp degrees {low} and {high} do not nest; the runtime moves "
                    "activations only between tp's where one divides the other")
    if plan.sequence_parallel:
        uneven = [tp for tp in degrees if plan.seq_len % tp]
        if uneven:
            return (f"sequence parallelism splits the {plan.seq_len} positions of a sequence "
                    f"over each layer's tp ranks, and tp {uneven[0]} does not divide them; "
                    "choose tp's that divide seq_len, or set sequence_parallel false")
    first, last = plan.stages[0].layer_strategies, plan.stages[-1].layer_strategies
    assert first is not None and last is not None
    return tied_ends_refusal(model, first[0], last[-1], apart=plan.num_chunks > 1)


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


def refuse_context_parallel(plan: Plan, where: str = "meshmorph run") -> None:
    """A PlanError naming the constraint and a way out when ``plan`` has cp > 1."""
    if plan.cp > 1:
        raise PlanError(
            f"{where} does not run context parallelism: the plan has cp {plan.cp} (ring "
            f"attention needs torch's context_parallel, which runs on CUDA SDPA kernels, and "
            f"meshmorph's runtime does not split sequences); re-plan with cp 1 (meshmorph plan "
            f"--max-cp 1) or fold the {plan.cp} ranks into dp or tp, at a shorter sequence if "
            f"it no longer fits"
        )


def zero_runs_under(schedule: Schedule, zero: int, dp: int) -> bool:
    """Whether a plan (or one layer of a layerwise plan) at ZeRO ``zero`` over ``dp`` ranks runs
    under ``schedule``: torch pipelining's split backward (zb, zbv, dualpipev) loses ZeRO-3's
    weight gradients, so ZeRO-3 over more than one rank does not run under it."""
    return not (schedule.split_backward and zero == 3 and dp > 1)
