"""The training loss: mean token cross-entropy, over whole logits or over vocabulary shards.

Whole logits (``_RowChunkedCrossEntropy``): the log-softmax runs in fp32 over blocks of rows, the
upcast inside ``log_softmax(dtype=float32)``, so the only fp32 tensor over every logit is the
log-probabilities kept for backward: no fp32 copy of the whole [b s, V] logits beside them, and
a padded vocabulary's head (a strided slice of its [b, s, V_padded] product) is copied one
block at a time, never whole. The backward runs nll_loss's and log_softmax's own backward
kernels per block and writes into one gradient in the logits' dtype, so the loss and every
gradient are bitwise what ``F.cross_entropy(logits.float())`` gives.

A vocabulary-parallel head (tensor parallelism with the vocabulary split, run/parallel/parallelize.py)
hands back its logits as a DTensor sharded on the vocabulary: torch's ``loss_parallel`` takes the
cross-entropy over the shards (a max, a sum of exponentials and the target logits reduced over
the tp ranks: ``b s`` floats each instead of gathering ``b s V`` logits). Both the forward and
the backward of the loss must run inside ``loss_parallel``: ``token_cross_entropy`` does both
in one autograd function and returns a plain scalar, so callers (the engine's gradient
accumulation, torch's pipeline schedules) treat it as any other loss.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import loss_parallel


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token of a micro-batch: logits [b, s, V], labels [b, s].

    All micro-batches hold the same number of tokens, so the mean of micro-batch means (over
    micro-batches and data-parallel ranks) is the mean over the global batch. Logits sharded on
    the vocabulary (a DTensor) go through ``loss_parallel``."""
    if isinstance(logits, DTensor):
        return _VocabParallelCrossEntropy.apply(logits, labels)
    return _RowChunkedCrossEntropy.apply(logits.flatten(0, 1), labels.flatten())


CHUNK_FP32_BYTES = 256 * 2**20
"""Most bytes of fp32 log-probabilities the loss holds at once (a block of rows)."""


def _row_blocks(logits: torch.Tensor) -> Iterator[slice]:
    """The row blocks of ``logits`` [N, V], ``CHUNK_FP32_BYTES`` of fp32 each."""
    rows = max(1, CHUNK_FP32_BYTES // (4 * logits.shape[1]))
    return (slice(start, start + rows) for start in range(0, logits.shape[0], rows))


class _RowChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits [N, V] (any dtype and strides) against labels [N], with the
    log-softmax in fp32 block by block (module docstring)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        picked = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        blocks = list(_row_blocks(logits))
        logps = []
        for block in blocks:
            logps.append(F.log_softmax(logits[block], dim=-1, dtype=torch.float32))
            picked[block] = logps[-1].gather(1, labels[block, None])[:, 0]
        ctx.save_for_backward(labels, *logps)
        ctx.blocks, ctx.shape, ctx.dtype = blocks, logits.shape, logits.dtype
        # nll_loss's own mean over the picked log-probabilities: its summation, its rounding
        return F.nll_loss(picked[:, None], torch.zeros_like(labels))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        labels, *logps = ctx.saved_tensors
        total = torch.tensor(float(ctx.shape[0]), device=grad.device)  # nll's mean weight
        out = torch.empty(ctx.shape, dtype=ctx.dtype, device=grad.device)
        for block, logp in zip(ctx.blocks, logps, strict=True):
            dlogp = torch.ops.aten.nll_loss_backward(grad, logp, labels[block], None, 1, -100,
                                                     total)  # mean reduction, no ignore index
            if ctx.dtype == torch.float32:  # straight into the gradient
                torch._log_softmax_backward_data(dlogp, logp, -1, torch.float32, out=out[block])
            else:  # the fp32 gradient rounded to the logits' dtype, as .float()'s backward does
                out[block] = torch._log_softmax_backward_data(dlogp, logp, -1, torch.float32)
        return out, None


def mask_padded_vocab(logits: DTensor, vocab_size: int) -> DTensor:
    """Vocabulary-sharded logits of a padded head with the pad columns (>= ``vocab_size``) at the
    dtype's lowest value: their softmax weight and gradient are exactly 0, so the loss and every
    gradient are those of the unpadded model (the sharded counterpart of slicing them off)."""
    local = logits.to_local()
    placement = logits.placements[-1]
    rank = logits.device_mesh.get_local_rank(logits.device_mesh.ndim - 1)
    width = local.shape[-1]
    # even shards: padded_vocab_size is a multiple of tp
    first = rank * width if placement.is_shard() else 0
    if first + width <= vocab_size:
        return logits
    column = torch.arange(first, first + width, device=local.device)
    local = local.masked_fill(column >= vocab_size, torch.finfo(local.dtype).min)
    return DTensor.from_local(local, logits.device_mesh, logits.placements,
                              shape=logits.shape, stride=logits.stride(), run_check=False)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """``F.cross_entropy`` of vocabulary-sharded logits under ``loss_parallel``, forward and
    backward, returning the mean loss as a plain (replicated) tensor."""

    @staticmethod
    def forward(ctx: Any, logits: DTensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad(), loss_parallel():
            leaf = logits.detach().requires_grad_(True)
            loss = F.cross_entropy(leaf.flatten(0, 1).float(), labels.flatten())
        ctx.leaf, ctx.loss = leaf, loss
        return loss.to_local().detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        loss: DTensor = ctx.loss
        grad_loss = DTensor.from_local(grad, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim,
                                       run_check=False)
        with loss_parallel():
            (grad_logits,) = torch.autograd.grad(loss, ctx.leaf, grad_loss)
        ctx.leaf = ctx.loss = None
        return grad_logits, None
