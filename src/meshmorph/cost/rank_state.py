"""What one rank of a Plan holds at the end of backward and sends in one step, in bytes: the
prediction the run's ``state`` line puts beside its measurement (run/engine/state_line.py), for
plans with and without layer strategies. docs/cost-model.md, "State and traffic", says what each
figure counts and where torch departs from the textbook; the functions below say how.

Held (end of backward, before the optimizer step), per distinct tensor the rank allocates
(cost/tensor_shapes.py; ``r`` its tensor-parallel-local dim-0 rows, ``k`` the rest of its
elements, ``d`` = dp, ``c`` the compute dtype's bytes; cost/state.py for the table by stage):
whole fp32 parameters and gradients ``4 r k`` (ZeRO 0 or dp 1, a layerwise plan's ZeRO-1 layers),
or FSDP2's shards padded to ``ceil(r / d)`` rows, plus the unsharded copy ``c ceil(r/d) d k`` for
ZeRO-1/2 without pipeline parallelism; moments ``8 r_i k`` on the rows ``r_i`` the rank owns
(DTensor's Shard(0) rule) where ZeRO shards them, else ``8 r k``. At its peak
(``peak_state_bytes``, pp 1) ZeRO-1 of a whole chunk over several micro-batches holds the whole
gradients in the reduce dtype in place of their shard.

Sent per step (run/engine/comm_count.py: each collective's input buffer on this rank; a receive
sends nothing): data-parallel traffic (cost/state.py) on padded shards, the tied embedding's
gradient across the two end ranks, tensor-parallel activations as DTensor lays them out
(run/parallel/parallelize.py) and, under fp8, the float64 maxima of the float8 scales reduced
along a split dim (``cost.fp8.tp_amax_elements``), the pipeline's hidden state to each
neighbour chunk on another rank with torch's first-step handshake, and meshmorph's own loss and
norm reductions. Under
context parallelism (priced, not run) ``d`` is dp x cp (shard index ``dp_rank * cp + cp_rank``),
activations count the rank's ``s / cp`` tokens, and each block sends its K and V round the ring
(cost/context_parallel.py).

Layer strategies (run by the layerwise engine, run/parallel/segments.py): the rank's chunks are
walked segment by segment (cost/segments.py: one per layer under its own tp, dp and ZeRO; rank
``r`` of a stage is tp rank ``r % tp_i`` of data-parallel block ``r // tp_i``), with these rules
at each layer's degrees and what that engine does differently: every layer reduces its gradients
on its own group (once per micro-batch; ZeRO 0/1 one flat buffer per step, a ZeRO-2 layer under a
split backward once per step), a ZeRO-2 layer keeps its gathered copy under a pipeline too, and a
vocabulary-parallel embedding outside FSDP2 keeps torch's double-size gradient under sequence
parallelism as at dp 1; the residual stream's dtype is followed layer by layer; activations move
between neighbours whose tp differs (run/parallel/redistribute.py); the head all-gathers its
logits (no ``loss_parallel``); token ids and labels are gathered into the first and last layers'
layouts; the norm is one float64 sum of squares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from meshmorph.cost.context_parallel import kv_bytes
from meshmorph.cost.fp8 import AMAX_BYTES, tp_amax_elements
from meshmorph.cost.model import CostModel
from meshmorph.cost.segments import Segment, chunk_segments, fsdp_sharded
from meshmorph.cost.state import (
    ADAM_BYTES,
    GRAD_BYTES,
    MASTER_BYTES,
    compute_bytes,
    data_parallel_traffic,
    fsdp_shards,
)
from meshmorph.cost.tensor_shapes import ParamTensor, layer_tensors, rank_tensors, vocab_split
from meshmorph.spec.cluster import parse_cluster
from meshmorph.spec.model import LayerKind, ModelSpec, Recompute
from meshmorph.spec.plan import Plan
from meshmorph.spec.runnable import lists_layer_strategies

COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "broadcast")
"""Kinds of collectives in ``comm_bytes`` (run/engine/comm_count.py counts the same)."""
LOSS_BYTES = 8
"""The step's loss, one float64 all-reduce over every rank."""
NORM_CLASS_BYTES = 32
"""run/engine/grad_norm.py: a float64 [4] vector of per-placement-class sums, all-reduced over dp when
the rank holds dp-sharded gradients (FSDP2) and over tp when it holds tp-split ones."""
NORM_PP_BYTES = 8
"""run/engine/grad_norm.py: the float64 norm, all-reduced over pp when pp > 1."""
NORM_BYTES = 8
"""run/engine/grad_norm.py (a layerwise plan): one float64 sum of squares, all-reduced over the
job."""
HANDSHAKE_BYTES = 4
"""torch pipelining's first-step neighbour check: one float32 per neighbouring stage."""
TOKEN_BYTES = 8
"""A token id (int64)."""
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


def held_state(tensors: list[ParamTensor], tp: int, dp: int, dp_rank: int, zero: int, *,
               per_layer: bool = False) -> tuple[float, float, float, float, float]:
    """What one rank holds of ``tensors`` at the end of backward: (params, grads, moments) bytes,
    plus the elements of the whole local tensors and of their padded dim-0 shards. FSDP2
    (``fsdp_shards``: ZeRO-1/2/3 over dp > 1, ZeRO-2/3 for a layer run alone, ``per_layer``)
    holds padded dim-0 shards of everything; otherwise whole tensors, with AdamW's moments
    sharded by rows under ZeRO-1."""
    fsdp = fsdp_shards(zero=zero, dp=dp, per_layer=per_layer)
    params = grads = moments = whole = padded = 0.0
    for tensor in tensors:
        rows, rest = _rows_rest(tensor, tp)
        whole += rows * rest
        padded += math.ceil(rows / dp) * rest
        held = math.ceil(rows / dp) if fsdp else rows
        params += MASTER_BYTES * held * rest
        grads += GRAD_BYTES * held * rest
        sharded = fsdp or zero == 1 and dp > 1
        moments += ADAM_BYTES * (_own_rows(rows, dp, dp_rank) * rest if sharded else rows * rest)
    return params, grads, moments, whole, padded


@dataclass(slots=True)
class _RankState:
    """What one rank holds and sends, added up segment by segment."""

    plan: Plan
    layerwise: bool
    """The layerwise engine runs the plan (module docstring)."""
    in_stage: int
    """The rank's place among its stage's tp x cp x dp ranks."""
    params: float = 0.0
    grads: float = 0.0
    moments: float = 0.0
    between_grads: float = 0.0
    """Gradient bytes at the end of a micro-batch's backward before the last (pp 1)."""
    tensors: list[ParamTensor] = field(default_factory=list)
    comm: dict[str, float] = field(default_factory=dict)

    def result(self) -> dict[str, object]:
        held = {"params_bytes": self.params, "grads_bytes": self.grads,
                "optimizer_bytes": self.moments}
        if self.plan.pp == 1:  # measured where the engine sees micro-batch boundaries
            held["peak_state_bytes"] = self.params + self.moments + max(self.grads,
                                                                        self.between_grads)
        return {**held, "comm_bytes": self.comm}


def predict_rank_state(model: ModelSpec, plan: Plan, rank: int) -> dict[str, object]:
    """``params_bytes``, ``grads_bytes``, ``optimizer_bytes`` and ``comm_bytes`` (by kind) of
    global ``rank`` of ``plan``, with or without layer strategies (the module docstring says
    what each counts)."""
    pp_rank = plan.coords_of(rank)[0]
    model = model.with_seq_len(plan.seq_len)
    layerwise = lists_layer_strategies(plan)
    state = _RankState(plan, layerwise, rank % (plan.tp * plan.cp * plan.dp))
    state.comm = dict.fromkeys(COMM_KINDS + (("all_to_all",) if layerwise
                                             and plan.sequence_parallel else ()), 0.0)
    plans: dict = {}
    for chunk in plan.chunks_of(pp_rank):  # one, or several (interleaved, V)
        segments = chunk_segments(model, plan, chunk, plans)
        # bytes per element of the residual stream coming into a layer: the embedding's output
        # is fp32 unless FSDP2 casts it; a cast layer's output is 16-bit and stays so
        stream = 4.0 if chunk == 0 else _hidden_bytes(plan)
        for at, segment in enumerate(segments):
            _held(model, state, segment)
            if at:  # the hidden state moved between the two layouts (cost/transition.py)
                before = segments[at - 1].plan
                _moved(state, before.tp, before.dp, segment.plan.tp, segment.plan.dp,
                       model.hidden_size * stream, plan.sequence_parallel)
            stream = _activations(model, state, segment, stream)
        if plan.pp > 1:
            _pipeline(model, state, chunk)
    _rank_ends(model, state, pp_rank)
    return state.result()


def _casts(plan: Plan) -> bool:
    """Whether FSDP2's mixed precision casts a layer under ``plan``'s (segment's) strategy to
    the compute dtype; under autocast alone the residual stream keeps the dtype it comes in."""
    return plan.dtype != "fp32" and fsdp_sharded(plan)


def _held(model: ModelSpec, state: _RankState, segment: Segment) -> None:
    """A segment's parameters, gradients and moments (at the end of backward and between
    micro-batches), and its data-parallel traffic."""
    plan, sub = state.plan, segment.plan
    t, d, zero = sub.tp, sub.grad_replicas, sub.zero
    fsdp = fsdp_sharded(sub)
    tensors = rank_tensors(model, [(segment.start, segment.stop)], t)
    if segment.drop_tied:  # the head's matrix is the embedding's, in the same chunk
        tensors = [x for x in tensors if x.name != "out.weight"]
    state.tensors += tensors
    params, grads, moments, whole, padded = held_state(tensors, t, d, state.in_stage // t, zero,
                                                       per_layer=segment.alone)
    between = grads
    # torch: the vocabulary-parallel embedding's local gradient is a view into a storage twice
    # its size until a data-parallel reduction replaces it with a fresh tensor, unless the
    # tied head's gradient, which the backward produces first, is there (the same chunk)
    split_embedding = segment.start == 0 and vocab_split(model, t)
    doubled = split_embedding and not (model.tied_embeddings and segment.stop == model.num_layers)
    if fsdp and zero <= 2 and (plan.pp == 1 or state.layerwise):
        params += compute_bytes(plan.dtype) * padded * d  # gathered once, kept to the step's end
        if zero == 1 and plan.num_microbatches > 1:  # whole gradients accumulated, unsynced
            between = compute_bytes(plan.reduce_dtype) * (
                whole + (tensors[0].local_numel(t) if doubled and not state.layerwise else 0))
    if d == 1 and doubled or split_embedding and state.layerwise and plan.sequence_parallel \
            and not fsdp:
        grads += GRAD_BYTES * tensors[0].local_numel(t)
    state.params += params
    state.grads += grads
    state.between_grads += between
    state.moments += moments
    # cost/state.py's traffic: all-reduces of the whole local tensors, all-gathers of a padded
    # shard, reduce-scatters of dp of them. The uniform engine reduces FSDP2 once per step under
    # a pipeline (torch's pipelining); the layerwise engine per micro-batch, but once per step
    # for a ZeRO-2 layer under a split backward (run/engine/train_engine.py)
    once = plan.pp > 1 and (not state.layerwise or plan.schedule.split_backward and zero == 2)
    traffic = data_parallel_traffic(zero=zero, dp=d, pp=plan.pp if once else 1, dtype=plan.dtype,
                                    reduce_dtype=plan.reduce_dtype, per_layer=segment.alone)
    m, comm = plan.num_microbatches, state.comm
    comm["all_reduce"] += traffic.all_reduce_per_step * whole
    comm["all_gather"] += (traffic.all_gather_per_step
                           + m * traffic.all_gather_per_microbatch) * d * padded
    comm["reduce_scatter"] += (traffic.reduce_scatter_per_step
                               + m * traffic.reduce_scatter_per_microbatch) * d * padded


def _activations(model: ModelSpec, state: _RankState, segment: Segment, stream: float) -> float:
    """The tensor-parallel (and context-parallel) activation traffic of a segment's layers, per
    micro-batch of its ``b`` sequences; returns the residual stream's bytes per element after
    it."""
    plan, sub, comm = state.plan, segment.plan, state.comm
    t, m, s, h = sub.tp, plan.num_microbatches, plan.seq_len // plan.cp, model.hidden_size
    sp, c = plan.sequence_parallel and t > 1, compute_bytes(plan.dtype)
    bsh = sub.micro_batch * s * h
    fsdp, casts = fsdp_sharded(sub), _casts(sub)
    for offset, index in enumerate(range(segment.start, segment.stop)):
        kind = model.layers[index].kind
        # the embedding's output, or the layer's input (cast, or as it came)
        stream = c if casts else 4.0 if kind == LayerKind.EMBEDDING else stream
        full = segment.recompute[offset] == Recompute.FULL
        if plan.cp > 1 and kind == LayerKind.BLOCK:  # the ring: K, V forward (again under
            # recompute), with their gradients back
            kv = kv_bytes(model, sub.micro_batch, t, plan.cp, c)
            rings = 3 + (segment.recompute[offset] != Recompute.NONE)
            comm["send_recv"] += m * (plan.cp - 1) * rings * kv
        if t > 1:
            _layer_tp(model, state, kind, sub, m=m, bsh=bsh, hidden=stream, full=full)
            if sp:  # norm gradients are partial sums over the sequence shards: all-reduced
                # once per step, or by a layerwise FSDP2 layer per micro-batch in its dtype
                norms = sum(x.local_numel(t) for x in layer_tensors(model, index, t)
                            if "norm" in x.name)
                comm["all_reduce"] += (m * c if state.layerwise and fsdp else GRAD_BYTES) * norms
    return stream


def _layer_tp(model: ModelSpec, state: _RankState, kind: LayerKind, sub: Plan, *, m: int,
              bsh: int, hidden: float, full: bool) -> None:
    """One layer's tensor-parallel collectives per step (DTensor as run/parallel/parallelize.py
    lays it out), ``bsh`` elements of hidden state per micro-batch: row-parallel outputs and
    logits in the compute dtype, inputs and input gradients in the stream's ``hidden``."""
    plan, comm, t = state.plan, state.comm, sub.tp
    sp, c = plan.sequence_parallel, compute_bytes(plan.dtype)
    split = vocab_split(model, t)
    if kind == LayerKind.EMBEDDING:
        if split:
            comm["all_reduce"] += m * bsh * hidden  # the embedding's output
        if sp:  # the output kept as a sequence slice: its gradient gathered
            comm["all_gather"] += m * bsh // t * hidden
    elif kind == LayerKind.BLOCK:
        replays = 2 if full else 1
        # the uniform engine: torch's checkpoint stops recomputing a block once its last saved
        # tensor (the MLP's row-parallel input) is back, so the MLP output's collective runs
        # once and the attention's again under full recompute; the layerwise engine's layers
        # replay both, as measured (tests/dist/test_layerwise_sp.py)
        outputs = 2 * replays if state.layerwise else 2 + full
        if sp:  # inputs gathered (forward, replays), output gradients gathered
            comm["all_gather"] += replays * 2 * m * bsh // t * hidden + 2 * m * bsh // t * c
            comm["reduce_scatter"] += outputs * m * bsh * c
        else:  # row-parallel outputs, in the compute dtype
            comm["all_reduce"] += outputs * m * bsh * c
        # column-parallel input gradients (q, k, v and fc1, or w1 and w3), in the input's dtype
        up = 1 if model.arch == "gpt" else 2
        comm["all_reduce"] += (3 + up) * m * bsh * hidden
        if plan.dtype == "fp8":  # float8 scales over split dims (cost/fp8.py)
            comm["all_reduce"] += m * AMAX_BYTES * tp_amax_elements(
                str(plan.fp8_scaling), tokens=bsh // model.hidden_size,
                hidden=model.hidden_size, column=3 + up, row=2, replays=replays)
    elif split and state.layerwise:  # the head's logits gathered, its input gradient reduced
        comm["all_gather"] += m * sub.micro_batch * (plan.seq_len // plan.cp) \
            * model.padded_vocab_size // t * c
        if sp:  # the head's input gathered
            comm["all_gather"] += m * bsh // t * hidden
        comm["all_reduce"] += m * bsh * hidden
    elif split:  # loss_parallel (run/model/loss.py): max, sum of exponentials, target logit
        comm["all_reduce"] += m * LOSS_PARALLEL_REDUCTIONS * bsh // model.hidden_size * 4
        if sp:
            comm["all_gather"] += m * bsh // t * hidden
            comm["reduce_scatter"] += m * bsh * hidden
        else:
            comm["all_reduce"] += m * bsh * hidden


def remote_neighbours(plan: Plan, chunk: int) -> int:
    """Neighbour chunks of ``chunk`` (``chunk - 1`` and ``chunk + 1``) held by another pipeline
    rank: torch pipelining sends a micro-batch's activation or gradient (and its first step's
    handshake) only to those; a neighbour on the same rank (the V's turn, chunks ``pp - 1`` and
    ``pp`` on rank ``pp - 1`` under zbv and dualpipev) takes it as a local input."""
    here = plan.pp_rank_of_chunk(chunk)
    return sum(plan.pp_rank_of_chunk(other) != here for other in (chunk - 1, chunk + 1)
               if 0 <= other < plan.num_chunks)


def _pipeline(model: ModelSpec, state: _RankState, chunk: int) -> None:
    """A pipeline chunk's traffic at its ends (pp > 1): torch pipelining's sends of ``b s h`` per
    micro-batch (``s / t`` under sequence parallelism) to each neighbour chunk on another rank
    plus its first step's handshake; under layer strategies also the tokens moved into the first
    layer's layout (chunk 0) or the received hidden state into it (later chunks), and the
    output moved back to the plan's data layout (the hidden state, or the last chunk's logits,
    whose labels stay in the data layout)."""
    plan, comm = state.plan, state.comm
    m, s, b, h = plan.num_microbatches, plan.seq_len // plan.cp, plan.micro_batch, \
        model.hidden_size
    sp, hidden = plan.sequence_parallel, _hidden_bytes(plan)
    neighbours = remote_neighbours(plan, chunk)
    comm["send_recv"] += HANDSHAKE_BYTES * neighbours \
        + m * neighbours * b * (s // plan.tp if sp else s) * h * hidden
    strategies = plan.stages[chunk].layer_strategies
    if strategies is None:
        return
    first, last = strategies[0], strategies[-1]
    if chunk == 0:
        if first.tp > plan.tp:
            comm["all_gather"] += m * b * s * TOKEN_BYTES
    else:
        _moved(state, plan.tp, plan.dp, first.tp, first.dp, h * hidden, sp)
    end = chunk == plan.num_chunks - 1
    width = model.vocab_size * compute_bytes(plan.dtype) if end else h * hidden
    _moved(state, last.tp, last.dp, plan.tp, plan.dp, width, sp and not end)


def _moved(state: _RankState, tp_a: int, dp_a: int, tp_b: int, dp_b: int, width: float,
           sequence: bool) -> None:
    """Activations of ``width`` bytes per position moved from layout (tp_a, dp_a) to
    (tp_b, dp_b) of a stage's devices (run/parallel/redistribute.py): between two
    layers, or between the data layout and a layerwise chunk's ends."""
    plan, comm = state.plan, state.comm
    m, s, sequences = plan.num_microbatches, plan.seq_len, plan.dp * plan.micro_batch
    if sequence and tp_a != tp_b:  # the sequence-split hidden state: all-to-all each way
        comm["all_to_all"] += 2 * m * sequences * s // (tp_a * dp_a) * width
    elif tp_b > tp_a:  # forward all-gather of this rank's B / dp_a sequences
        comm["all_gather"] += m * sequences // dp_a * s * width
    elif tp_b < tp_a:  # backward all-gather of the gradient of B / dp_b sequences
        comm["all_gather"] += m * sequences // dp_b * s * width


def _rank_ends(model: ModelSpec, state: _RankState, pp_rank: int) -> None:
    """What a rank sends once per step besides its layers: the tied embedding's gradient
    all-reduce across the end ranks, the tokens and labels moved into the first and last
    layer's layouts (layer strategies without a pipeline), and meshmorph's own reductions."""
    plan, comm = state.plan, state.comm
    ends = [c for c in plan.chunks_of(pp_rank) if c in (0, plan.num_chunks - 1)]
    # under a V the first and the last chunk are both on pipeline rank 0: the two copies'
    # gradients are summed there without a collective
    if model.tied_embeddings and plan.pp > 1 and len(ends) == 1:
        embed = plan.stages[0].layer_strategies
        t, d, zero = (embed[0].tp, embed[0].dp, embed[0].zero) if embed else \
            (plan.tp, plan.grad_replicas, plan.zero)
        rows, rest = _rows_rest(layer_tensors(model, 0, t)[0], t)
        sharded = fsdp_shards(zero=zero, dp=d, per_layer=bool(embed))
        comm["all_reduce"] += GRAD_BYTES * (math.ceil(rows / d) if sharded else rows) * rest
    if state.layerwise:
        if plan.pp == 1:
            layers = plan.stages[0].layer_strategies or ()
            for layer in (layers[0], layers[-1]):  # tokens in, labels out
                if layer.tp > plan.tp:
                    comm["all_gather"] += plan.num_microbatches * plan.micro_batch \
                        * plan.seq_len * TOKEN_BYTES
        comm["all_reduce"] += LOSS_BYTES + NORM_BYTES
        return
    fsdp = fsdp_sharded(plan)
    split = plan.tp > 1 and any(tensor.tp_dim is not None for tensor in state.tensors)
    comm["all_reduce"] += LOSS_BYTES + NORM_CLASS_BYTES * (fsdp + split) \
        + NORM_PP_BYTES * (plan.pp > 1)


def _hidden_bytes(plan: Plan) -> float:
    """Bytes per element of the residual stream between pipeline stages (run/engine/pipeline.py's
    ``io_dtypes``) and of the plan's tensor-parallel inputs: fp32 under autocast, the compute
    dtype under the plan's FSDP2 mixed precision."""
    return compute_bytes(plan.dtype) if _casts(plan) else 4.0


def predict_ranks(model: ModelSpec, plan: Plan) -> list[dict[str, object]]:
    """``predict_rank_state`` of every rank, in rank order (``estimate --json``'s ``ranks``)."""
    model = model.with_seq_len(plan.seq_len)
    return [{"rank": rank, **predict_rank_state(model, plan, rank)}
            for rank in range(plan.world_size)]


def predict_peak_bytes(model: ModelSpec, plan: Plan, rank: int, gpu: str) -> float:
    """The cost model's peak allocation of ``rank`` on catalog GPU ``gpu``: its StageMemory
    without the CUDA context and allocator reserve (what ``torch.cuda.max_memory_allocated``
    can see)."""
    model = model.with_seq_len(plan.seq_len)
    pp_rank = plan.coords_of(rank)[0]
    cost = CostModel(model, parse_cluster(f"{gpu}:1x{plan.world_size}"))
    plans: dict = {}
    segments = [s for c in plan.chunks_of(pp_rank) for s in chunk_segments(model, plan, c, plans)]
    memory = cost.segments_memory(plan, pp_rank, segments, cost.default_gpu())
    return memory.total - memory.reserved
