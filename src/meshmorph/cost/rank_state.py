"""What one rank of a Plan holds at the end of backward and sends in one step, in bytes: the
prediction the run's ``state`` line puts beside its measurement (run/engine/state_line.py).

Held (end of backward, before the optimizer step), per distinct tensor the rank allocates
(cost/tensor_shapes.py; ``r`` its tensor-parallel-local dim-0 rows, ``k`` the rest of its
elements, ``d`` = dp, ``c`` the compute dtype's bytes; cost/state.py for the table by stage):

- ZeRO 0/1 (or dp 1): parameters ``4 r k``, gradients ``4 r k`` (DDP's buckets, or FSDP2
  ``replicate``'s reduced gradients); ZeRO-1's moments ``8 r_i k`` on the rank's own rows ``r_i``
  (DTensor's Shard(0) rule: ``ceil(r / d)`` rows each, the last ranks fewer), ZeRO-0's ``8 r k``.
- FSDP2 (ZeRO 2/3): sharded parameters and gradients padded to ``ceil(r / d)`` rows
  (``4 ceil(r/d) k`` each), plus for ZeRO-2 without pipeline parallelism the unsharded copy
  ``c ceil(r/d) d k``; moments ``8 r_i k`` (unpadded local shard).

Sent per step (run/engine/comm_count.py: each collective's input buffer on this rank; a receive sends
nothing), ``m`` micro-batches of ``b`` sequences of ``s`` tokens:

- data parallel: cost/state.py's traffic (``data_parallel_traffic``) applied to padded shards;
- the tied embedding's gradient, summed over the first and last pipeline ranks (its local, and
  under FSDP2 sharded, gradient) where they are two ranks (under a V both copies sit on rank 0,
  in chunks 0 and 2pp - 1, and are summed there without a collective);
- tensor parallel activations per micro-batch (DTensor as run/parallel/parallelize.py lays it out):
  without sequence parallelism, an all-reduce of ``b s h`` after the vocabulary-parallel
  embedding and after each row-parallel layer (2 per block) in forward, one per column-parallel
  layer's input gradient in backward (q, k, v and the first MLP projection(s)), one for the
  head's input gradient, and loss_parallel's three fp32 all-reduces of ``b s`` values over the
  vocabulary-sharded logits (no gather of the logits); with sequence
  parallelism the row-parallel all-reduces become reduce-scatters of ``b s h`` and the block
  inputs all-gathers of ``b s/t h`` (forward and backward), and the norms' gradients are
  all-reduced once per step;
- pipeline: each micro-batch's hidden state ``b s h`` (``s/t`` under sequence parallelism) to
  the next chunk and its gradient to the previous one, plus torch's one 4-byte handshake per
  neighbour in the first step, for each neighbour chunk on another rank (``remote_neighbours``:
  the V's turn, chunks pp - 1 and pp on rank pp - 1, passes both locally);
- meshmorph's own reductions: the loss and the global gradient norm (8 bytes each).

Context parallelism (``cp`` > 1; priced, not run): ``d`` is dp x cp (``Plan.grad_replicas``:
parameters are replicated over both, the shard index is ``dp_rank * cp + cp_rank``), every
activation figure above counts the rank's ``s / cp`` tokens, and each block sends its K and V
(``2 b (s/cp) h_kv / t`` elements in the compute dtype) ``cp - 1`` times per micro-batch in
forward and K, V and their gradients ``cp - 1`` times in backward (cost/context_parallel.py),
the forward's ring again under recompute.
"""

from __future__ import annotations

import math

from meshmorph.cost.context_parallel import kv_bytes
from meshmorph.cost.state import compute_bytes, data_parallel_traffic
from meshmorph.cost.tensor_shapes import ParamTensor, layer_tensors, rank_tensors, vocab_split
from meshmorph.spec.model import LayerKind, ModelSpec, Recompute
from meshmorph.spec.plan import Plan

COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "broadcast")
"""Kinds of collectives in ``comm_bytes`` (run/engine/comm_count.py counts the same)."""
MASTER, GRAD, MOMENTS = 4, 4, 8
"""Bytes per element of fp32 parameters, fp32 gradients, and AdamW's two fp32 moments."""
LOSS_BYTES = 8
"""The step's loss, one float64 all-reduce over every rank."""
NORM_CLASS_BYTES = 32
"""run/engine/grad_norm.py: a float64 [4] vector of per-placement-class sums, all-reduced over dp when
the rank holds dp-sharded gradients (FSDP2) and over tp when it holds tp-split ones."""
NORM_PP_BYTES = 8
"""run/engine/grad_norm.py: the float64 norm, all-reduced over pp when pp > 1."""
HANDSHAKE_BYTES = 4
"""torch pipelining's first-step neighbour check: one float32 per neighbouring stage."""
LOSS_PARALLEL_REDUCTIONS = 3
"""torch's loss_parallel over vocabulary-sharded logits: three fp32 all-reduces of one value per
token in forward (the max, the sum of exponentials, the target's log-probability), none in
backward."""


def _rows_rest(tensor: ParamTensor, tp: int) -> tuple[int, int]:
    shape = tensor.local_shape(tp)
    return shape[0], math.prod(shape[1:])


def _own_rows(rows: int, dp: int, dp_rank: int) -> int:
    """Rows of dim 0 a data-parallel rank owns under DTensor's Shard(0) (torch.chunk) rule."""
    size = math.ceil(rows / dp)
    start = min(dp_rank * size, rows)
    return min(start + size, rows) - start


def held_state(tensors: list[ParamTensor], tp: int, dp: int, dp_rank: int,
               zero: int) -> tuple[float, float, float, float, float]:
    """What one rank holds of ``tensors`` at the end of backward: (params, grads, moments) bytes,
    plus the elements of the whole local tensors and of their padded dim-0 shards. FSDP2 (ZeRO-2/3
    over dp > 1) holds padded dim-0 shards of everything; otherwise whole tensors, with AdamW's
    moments sharded by rows under ZeRO-1."""
    fsdp = dp > 1 and zero >= 2
    params = grads = moments = whole = padded = 0.0
    for tensor in tensors:
        rows, rest = _rows_rest(tensor, tp)
        whole += rows * rest
        padded += math.ceil(rows / dp) * rest
        own = _own_rows(rows, dp, dp_rank) * rest
        if fsdp:
            params += MASTER * math.ceil(rows / dp) * rest
            grads += GRAD * math.ceil(rows / dp) * rest
            moments += MOMENTS * own
        else:
            params += MASTER * rows * rest
            grads += GRAD * rows * rest
            moments += MOMENTS * (own if zero == 1 and dp > 1 else rows * rest)
    return params, grads, moments, whole, padded


def add_data_parallel_comm(comm: dict[str, float], plan: Plan, *, zero: int, dp: int, pp: int,
                           whole: float, padded: float) -> None:
    """Add to ``comm`` the bytes one rank sends per step for data parallelism over ``dp`` ranks
    at ``zero``: cost/state.py's multiples applied to ``whole`` local elements (all-reduce) and to
    the ``padded`` dim-0 shards torch moves (an all-gather sends a padded shard, a reduce-scatter
    dp of them)."""
    traffic = data_parallel_traffic(zero=zero, dp=dp, pp=pp, dtype=plan.dtype,
                                    reduce_dtype=plan.reduce_dtype)
    m = plan.num_microbatches
    comm["all_reduce"] += traffic.all_reduce_per_step * whole
    comm["all_gather"] += (traffic.all_gather_per_step
                           + m * traffic.all_gather_per_microbatch) * dp * padded
    comm["reduce_scatter"] += (traffic.reduce_scatter_per_step
                               + m * traffic.reduce_scatter_per_microbatch) * dp * padded


def _coords(plan: Plan, rank: int) -> tuple[int, int, int]:
    """(pp_rank, replica rank, tp_rank) of a global rank (``Plan.coords_of``); the replica rank
    is the rank's place in its dp x cp group (``dp_rank * cp + cp_rank``), the ZeRO shard it owns."""
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"rank {rank} is outside the plan's {plan.world_size} ranks")
    pp_rank, dp_rank, cp_rank, tp_rank = plan.coords_of(rank)
    return pp_rank, dp_rank * plan.cp + cp_rank, tp_rank


def predict_rank_state(model: ModelSpec, plan: Plan, rank: int) -> dict[str, object]:
    """``params_bytes``, ``grads_bytes``, ``optimizer_bytes`` and ``comm_bytes`` (by kind) of
    global ``rank`` of ``plan`` (the module docstring says what each counts)."""
    pp_rank, dp_rank, _ = _coords(plan, rank)
    chunk_ids = plan.chunks_of(pp_rank)
    ranges = [(plan.stages[c].start, plan.stages[c].stop) for c in chunk_ids]
    t, d = plan.tp, plan.grad_replicas
    c = compute_bytes(plan.dtype)
    fsdp = d > 1 and plan.zero >= 2
    comm = dict.fromkeys(COMM_KINDS, 0.0)

    tensors = rank_tensors(model, ranges, t)
    # elements: whole local tensors, padded dim-0 shards
    params, grads, moments, whole, padded_shard = held_state(tensors, t, d, dp_rank, plan.zero)
    if fsdp and plan.zero == 2 and plan.pp == 1:
        params += c * padded_shard * d  # gathered once, kept to the end of the step
    holds_embed = any(start == 0 for start, _ in ranges)
    if holds_embed and vocab_split(model, t) and d == 1:
        # torch: the vocabulary-parallel embedding's local gradient is a view into a storage
        # twice its size (no data-parallel reduction replaces it with a fresh tensor)
        rows, rest = _rows_rest(layer_tensors(model, 0, t)[0], t)
        grads += GRAD * rows * rest

    # --- data parallel -----------------------------------------------------------------------
    # cost/state.py's multiples (bytes per parameter, all-gathers of 1/d shards), applied to the
    # padded shards torch moves: an all-gather sends a padded shard, a reduce-scatter d of them
    add_data_parallel_comm(comm, plan, zero=plan.zero, dp=d, pp=plan.pp, whole=whole,
                           padded=padded_shard)

    # --- the tied embedding's two copies across pipeline ranks ---------------------------------
    holds_head = any(stop == model.num_layers for _, stop in ranges)
    # under a V the first and the last chunk are both on pipeline rank 0: the two copies'
    # gradients are summed there without a collective
    apart = plan.pp_rank_of_chunk(0) != plan.pp_rank_of_chunk(plan.num_chunks - 1)
    if model.tied_embeddings and apart and (holds_embed or holds_head):
        tok = layer_tensors(model, 0, t)[0]
        rows, rest = _rows_rest(tok, t)
        comm["all_reduce"] += GRAD * (math.ceil(rows / d) if fsdp else rows) * rest

    # --- tensor parallel activations, pipeline transfers ---------------------------------------
    for kind, nbytes in _activation_traffic(model, plan, chunk_ids).items():
        comm[kind] += nbytes
    comm["all_reduce"] += LOSS_BYTES + NORM_CLASS_BYTES * ((fsdp) + (t > 1 and any(
        tensor.tp_dim is not None for tensor in tensors))) + NORM_PP_BYTES * (plan.pp > 1)

    return {"params_bytes": params, "grads_bytes": grads, "optimizer_bytes": moments,
            "comm_bytes": comm}


def remote_neighbours(plan: Plan, chunk: int) -> int:
    """Neighbour chunks of ``chunk`` (``chunk - 1`` and ``chunk + 1``) held by another pipeline
    rank: torch pipelining sends a micro-batch's activation or gradient (and its first step's
    handshake) only to those; a neighbour on the same rank (the V's turn, chunks ``pp - 1`` and
    ``pp`` on rank ``pp - 1`` under zbv and dualpipev) takes it as a local input."""
    here = plan.pp_rank_of_chunk(chunk)
    return sum(plan.pp_rank_of_chunk(other) != here for other in (chunk - 1, chunk + 1)
               if 0 <= other < plan.num_chunks)


def _activation_traffic(model: ModelSpec, plan: Plan, chunk_ids: list[int]) -> dict[str, float]:
    """Tensor-parallel and pipeline bytes one rank sends per step for the activations of its
    model chunks ``chunk_ids``."""
    out = dict.fromkeys(COMM_KINDS, 0.0)
    t, m, b, s, h = plan.tp, plan.num_microbatches, plan.micro_batch, plan.seq_len // plan.cp, \
        model.hidden_size
    sp = plan.sequence_parallel
    tp_b = _tp_activation_bytes(plan)
    hidden_b = _hidden_bytes(plan)
    bsh = b * s * h
    up = 1 if model.arch == "gpt" else 2  # first MLP projections: fc1, or w1 and w3
    split = vocab_split(model, t)
    for index in chunk_ids:
        stage = plan.stages[index]
        if plan.cp > 1:  # the ring: K, V forward (again under recompute), with gradients back
            kv = kv_bytes(model.with_seq_len(plan.seq_len), b, t, plan.cp,
                          compute_bytes(plan.dtype))
            for offset, layer_index in enumerate(range(stage.start, stage.stop)):
                if model.layers[layer_index].kind == LayerKind.BLOCK:
                    rings = 3 + (stage.recompute[offset] != Recompute.NONE)
                    out["send_recv"] += m * (plan.cp - 1) * rings * kv
        if plan.pp > 1:
            neighbours = remote_neighbours(plan, index)
            local_s = s // t if sp else s
            out["send_recv"] += HANDSHAKE_BYTES * neighbours \
                + m * neighbours * b * local_s * h * hidden_b
        if t == 1:
            continue
        for offset, layer_index in enumerate(range(stage.start, stage.stop)):
            layer = model.layers[layer_index]
            if layer.kind == LayerKind.EMBEDDING:
                if split:
                    out["all_reduce"] += m * bsh * hidden_b  # the embedding's output
                if sp:
                    out["all_gather"] += m * bsh // t * hidden_b  # its gradient, gathered
            elif layer.kind == LayerKind.BLOCK:
                replays = 2 if stage.recompute[offset] == Recompute.FULL else 1
                if sp:  # inputs gathered (forward, replays), output gradients gathered
                    out["all_gather"] += replays * 2 * m * bsh // t * hidden_b \
                        + 2 * m * bsh // t * tp_b
                    out["reduce_scatter"] += replays * 2 * m * bsh * tp_b
                else:  # row-parallel outputs, in the compute dtype
                    out["all_reduce"] += replays * 2 * m * bsh * tp_b
                # column-parallel input gradients, in the dtype of the input
                out["all_reduce"] += (3 + up) * m * bsh * hidden_b
            else:  # head
                if split:  # loss_parallel (run/model/loss.py): max, sum of exponentials, target logit
                    out["all_reduce"] += m * LOSS_PARALLEL_REDUCTIONS * b * s * 4
                    if sp:
                        out["all_gather"] += m * bsh // t * hidden_b
                        out["reduce_scatter"] += m * bsh * hidden_b
                    else:
                        out["all_reduce"] += m * bsh * hidden_b
        if sp:  # norm gradients are partial sums over the sequence shards: one all-reduce
            norms = sum(tensor.local_numel(t) for layer_index in range(stage.start, stage.stop)
                        for tensor in layer_tensors(model, layer_index, t)
                        if "norm" in tensor.name)
            out["all_reduce"] += GRAD * norms
    return out


def _tp_activation_bytes(plan: Plan) -> float:
    """Bytes per element of a linear layer's output (row-parallel outputs, the logits): the
    compute dtype, under autocast and FSDP2's mixed precision alike."""
    return compute_bytes(plan.dtype)


def _hidden_bytes(plan: Plan) -> float:
    """Bytes per element of the residual stream (the hidden state between pipeline stages,
    run/engine/pipeline.py, and the inputs of tensor-parallel regions): fp32 under autocast, the
    compute dtype under FSDP2's mixed precision."""
    if plan.dtype == "fp32":
        return 4.0
    return compute_bytes(plan.dtype) if plan.grad_replicas > 1 and plan.zero >= 2 else 4.0


def predict_ranks(model: ModelSpec, plan: Plan) -> list[dict[str, object]]:
    """``predict_rank_state`` of every rank, in rank order (``estimate --json``'s ``ranks``)."""
    model = model.with_seq_len(plan.seq_len)
    return [{"rank": rank, **predict_rank_state(model, plan, rank)}
            for rank in range(plan.world_size)]


def predict_peak_bytes(model: ModelSpec, plan: Plan, rank: int, gpu: str) -> float:
    """The cost model's peak allocation of ``rank`` on catalog GPU ``gpu``: its StageMemory
    without the CUDA context and allocator reserve (what ``torch.cuda.max_memory_allocated``
    can see)."""
    from meshmorph.cost.model import CostModel
    from meshmorph.spec.cluster import parse_cluster

    model = model.with_seq_len(plan.seq_len)
    pp_rank = _coords(plan, rank)[0]
    cost = CostModel(model, parse_cluster(f"{gpu}:1x{plan.world_size}"))
    chunks = [(plan.stages[c].start, plan.stages[c].stop, plan.stages[c].recompute)
              for c in plan.chunks_of(pp_rank)]
    memory = cost.rank_memory(plan, pp_rank, chunks, cost.default_gpu())
    return memory.total - memory.reserved
