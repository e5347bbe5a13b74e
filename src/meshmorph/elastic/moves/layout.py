"""Layout: which rank holds which box of every piece of training state under a Plan.

A pure function of (ModelSpec, Plan), from ``cost/tensor_shapes.py`` (what the runtime
allocates) and how ``run/`` shards it:

- pipeline rank ``p`` holds the chunks ``plan.chunks_of(p)``; a tied head on a later pipeline
  rank holds a replica of the embedding, moments included;
- tensor parallelism splits each tensor along its ``tp_dim`` (column-parallel by dim 0,
  row-parallel by dim 1, embedding and head by vocabulary where tp divides it), else whole;
- ZeRO 0 replicates; ZeRO 1-3 (FSDP2) shard the fp32 masters and both moments by dim 0 of the
  tp-local tensor (``_dp_piece``); gathered copies and gradients are not state at a step
  boundary;
- every rank holds ``step``, ``lr_scheduler``, ``data`` (consumed samples) and ``rng/<rank>``.

All state tensors are fp32 (the masters are fp32 in every precision).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from meshmorph.cost.state import fsdp_shards
from meshmorph.cost.tensor_shapes import ParamTensor, layer_tensors
from meshmorph.elastic.moves.box import Box
from meshmorph.spec.model import LayerKind, ModelSpec
from meshmorph.spec.plan import Plan, PlanError
from meshmorph.spec.runnable import refuse_context_parallel

MOMENTS = ("exp_avg", "exp_avg_sq")
"""AdamW's two moments, named as torch's optimizer state names them."""
RNG_STATE_BYTES = 5056
"""Bytes of torch's CPU generator state (``torch.get_rng_state().numel()``): one rank's stream."""
DTYPE_BYTES = {"fp32": 4, "int64": 8, "uint8": 1}
"""Bytes of one element of each state dtype."""


@dataclass(frozen=True, slots=True)
class StateTensor:
    """One logical (whole, one-device) state tensor."""

    key: str
    """``param/<fqn>``, ``exp_avg/<fqn>``, ``exp_avg_sq/<fqn>`` (``<fqn>`` the parameter's name in
    the one-device model, as DCP checkpoints name it), ``step``, ``lr_scheduler``, ``data`` or
    ``rng/<rank>``."""
    shape: tuple[int, ...]
    """Whole shape; ``()`` for a counter, ``(bytes,)`` for an opaque byte string."""
    dtype: str
    """``fp32``, ``int64`` or ``uint8``."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, slots=True)
class Piece:
    """The box of one state tensor that a rank holds."""

    key: str
    """Key of the StateTensor."""
    box: Box
    """The elements held (real data only: FSDP2's padding is not in it)."""
    pad_rows: int = 0
    """Rows along dim 0 the rank allocates beyond ``box`` (FSDP2 pads every shard to
    ``ceil(n / dp)`` rows)."""


@dataclass(frozen=True, slots=True)
class Layout:
    """Every state tensor of a job under one Plan, and what each rank holds of it."""

    model: ModelSpec
    """The model the state belongs to."""
    plan: Plan
    """The Plan the state is laid out by."""
    world_size: int
    """Ranks of the plan (tp x pp x dp)."""
    tensors: dict[str, StateTensor]
    """Logical state tensors by key."""
    held: dict[int, tuple[Piece, ...]]
    """Per rank, the pieces it holds (one per key it holds; replicas included)."""

    def holders(self, key: str) -> list[tuple[int, Box]]:
        """(rank, box) of every rank holding part of ``key``, replicas included, by rank."""
        return [(rank, piece.box) for rank in sorted(self.held) for piece in self.held[rank]
                if piece.key == key and piece.box.numel]

    def piece(self, rank: int, key: str) -> Piece | None:
        """What ``rank`` holds of ``key`` (None: nothing)."""
        return next((p for p in self.held.get(rank, ()) if p.key == key), None)

    def bytes_on(self, rank: int) -> int:
        """Bytes of real state held by ``rank``."""
        return sum(self._bytes(piece.key, piece.box.numel) for piece in self.held.get(rank, ()))

    def allocated_bytes_on(self, rank: int) -> int:
        """Bytes ``rank`` allocates for its state, FSDP2's padding rows included."""
        return sum(self._bytes(p.key, p.box.numel + p.pad_rows * p.box.row_numel())
                   for p in self.held.get(rank, ()))

    def _bytes(self, key: str, numel: int) -> int:
        return numel * DTYPE_BYTES[self.tensors[key].dtype]


def param_fqn(model: ModelSpec, layer: int, name: str) -> str:
    """A parameter's name in the one-device model (``run/model/decoder.py``): ``embed.tok.weight``,
    ``blocks.3.attn.wq.weight`` (layer 4), ``head.out.weight``; a tied head's weight is the
    embedding's ``embed.tok.weight``."""
    kind = model.layers[layer].kind
    if kind == LayerKind.EMBEDDING:
        return f"embed.{name}"
    if kind == LayerKind.HEAD:
        if name == "out.weight" and model.tied_embeddings:
            return "embed.tok.weight"
        return f"head.{name}"
    return f"blocks.{layer - 1}.{name}"


def rank_tensors(model: ModelSpec, plan: Plan, pp_rank: int) -> Iterator[tuple[str, ParamTensor]]:
    """(fqn, tensor) of every parameter tensor pipeline rank ``pp_rank`` holds (its chunks'
    layers; a tied head beside its embedding once)."""
    seen: set[str] = set()
    for chunk in plan.chunks_of(pp_rank):
        stage = plan.stages[chunk]
        for layer in range(stage.start, stage.stop):
            for tensor in layer_tensors(model, layer, plan.tp):
                fqn = param_fqn(model, layer, tensor.name)
                if fqn not in seen:
                    seen.add(fqn)
                    yield fqn, tensor


def _tp_box(shape: tuple[int, ...], tp_dim: int | None, tp: int, tp_rank: int) -> Box:
    """The box a tensor-parallel rank holds of a whole tensor (tp divides the split dim)."""
    if tp_dim is None or tp == 1:
        return Box.whole(shape)
    part = shape[tp_dim] // tp
    offset = [0] * len(shape)
    length = list(shape)
    offset[tp_dim], length[tp_dim] = tp_rank * part, part
    return Box(tuple(offset), tuple(length))


def _dp_piece(key: str, local: Box, dp: int, dp_rank: int) -> Piece:
    """Data-parallel rank ``dp_rank``'s dim-0 shard of the tp-local box ``local`` as FSDP2 and
    ZeRO-1 cut it (``torch.chunk``: ``ceil(rows / dp)`` rows per rank, the last ranks fewer or
    none), FSDP2's padding up to ``ceil(rows / dp)`` recorded."""
    rows = local.length[0]
    size = -(-rows // dp)
    start = min(dp_rank * size, rows)
    stop = min(start + size, rows)
    box = Box((local.offset[0] + start, *local.offset[1:]), (stop - start, *local.length[1:]))
    return Piece(key, box, pad_rows=size - (stop - start))


def layout_of(model: ModelSpec, plan: Plan) -> Layout:
    """The Layout of ``plan``'s training state (pure: no torch, no torch.distributed).

    Raises PlanError where the plan does not fit the model (``Plan.check_against``), or lists
    per-layer strategies (layerwise plans: their state is laid out layer by layer, not here)."""
    if any(stage.layer_strategies is not None for stage in plan.stages):
        raise PlanError("elastic layouts and reshapes cover plans with one tp/dp/ZeRO per stage; "
                        "this plan lists layer_strategies (a layerwise plan): drop them, or "
                        "re-plan with meshmorph plan --uniform")
    refuse_context_parallel(plan, "elastic layouts and reshapes")
    plan.check_against(model)
    small = {key: StateTensor(key, (), "int64") for key in ("step", "lr_scheduler", "data")}
    tensors: dict[str, StateTensor] = dict(small)
    held: dict[int, list[Piece]] = {}
    shard = fsdp_shards(zero=plan.zero, dp=plan.dp)
    for pp_rank in range(plan.pp):
        for dp_rank in range(plan.dp):
            for tp_rank in range(plan.tp):
                rank = plan.rank_of(pp_rank, dp_rank, tp_rank)
                pieces = held.setdefault(rank, [])
                for fqn, tensor in rank_tensors(model, plan, pp_rank):
                    local = _tp_box(tensor.shape, tensor.tp_dim, plan.tp, tp_rank)
                    for kind in ("param", *MOMENTS):
                        key = f"{kind}/{fqn}"
                        tensors.setdefault(key, StateTensor(key, tensor.shape, "fp32"))
                        pieces.append(_dp_piece(key, local, plan.dp, dp_rank) if shard
                                      else Piece(key, local))
                rng = f"rng/{rank}"
                tensors[rng] = StateTensor(rng, (RNG_STATE_BYTES,), "uint8")
                pieces.extend(Piece(key, Box.whole(t.shape)) for key, t in small.items())
                pieces.append(Piece(rng, Box.whole(tensors[rng].shape)))
    return Layout(model=model, plan=plan, world_size=plan.world_size, tensors=tensors,
                  held={rank: tuple(pieces) for rank, pieces in sorted(held.items())})
