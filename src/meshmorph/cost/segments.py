"""A model chunk as segments: the runtime's units of data-parallel communication.

The cost model prices every chunk of a Plan as segments, runs of consecutive layers under one
strategy (tp, dp, ZeRO) that the runtime wraps and reduces as one unit, each as
``CostModel.chunk_time`` prices layers under one plan, with the redistribution between
neighbours whose tp differs (cost/transition.py). The segments follow the engine that runs the
plan (docs/layerwise.md, "Cost"): a stage without layer strategies is one segment under the plan
itself, reducing its gradients with the rank's other chunks (DDP's buckets, FSDP2's one step
reduction); a stage listing ``layer_strategies`` runs on the layerwise engine, which wraps every
layer as its own unit, so each layer is a segment under the uniform plan it sees (``layer_plan``)
that exposes its ZeRO traffic against its own compute and reduces on its own (``Segment.alone``),
even beside a neighbour under the same strategy. The per-layer search prices each layer by the
same function (``CostModel.layer_alone``), so its optimum is this model's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from meshmorph.cost.state import fsdp_shards
from meshmorph.spec.model import LayerKind, ModelSpec, Recompute
from meshmorph.spec.plan import LayerStrategy, Plan, PlanError
from meshmorph.spec.runnable import lists_layer_strategies, plan_strategy, stage_strategies


class Segment(NamedTuple):
    """Consecutive layers of one chunk that run under one strategy as one unit (a tuple: the
    planner makes one per chunk of every plan it prices)."""

    start: int
    """Index of the first layer."""
    stop: int
    """One past the last layer."""
    plan: Plan
    """The uniform plan its layers see: the plan itself, or ``layer_plan`` of a layer strategy."""
    recompute: tuple[Recompute, ...]
    """Recompute of each of its layers."""
    drop_tied: bool = False
    """It holds the head of a chunk that also holds the tied embedding: the tied matrix is
    counted once, with the embedding."""
    alone: bool = False
    """It reduces its gradients on its own (a layer of a layerwise stage), not together with
    the rank's other segments; its one layer is one FSDP2 unit."""

    def units(self, model: ModelSpec) -> int:
        """FSDP2 units it holds: each block and the chunk's root, one for a layer alone."""
        return 1 if self.alone else fsdp_units(model, self.start, self.stop)

    @property
    def strategy(self) -> LayerStrategy:
        """Its (tp, dp, ZeRO)."""
        return plan_strategy(self.plan)


def fsdp_sharded(plan: Plan) -> bool:
    """Whether FSDP2 shards the parameters of a layer under ``plan``'s (segment's) strategy: a
    ``LayerPlan`` and every layer of a layerwise plan run as the layerwise engine runs them."""
    per_layer = isinstance(plan, LayerPlan) or lists_layer_strategies(plan)
    return fsdp_shards(zero=plan.zero, dp=plan.grad_replicas, per_layer=per_layer)


def autocast_stream(plan: Plan) -> bool:
    """Whether a layer under ``plan``'s (segment's) strategy runs 16-bit autocast over an fp32
    residual stream (the embedding's output is fp32, and so is every residual add after it);
    FSDP2's mixed precision casts the stream to the compute dtype where it shards the layer."""
    return plan.dtype != "fp32" and not fsdp_sharded(plan)


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerPlan(Plan):
    """The uniform plan one layer of a layerwise stage sees (``layer_plan``): a Plan whose
    type says the layerwise engine runs the layer as its own unit, so the cost model prices the
    layer's data parallelism as that engine realises it (cost/state.py's ``per_layer``: a
    ZeRO-1 layer keeps whole parameters and steps ``ShardedAdamW``)."""


def layer_plan(plan: Plan, strategy: LayerStrategy) -> LayerPlan:
    """The uniform plan a layer under ``strategy`` sees: the plan's devices, schedule and
    micro-batch count, the layer's tp, dp, ZeRO and its per-rank micro-batch (the stage's
    plan dp x micro_batch sequences per micro-batch, over the layer's dp)."""
    sequences = plan.dp * plan.micro_batch
    if sequences % strategy.dp:
        raise PlanError(f"layer dp {strategy.dp} does not divide the stage's {sequences} sequences "
                        "per micro-batch; choose a dp that divides them")
    micro = sequences // strategy.dp
    own = {name: getattr(plan, name) for name in plan.__dataclass_fields__}
    own.update(tp=strategy.tp, dp=strategy.dp, zero=strategy.zero, micro_batch=micro,
               global_batch=strategy.dp * micro * plan.num_microbatches,
               sequence_parallel=plan.sequence_parallel and strategy.tp > 1, stages=())
    return LayerPlan(**own)


def fsdp_units(model: ModelSpec, start: int, stop: int) -> int:
    """FSDP2 units of a chunk of layers [start, stop): each block and the chunk's root."""
    return sum(1 for layer in model.layers[start:stop] if layer.kind == LayerKind.BLOCK) + 1


def chunk_segments(model: ModelSpec, plan: Plan, chunk: int,
                   plans: dict[LayerStrategy, Plan] | None = None) -> list[Segment]:
    """The segments of model chunk ``chunk`` (module docstring); ``plans`` caches
    ``layer_plan`` by strategy across chunks."""
    stage = plan.stages[chunk]
    tied = model.tied_embeddings and stage.start == 0 and stage.stop == model.num_layers
    if stage.layer_strategies is None:
        return [Segment(stage.start, stage.stop, plan, tuple(stage.recompute))]
    plans = {} if plans is None else plans
    out = []
    for offset, strategy in enumerate(stage.layer_strategies):
        sub = plans.get(strategy)
        if sub is None:
            sub = plans[strategy] = layer_plan(plan, strategy)
        index = stage.start + offset
        out.append(Segment(index, index + 1, sub, (stage.recompute[offset],),
                           drop_tied=tied and index == model.num_layers - 1, alone=True))
    return out


def as_layerwise(plan: Plan) -> Plan:
    """``plan`` with every stage listing the plan's own strategy for each layer: the same
    layout run by the layerwise engine, priced layer by layer (module docstring)."""
    return replace(plan, stages=tuple(
        replace(stage, layer_strategies=stage_strategies(plan, stage)) for stage in plan.stages))
