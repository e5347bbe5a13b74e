"""What one rank holds and sends for its parameters, by ZeRO stage, as meshmorph's runtime
realises the stages with torch's own pieces (see docs/cost-model.md, "State and traffic").

Precision: every plan keeps fp32 master parameters, fp32 gradients and fp32 Adam moments; a
16-bit plan computes in bf16/fp16 (FSDP2 ``MixedPrecisionPolicy(param_dtype=16-bit,
reduce_dtype=fp32)``, autocast where FSDP is not used), so gradients are reduced in fp32 and
ZeRO parameter gathers move 16-bit copies.

| ZeRO | realised as | params | grads | optimizer | traffic per step |
| --- | --- | --- | --- | --- | --- |
| 0 | DDP (or FSDP2 ``replicate``) | 4 | 4 | 8 | all-reduce of fp32 gradients |
| 1 | ZeRO-0's gradient all-reduce, AdamW on a dim-0 shard of every parameter (DTensor) | 4 | 4 | 8/d | all-reduce of gradients, all-gather of updated fp32 shards |
| 2 | FSDP2, parameters gathered once per step and kept to its end | 4/d + c | 4/d | 8/d | all-gather (c) once, reduce-scatter (fp32) per micro-batch |
| 3 | FSDP2 per block, resharded after forward and after backward | 4/d | 4/d | 8/d | all-gather (c) twice and reduce-scatter once per micro-batch |

(bytes per parameter of the rank's tensor-parallel chunk, at the end of backward before the
optimizer step; d = dp, c = bytes of the compute dtype). Under pipeline parallelism torch's
pipelining runs every FSDP2 chunk without gradient sync between micro-batches and without
resharding after backward, then reduce-scatters once (``perform_reduce_grad``): ZeRO-2 and 3 then
hold unsharded parameters and whole fp32 gradients at their peak and reduce once per step, and
their end-of-backward state is ZeRO-3's. ZeRO-3 then gathers m + 1 times per step, not 2m (a
block gathered for a backward stays gathered into the next forward).

Measured per rank against cost/rank_state.py (which adds dim-0 padding, tensor-parallel and
pipeline activations) by ``tests/dist/test_state_line.py``; docs/cost-model.md, "State and traffic".
"""

from __future__ import annotations

from dataclasses import dataclass

MASTER_BYTES = 4.0
"""fp32 master parameter."""
GRAD_BYTES = 4.0
"""fp32 gradient (reduced in fp32)."""
ADAM_BYTES = 8.0
"""fp32 first and second moments."""


def compute_bytes(dtype: str) -> float:
    """Bytes of one element in the dtype the plan computes in."""
    return 4.0 if dtype == "fp32" else 2.0


@dataclass(frozen=True, slots=True)
class HeldBytes:
    """Bytes per parameter one rank holds for its chunk's parameters."""

    params: float
    """Parameters (fp32 masters, plus unsharded compute copies FSDP keeps) at the end of backward."""
    grads: float
    """Gradients at the end of backward."""
    optimizer: float
    """Adam moments."""
    peak_extra: float
    """Transient bytes on top at the step's peak (unsharded copies and whole gradients that
    exist between micro-batches but are freed by the end of backward)."""

    @property
    def at_peak(self) -> float:
        return self.params + self.grads + self.optimizer + self.peak_extra


def held_bytes_per_param(*, zero: int, dp: int, pp: int, dtype: str) -> HeldBytes:
    """Per-parameter state of one rank under a ZeRO stage (the table in the module docstring)."""
    c = compute_bytes(dtype)
    if dp == 1 or zero == 0:
        # autocast keeps a 16-bit copy of each weight it used from forward to backward
        return HeldBytes(MASTER_BYTES, GRAD_BYTES, ADAM_BYTES, c if c < MASTER_BYTES else 0.0)
    if zero == 1:
        return HeldBytes(MASTER_BYTES, GRAD_BYTES, ADAM_BYTES / dp, c if c < MASTER_BYTES else 0.0)
    sharded = HeldBytes(MASTER_BYTES / dp, GRAD_BYTES / dp, ADAM_BYTES / dp, 0.0)
    if pp > 1:  # unsharded parameters and whole gradients until the step's one reduce-scatter
        return HeldBytes(sharded.params, sharded.grads, sharded.optimizer, c + GRAD_BYTES)
    if zero == 2:
        return HeldBytes(sharded.params + c, sharded.grads, sharded.optimizer, 0.0)
    return sharded


def gather_bytes_per_param(dtype: str) -> float:
    """Bytes per parameter a ZeRO-2/3 all-gather moves (16-bit copies under mixed precision)."""
    return compute_bytes(dtype)


@dataclass(frozen=True, slots=True)
class DataParallelTraffic:
    """Data-parallel collectives of one rank per step, as multiples of its chunk's parameter count
    (bytes = multiple x parameters; each collective's input buffer on this rank)."""

    all_reduce_per_step: float = 0.0
    """Gradient all-reduce after the last micro-batch (ZeRO 0/1)."""
    all_gather_per_step: float = 0.0
    """Parameter all-gathers once per step: ZeRO-1's updated shards, ZeRO-2's first gather."""
    reduce_scatter_per_step: float = 0.0
    """One gradient reduce-scatter per step (FSDP2 under pipeline parallelism)."""
    all_gather_per_microbatch: float = 0.0
    """Parameter all-gathers inside every micro-batch (ZeRO-3: forward and backward)."""
    reduce_scatter_per_microbatch: float = 0.0
    """Gradient reduce-scatters inside every micro-batch's backward (ZeRO-2/3 without pp)."""


def data_parallel_traffic(*, zero: int, dp: int, pp: int, dtype: str,
                          reduce_dtype: str = "fp32") -> DataParallelTraffic:
    """What a rank's data-parallel group moves per step for its parameters (module docstring).
    All-gather inputs are this rank's shard (1/d of the full buffer), reduce-scatter inputs the
    full buffer; all-reduce inputs the full buffer. Gradients travel in ``reduce_dtype``."""
    if dp == 1:
        return DataParallelTraffic()
    c = gather_bytes_per_param(dtype)
    GRAD_BYTES = compute_bytes(reduce_dtype)  # noqa: N806 (the table's name for it)
    if zero == 0:
        return DataParallelTraffic(all_reduce_per_step=GRAD_BYTES)
    if zero == 1:
        return DataParallelTraffic(all_reduce_per_step=GRAD_BYTES,
                                   all_gather_per_step=MASTER_BYTES / dp)
    if pp > 1:
        if zero == 2:
            return DataParallelTraffic(all_gather_per_step=c / dp,
                                       reduce_scatter_per_step=GRAD_BYTES)
        # measured: a block stays gathered from its backward to the next forward (torch's
        # pipelining turns off resharding after backward), so only a forward that follows a
        # forward and a backward that follows a forward gather: m + 1 gathers per step under
        # GPipe, 1F1B and interleaved (one gather per micro-batch plus the first, per chunk)
        return DataParallelTraffic(all_gather_per_step=c / dp, all_gather_per_microbatch=c / dp,
                                   reduce_scatter_per_step=GRAD_BYTES)
    if zero == 2:
        return DataParallelTraffic(all_gather_per_step=c / dp,
                                   reduce_scatter_per_microbatch=GRAD_BYTES)
    return DataParallelTraffic(all_gather_per_microbatch=2 * c / dp,
                               reduce_scatter_per_microbatch=GRAD_BYTES)
