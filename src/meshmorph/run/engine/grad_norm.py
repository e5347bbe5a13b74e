"""The global gradient norm over every pipeline, data- and tensor-parallel shard, and clipping.

Gradients fall into placement classes by the mesh dims they are sharded over: none (whole on
every rank: DDP, replicated norms), ``dp`` (FSDP2 shards), ``tp`` (tensor-parallel splits) or
both. Each rank sums the squares of its local shards per class (float64), then one all-reduce
per mesh dim that shards anything sums the classes sharded over that dim, and one over ``pp``
sums the stages: at most three collectives of a 4-element vector per step, however many
parameters there are. A class replicated over a dim is not summed over it (every replica holds
the same value), so every element is counted once and every rank gets the one-device norm.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

from meshmorph.run.parallel.mesh import TrainMesh

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


def global_grad_norm(grads: Iterable[torch.Tensor], mesh: TrainMesh | None) -> float:
    """L2 norm of the whole model's gradient; ``mesh`` None for one process."""
    sums, present = local_sums_of_squares(grads)
    if mesh is None or dist.get_world_size() == 1:
        return float(sums.sum().sqrt())
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
    return float(total.sqrt())


def clip_grads_(grads: Iterable[torch.Tensor], norm: float, max_norm: float) -> None:
    """Scale gradients so their global norm is at most ``max_norm`` (torch's clip_grad_norm_ rule:
    coef = max_norm / (norm + 1e-6), capped at 1)."""
    coef = max_norm / (norm + 1e-6)
    if max_norm <= 0 or coef >= 1.0:
        return
    torch._foreach_mul_([_storage(g) for g in grads], coef)  # scaling is linear: Partial too


def _storage(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad
