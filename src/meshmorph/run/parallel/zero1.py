"""ZeRO-1 of a layerwise plan's layers: AdamW whose moments live on this rank's dim-0 shard of
every parameter. (A uniform chunk's ZeRO-1 runs on FSDP2 instead, run/parallel/parallelize.py.)

The layerwise engine keeps a ZeRO-1 layer's parameters and gradients whole on every
data-parallel rank (its summed gradient all-reduce makes them so, and a tied embedding and head
in one chunk stay one parameter, which FSDP2 cannot shard for two layers run apart); each rank
updates only its dim-0 shard of every parameter — a view of the local parameter tensor, whose
gradient is the matching view of the all-reduced gradient (no copy) — with torch's own AdamW
arithmetic (``torch.optim.adamw.adamw``), then the updated shards are
all-gathered back into the whole parameters in buckets: each rank packs its padded shards of a
bucket's parameters into one flat buffer and one ``all_gather_into_tensor`` per bucket brings
everyone's (Megatron's distributed optimizer gathers its parameter buckets the same way). The
bytes moved are the padded shards', as with one gather per parameter; the messages are few.

Shards follow DTensor's ``Shard(0)`` rule (``torch.chunk``): ``ceil(n / d)`` rows per rank, the
last ranks hold fewer or none. The optimizer's ``param_groups`` hold the model's own parameters,
so ``torch.distributed.checkpoint``'s optimizer state dict names them as usual; the moments are
DTensors over the data-parallel (and tensor-parallel) mesh with the parameter's global shape,
placed as FSDP2 places its sharded parameters (``_StridedShard`` where tensor parallelism
already splits dim 0), so a checkpoint reshards to any layout.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.optim.adamw import adamw


def shard_bounds(rows: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """Rows [start, stop) of dim 0 that rank ``dp_rank`` of ``dp`` owns (DTensor's Shard(0))."""
    size = math.ceil(rows / dp) if rows else 0
    start = min(dp_rank * size, rows)
    return start, min(start + size, rows)


BUCKET_NUMEL = 16 * 2**20
"""Elements of padded shards packed into one all-gather (64 MiB of fp32 sent by each rank)."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor  # type: ignore[attr-defined]


class ShardedAdamW(torch.optim.Optimizer):
    """AdamW over dim-0 shards of whole parameters, all-gathered after every step (ZeRO-1)."""

    def __init__(self, params: list[nn.Parameter], *, dp_mesh: DeviceMesh,
                 dp_tp_mesh: DeviceMesh | None, lr: float, betas: tuple[float, float],
                 eps: float, weight_decay: float, foreach: bool, fused: bool) -> None:
        # torch's AdamW param-group keys (amsgrad, maximize, ...), so checkpoints of either
        # optimizer load into the other
        defaults = torch.optim.AdamW([torch.zeros(1)], lr=lr, betas=betas, eps=eps,
                                     weight_decay=weight_decay, foreach=foreach and not fused,
                                     fused=fused or None).defaults
        super().__init__(params, dict(defaults))
        self.dp_mesh = dp_mesh
        self.dp_tp_mesh = dp_tp_mesh
        self.dp, self.dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
        self.foreach, self.fused = foreach, fused

    # --- the moments: DTensors with the parameter's global shape --------------------------------
    def _moment_spec(self, param: torch.Tensor) -> tuple[DeviceMesh, list[Placement]]:
        """Mesh and placements of a moment: the parameter's, with dim 0 split over dp."""
        if not isinstance(param, DTensor):
            return self.dp_mesh, [Shard(0)]
        names = param.device_mesh.mesh_dim_names or ()
        if "dp" in names:  # FSDP2 replicate made it a (dp, tp) DTensor, Replicate on dp
            mesh, placements, dp_dim = param.device_mesh, list(param.placements), names.index("dp")
        else:  # tensor parallel only: add the dp dim in front
            if self.dp_tp_mesh is None:
                raise ValueError("ShardedAdamW needs dp_tp_mesh for DTensor parameters on the tp mesh")
            mesh, placements, dp_dim = self.dp_tp_mesh, [Shard(0), *param.placements], 0
        # tensor parallelism that also splits dim 0 is interleaved inside each dp shard
        split = 1
        for j in range(dp_dim + 1, mesh.ndim):
            if isinstance(placements[j], Shard | _StridedShard) and placements[j].dim == 0:
                split *= mesh.size(j)
        placements[dp_dim] = _StridedShard(0, split_factor=split) if split > 1 else Shard(0)
        return mesh, placements

    def _init_state(self, param: torch.Tensor, shard: torch.Tensor) -> dict[str, Any]:
        mesh, placements = self._moment_spec(param)

        def moment() -> DTensor:
            return DTensor.from_local(torch.zeros_like(shard), mesh, placements,
                                      shape=param.shape, stride=param.stride(), run_check=False)

        return {"step": torch.tensor(0.0), "exp_avg": moment(), "exp_avg_sq": moment()}

    def _shard(self, tensor: torch.Tensor) -> torch.Tensor:
        local = _local(tensor)
        start, stop = shard_bounds(local.shape[0], self.dp, self.dp_rank)
        return local[start:stop]  # a view: the update lands in the parameter itself

    # --- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            owners, params, grads, avgs, sqs, steps = [], [], [], [], [], []
            for param in group["params"]:
                if param.grad is None:
                    continue
                shard = self._shard(param)
                state = self.state[param]
                if not state:
                    state.update(self._init_state(param, shard))
                owners.append(param)
                params.append(shard)
                grads.append(self._shard(param.grad))
                avgs.append(_local(state["exp_avg"]))
                sqs.append(_local(state["exp_avg_sq"]))
                steps.append(state["step"])
            if not owners:
                continue
            beta1, beta2 = group["betas"]
            adamw(params, grads, avgs, sqs, [], steps, foreach=self.foreach and not self.fused,
                  fused=self.fused or None, amsgrad=False, beta1=beta1, beta2=beta2,
                  lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                  maximize=False)
            self._gather_all_([_local(param) for param in owners])
        return loss

    def _gather_all_(self, locals_: list[torch.Tensor]) -> None:
        """All-gather every rank's updated dim-0 shards into the whole local parameters, one
        collective per bucket of about ``BUCKET_NUMEL`` elements of one dtype."""
        if self.dp == 1:
            return
        bucket: list[torch.Tensor] = []
        filled = 0
        for local in locals_:
            size = self._padded_shard_numel(local)
            if bucket and (filled + size > BUCKET_NUMEL or local.dtype != bucket[0].dtype):
                self._gather_bucket_(bucket)
                bucket, filled = [], 0
            bucket.append(local)
            filled += size
        if bucket:
            self._gather_bucket_(bucket)

    def _padded_shard_numel(self, local: torch.Tensor) -> int:
        rows = local.shape[0] if local.dim() else 1
        return math.ceil(rows / self.dp) * (local.numel() // max(rows, 1))

    def _gather_bucket_(self, bucket: list[torch.Tensor]) -> None:
        sizes = [self._padded_shard_numel(local) for local in bucket]
        total = sum(sizes)
        mine = torch.zeros(total, dtype=bucket[0].dtype, device=bucket[0].device)
        offset = 0
        for local, size in zip(bucket, sizes, strict=True):
            rows = local.view(local.shape[0] if local.dim() else 1, -1)
            start, stop = shard_bounds(rows.shape[0], self.dp, self.dp_rank)
            mine[offset:offset + (stop - start) * rows.shape[1]] = rows[start:stop].reshape(-1)
            offset += size
        everyone = torch.empty(self.dp * total, dtype=mine.dtype, device=mine.device)
        dist.all_gather_into_tensor(everyone, mine, group=self.dp_mesh.get_group())
        for rank in range(self.dp):
            offset = rank * total
            for local, size in zip(bucket, sizes, strict=True):
                rows = local.view(local.shape[0] if local.dim() else 1, -1)
                start, stop = shard_bounds(rows.shape[0], self.dp, rank)
                count = (stop - start) * rows.shape[1]
                rows[start:stop] = everyone[offset:offset + count].view(stop - start, rows.shape[1])
                offset += size
