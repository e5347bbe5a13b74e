"""Gradients between the backward and the norm: the reductions torch's wrappers do not make, each
gradient laid out as its parameter, and the two copies of a tied embedding summed.

Reductions after the backward (``all_reduce_grads_``): a chunk that DDP runs with
``overlap_grad_reduce`` off (each gradient averaged over the dp group, in the plan's
``reduce_dtype``, as DDP's reducer would), and every ZeRO 0/1 segment of a plan whose layers'
strategies differ (its gradients summed over its dp group, packed in one buffer).

Split-backward pipelines (zb, zbv, dualpipev): torch pipelining splits each micro-batch's
backward into the input-gradient pass (I) and a later weight-gradient pass (W). It defers FSDP2's
reduction only for a stage module that is itself an ``FSDPModule``; an FSDP2 unit below a plain
stage module (a ZeRO-2 layer of a per-layer segment) fires its post-backward hook when the
gradient reaches its input, in the I pass, before the W pass has written the weight gradients.
So for the step every such unit accumulates without reducing (``hold_reduction``), and after the
schedule ``reduce_held`` runs each unit's post-backward once with its reduce-scatter on, as
torch's own ``perform_reduce_grad`` does for a stage module: one reduce-scatter per unit and step.
The gathered parameters stay registered from the first forward to the step's end (ZeRO-2), so
the W pass finds the parameters the I pass recorded. ZeRO-3 units are refused under these
schedules (spec/runnable.split_backward_refusal).

Tied embedding on two pipeline ranks (``TiedCopies``): the first rank's embedding and the last
rank's head each hold a copy, built from the same seed; after the reductions their gradients are
summed over each pair of ranks holding the same shard (both on rank 0 under a V), so both copies
step alike, and the head's copy is left out of the norm.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from meshmorph.run.model.decoder import Transformer
from meshmorph.run.parallel.mesh import TrainMesh
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's storage of ``tensor`` (a DTensor's local shard)."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor  # type: ignore[attr-defined]


def all_reduce_grads_(groups: Iterable[list[nn.Parameter]], group: dist.ProcessGroup,
                      dtype: torch.dtype, divide: int = 1) -> None:
    """All-reduce each list's local gradients over ``group`` in ``dtype`` (packed into one buffer
    per list; a lone contiguous gradient of that dtype in place), divided by ``divide`` first;
    the gradients keep their storage."""
    pending = []
    for params in groups:
        grads = [local(p.grad) for p in params if p.grad is not None]  # type: ignore[arg-type]
        if not grads:
            continue
        own = len(grads) == 1 and grads[0].is_contiguous()
        flat = grads[0].view(-1) if own else torch.cat([g.reshape(-1) for g in grads])
        wire = flat.to(dtype)  # flat itself where the dtype agrees
        if divide != 1:
            wire.div_(divide)
        work = dist.all_reduce(wire, group=group, async_op=True)
        pending.append((work, grads, wire if not (own and wire is flat) else None))
    for work, grads, wire in pending:
        work.wait()
        if wire is None:  # reduced in place
            continue
        offset = 0
        for grad in grads:
            grad.copy_(wire[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def align_grads_(params: Iterable[nn.Parameter]) -> None:
    """Give every DTensor gradient its parameter's placements (tensor parallelism can leave a
    gradient Partial or Replicate where the parameter is sharded)."""
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(param.device_mesh, param.placements)


def hold_reduction(modules: Iterable[FSDPModule]) -> None:
    """Accumulate gradients on the gathered parameters over the step, no reduction (ZeRO-2)."""
    for module in modules:
        module.set_is_last_backward(False)
        module.set_reshard_after_backward(False)
        module.set_requires_gradient_sync(False)


def reduce_held(modules: Iterable[FSDPModule]) -> None:
    """Reduce-scatter every unit's accumulated gradients once over its dp group (after the last
    weight-gradient pass); the gathered parameters stay to the step's end."""
    for module in modules:
        module.set_is_last_backward(True)
        module.set_requires_gradient_sync(True)
        state = fully_shard.state(module)  # type: ignore[attr-defined]
        for inner in state._state_ctx.all_states:
            for group in inner._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()


class TiedCopies:
    """The two copies of a tied embedding on a pipeline's first and last ranks (module
    docstring); does nothing for a model that ties none, or at pp 1 (one parameter).
    Collective at construction: every rank makes every pair's group, in the same order."""

    def __init__(self, spec: ModelSpec, plan: Plan, parts: list[Transformer],
                 mesh: TrainMesh) -> None:
        tied = spec.tied_embeddings and plan.pp > 1
        self.params = [weight for part in parts if tied for weight in (
            part.embed.tok.weight if part.embed is not None else None,
            part.head.out.weight if part.head is not None else None) if weight is not None]
        """This rank's copies: the embedding's and/or the head's."""
        self.head_copies = {id(part.head.out.weight) for part in parts
                            if tied and part.head is not None and part.embed is None}
        """ids of the head's copies, which the norm leaves out (the embedding counts them)."""
        self.local = tied and plan.pp_rank_of_chunk(plan.num_chunks - 1) == 0
        """Both copies on this rank (rank 0 of a V holds the embedding's and the head's chunk)."""
        self.group: dist.ProcessGroup | None = None
        """The pair of ranks holding this rank's shard of both copies."""
        if tied and not self.local:
            self.group = mesh.group("pp") if plan.pp == 2 else self._make_group(plan)

    @staticmethod
    def _make_group(plan: Plan) -> dist.ProcessGroup | None:
        mine = None
        for dp_rank in range(plan.dp):  # every rank creates every group, in the same order
            for tp_rank in range(plan.tp):
                ranks = [plan.rank_of(0, dp_rank, tp_rank),
                         plan.rank_of(plan.pp - 1, dp_rank, tp_rank)]
                group = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    mine = group
        return mine

    def sum_grads_(self) -> None:
        """Give both copies the sum of their gradients (laid out as their parameters)."""
        grads = [local(p.grad) for p in self.params if p.grad is not None]
        if not grads or (self.local and len(grads) != 2) or \
                (not self.local and self.group is None):
            return
        total = grads[0] + grads[1] if len(grads) == 2 else grads[0].clone()
        if not self.local:
            dist.all_reduce(total, group=self.group)
        for grad in grads:
            grad.copy_(total)
