"""One rank's memory and tail as the terms ``CostModel`` adds them up, for the planner's bounds.

``CostModel.rank_memory`` of a rank holding P parameters (its tensor-parallel share, a tied copy
counted once), whose layers keep a_i activation bytes per micro-batch and rematerialise w_i
while they recompute, is affine in what the rank holds:

    total = P x held.at_peak                       (cost/state.py: masters, grads, moments, extra)
          + in_flight x sum_i a_i + max_i w_i      (activations: micro-batches in flight, working set)
          + gather x (params of its largest layer) (ZeRO-3 without pp: that layer, plus a prefetch)
          + reserved                               (context + allocator reserve)

and its tail after the last backward is ``CostModel.rank_tail`` with the overlap window
``CostModel.assemble`` gives it (two thirds of the chunk's compute: its backward without
recompute). ``CostModel.rank_memory`` and ``CostModel.assemble`` are computed through these
functions, and the planner's bounds and stage search build on the same ones, never on their own
copy of the arithmetic (``tests/unit/test_rank_terms_bounds.py`` checks they reassemble).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from meshmorph.cost.context_parallel import kv_bytes
from meshmorph.cost.layer_cost import PieceCost
from meshmorph.cost.pipeline import weight_copies
from meshmorph.cost.state import MASTER_BYTES, compute_bytes
from meshmorph.cost.tensor_shapes import vocab_split
from meshmorph.schedule.table import Schedule
from meshmorph.spec.gpus import GPUSpec
from meshmorph.spec.plan import Plan

if TYPE_CHECKING:  # CostModel builds on these terms: no import cycle at run time
    from meshmorph.cost.model import CostModel


@lru_cache(maxsize=65536)
def in_flight_microbatches(schedule: Schedule, pp: int, pp_rank: int, m: int, vpp: int) -> float:
    """Micro-batches of activations a pipeline rank holds at its peak (Korthikanti et al. 2022)."""
    if pp == 1:
        return 1.0  # gradient accumulation frees each micro-batch after its backward
    if schedule == Schedule.GPIPE:
        return float(m)  # all forwards before any backward
    if schedule == Schedule.INTERLEAVED:
        # Megatron's warm-up (p - k - 1)*2 + (v - 1)*p chunk-forwards, +1 in steady state, in units
        # of one chunk (1/v of the rank's layers): rank 0 -> p + (p - 1)/v
        units = min(m * vpp, (pp - pp_rank - 1) * 2 + (vpp - 1) * pp + 1)
        return units / vpp
    if schedule.v_shape:
        # two chunks per rank, each half the rank's layers: the peak (stage, micro-batch) pairs
        # of the V's action list, in units of the whole rank; with m >= 2pp that peak is 2pp
        # (zbv) or 2pp + 1 (dualpipev) on every rank, with fewer (zbv) min(m + k + 1, 2m, 2pp)
        # on rank k (tests/unit/test_pipeline_async_cost.py holds them to the simulator's)
        if m >= 2 * pp or schedule == Schedule.DUALPIPEV:
            return (2 * pp + (schedule == Schedule.DUALPIPEV)) / 2
        return min(m + pp_rank + 1, 2 * m, 2 * pp) / 2
    if schedule == Schedule.ZERO_BUBBLE:
        return float(min(m, pp))  # ZB-H1 keeps the peak of 1F1B's first stage on every rank
    return float(min(m, pp - pp_rank))  # 1F1B: stage k holds p - k


@dataclass(frozen=True, slots=True)
class RankMemoryTerms:
    """The coefficients of one pipeline rank's peak memory (module docstring)."""

    bytes_per_param: float
    """Bytes per held parameter at the step's peak (``CostModel.held(plan).at_peak``, plus
    ``weight_copy_bytes_per_param``)."""
    weight_copy_bytes_per_param: float
    """Stashed or predicted fp32 weight copies of asynchronous pipelining
    (``cost.pipeline.weight_copies``); 0 for synchronous schedules."""
    in_flight: float
    """Micro-batches of the rank's stored activations alive at its peak."""
    gather_bytes_per_param: float
    """Bytes per parameter of the rank's largest layer held as gather buffers (ZeRO-3 without
    pipeline parallelism: one layer in use and one prefetched, in the compute dtype; else 0)."""
    reserved_bytes: float
    """CUDA context, communicator buffers and the allocator's reserve."""
    budget_bytes: float
    """Device memory of the rank's GPU."""

    def activation_bytes(self, stored: float, working: float) -> float:
        """Activation memory of layers storing ``stored`` bytes per micro-batch in total, the
        largest of whose working sets (while one recomputes) is ``working``."""
        return self.in_flight * stored + working

    def total(self, *, params: float, stored: float, working: float,
              largest_layer_params: float) -> float:
        """Peak bytes of a rank holding ``params`` parameters (module docstring)."""
        return (params * self.bytes_per_param + self.activation_bytes(stored, working)
                + largest_layer_params * self.gather_bytes_per_param + self.reserved_bytes)


def rank_memory_terms(cost: CostModel, plan: Plan, pp_rank: int, gpu: GPUSpec, *,
                      head_plan: Plan | None = None) -> RankMemoryTerms:
    """What ``cost.rank_memory(plan, pp_rank, ..., gpu)`` multiplies and adds, for any layers;
    ``head_plan``: the plan the head's layer runs under (a layerwise stage's, for its loss
    buffers; default ``plan``)."""
    gathering = plan.zero == 3 and plan.grad_replicas > 1 and plan.pp == 1
    copies = weight_copies(plan.schedule, plan.weight_prediction, plan.pp, pp_rank,
                           plan.num_microbatches)
    return RankMemoryTerms(
        bytes_per_param=cost.held(plan).at_peak + copies * MASTER_BYTES,
        weight_copy_bytes_per_param=copies * MASTER_BYTES,
        in_flight=in_flight_microbatches(plan.schedule, plan.pp, pp_rank, plan.num_microbatches,
                                         plan.vpp),
        # one unit in use, one more prefetched where fsdp_prefetch is on
        gather_bytes_per_param=(2 if plan.fsdp_prefetch else 1) * compute_bytes(plan.dtype)
        if gathering else 0.0,
        # TransformerEngine's userbuffers under tp_comm_overlap: tp_overlap_buffers of one
        # micro-batch's b x s x h hidden state in the compute dtype
        reserved_bytes=device_reserve_bytes(cost, gpu)
        + (cost.coef.tp_overlap_buffers * plan.micro_batch * cost.model.seq_len
           * cost.model.hidden_size * compute_bytes(plan.dtype) if plan.tp_comm_overlap else 0.0)
        + head_loss_bytes(cost, plan if head_plan is None else head_plan, pp_rank)
        + ring_buffer_bytes(cost, plan),
        budget_bytes=gpu.memory_bytes,
    )


def device_reserve_bytes(cost: CostModel, gpu: GPUSpec) -> float:
    """CUDA context, communicator buffers and the allocator's reserve of one rank: what every
    rank keeps whatever it holds."""
    return cost.coef.context_bytes + cost.coef.memory_reserve_fraction * gpu.memory_bytes


def ring_buffer_bytes(cost: CostModel, plan: Plan) -> float:
    """Receive buffers of context parallelism's ring (cost/context_parallel.py): the next K/V
    block and its gradients while a block runs, the same for every block, so a constant of the
    rank rather than a layer's working set (the planner's rule that a layer without recompute
    rematerialises nothing holds); 0 at cp 1."""
    if plan.cp == 1:
        return 0.0
    return 2 * kv_bytes(cost.model, plan.micro_batch, plan.tp, plan.cp, compute_bytes(plan.dtype))


LOSS_BLOCK_BYTES = 256 * 2**20
"""fp32 bytes of one row block of the whole-logits loss (run/model/loss.py's
``CHUNK_FP32_BYTES``; tests/unit/test_loss_memory.py holds the two equal)."""


def head_loss_bytes(cost: CostModel, plan: Plan, pp_rank: int) -> float:
    """Bytes the loss holds on the rank with the head while it runs, beyond what it keeps for
    backward, for one micro-batch of the rank's s / cp tokens: over whole logits in meshmorph's
    row-chunked loss the head's product (or its gradient) and one row block's fp32 temporaries;
    over vocabulary shards, or in another framework's loss over a fp32 copy of the logits
    (``TransformerShape.runtime`` false), ``LayerSpec.transient_bytes_per_token`` of the head
    split over tp; 0 on the other pipeline ranks."""
    if pp_rank != plan.pp_rank_of_chunk(plan.num_chunks - 1):
        return 0.0
    model = cost.model
    tokens = plan.micro_batch * model.seq_len / plan.cp
    if not vocab_split(model, plan.tp) and model.layers[min(1, model.num_layers - 1)].runtime \
            is not None:
        # whole logits (run/model/loss.py's row blocks): the head's product in the compute
        # dtype (or, in backward, the logits' gradient) beside the kept log-probabilities, and
        # one row block's two fp32 temporaries (nll's gradient, the fp32 input gradient)
        blocks = min(2 * LOSS_BLOCK_BYTES, 8.0 * model.vocab_size * tokens)
        return compute_bytes(plan.dtype) * model.padded_vocab_size * tokens + blocks
    head = model.layers[-1]
    return head.transient_bytes_per_token / plan.tp * tokens


def tail_overlap_window_s(time: PieceCost) -> float:
    """The compute the gradient sync may hide behind: the rank's last backward without
    recompute (backward = 2 x forward), so that more recompute never shortens the step."""
    return time.compute_s * 2 / 3


def rank_tail_s(cost: CostModel, plan: Plan, time: PieceCost, gpu: GPUSpec) -> float:
    """Exposed gradient sync + optimizer step after the last backward of a rank holding one
    chunk with times ``time``, as ``CostModel.assemble`` adds it."""
    sync, optimizer = cost.rank_tail(plan, time.params, tail_overlap_window_s(time), gpu)
    return sync + optimizer


def least_rank_tail_s(cost: CostModel, plan: Plan, params: float, gpu: GPUSpec) -> float:
    """The least tail a rank holding ``params`` can have whatever its layers (the sync hidden as
    far as ``dp_overlap`` allows), plus the least exposed part of its per-micro-batch ZeRO
    traffic (``comm.overlapped`` never hides more than the overlap share): affine in ``params``.
    Memoised on ``cost`` by the plan fields it reads (many configurations share them)."""
    key = (type(plan), plan.tp, plan.dp, plan.cp, plan.pp, plan.zero, plan.dtype,
           plan.reduce_dtype, plan.num_microbatches, plan.overlap_grad_reduce,
           plan.overlap_param_gather, plan.fsdp_prefetch, params, gpu.name, gpu.hbm_gbps)
    found = cost.least_tails.get(key)
    if found is not None:
        return found
    sync, optimizer = cost.rank_tail(plan, params, float("inf"), gpu, least=True)
    gathers, scatter = cost.microbatch_dp_traffic(plan, params, gpu,
                                                  units=1 if cost.fsdp_measured(plan) else 0)
    per_microbatch = sum(cost.zero_exposed(plan, gathers, scatter, float("inf"), float("inf")))
    found = cost.least_tails[key] = sync + optimizer + plan.num_microbatches * per_microbatch
    return found
