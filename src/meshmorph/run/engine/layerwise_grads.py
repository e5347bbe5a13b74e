"""Gradients of a layerwise stage: each layer's reduction over its own dp group, and the global
norm over layers that live on different meshes.

Reduction (ZeRO 0/1 layers; FSDP2 reduce-scatters zero 2/3 layers itself): after the last
micro-batch's backward, one all-reduce per layer of its local gradients packed into one flat
buffer, summed (not averaged: run/parallel/layerwise_parallelize.py) over the layer's dp group, in the
plan's ``reduce_dtype``; each gradient then becomes a view of the reduced buffer.

Norm: a layer's local gradient is held by ``replicas`` ranks of the stage: its dp degree for a
ZeRO 0/1 layer (every dp rank holds the same reduced gradient) times the tp degree for a
tensor the layer's tp does not split, 1 for FSDP2's shards (a DTensor names its replicated mesh
dims). Every rank sums ``||local||^2 / replicas`` over its gradients in float64 and one
all-reduce of that scalar over the stage gives every element exactly once: the one-device norm.
A tied head's own copy on the last pipeline stage (pp > 1) is left out of it: its gradient is
the embedding's (run/engine/train_engine.py's ``_sync_tied_grads`` sums the two over each pair of ranks that
hold the same shard), and the embedding counts it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial

from meshmorph.run.parallel.layerwise_parallelize import LayerUnit
from meshmorph.run.parallel.parallelize import TORCH_DTYPES


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor  # type: ignore[attr-defined]


def reduce_layer_grads(units: Iterable[LayerUnit], reduce_dtype: str) -> None:
    """Sum every ZeRO 0/1 layer's gradients over its dp group (module docstring)."""
    dtype = TORCH_DTYPES[reduce_dtype]
    for unit in units:
        if not unit.reduces_by_hand:
            continue
        params = [p for p in unit.params if p.grad is not None]
        if not params:
            continue
        locals_ = [_local(p.grad) for p in params]  # type: ignore[arg-type]
        flat = torch.cat([g.reshape(-1) for g in locals_]).to(dtype)
        dist.all_reduce(flat, group=unit.layout.dp_mesh.get_group())
        flat = flat.to(locals_[0].dtype)
        offset = 0
        for param, local in zip(params, locals_, strict=True):
            view = flat[offset:offset + local.numel()].view_as(local)
            offset += local.numel()
            grad = param.grad
            if isinstance(grad, DTensor):
                param.grad = DTensor.from_local(view, grad.device_mesh, grad.placements,
                                                shape=grad.shape, stride=grad.stride(),
                                                run_check=False)
            else:
                param.grad = view


def replicas(unit: LayerUnit, grad: torch.Tensor) -> int:
    """How many ranks of the stage hold the same local ``grad`` of ``unit``'s parameter."""
    count = 1 if unit.fsdp else unit.strategy.dp
    if isinstance(grad, DTensor):
        if any(isinstance(p, Partial) for p in grad.placements):
            raise ValueError("a Partial gradient reached the norm; align gradients to their "
                             "parameters' placements first")
        count *= math.prod(grad.device_mesh.size(i) for i, p in enumerate(grad.placements)
                           if p.is_replicate())
    return count


def tied_head_copy(chunk: torch.nn.Module, tied: bool) -> set[int]:
    """ids of the parameters the norm leaves out: a tied head's own copy of the embedding, on a
    chunk that holds the head without the embedding (``tied``: the model ties them)."""
    head, embed = getattr(chunk, "head", None), getattr(chunk, "embed", None)
    if not tied or head is None or embed is not None:
        return set()
    return {id(head.out.weight)}


def layerwise_grad_norm(units: Iterable[LayerUnit], device: torch.device,
                        skip: set[int] | None = None) -> float:
    """The global L2 norm of the job's gradients, identical on every rank (every stage's
    layers once; ``skip``: ids of parameters not counted, ``tied_head_copy``)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for unit in units:
        grads = [p.grad for p in unit.params if p.grad is not None and id(p) not in (skip or ())]
        if not grads:
            continue
        norms = torch._foreach_norm([_local(g) for g in grads], 2, dtype=torch.float64)
        for grad, norm in zip(grads, norms, strict=True):
            total += norm.square() / replicas(unit, grad)
    if dist.get_world_size() > 1:
        dist.all_reduce(total)
    return float(total.sqrt())
