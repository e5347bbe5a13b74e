"""Apply a layerwise stage to one model chunk: every layer on its own (dp, tp) mesh.

A layerwise stage (``StagePlan.layer_strategies``) splits the stage's D = plan tp x dp devices
per layer, D = tp_i x dp_i, ranks numbered with tp innermost as everywhere in meshmorph. Each
distinct tp degree gets one 2-D DeviceMesh ``("dp", "tp")`` of shape (D / tp, tp) over the
stage's ranks (``LayerLayouts``); a layer is parallelized on its degree's mesh, in the uniform
path's order:

- tensor parallelism: the uniform path's own styles (``parallelize.tp_plan``: Megatron's column
  and row split, vocabulary-parallel embedding and head, and with ``plan.sequence_parallel``
  Megatron's sequence parallelism: ``SequenceParallel`` norms, ``PrepareModuleInput`` gathers
  before attention and MLP, reduce-scattered row outputs, the embedding's output kept as this
  rank's sequence slice), restricted to the layer's modules and applied over the layer's ``tp``
  sub-mesh (skipped at tp 1, where parameters stay plain and the layer holds whole sequences);
- recompute: the stage's per-layer modes (``apply_recompute``);
- data parallelism by the layer's ZeRO stage over its ``dp`` sub-mesh: zero 2/3 are FSDP2
  ``fully_shard`` of the layer alone (``reshard_after_forward`` for zero 3), gradients
  reduce-scattered as a sum (``set_gradient_divide_factor(1)``); zero 0/1 keep whole parameters
  and the engine all-reduces the layer's gradients over the layer's dp group once per step
  (run/engine/layerwise_grads.py), zero 1 then steps a ``ShardedAdamW`` over that group.

Gradients are sums over each layer's dp group, never means: the engine back-propagates each
rank's share of the micro-batch mean (run/engine/layerwise_engine.py), so a layer's gradient on one
dp rank is already its sequences' exact contribution.

Embedding and head run under their own listed strategies, as the cost model prices them. A tied
embedding and head (one matrix) in one chunk must share tp and ZeRO: they stay one parameter on
one mesh, reduced once with the embedding's layer, under ZeRO 0 or 1 (FSDP2 cannot shard one
matrix for two modules it runs apart; run/engine/layerwise_engine.py refuses it). Under pp > 1 the
last stage's head holds its own copy, built with the embedding's values and laid out as the
embedding (same tp and ZeRO: spec/runnable.py); run/engine/layerwise_grads.py sums the two
gradients over each pair of ranks holding the same shard, so both copies step alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from meshmorph.run.model.decoder import Transformer
from meshmorph.run.model.materialize import materialize_
from meshmorph.run.parallel.layerwise_redistribute import LayoutGroups
from meshmorph.run.parallel.parallelize import TORCH_DTYPES, tp_plan
from meshmorph.run.parallel.recompute import apply_recompute
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import LayerStrategy, Plan, StagePlan


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """One (dp, tp) split of the stage's devices and this rank's place in it."""

    tp: int
    """Tensor-parallel degree."""
    dp: int
    """Data-parallel degree (stage devices / tp)."""
    mesh: DeviceMesh
    """2-D mesh with dims ("dp", "tp") over this rank's stage."""
    tp_mesh: DeviceMesh
    """Its "tp" dim through this rank."""
    dp_mesh: DeviceMesh
    """Its "dp" dim through this rank."""

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel block: the sequences of a micro-batch it runs."""
        return self.dp_mesh.get_local_rank()


class LayerLayouts:
    """The meshes of every tp degree a stage uses, and the groups that move activations between
    them; made collectively at construction (every rank, same order). Under pipeline
    parallelism (``pp`` stages of ``devices`` ranks, stage-major as run/parallel/mesh.py numbers them)
    each degree's mesh is a ("pp", "dp", "tp") mesh of the job, and a rank keeps its stage's
    ("dp", "tp") slice."""

    def __init__(self, devices: int, degrees: set[int], device_type: str, *, pp: int = 1,
                 pp_rank: int = 0) -> None:
        self.devices = devices
        self.layouts: dict[int, Layout] = {}
        for tp in sorted(degrees):
            if pp == 1:
                mesh = init_device_mesh(device_type, (devices // tp, tp),
                                        mesh_dim_names=("dp", "tp"))
                stage = mesh
            else:
                mesh = init_device_mesh(device_type, (pp, devices // tp, tp),
                                        mesh_dim_names=("pp", "dp", "tp"))
                stage = mesh["dp", "tp"]
            self.layouts[tp] = Layout(tp=tp, dp=devices // tp, mesh=stage, tp_mesh=mesh["tp"],
                                      dp_mesh=mesh["dp"])
        self.groups = LayoutGroups(pp_rank * devices, devices, pp)
        self.groups.tp_groups = {tp: layout.tp_mesh.get_group() for tp, layout in
                                 self.layouts.items() if tp > 1}
        ordered = sorted(degrees)
        for i, low in enumerate(ordered):  # every pair's all-gather groups, in one order
            for high in ordered[i + 1:]:
                self.groups.groups(low, high)

    def __getitem__(self, tp: int) -> Layout:
        return self.layouts[tp]


@dataclass(slots=True, kw_only=True)
class LayerUnit:
    """One layer of the chunk as the runtime runs it."""

    index: int
    """Layer index in ``ModelSpec.layers``."""
    module: nn.Module
    """The layer's module (``embed``, ``blocks[i]`` or ``head``)."""
    strategy: LayerStrategy
    """Its tp / dp / ZeRO."""
    layout: Layout
    """Its mesh."""
    params: list[nn.Parameter] = field(default_factory=list)
    """The parameters this unit owns (a tied head's weight belongs to the embedding's unit)."""
    sequence_parallel: bool = False
    """Whether its hidden state (input and output) is split along the sequence over its tp
    ranks (Megatron's sequence parallelism; whole sequences at tp 1)."""

    @property
    def fsdp(self) -> bool:
        """Whether FSDP2 shards it (ZeRO 2/3 over more than one rank)."""
        return self.strategy.dp > 1 and self.strategy.zero >= 2

    @property
    def reduces_by_hand(self) -> bool:
        """Whether the engine all-reduces its gradients (ZeRO 0/1 over more than one rank)."""
        return self.strategy.dp > 1 and self.strategy.zero <= 1


def stage_degrees(plan: Plan) -> set[int]:
    """Every tp degree a layerwise plan's layers use, and the plan's own (its data layout)."""
    return {plan.tp} | {s.tp for stage in plan.stages for s in stage.layer_strategies or ()}


def _layer_module(chunk: Transformer, spec: ModelSpec, index: int) -> tuple[str, nn.Module]:
    if index == 0:
        assert chunk.embed is not None
        return "embed", chunk.embed
    if index == spec.num_layers - 1:
        assert chunk.head is not None
        return "head", chunk.head
    return f"blocks.{index - 1}", chunk.blocks[str(index - 1)]


def parallelize_layerwise(chunk: Transformer, spec: ModelSpec, plan: Plan, stage: StagePlan,
                          layouts: LayerLayouts, *, seed: int,
                          device: torch.device) -> list[LayerUnit]:
    """Parallelize ``chunk`` (built on the meta device, the layers of ``stage``) layer by layer
    (module docstring) and give this rank its shards; returns the layers in order."""
    assert stage.layer_strategies is not None
    units: list[LayerUnit] = []
    names = []
    for offset, strategy in enumerate(stage.layer_strategies):
        index = stage.start + offset
        name, module = _layer_module(chunk, spec, index)
        layout = layouts[strategy.tp]
        if strategy.tp > 1:
            styles = {key: style for key, style in
                      tp_plan(chunk, spec, strategy.tp, plan.sequence_parallel).items()
                      if key == name or key.startswith(name + ".")}
            parallelize_module(chunk, layout.tp_mesh, styles, src_data_rank=None)
        units.append(LayerUnit(index=index, module=module, strategy=strategy, layout=layout,
                               sequence_parallel=plan.sequence_parallel))
        names.append(name)
    tied = spec.tied_embeddings and chunk.embed is not None and chunk.head is not None
    if tied:
        chunk.head.out.weight = chunk.embed.tok.weight  # type: ignore[union-attr]
    apply_recompute(chunk, stage.start, stage.recompute)
    policy = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[plan.dtype],
                                  reduce_dtype=TORCH_DTYPES[plan.reduce_dtype])
    for unit in units:
        if not unit.fsdp:
            continue
        module = fully_shard(unit.module, mesh=unit.layout.dp_mesh,
                             reshard_after_forward=unit.strategy.zero == 3, mp_policy=policy)
        assert isinstance(module, FSDPModule)
        # a sum over the layer's dp group (SUM ops and no division: gloo has no PREMUL_SUM)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    if any(p.is_meta for p in chunk.parameters()):
        materialize_(chunk, spec, seed=seed, device=device)
    seen: set[int] = set()
    for unit in units:
        for param in unit.module.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                unit.params.append(param)
    return units
