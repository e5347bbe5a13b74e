"""The global gradient norm over every pipeline, data- and tensor-parallel shard, and clipping.

Every figure stays on the device: the norm is a float64 tensor, and clipping scales the
gradients by a clamped tensor coefficient, as ``torch.nn.utils.clip_grad_norm_`` does, so a step
reads nothing back to the host until its metrics (run/engine/train_engine.py: the loss and the
norm together, once).

A uniform plan's gradients all live on the plan's mesh and fall into placement classes by the
mesh dims they are sharded over: none (whole on every rank: DDP, replicated norms), ``dp``
(FSDP2 shards), ``tp`` (tensor-parallel splits) or both. Each rank sums the squares of its local
shards per class (float64), then one all-reduce per mesh dim that shards anything sums the
classes sharded over that dim, and one over ``pp`` sums the stages: at most three collectives
of a 4-element vector per step, however many parameters there are. A class replicated over a dim
is not summed over it (every replica holds the same value), so every element is counted once
and every rank gets the one-device norm (what cost/rank_state.py prices).

A plan whose layers' strategies differ has gradients on several meshes. There a local gradient
is held by ``replicas`` ranks of its stage: its segment's dp for a ZeRO 0/1 segment (every dp
rank holds the same reduced gradient) times the tp degree for a tensor the segment's tp does not
split, 1 for FSDP2's shards. Every rank sums ``||local||^2 / replicas`` in float64 and one
all-reduce of that scalar over the job gives every element once (what cost/rank_state.py
prices).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

from meshmorph.run.parallel.mesh import TrainMesh
from meshmorph.run.parallel.segments import Segment

SHARD_DIMS = ("dp", "tp")
"""Mesh dims a gradient can be sharded over; pipeline stages hold different layers instead."""
CLASSES = ((), ("dp",), ("tp",), ("dp", "tp"))
"""Placement classes: the dims a gradient is sharded over, in a fixed order on every rank."""


def placement_class(grad: torch.Tensor) -> tuple[str, ...]:
    """The mesh dims ``grad`` is sharded over (Shard or _StridedShard), in CLASSES' order."""
    if not isinstance(grad, DTensor):
        return ()
    names = grad.device_mesh.mesh_dim_names or ()
    sharded = {n for n, p in zip(names, grad.placements, strict=True)
               if not p.is_replicate() and not p.is_partial()}
    unknown = sharded - set(SHARD_DIMS)
    if unknown:
        raise ValueError(f"gradient sharded over mesh dims {sorted(unknown)}; the norm knows "
                         f"only {SHARD_DIMS} (name the mesh dims as run.mesh does)")
    return tuple(d for d in SHARD_DIMS if d in sharded)


def _local(grad: torch.Tensor) -> torch.Tensor:
    if not isinstance(grad, DTensor):
        return grad
    if any(isinstance(p, Partial) for p in grad.placements):
        # pending sums must be reduced before squaring: ||a + b||^2 != ||a||^2 + ||b||^2; the
        # engine aligns gradients to their parameters' placements first, so this is the rare path
        grad = grad.redistribute(
            placements=[Replicate() if isinstance(p, Partial) else p for p in grad.placements]
        )
    return grad.to_local()


def local_sums_of_squares(grads: Iterable[torch.Tensor]) -> tuple[torch.Tensor, set[int]]:
    """float64 [len(CLASSES)]: this rank's sum of squared local gradient elements per class, and
    the indexes of the classes it holds any gradient of."""
    by_class: dict[int, list[torch.Tensor]] = {}
    device = torch.device("cpu")
    for grad in grads:
        local = _local(grad).detach()
        device = local.device
        by_class.setdefault(CLASSES.index(placement_class(grad)), []).append(local)
    sums = torch.zeros(len(CLASSES), dtype=torch.float64, device=device)
    for index, tensors in by_class.items():
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float64)  # one fused pass per class
        sums[index] = torch.stack(norms).square().sum()
    return sums, set(by_class)


def _plan_mesh_norm(grads: Iterable[torch.Tensor], mesh: TrainMesh | None) -> torch.Tensor:
    """The norm of gradients that all live on the plan's mesh (module docstring)."""
    sums, present = local_sums_of_squares(grads)
    if mesh is None or dist.get_world_size() == 1:
        return sums.sum().sqrt()
    sums = sums.to(mesh.mesh.device_type)
    sizes = {"dp": mesh.dp, "tp": mesh.tp}
    for dim in SHARD_DIMS:
        on_dim = [dim in c for c in CLASSES]
        # the members of a dim's group hold the same layers and placements: all of them (or
        # none) take this branch
        if sizes[dim] > 1 and any(on_dim[i] for i in present):
            mask = torch.tensor(on_dim, device=sums.device)
            part = torch.where(mask, sums, torch.zeros_like(sums))
            dist.all_reduce(part, group=mesh.group(dim))  # sum the shards over this dim
            sums = torch.where(mask, part, sums)
    total = sums.sum()
    if mesh.pp > 1:
        dist.all_reduce(total, group=mesh.group("pp"))  # each stage holds other layers
    return total.sqrt()


def global_grad_norm(grads: Iterable[torch.Tensor], mesh: TrainMesh | None) -> float:
    """L2 norm of the whole model's gradient, on the host; ``mesh`` None for one process."""
    return float(_plan_mesh_norm(grads, mesh))


def replicas(segment: Segment, grad: torch.Tensor) -> int:
    """How many ranks of the stage hold the same local ``grad`` of ``segment``'s parameter."""
    count = 1 if segment.fsdp else segment.strategy.dp
    if isinstance(grad, DTensor):
        if any(isinstance(p, Partial) for p in grad.placements):
            raise ValueError("a Partial gradient reached the norm; align gradients to their "
                             "parameters' placements first")
        count *= math.prod(grad.device_mesh.size(i) for i, p in enumerate(grad.placements)
                           if p.is_replicate())
    return count


def _job_norm(segments: list[Segment], skip: set[int], device: torch.device) -> torch.Tensor:
    """The norm of gradients on several meshes: one scalar over the job (module docstring)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for segment in segments:
        grads = [p.grad for p in segment.params if p.grad is not None and id(p) not in skip]
        if not grads:
            continue
        norms = torch._foreach_norm([_storage(g) for g in grads], 2, dtype=torch.float64)
        for grad, norm in zip(grads, norms, strict=True):
            total += norm.square() / replicas(segment, grad)
    if dist.get_world_size() > 1:
        dist.all_reduce(total)
    return total.sqrt()


def grad_norm(segments: list[Segment], mesh: TrainMesh, skip: set[int],
              device: torch.device) -> torch.Tensor:
    """The global L2 norm of the job's gradients, a float64 tensor on ``device``, identical on
    every rank: every stage's segments once, ``skip`` (ids of parameters another one counts)
    left out."""
    if any(segment.per_layer for segment in segments):
        return _job_norm(segments, skip, device)
    return _plan_mesh_norm([p.grad for segment in segments for p in segment.params
                            if p.grad is not None and id(p) not in skip], mesh)


def clip_grads_(grads: Iterable[torch.Tensor], norm: float | torch.Tensor,
                max_norm: float) -> None:
    """Scale gradients so their global norm is at most ``max_norm`` (torch's clip_grad_norm_ rule:
    coef = max_norm / (norm + 1e-6), capped at 1). A tensor ``norm`` stays on its device: the
    gradients are multiplied by the clamped coefficient, 1 where no clipping is needed."""
    coef = max_norm / (norm + 1e-6)
    if max_norm <= 0 or (not isinstance(coef, torch.Tensor) and coef >= 1.0):
        return
    storages = [_storage(g) for g in grads]  # scaling is linear: Partial too
    if isinstance(coef, torch.Tensor) and storages:  # the kernel rounds it to their dtype
        coef = torch.clamp(coef, max=1.0).to(storages[0].dtype)
    if storages:
        torch._foreach_mul_(storages, coef)


def _storage(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad
