"""The global gradient norm over every pipeline, data- and tensor-parallel shard, and clipping.

Each element of the model's gradient is counted exactly once: a rank adds the squares of its
local gradient shard only where it is the first holder of that shard (coordinate 0 on every
mesh dim the tensor is replicated over), and one all-reduce over the whole job sums them.
The result is the norm one device would compute, on every rank, from a single collective.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

from meshmorph.run.mesh import TrainMesh


def _owns(grad: torch.Tensor, mesh: TrainMesh | None) -> bool:
    """Whether this rank's copy of ``grad``'s local shard is the one that counts."""
    if mesh is None:
        return True
    coords = {"dp": mesh.dp_rank, "tp": mesh.tp_rank}
    sharded_on: set[str] = set()
    if isinstance(grad, DTensor):
        names = grad.device_mesh.mesh_dim_names or ()
        sharded_on = {n for n, p in zip(names, grad.placements, strict=True)
                      if not p.is_replicate() and not p.is_partial()}  # Shard or _StridedShard
    # replicated over every other data/tensor-parallel dim: only coordinate 0 counts
    return all(coords[name] == 0 for name in coords if name not in sharded_on)


def _local(grad: torch.Tensor) -> torch.Tensor:
    if not isinstance(grad, DTensor):
        return grad
    if any(isinstance(p, Partial) for p in grad.placements):
        # pending sums must be reduced before squaring: ||a + b||^2 != ||a||^2 + ||b||^2
        grad = grad.redistribute(
            placements=[Replicate() if isinstance(p, Partial) else p for p in grad.placements]
        )
    return grad.to_local()


def global_grad_norm(grads: Iterable[torch.Tensor], mesh: TrainMesh | None) -> float:
    """L2 norm of the whole model's gradient; ``mesh`` None for one process."""
    total = torch.zeros((), dtype=torch.float64)
    for grad in grads:
        local = _local(grad)  # collective for Partial grads: every rank must reach it
        if _owns(grad, mesh):
            total += local.detach().double().pow(2).sum().cpu()  # sum of squares
    if mesh is not None and dist.get_world_size() > 1:
        device = mesh.mesh.device_type
        total = total.to(device)
        dist.all_reduce(total)  # one sum over pp, dp and tp
    return float(total.sqrt())


def clip_grads_(grads: Iterable[torch.Tensor], norm: float, max_norm: float) -> None:
    """Scale gradients so their global norm is at most ``max_norm`` (torch's clip_grad_norm_ rule:
    coef = max_norm / (norm + 1e-6), capped at 1)."""
    coef = max_norm / (norm + 1e-6)
    if max_norm <= 0 or coef >= 1.0:
        return
    for grad in grads:
        grad.mul_(coef)
