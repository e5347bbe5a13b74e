"""Apply a Plan to one model chunk, in a fixed order: float8 linear layers (dtype fp8,
run/model/float8.py), tensor/sequence parallel, activation recompute, then data parallel.

Data parallelism by ZeRO stage (what each holds and sends: cost/state.py, docs/cost-model.md):

- zero 0: whole parameters, gradients and optimizer state on every data-parallel rank, gradients
  all-reduced once per step: ``DistributedDataParallel`` around the chunk where its parameters
  are plain tensors (tp 1; the fastest path), FSDP2's composable ``replicate`` where tensor
  parallelism made them DTensors, and under a zero-bubble schedule. The DDP wrapper is only what
  runs the chunk: the chunk itself, with its original parameter names, stays the engine's model part.
- zero 1: FSDP2 ``fully_shard(reshard_after_forward=False)`` on every block and on the chunk
  root, Megatron's distributed optimizer on torch's pieces: each rank keeps the fp32 master
  shard of every parameter and its AdamW moments; the engine turns gradient sync off for every
  micro-batch but the last (FSDP2 accumulates the whole gradients in ``reduce_dtype``) and
  resharding after backward off, so each unit reduce-scatters its gradients once, in the last
  micro-batch's backward, as soon as they are produced, and is gathered once per step, in the
  compute dtype, kept to the optimizer step, then resharded.
- zero 2: the same, with gradient sync on in every micro-batch: gradients are reduce-scattered
  after every micro-batch and only the shard is kept.
- zero 1/2, ``Plan.overlap_param_gather``: each unit's gather of the next step is issued
  asynchronously while the unit before it computes (FSDP2 forward prefetch with
  ``set_unshard_async_op``), so the first forward waits only for the root's; off, each unit
  gathers on the critical path in its own pre-forward.
- zero 3: FSDP2 ``fully_shard(reshard_after_forward=True)`` on every block and on the chunk root:
  parameters are gathered per block in forward and again in backward.

Precision: the fp32 master parameters live in FSDP2's shards (zero 1-3) or whole (zero 0).
FSDP2 computes through ``MixedPrecisionPolicy(param_dtype=plan.dtype,
reduce_dtype=plan.reduce_dtype)``; zero 0 runs forward under ``torch.autocast`` and reduces
gradients in fp32, or through DDP's bf16/fp16 compress hook (``replicate``'s ``reduce_dtype``)
when the plan's ``reduce_dtype`` is 16-bit.

With tensor parallelism every parameter of the chunk is a DTensor on the tp mesh (parameters TP
does not split are replicated DTensors), so with data parallelism on top every parameter lives on
the same 2-D (dp, tp) mesh.

``parallelize`` applies this segment by segment (run/parallel/segments.py). A uniform plan's
chunk is one segment on the plan's mesh and gets exactly the above. A plan whose layers'
strategies differ gives each segment the same tensor parallel styles (restricted to its layers,
logits gathered rather than vocabulary-parallel) over its own split's tp mesh, the stage's
recompute, and per layer: FSDP2 ``fully_shard`` of the layer alone for ZeRO 2/3, gradients summed
over the segment's dp group; ZeRO 0/1 layers keep whole parameters and the engine all-reduces
their summed gradients after the backward (run/engine/grads.py), ZeRO 1 then steps a
``ShardedAdamW`` (run/parallel/zero1.py) over that group. Gradients are sums there, never means:
the engine back-propagates each rank's share of the micro-batch mean. A tied embedding and head
in one chunk stay one parameter (ZeRO 0/1: FSDP2 cannot shard one matrix for two modules it runs
apart); on two pipeline stages each holds its copy, laid out alike, and the engine sums their
gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from meshmorph.cost.state import fsdp_shards
from meshmorph.run.model.decoder import Transformer
from meshmorph.run.model.float8 import (
    cast_inputs_under_autocast_,
    check_float8_device,
    convert_for_plan_,
)
from meshmorph.run.model.materialize import materialize_
from meshmorph.run.parallel.mesh import TrainMesh
from meshmorph.run.parallel.recompute import apply_recompute
from meshmorph.run.parallel.segments import (
    ParallelChunk,
    Segment,
    SegmentRunner,
    layer_module,
    strategy_runs,
)
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan, StagePlan
from meshmorph.spec.runnable import lists_layer_strategies, stage_strategies


class ReplicateParallel(ParallelStyle):
    """Parameters become replicated DTensors on the tp mesh; plain-tensor inputs are taken as
    replicated, DTensor inputs are gathered, and the output is handed back as a plain tensor. For the layers tensor
    parallelism does not split (norms without sequence parallel, learned positions)."""

    @staticmethod
    def _params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            dtensor = DTensor.from_local(param.detach(), mesh, [Replicate()], run_check=False)
            module.register_parameter(param_name, nn.Parameter(dtensor))

    @staticmethod
    def _inputs(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        def whole(x: Any) -> Any:
            if isinstance(x, DTensor):  # e.g. a sequence-parallel norm's output: gather it
                return x.redistribute(placements=[Replicate()])
            if isinstance(x, torch.Tensor):
                return DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            return x

        return tuple(whole(x) for x in inputs)

    @staticmethod
    def _outputs(module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
        return output.to_local() if isinstance(output, DTensor) else output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._params, self._inputs, self._outputs)


def tp_plan(chunk: Transformer, spec: ModelSpec, tp_degree: int,
            sequence_parallel: bool, vocab_parallel_loss: bool = False) -> dict[str, ParallelStyle]:
    """Module name -> parallel style for the layers this chunk holds (Megatron's split: q/k/v,
    fc1 (or w1/w3) by columns, wo and fc2 (or w2) by rows, embedding and head by vocabulary).
    ``vocab_parallel_loss``: a vocabulary-parallel head hands back its logits sharded on the
    vocabulary (a DTensor) for ``loss_parallel`` (run/model/loss.py), instead of gathering them."""
    seq = Shard(1)  # activations between tensor-parallel regions: by sequence with SP
    norm: ParallelStyle = SequenceParallel() if sequence_parallel else ReplicateParallel()
    between = seq if sequence_parallel else Replicate()
    # vocab-parallel embedding and head where t divides V, else both replicated
    vocab_split = spec.padded_vocab_size % tp_degree == 0  # the runtime's (padded) rows
    plan: dict[str, ParallelStyle] = {}
    if chunk.embed is not None:
        plan["embed.tok"] = (RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
                             if vocab_split else ReplicateParallel())
        if chunk.embed.pos is not None:
            plan["embed.pos"] = ReplicateParallel()
        if sequence_parallel:  # each rank keeps its sequence slice of the summed embeddings
            plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(),
                                                desired_output_layouts=seq, use_local_output=True)
    up = ("fc1",) if spec.arch == "gpt" else ("w1", "w3")
    down = "fc2" if spec.arch == "gpt" else "w2"
    for key in chunk.blocks:
        block = f"blocks.{key}"
        plan[f"{block}.attn_norm"] = norm
        plan[f"{block}.mlp_norm"] = norm
        if sequence_parallel:
            for region in ("attn", "mlp"):
                plan[f"{block}.{region}"] = PrepareModuleInput(
                    input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                    use_local_output=True)
        for name in ("wq", "wk", "wv"):
            plan[f"{block}.attn.{name}"] = ColwiseParallel()
        plan[f"{block}.attn.wo"] = RowwiseParallel(output_layouts=between)
        for name in up:
            plan[f"{block}.mlp.{name}"] = ColwiseParallel()
        plan[f"{block}.mlp.{down}"] = RowwiseParallel(output_layouts=between)
    if chunk.head is not None:
        plan["head.norm"] = norm
        plan["head.out"] = (ColwiseParallel(input_layouts=between, output_layouts=Shard(-1),
                                            use_local_output=False)
                            if vocab_split and vocab_parallel_loss else
                            ColwiseParallel(input_layouts=between, output_layouts=Replicate())
                            if vocab_split else ReplicateParallel())
    return plan


def apply_tp(chunk: Transformer, spec: ModelSpec, tp_mesh: DeviceMesh, sequence_parallel: bool,
             *, layers: Collection[str] | None = None, vocab_parallel_loss: bool = True,
             tie: bool = True) -> None:
    """Tensor (and sequence) parallelism over ``tp_mesh`` of the chunk's layers named in
    ``layers`` (``embed``, ``blocks.<i>``, ``head``; None: every layer). A tied head is re-tied
    afterwards where ``tie`` (both halves are split by vocabulary rows, so they stay one
    DTensor); with ``tie`` off the caller re-ties it (``tie_head``) after its last call."""
    styles = tp_plan(chunk, spec, tp_mesh.size(), sequence_parallel,
                     vocab_parallel_loss=vocab_parallel_loss)
    if layers is not None:
        styles = {key: style for key, style in styles.items()
                  if any(key == name or key.startswith(name + ".") for name in layers)}
    # every rank built the same weights from the same seed: no broadcast needed (src_data_rank None)
    parallelize_module(chunk, tp_mesh, styles, src_data_rank=None)
    if tie:
        tie_head(chunk, spec)


def tie_head(chunk: Transformer, spec: ModelSpec) -> None:
    """Make a tied head's weight the embedding's parameter again, where the chunk holds both."""
    if spec.tied_embeddings and chunk.embed is not None and chunk.head is not None:
        chunk.head.out.weight = chunk.embed.tok.weight


TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                "fp8": torch.bfloat16}
"""torch dtype of each plan dtype name as tensors are kept and computed outside the float8
GEMMs: fp8 is bf16 mixed precision whose block linears multiply in float8 (run/model/float8.py)."""


def uses_fsdp_precision(plan: Plan) -> bool:
    """Whether FSDP2's MixedPrecisionPolicy sets the compute dtype of the plan's own layout
    (cost/state.py's ``fsdp_shards``: zero 1-3 over dp > 1, zero 2/3 for a layerwise plan's):
    what pipeline stages hand over (run/engine/pipeline.io_dtypes)."""
    return fsdp_shards(zero=plan.zero, dp=plan.dp, per_layer=lists_layer_strategies(plan))


def autocasts(plan: Plan) -> bool:
    """Whether the forward runs under ``torch.autocast``: a 16-bit plan with some layer that
    FSDP2's mixed precision does not cast (ZeRO 0, dp 1, a layerwise plan's ZeRO-1 layers);
    where every layer is cast the parameters are already 16-bit and autocast would only move
    norms and softmax to fp32."""
    per_layer = lists_layer_strategies(plan)
    return plan.dtype != "fp32" and not all(
        fsdp_shards(zero=s.zero, dp=s.dp, per_layer=per_layer)
        for stage in plan.stages for s in stage_strategies(plan, stage))


def _bf16_compress(state, bucket):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
    """torch's bf16 compress hook under another name: DDP refuses the hook by name unless CUDA
    and NCCL are there, though gloo reduces bf16 as well (unannotated: DDP checks annotations
    against the real classes, and this module's are strings)."""
    return default_hooks.bf16_compress_hook(state, bucket)


_COMPRESS_HOOKS = {"bf16": _bf16_compress, "fp16": default_hooks.fp16_compress_hook}
"""DDP comm hooks that reduce fp32 gradients in a 16-bit dtype (torch's default hooks)."""


def _fully_shard(units: list[nn.Module], mesh: DeviceMesh, plan: Plan, zero: int, *,
                 summed: bool) -> None:
    """FSDP2 on each of ``units`` in order (ZeRO-3 reshards after forward), computing in the
    plan's dtype and reducing in its ``reduce_dtype``; ``summed``: gradients summed over the dp
    group (SUM ops and no division: gloo has no PREMUL_SUM) instead of averaged."""
    policy = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[plan.dtype],
                                  reduce_dtype=TORCH_DTYPES[plan.reduce_dtype])
    for unit in units:
        module = fully_shard(unit, mesh=mesh, reshard_after_forward=zero == 3, mp_policy=policy)
        if summed:
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def apply_dp(chunk: Transformer, dp_mesh: DeviceMesh, plan: Plan, *, allow_ddp: bool = True,
             materialize: Callable[[], None] = lambda: None) -> nn.Module:
    """Data parallelism over ``dp_mesh`` by ZeRO stage (see the module docstring); returns the
    module that runs the chunk (a DDP wrapper, or the chunk itself). ``allow_ddp`` False keeps
    zero 0 on ``replicate`` (a zero-bubble schedule computes weight gradients apart from the
    backward that DDP's reducer hooks into, and DDP then misses them). ``materialize`` gives a
    chunk built on the meta device its storage; it runs before DDP, which needs real tensors."""
    if plan.zero == 0:
        if allow_ddp and not any(isinstance(p, DTensor) for p in chunk.parameters()):
            materialize()
            # every rank built the same weights: no initial broadcast needed; gradients are views
            # into DDP's buckets (one fp32 copy of the gradients, not two)
            ddp = DistributedDataParallel(chunk, process_group=dp_mesh.get_group(),
                                          broadcast_buffers=False, init_sync=False,
                                          gradient_as_bucket_view=True)
            if plan.reduce_dtype in _COMPRESS_HOOKS:
                ddp.register_comm_hook(dp_mesh.get_group(), _COMPRESS_HOOKS[plan.reduce_dtype])
            return ddp
        policy = MixedPrecisionPolicy(reduce_dtype=TORCH_DTYPES[plan.reduce_dtype])
        for block in chunk.blocks.values():
            replicate(block, mesh=dp_mesh, mp_policy=policy)
        replicate(chunk, mesh=dp_mesh, mp_policy=policy)
        return chunk
    _fully_shard([*chunk.blocks.values(), chunk], dp_mesh, plan, plan.zero, summed=False)
    cuda = dp_mesh.device_type == "cuda"
    if plan.zero == 3:
        set_prefetch(chunk, plan.fsdp_prefetch, wait_for_device=cuda)
    else:
        set_gather_overlap(chunk, plan.overlap_param_gather, wait_for_device=cuda)
    return chunk


def set_gather_overlap(chunk: Transformer, overlap: bool, *, wait_for_device: bool) -> None:
    """ZeRO-1/2's ``Plan.overlap_param_gather`` on FSDP2 units (the chunk root, then its blocks
    in order), whose parameters are gathered once per step, in the first forward. On: each unit
    issues the next one's all-gather asynchronously (``set_unshard_async_op``: on gloo it runs on
    the backend's thread, on NCCL on its stream) and its own pre-forward waits for it, so each
    gather runs while the unit before computes and the first forward waits only for the root's.
    Off: each unit gathers in its own pre-forward, after (``wait_for_device``, CUDA) the queued
    compute, the gather on the critical path."""
    units = [chunk, *chunk.blocks.values()]
    if overlap:
        chunk._set_unshard_async_op(True)  # type: ignore[operator]  # every unit below the root
    for index, unit in enumerate(units):
        if overlap and index + 1 < len(units):
            unit.set_modules_to_forward_prefetch([units[index + 1]])
        elif not overlap and wait_for_device:
            _gather_after_compute(unit)


def _gather_after_compute(unit: nn.Module) -> None:
    """Make ``unit``'s pre-forward wait for the compute queued on the device (CUDA) before it
    gathers, so no gather runs beside compute."""
    unit.register_forward_pre_hook(lambda *_: torch.cuda.current_stream().synchronize(),
                                   prepend=True)


def set_prefetch(chunk: Transformer, prefetch: bool, *, wait_for_device: bool) -> None:
    """ZeRO-3's ``Plan.fsdp_prefetch`` on FSDP2 units (the chunk root, then its blocks in order).
    On: each unit prefetches the next one's all-gather in forward and the previous one's in
    backward (``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``). Off:
    each unit names only itself for backward prefetch (already gathered: FSDP2's implicit
    prefetch of the next unit is off), none in forward, and where ``wait_for_device`` (CUDA)
    each unit waits for the queued compute before its gather, so no gather runs beside compute
    and one unit is gathered at a time."""
    units = [chunk, *chunk.blocks.values()]
    for index, unit in enumerate(units):
        if prefetch:
            if index + 1 < len(units):
                unit.set_modules_to_forward_prefetch([units[index + 1]])
            if index > 1:  # backward runs the blocks in reverse; the root's gather is first
                unit.set_modules_to_backward_prefetch([units[index - 1]])
            continue
        unit.set_modules_to_backward_prefetch([unit])
        if wait_for_device:
            _gather_after_compute(unit)


def _segments(chunk: Transformer, spec: ModelSpec, plan: Plan, stage: StagePlan,
              mesh: TrainMesh) -> list[Segment]:
    """The chunk's segments (run/parallel/segments.py), before any parallelism."""
    per_layer = lists_layer_strategies(plan)  # as cost/segments.py prices it
    segments = []
    for start, stop, strategy in strategy_runs(plan, stage):
        named = [layer_module(chunk, spec, index) for index in range(start, stop)]
        segments.append(Segment(start=start, stop=stop, strategy=strategy,
                                mesh=mesh.splits[strategy.tp], per_layer=per_layer,
                                names=[name for name, _ in named],
                                modules=[module for _, module in named]))
    return segments


def parallelize(chunk: Transformer, spec: ModelSpec, plan: Plan, index: int, mesh: TrainMesh,
                *, seed: int, device: torch.device,
                boundary_dtype: torch.dtype | None = None) -> ParallelChunk:
    """Apply ``plan`` to ``chunk`` (the layers of ``plan.stages[index]``, built on the meta
    device) in place, segment by segment: float8 block linears (dtype fp8), TP/SP, recompute,
    DP, and give it this rank's shards (``materialize_``: after TP and FSDP2 sharding, so only
    the local shards are allocated; before DDP, which needs real tensors). ``boundary_dtype``:
    a pipeline stage's output dtype (``io_dtypes``), which a chunk of per-layer segments casts
    its output to."""
    def materialize() -> None:
        if any(p.is_meta for p in chunk.parameters()):
            materialize_(chunk, spec, seed=seed, device=device)

    float8 = convert_for_plan_(chunk, plan)  # dtype fp8: block linears to float8, first
    if float8:
        check_float8_device(device)
    stage = plan.stages[index]
    segments = _segments(chunk, spec, plan, stage, mesh)
    per_layer = segments[0].per_layer
    for segment in segments:
        if segment.strategy.tp > 1:
            apply_tp(chunk, spec, segment.mesh.tp_mesh, plan.sequence_parallel,
                     layers=segment.names, vocab_parallel_loss=not per_layer, tie=False)
    tie_head(chunk, spec)
    if float8:
        cast_inputs_under_autocast_(chunk)  # after TP's input hooks (run/model/float8.py)
    apply_recompute(chunk, stage.start, stage.recompute)
    runner: nn.Module = chunk
    if per_layer:
        for segment in segments:
            if segment.fsdp:
                segment.fsdp_units = list(segment.modules)
                _fully_shard(segment.fsdp_units, segment.mesh.dp_mesh, plan,
                             segment.strategy.zero, summed=True)
        runner = SegmentRunner(chunk, segments, mesh.moves, data_tp=plan.tp,
                               sequence_parallel=plan.sequence_parallel,
                               boundary_dtype=boundary_dtype)
    elif plan.dp > 1:
        split_backward = plan.pp > 1 and plan.schedule.split_backward
        runner = apply_dp(chunk, segments[0].mesh.dp_mesh, plan, allow_ddp=not split_backward,
                          materialize=materialize)
        if segments[0].fsdp:
            segments[0].fsdp_units = [*chunk.blocks.values(), chunk]
    materialize()
    seen: set[int] = set()
    for segment in segments:  # as registered now; a tied matrix once, with the embedding
        for param in (p for module in segment.modules for p in module.parameters()):
            if id(param) not in seen:
                seen.add(id(param))
                segment.params.append(param)
    return ParallelChunk(index=index, module=chunk, runner=runner, segments=segments)
