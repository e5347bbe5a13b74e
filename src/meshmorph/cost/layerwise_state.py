"""What one rank of a layerwise plan holds at the end of backward and sends in one step, in
bytes: the prediction the run's ``state`` line puts beside its measurement for plans whose
stage lists ``layer_strategies`` (run/engine/layerwise_engine.py runs them). A rank holding several
chunks (interleaved, zbv, dualpipev) holds and sends the sum of its chunks' figures.

Each layer i runs under its own (tp_i, dp_i, ZeRO_i) on the stage's D ranks (tp innermost: rank
r is tp rank r % tp_i of data-parallel block r // tp_i). Per layer, with cost/rank_state.py's
rules applied at the layer's own degrees (``r`` tp-local dim-0 rows, ``k`` the rest, ``c`` the
compute dtype's bytes):

- held: ZeRO 0/1 (or dp_i 1) ``4 r k`` parameters and gradients (the gradients of a reduced
  layer are views of its one reduced buffer), moments ``8 r k`` (ZeRO-1: ``8 r_own k``); FSDP2
  (ZeRO 2/3) padded shards ``4 ceil(r / dp_i) k`` each, ZeRO-2's gathered copy
  ``c ceil(r / dp_i) dp_i k``, moments on the unpadded own rows; a vocabulary-parallel
  embedding whose gradient no reduction replaces (dp_i 1, or sequence parallel outside FSDP2)
  keeps torch's double-size storage;
  a tied head's matrix is the embedding's and is counted once;
- sent by its data-parallel group: ``cost.state.data_parallel_traffic`` at (ZeRO_i, dp_i, pp 1):
  the one summed all-reduce of a ZeRO 0/1 layer's gradients in ``reduce_dtype``, ZeRO-1's
  parameter all-gather, FSDP2's gathers and reduce-scatters of padded shards (a ZeRO-2 layer
  under a split-backward schedule, zb/zbv/dualpipev, reduce-scatters once per step:
  run/engine/layerwise_pipeline.py, the pp > 1 row);
- sent by its tensor-parallel group per micro-batch of ``b = B / dp_i`` sequences (B = plan dp x
  micro_batch): the uniform layout's all-reduces of ``b s h`` (row-parallel outputs, replayed
  under full recompute; column-parallel input gradients; the vocabulary-parallel embedding's
  output and the head's input gradient) and the head's all-gather of ``b s V / tp_i`` logits;
- between neighbours whose tp differs, per micro-batch (run/parallel/layerwise_redistribute.py): the
  forward all-gather input ``(B / dp_a) s h`` when tp grows, the backward all-gather of the
  gradient ``(B / dp_b) s h`` when it shrinks, in the residual stream's dtype there (fp32 from
  the embedding under autocast, 16-bit from the first layer FSDP2's mixed precision casts on:
  autocast keeps a 16-bit stream 16-bit); a tensor-parallel layer's input gradients likewise;
- the data: the trainer cuts the batch in the plan's (tp, dp) layout, so the token ids (int64)
  of ``B / dp`` sequences are all-gathered into the first layer's layout when its tp is larger,
  and the labels into the last layer's;
- meshmorph's own reductions: the loss and the squared gradient norm, 8 bytes each.
"""

from __future__ import annotations

import math

from meshmorph.cost.rank_state import (
    COMM_KINDS,
    GRAD,
    HANDSHAKE_BYTES,
    LOSS_BYTES,
    _rows_rest,
    add_data_parallel_comm,
    held_state,
)
from meshmorph.cost.state import compute_bytes
from meshmorph.cost.tensor_shapes import layer_tensors, vocab_split
from meshmorph.spec.model import LayerKind, ModelSpec, Recompute
from meshmorph.spec.plan import LayerStrategy, Plan, PlanError

NORM_BYTES = 8
"""run/engine/layerwise_grads.py: one float64 sum of squares, all-reduced over the stage."""
TOKEN_BYTES = 8
"""A token id (int64)."""


def _casts(plan: Plan, strategy: LayerStrategy) -> bool:
    """Whether FSDP2's mixed precision casts the layer's inputs (and so its output) to the
    compute dtype; under autocast alone the residual stream keeps the dtype it comes in."""
    return strategy.dp > 1 and strategy.zero >= 2 and plan.dtype != "fp32"


def _boundary_bytes(plan: Plan) -> float:
    """Bytes per element of the hidden state between pipeline stages (run/engine/pipeline.py's
    ``io_dtypes``: the compute dtype under the plan's FSDP2 mixed precision, else fp32)."""
    if plan.dtype != "fp32" and plan.dp > 1 and plan.zero >= 2:
        return compute_bytes(plan.dtype)
    return 4.0


def _pipeline_traffic(model: ModelSpec, plan: Plan, chunk: int) -> dict[str, float]:
    """A pipeline chunk's traffic at its ends (pp > 1): the tokens moved into the first layer's
    layout (chunk 0) or the received hidden state (later chunks), the output moved back to the
    data layout (the hidden state, or the logits of the last chunk, whose labels stay in the data
    layout), and torch pipelining's sends of ``b s h`` per micro-batch to each neighbour chunk on
    another rank plus its first step's handshake."""
    sp = plan.sequence_parallel
    out = dict.fromkeys(COMM_KINDS + (("all_to_all",) if sp else ()), 0.0)
    strategies = plan.stages[chunk].layer_strategies
    assert strategies is not None
    m, s, b = plan.num_microbatches, plan.seq_len, plan.micro_batch
    sequences = plan.dp * b
    c = compute_bytes(plan.dtype)
    hidden = _boundary_bytes(plan)
    first, last = chunk == 0, chunk == plan.num_chunks - 1

    def moved(tp_a: int, dp_a: int, tp_b: int, dp_b: int, width: float,
              sequence: bool = False) -> None:
        if sequence and tp_a != tp_b:  # the sequence-split hidden state: all-to-all each way
            out["all_to_all"] += 2 * m * sequences * s // (tp_a * dp_a) * width
        elif tp_b > tp_a:  # forward all-gather of this rank's B / dp_a sequences
            out["all_gather"] += m * sequences // dp_a * s * width
        elif tp_b < tp_a:  # backward all-gather of the gradient of B / dp_b sequences
            out["all_gather"] += m * sequences // dp_b * s * width

    head, tail = strategies[0], strategies[-1]
    if first:
        if head.tp > plan.tp:
            out["all_gather"] += m * b * s * TOKEN_BYTES
    else:
        moved(plan.tp, plan.dp, head.tp, head.dp, model.hidden_size * hidden, sp)
    logits = 4.0 if plan.dtype == "fp32" else c
    width = model.vocab_size * logits if last else model.hidden_size * hidden
    moved(tail.tp, tail.dp, plan.tp, plan.dp, width, sp and not last)
    # a neighbour chunk on this rank (the V's turn) takes the activation without a send
    here = plan.pp_rank_of_chunk(chunk)
    neighbours = sum(plan.pp_rank_of_chunk(other) != here
                     for other in (chunk - 1, chunk + 1) if 0 <= other < plan.num_chunks)
    out["send_recv"] += HANDSHAKE_BYTES * neighbours \
        + m * neighbours * b * (s // plan.tp if sp else s) * model.hidden_size * hidden
    return out


def predict_layerwise_rank_state(model: ModelSpec, plan: Plan, rank: int) -> dict[str, object]:
    """``params_bytes``, ``grads_bytes``, ``optimizer_bytes`` and ``comm_bytes`` (by kind) of
    ``rank`` of a layerwise ``plan`` (module docstring)."""
    if any(st.layer_strategies is None for st in plan.stages):
        raise PlanError("the layerwise state prediction covers plans whose stages list "
                        "layer_strategies; use cost.rank_state for the others")
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"rank {rank} is outside the plan's {plan.world_size} ranks")
    model = model.with_seq_len(plan.seq_len)
    pp_rank, rank = divmod(rank, plan.tp * plan.dp)  # the stage, and the rank within it
    m, s, h = plan.num_microbatches, plan.seq_len, model.hidden_size
    sequences = plan.dp * plan.micro_batch  # B: one stage micro-batch
    c = compute_bytes(plan.dtype)
    sp = plan.sequence_parallel
    comm = dict.fromkeys(COMM_KINDS + (("all_to_all",) if sp else ()), 0.0)
    params = grads = moments = 0.0
    up = 1 if model.arch == "gpt" else 2
    split = plan.pp > 1 and plan.schedule.split_backward
    for chunk in plan.chunks_of(pp_rank):  # one, or several (interleaved, V)
        stage = plan.stages[chunk]
        strategies = stage.layer_strategies
        assert strategies is not None
        # bytes per element of the residual stream coming into the layer: the embedding's
        # output is fp32 unless FSDP2 casts it; a cast layer's output is 16-bit and stays so
        stream = 4.0 if chunk == 0 else _boundary_bytes(plan)
        for offset, strategy in enumerate(strategies):
            index = stage.start + offset
            t, d, zero = strategy.tp, strategy.dp, strategy.zero
            dp_rank = rank // t
            fsdp = d > 1 and zero >= 2
            kind = model.layers[index].kind
            tensors = layer_tensors(model, index, t)
            if kind == LayerKind.HEAD and model.tied_embeddings and stage.start == 0:
                tensors = [x for x in tensors if x.name != "out.weight"]  # the embedding's matrix
            held_params, held_grads, held_moments, whole, padded = held_state(tensors, t, d,
                                                                              dp_rank, zero)
            params += held_params
            grads += held_grads
            moments += held_moments
            if fsdp and zero == 2:
                params += c * padded * d  # gathered once, kept to the end of the step
            if kind == LayerKind.EMBEDDING and vocab_split(model, t) and (d == 1 or sp) \
                    and not fsdp:  # FSDP2's reduce-scatter replaces the unsharded gradient
                grads += GRAD * tensors[0].local_numel(t)  # torch's double-size local gradient
            # a split backward reduces ZeRO-2 once per step (run/engine/layerwise_pipeline.py)
            add_data_parallel_comm(comm, plan, zero=zero, dp=d,
                                   pp=plan.pp if split and zero == 2 else 1, whole=whole,
                                   padded=padded)
            if t > 1:  # tensor-parallel activations, per micro-batch of B / dp sequences
                bsh = sequences // d * s * h
                # the embedding's output, or the layer's input (cast, or as it came)
                hidden = c if _casts(plan, strategy) else 4.0 if kind == LayerKind.EMBEDDING \
                    else stream
                if kind == LayerKind.EMBEDDING:
                    if vocab_split(model, t):
                        comm["all_reduce"] += m * bsh * hidden
                    if sp:  # the output kept as a sequence slice: its gradient gathered
                        comm["all_gather"] += m * bsh // t * hidden
                elif kind == LayerKind.BLOCK:
                    replays = 2 if stage.recompute[offset] == Recompute.FULL else 1
                    if sp:  # inputs gathered (forward, replays), output gradients gathered
                        comm["all_gather"] += replays * 2 * m * bsh // t * hidden \
                            + 2 * m * bsh // t * c
                        comm["reduce_scatter"] += replays * 2 * m * bsh * c
                    else:
                        comm["all_reduce"] += replays * 2 * m * bsh * c
                    comm["all_reduce"] += (3 + up) * m * bsh * hidden
                elif kind == LayerKind.HEAD and vocab_split(model, t):
                    comm["all_gather"] += m * (sequences // d) * s * model.padded_vocab_size // t * c
                    if sp:  # the head's input gathered (its gradient all-reduced, below)
                        comm["all_gather"] += m * bsh // t * hidden
                    comm["all_reduce"] += m * bsh * hidden
                if sp:  # norm gradients, partial sums over the sequence slices: all-reduced
                    # once per step, or by FSDP2 per micro-batch in its unsharded dtype
                    norms = sum(x.local_numel(t) for x in tensors if "norm" in x.name)
                    comm["all_reduce"] += m * c * norms if fsdp else GRAD * norms
            if offset and sp:  # the sequence-split hidden state: one all-to-all each way
                if t != strategies[offset - 1].tp:
                    comm["all_to_all"] += 2 * m * sequences * s * h // (t * d) * stream
            elif offset:  # the hidden state moved from the previous layer's layout
                before = strategies[offset - 1]
                if t > before.tp:  # forward all-gather of this rank's B / dp_a sequences
                    comm["all_gather"] += m * sequences // before.dp * s * h * stream
                elif t < before.tp:  # backward all-gather of the gradient of B / dp_b sequences
                    comm["all_gather"] += m * sequences // d * s * h * stream
            stream = c if _casts(plan, strategy) else 4.0 if kind == LayerKind.EMBEDDING else stream
        if plan.pp > 1:
            for kind, nbytes in _pipeline_traffic(model, plan, chunk).items():
                comm[kind] += nbytes
    ends = [chunk for chunk in plan.chunks_of(pp_rank) if chunk in (0, plan.num_chunks - 1)]
    if model.tied_embeddings and plan.pp > 1 and len(ends) == 1:  # one copy of the pair here
        embed = plan.stages[0].layer_strategies[0]  # type: ignore[index]
        rows, rest = _rows_rest(layer_tensors(model, 0, embed.tp)[0], embed.tp)
        fsdp = embed.dp > 1 and embed.zero >= 2
        comm["all_reduce"] += GRAD * (math.ceil(rows / embed.dp) if fsdp else rows) * rest
    if plan.pp == 1:
        for layer_tp in (strategies[0].tp, strategies[-1].tp):  # tokens in, labels out
            if layer_tp > plan.tp:
                comm["all_gather"] += m * plan.micro_batch * s * TOKEN_BYTES
    comm["all_reduce"] += LOSS_BYTES + NORM_BYTES
    return {"params_bytes": params, "grads_bytes": grads, "optimizer_bytes": moments,
            "comm_bytes": comm}
