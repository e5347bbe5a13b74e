"""Moving activations between two runs of layers whose (tp, dp) splits of a stage differ.

The redistribution cost/transition.py prices, as autograd functions. Ranks of a stage are numbered with tp innermost; under (tp, dp) rank r
holds the sequences of data-parallel block r // tp of a micro-batch (B / dp sequences),
replicated on the block's tp ranks. From a = (tp_a, dp_a) to b = (tp_b, dp_b):

- tp_b < tp_a: forward keeps its 1/k slice (k = tp_a / tp_b), backward all-gathers the input
  gradient from the k ranks that share r's a-block and r % tp_b;
- tp_b > tp_a: forward all-gathers the k = tp_b / tp_a consecutive a-blocks of r's b-block from
  the ranks sharing r % tp_a, backward keeps its slice of the (replicated) gradient.

Process groups are made once per (tp_a, tp_b) pair by every rank of the job, in one order, as
``torch.distributed.new_group`` requires (run/parallel/mesh.py makes them). run/parallel/segments.py
moves every activation (and the token ids and labels) between a chunk's segments through it.

With sequence parallelism (``redistribute_sequence``) a layer's hidden state is also split along
the sequence over its tp ranks: under (tp, dp) rank r holds the B / dp sequences of block
r // tp, positions slice r % tp of s / tp (a tp 1 layer holds whole sequences), B s h / D
elements on every rank whatever the split. Between tp's L < H (k = H / L) both layouts live
inside one H-block of ranks (the H layout's tp group), whose position p is tp rank c = p % L of
the L layout's block i = p // L. One ``all_to_all_single`` over that group moves them:

- L -> H: position (i, c) cuts its slice c into k sub-slices along the sequence and sends
  sub-slice j to position c k + j; position q receives the k blocks' sub-slices from positions
  i L + q // k and stacks them along the batch (its H-block's k B / dp_L sequences);
- H -> L, the inverse: position q cuts its sequences into k blocks and sends block i to position
  i L + q // k, which joins the k pieces along the sequence.

Each is the other's backward; every rank sends its whole buffer, B s h c / D bytes, each way.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class LayoutGroups:
    """The all-gather groups of every pair of tp degrees on one stage of ranks [first, first +
    devices); made lazily but collectively: call ``groups(low, high)`` on every rank of the job
    in the same order (before the first forward). With ``stages`` > 1 (pipeline stages of
    ``devices`` ranks each, stage s on ranks [s devices, (s + 1) devices)) every rank makes
    every stage's groups, as ``new_group`` requires, and keeps its own stage's."""

    def __init__(self, first: int, devices: int, stages: int = 1):
        self.first = first
        self.devices = devices
        self.stages = stages
        self._made: dict[tuple[int, int], dict[int, Any]] = {}
        self.tp_groups: dict[int, Any] = {}
        """tp degree -> this rank's tp group of that degree's layout (its H-block), for
        ``redistribute_sequence``; filled by run/parallel/mesh.py's ``build_mesh``."""

    def groups(self, low: int, high: int) -> dict[int, Any]:
        """Stage-local rank -> its group of k = high / low ranks (same high-block, same
        rank % low), for tp degrees ``low`` < ``high`` that nest."""
        if high % low or self.devices % high:
            raise ValueError(f"tp {low} and tp {high} do not nest on {self.devices} devices; "
                             "choose tp degrees where one divides the other and the stage")
        if (low, high) not in self._made:
            mine: dict[int, Any] = {}
            for stage in range(self.stages):
                base = stage * self.devices
                for block in range(self.devices // high):
                    for lane in range(low):
                        local = [block * high + q * low + lane for q in range(high // low)]
                        group = dist.new_group([base + r for r in local])
                        if base == self.first:
                            for r in local:
                                mine[r] = group
            self._made[low, high] = mine
        return self._made[low, high]


def _gather(x: torch.Tensor, group: Any, k: int) -> torch.Tensor:
    out = torch.empty((k * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp_a: int, tp_b: int, local: int,
                layouts: LayoutGroups) -> torch.Tensor:
        ctx.tp_a, ctx.tp_b, ctx.local, ctx.layouts = tp_a, tp_b, local, layouts
        if tp_b < tp_a:  # slice
            k = tp_a // tp_b
            return x.chunk(k, dim=0)[(local % tp_a) // tp_b].clone()
        k = tp_b // tp_a
        return _gather(x, layouts.groups(tp_a, tp_b)[local], k)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        tp_a, tp_b, local = ctx.tp_a, ctx.tp_b, ctx.local
        if tp_b < tp_a:  # gather the gradient of the whole a-block
            k = tp_a // tp_b
            return _gather(grad, ctx.layouts.groups(tp_b, tp_a)[local], k), None, None, None, None
        k = tp_b // tp_a
        return grad.chunk(k, dim=0)[(local % tp_b) // tp_a].clone(), None, None, None, None


def redistribute(x: torch.Tensor, tp_a: int, tp_b: int, layouts: LayoutGroups) -> torch.Tensor:
    """This rank's activation ``x`` (its a-block's sequences on dim 0) as layer b needs it."""
    if tp_a == tp_b:
        return x
    local = dist.get_rank() - layouts.first
    return _Redistribute.apply(x, tp_a, tp_b, local, layouts)


def _sequence_all_to_all(x: torch.Tensor, low: int, high: int, pos: int, group: Any,
                         up: bool) -> torch.Tensor:
    """One all-to-all of the module docstring over the H-block ``group`` (this rank at
    position ``pos``): L -> H when ``up``, else H -> L."""
    k = high // low
    if up:  # x: (n, s / L, ...) -> (k n, s / H, ...)
        pieces = list(x.chunk(k, dim=1))
        sources = [i * low + pos // k for i in range(k)]
        targets = [(pos % low) * k + j for j in range(k)]
        shape = (x.shape[0], x.shape[1] // k, *x.shape[2:])
    else:  # x: (k n, s / H, ...) -> (n, s / L, ...)
        pieces = list(x.chunk(k, dim=0))
        sources = [(pos % low) * k + j for j in range(k)]
        targets = [i * low + pos // k for i in range(k)]
        shape = (x.shape[0] // k, *x.shape[1:])
    numel = pieces[0].numel()
    send = torch.cat([piece.reshape(-1) for piece in pieces])  # targets ascend with the piece
    out = torch.empty(k * numel, dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, send, [numel if q in sources else 0 for q in range(high)],
                           [numel if q in targets else 0 for q in range(high)], group=group)
    received = out.view(k, *shape)  # by source, ascending
    if up:
        return received.reshape(k * shape[0], *shape[1:])
    return received.movedim(0, 1).reshape(shape[0], k * shape[1], *shape[2:])


class _RedistributeSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp_a: int, tp_b: int, local: int,
                layouts: LayoutGroups) -> torch.Tensor:
        low, high = sorted((tp_a, tp_b))
        group = layouts.tp_groups[high]
        ctx.args = (low, high, local % high, group, tp_b < tp_a)
        return _sequence_all_to_all(x, low, high, local % high, group, tp_b > tp_a)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _sequence_all_to_all(grad, *ctx.args), None, None, None, None


def redistribute_sequence(x: torch.Tensor, tp_a: int, tp_b: int,
                          layouts: LayoutGroups) -> torch.Tensor:
    """This rank's sequence-parallel hidden state ``x`` (its a-block's sequences on dim 0, its
    tp_a slice of positions on dim 1) as layer b needs it (module docstring)."""
    if tp_a == tp_b:
        return x
    high = max(tp_a, tp_b)
    if high % min(tp_a, tp_b) or x.shape[1] % (high // min(tp_a, tp_b)):
        raise ValueError(f"tp {tp_a} and tp {tp_b} do not nest, or the {x.shape[1]} positions "
                         "this rank holds do not split among them; choose tp's where one "
                         "divides the other and the sequence length")
    local = dist.get_rank() - layouts.first
    return _RedistributeSequence.apply(x, tp_a, tp_b, local, layouts)
