"""Apply a Plan to one model chunk, in a fixed order: tensor/sequence parallel, activation
recompute, then data parallel.

Data parallelism by ZeRO stage (what each holds and sends: cost/state.py, docs/cost-model.md):

- zero 0: whole parameters, gradients and optimizer state on every data-parallel rank, gradients
  all-reduced once per step: ``DistributedDataParallel`` around the chunk where its parameters
  are plain tensors (tp 1; the fastest path), FSDP2's composable ``replicate`` where tensor
  parallelism made them DTensors, and under a zero-bubble schedule. The DDP wrapper is only what
  runs the chunk: the chunk itself, with its original parameter names, stays the engine's model part.
- zero 1: zero 0's wrapping and gradient all-reduce; the optimizer shards its state
  (run/parallel/zero1.py: AdamW on a dim-0 shard of every parameter, updated shards all-gathered back).
- zero 2: FSDP2 ``fully_shard(reshard_after_forward=False)``; the engine also turns off
  resharding after backward, so parameters are gathered once per step and stay unsharded to its
  end (the engine reshards after the optimizer step); gradients are reduce-scattered after every
  micro-batch and only the shard is kept.
- zero 3: FSDP2 ``fully_shard(reshard_after_forward=True)`` on every block and on the chunk root:
  parameters are gathered per block in forward and again in backward.

Precision: a 16-bit plan keeps fp32 parameters. FSDP2 (zero 2/3) computes through
``MixedPrecisionPolicy(param_dtype=16-bit, reduce_dtype=plan.reduce_dtype)``; everywhere else the
engine runs forward under ``torch.autocast`` and gradients are reduced in fp32, or through DDP's
bf16/fp16 compress hook (``replicate``'s ``reduce_dtype``) when the plan's ``reduce_dtype`` is 16-bit.

With tensor parallelism every parameter of the chunk is a DTensor on the tp mesh (parameters TP
does not split are replicated DTensors), so with data parallelism on top every parameter lives on
the same 2-D (dp, tp) mesh.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
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

from meshmorph.run.model.decoder import Transformer
from meshmorph.run.model.materialize import materialize_
from meshmorph.run.parallel.mesh import TrainMesh
from meshmorph.run.parallel.recompute import apply_recompute
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan, StagePlan


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


def apply_tp(chunk: Transformer, spec: ModelSpec, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Tensor (and sequence) parallelism over ``tp_mesh``; a tied head is re-tied afterwards
    (both halves are split by vocabulary rows, so they stay one DTensor)."""
    # every rank built the same weights from the same seed: no broadcast needed (src_data_rank None)
    parallelize_module(chunk, tp_mesh, tp_plan(chunk, spec, tp_mesh.size(), sequence_parallel,
                                               vocab_parallel_loss=True), src_data_rank=None)
    if spec.tied_embeddings and chunk.embed is not None and chunk.head is not None:
        chunk.head.out.weight = chunk.embed.tok.weight


TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""torch dtype of each plan dtype name."""


def uses_fsdp_precision(plan: Plan) -> bool:
    """Whether FSDP2's MixedPrecisionPolicy (not autocast) sets the compute dtype: zero 2/3."""
    return plan.dp > 1 and plan.zero >= 2


def _bf16_compress(state, bucket):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
    """torch's bf16 compress hook under another name: DDP refuses the hook by name unless CUDA
    and NCCL are there, though gloo reduces bf16 as well (unannotated: DDP checks annotations
    against the real classes, and this module's are strings)."""
    return default_hooks.bf16_compress_hook(state, bucket)


_COMPRESS_HOOKS = {"bf16": _bf16_compress, "fp16": default_hooks.fp16_compress_hook}
"""DDP comm hooks that reduce fp32 gradients in a 16-bit dtype (torch's default hooks)."""


def apply_dp(chunk: Transformer, dp_mesh: DeviceMesh, plan: Plan, *, allow_ddp: bool = True,
             materialize: Callable[[], None] = lambda: None) -> nn.Module:
    """Data parallelism over ``dp_mesh`` by ZeRO stage (see the module docstring); returns the
    module that runs the chunk (a DDP wrapper, or the chunk itself). ``allow_ddp`` False keeps
    zero 0/1 on ``replicate`` (a zero-bubble schedule computes weight gradients apart from the
    backward that DDP's reducer hooks into, and DDP then misses them). ``materialize`` gives a
    chunk built on the meta device its storage; it runs before DDP, which needs real tensors."""
    reduce_dtype = TORCH_DTYPES[plan.reduce_dtype]
    if plan.zero <= 1:  # zero 1 shards only the optimizer (run/parallel/zero1.py)
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
        policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
        for block in chunk.blocks.values():
            replicate(block, mesh=dp_mesh, mp_policy=policy)
        replicate(chunk, mesh=dp_mesh, mp_policy=policy)
        return chunk
    policy = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[plan.dtype], reduce_dtype=reduce_dtype)
    shard = partial(fully_shard, mesh=dp_mesh, reshard_after_forward=plan.zero == 3,
                    mp_policy=policy)
    for block in chunk.blocks.values():
        shard(block)
    shard(chunk)
    if plan.zero == 3:
        set_prefetch(chunk, plan.fsdp_prefetch, wait_for_device=dp_mesh.device_type == "cuda")
    return chunk


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
            unit.register_forward_pre_hook(
                lambda *_: torch.cuda.current_stream().synchronize(), prepend=True)


def parallelize(chunk: Transformer, spec: ModelSpec, plan: Plan, stage: StagePlan,
                mesh: TrainMesh, *, seed: int, device: torch.device) -> nn.Module:
    """Apply ``plan`` to ``chunk`` (the layers of ``stage``) in place: TP/SP, recompute, DP, and
    give a chunk built on the meta device this rank's shards (``materialize_``: after TP and
    FSDP2 sharding, so only the local shards are allocated; before DDP, which needs real tensors).
    Returns the module that runs the chunk (a DDP wrapper for zero 0/1 without TP, else the chunk)."""
    def materialize() -> None:
        if any(p.is_meta for p in chunk.parameters()):
            materialize_(chunk, spec, seed=seed, device=device)

    if plan.tp > 1:
        apply_tp(chunk, spec, mesh.sub("tp"), plan.sequence_parallel)
    apply_recompute(chunk, stage.start, stage.recompute)
    runner: nn.Module = chunk
    if plan.dp > 1:
        split_backward = plan.pp > 1 and plan.schedule.split_backward
        runner = apply_dp(chunk, mesh.sub("dp"), plan, allow_ddp=not split_backward,
                          materialize=materialize)
    materialize()
    return runner
