"""Pipeline stages and schedules from ``torch.distributed.pipelining``.

Chunk ``c`` of ``plan.stages`` runs on pipeline rank ``c % pp`` (Megatron's interleaved order).
Schedules:

- ``gpipe``: ScheduleGPipe; ``1f1b``: Schedule1F1B (needs m >= pp);
- ``interleaved``: ScheduleInterleaved1F1B over the ``vpp`` chunks each rank holds;
- ``zb``: ScheduleInterleavedZeroBubble (ZB-H1, Qi et al. 2023) with one chunk per rank. It splits
  each backward into the input-gradient part (B), which the previous stage waits for, and the
  weight-gradient part (W), which fills the bubble. ZBVZeroBubble is not used: it needs two
  chunks per rank in a V order, while a Plan's chunks go round-robin.

Stage shapes are given up front (no shape-inference round trip): a chunk with the embedding takes
tokens [b, s]; other chunks take the hidden state [b, s/t or s, h] (sliced by sequence under
sequence parallelism); the last chunk returns logits [b, s, V].
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.pipelining.schedules import _PipelineSchedule

from meshmorph.run.mesh import TrainMesh
from meshmorph.run.parallelize import TORCH_DTYPES, uses_fsdp_precision
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan, Schedule


def io_dtypes(plan: Plan) -> tuple[torch.dtype, torch.dtype]:
    """(hidden state, logits) dtypes between stages: fp32 plans send fp32; under autocast the
    residual stream stays fp32 and the head's logits come out 16-bit; under FSDP2's mixed
    precision (zero 2/3) the whole chunk computes in the 16-bit dtype."""
    if plan.dtype == "fp32":
        return torch.float32, torch.float32
    compute = TORCH_DTYPES[plan.dtype]
    return (compute if uses_fsdp_precision(plan) else torch.float32), compute


def _io_shapes(chunk_index: int, plan: Plan, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Meta tensors of one micro-batch's input and output of a chunk (dtypes: ``io_dtypes``)."""
    b, s, h = plan.micro_batch, plan.seq_len, spec.hidden_size
    local_s = s // plan.tp if plan.sequence_parallel else s
    hidden_dtype, logits_dtype = io_dtypes(plan)
    # requires_grad marks the tensors whose gradients travel back between stages
    hidden = torch.empty(b, local_s, h, dtype=hidden_dtype, device="meta", requires_grad=True)
    first, last = chunk_index == 0, chunk_index == plan.num_chunks - 1
    inputs = torch.empty(b, s, dtype=torch.long, device="meta") if first else hidden
    outputs = torch.empty(b, s, spec.vocab_size, dtype=logits_dtype, device="meta",
                          requires_grad=True) \
        if last else hidden
    return inputs, outputs


def build_schedule(chunks: list[nn.Module], chunk_ids: list[int], spec: ModelSpec, plan: Plan,
                   mesh: TrainMesh, device: torch.device,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                   ) -> _PipelineSchedule:
    """The schedule that runs this rank's ``chunks`` (model chunks ``chunk_ids``) each step.

    ``loss_fn`` returns a micro-batch's mean loss; the schedule divides gradients by the number of
    micro-batches, so the accumulated gradient is that of the mean over the step's micro-batches."""
    group = mesh.group("pp")
    stages = []
    for chunk, index in zip(chunks, chunk_ids, strict=True):
        inputs, outputs = _io_shapes(index, plan, spec)
        stages.append(PipelineStage(chunk, index, plan.num_chunks, device, input_args=inputs,
                                    output_args=outputs, group=group))
    m = plan.num_microbatches
    if plan.schedule == Schedule.GPIPE:
        return ScheduleGPipe(stages[0], m, loss_fn=loss_fn)
    if plan.schedule == Schedule.ONE_F_ONE_B:
        return Schedule1F1B(stages[0], m, loss_fn=loss_fn)
    if plan.schedule == Schedule.INTERLEAVED:
        return ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)
    if plan.schedule == Schedule.ZERO_BUBBLE:
        return ScheduleInterleavedZeroBubble(stages, m, loss_fn=loss_fn)
    raise ValueError(f"unknown pipeline schedule {plan.schedule!r}; use gpipe, 1f1b, "
                     "interleaved or zb")
