"""What one rank holds and sends for its parameters, by ZeRO stage, as meshmorph's runtime
realises the stages with torch's own pieces (see docs/cost-model.md, "State and traffic").

Precision: the fp32 master parameters and fp32 Adam moments exist in every plan; a 16-bit plan
computes in bf16/fp16: FSDP2 ``MixedPrecisionPolicy(param_dtype=c, reduce_dtype=r)`` wherever
FSDP2 shards the parameters (its gathers move c-byte copies, its reduce-scatters r-byte
gradients), ``torch.autocast`` over fp32 parameters elsewhere.

| ZeRO | realised as | params | grads | optimizer | traffic per step |
| --- | --- | --- | --- | --- | --- |
| 0 | DDP (or FSDP2 ``replicate``) | 4 | 4 | 8 | all-reduce (r) of the gradients |
| 1 | FSDP2, no gradient sync before the last micro-batch, gathered once per step | 4/d + c | 4/d | 8/d | reduce-scatter (r) once, all-gather (c) once |
| 2 | FSDP2, parameters gathered once per step and kept to its end | 4/d + c | 4/d | 8/d | all-gather (c) once, reduce-scatter (r) per micro-batch |
| 3 | FSDP2 per block, resharded after forward and after backward | 4/d | 4/d | 8/d | all-gather (c) twice and reduce-scatter (r) once per micro-batch |

(bytes per parameter of the rank's tensor-parallel chunk, at the end of backward before the
optimizer step; d = dp, c = bytes of the compute dtype, r = bytes of the reduce dtype). ZeRO-1
accumulates the whole gradients in r bytes between micro-batches (FSDP2's accumulation without
gradient sync), so its peak, before the last micro-batch reduce-scatters them, is c + r + 12/d:
6 + 12/d under bf16 with fp32 reduction, Megatron-LM's distributed optimizer; once reduced it
holds 2 + 16/d. A layerwise plan's ZeRO-1 layers (``per_layer``) keep whole fp32 parameters and
gradients, all-reduce the gradients (r) and step ``ShardedAdamW``, whose updated fp32 shards are
all-gathered (4/d). Under pipeline parallelism torch's pipelining runs every FSDP2 chunk
without gradient sync between micro-batches and without resharding after backward, then
reduce-scatters once (``perform_reduce_grad``): ZeRO-1, 2 and 3 then hold unsharded parameters
and whole gradients at their peak and reduce once per step, and their end-of-backward state is
ZeRO-3's. ZeRO-3 then gathers m + 1 times per step, not 2m (a block gathered for a backward
stays gathered into the next forward).

Measured per rank against cost/rank_state.py (which adds dim-0 padding, tensor-parallel and
pipeline activations) by ``tests/dist/test_state_line.py``; docs/cost-model.md, "State and traffic".
"""

from __future__ import annotations

from dataclasses import dataclass

MASTER_BYTES = 4.0
"""fp32 master parameter."""
GRAD_BYTES = 4.0
"""fp32 gradient as the optimizer reads it (whole, or FSDP2's shard)."""
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


def fsdp_shards(*, zero: int, dp: int, per_layer: bool = False) -> bool:
    """Whether the runtime holds parameters under ``zero`` over ``dp`` ranks as FSDP2's dim-0
    shards: ZeRO 2/3, and ZeRO-1 of a whole chunk; a layerwise plan's ZeRO-1 layers
    (``per_layer``) keep whole parameters (module docstring)."""
    return dp > 1 and (zero >= 2 or (zero == 1 and not per_layer))


def held_bytes_per_param(*, zero: int, dp: int, pp: int, dtype: str, reduce_dtype: str = "fp32",
                         per_layer: bool = False) -> HeldBytes:
    """Per-parameter state of one rank under a ZeRO stage (the table in the module docstring)."""
    c, r = compute_bytes(dtype), compute_bytes(reduce_dtype)
    if not fsdp_shards(zero=zero, dp=dp, per_layer=per_layer):
        # autocast keeps a 16-bit copy of each weight it used from forward to backward; torchao's
        # float8 linears (dtype fp8) keep the fp32 parameter itself, and they hold nearly all
        moments = ADAM_BYTES / dp if zero == 1 else ADAM_BYTES  # ShardedAdamW's row shards
        copy = c if c < MASTER_BYTES and dtype != "fp8" else 0.0
        return HeldBytes(MASTER_BYTES, GRAD_BYTES, moments, copy)
    sharded = HeldBytes(MASTER_BYTES / dp, GRAD_BYTES / dp, ADAM_BYTES / dp, 0.0)
    if pp > 1:  # unsharded parameters and whole gradients until the step's one reduce-scatter
        return HeldBytes(sharded.params, sharded.grads, sharded.optimizer, c + r)
    if zero == 3:
        return sharded
    # ZeRO-1/2: gathered once, the c-byte copy kept to the step's end; ZeRO-1 accumulates the
    # whole gradients (r bytes) until the last micro-batch reduce-scatters them into the shard
    extra = r - sharded.grads if zero == 1 else 0.0
    return HeldBytes(sharded.params + c, sharded.grads, sharded.optimizer, extra)


@dataclass(frozen=True, slots=True)
class DataParallelTraffic:
    """Data-parallel collectives of one rank per step, as multiples of its chunk's parameter count
    (bytes = multiple x parameters; each collective's input buffer on this rank)."""

    all_reduce_per_step: float = 0.0
    """Gradient all-reduce after the last micro-batch (ZeRO 0, a layerwise ZeRO-1 layer)."""
    all_gather_per_step: float = 0.0
    """Parameter all-gathers once per step: ZeRO-1/2's gather of the updated parameters before
    the first forward, a layerwise ZeRO-1 layer's updated fp32 shards."""
    reduce_scatter_per_step: float = 0.0
    """One gradient reduce-scatter per step (ZeRO-1, FSDP2 under pipeline parallelism)."""
    all_gather_per_microbatch: float = 0.0
    """Parameter all-gathers inside every micro-batch (ZeRO-3: forward and backward)."""
    reduce_scatter_per_microbatch: float = 0.0
    """Gradient reduce-scatters inside every micro-batch's backward (ZeRO-2/3 without pp)."""


def data_parallel_traffic(*, zero: int, dp: int, pp: int, dtype: str,
                          reduce_dtype: str = "fp32",
                          per_layer: bool = False) -> DataParallelTraffic:
    """What a rank's data-parallel group moves per step for its parameters (module docstring).
    All-gather inputs are this rank's shard (1/d of the full buffer), reduce-scatter inputs the
    full buffer; all-reduce inputs the full buffer. Gradients travel in ``reduce_dtype``."""
    if dp == 1:
        return DataParallelTraffic()
    # all-gathers move c-byte copies (16-bit under mixed precision)
    c, r = compute_bytes(dtype), compute_bytes(reduce_dtype)
    if not fsdp_shards(zero=zero, dp=dp, per_layer=per_layer):
        return DataParallelTraffic(all_reduce_per_step=r,
                                   all_gather_per_step=MASTER_BYTES / dp if zero == 1 else 0.0)
    if zero == 3 and pp > 1:
        # measured: a block stays gathered from its backward to the next forward (torch's
        # pipelining turns off resharding after backward), so only a forward that follows a
        # forward and a backward that follows a forward gather: m + 1 gathers per step under
        # GPipe, 1F1B and interleaved (one gather per micro-batch plus the first, per chunk)
        return DataParallelTraffic(all_gather_per_step=c / dp, all_gather_per_microbatch=c / dp,
                                   reduce_scatter_per_step=r)
    if zero == 3:
        return DataParallelTraffic(all_gather_per_microbatch=2 * c / dp,
                                   reduce_scatter_per_microbatch=r)
    if zero == 1 or pp > 1:  # one reduce-scatter per step: the last micro-batch's, or torch
        # pipelining's after the last backward
        return DataParallelTraffic(all_gather_per_step=c / dp, reduce_scatter_per_step=r)
    return DataParallelTraffic(all_gather_per_step=c / dp, reduce_scatter_per_microbatch=r)
