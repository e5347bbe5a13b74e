"""What one rank builds when it builds an engine of a Plan, from the plan alone (pure): the
counts ``move_time`` prices the new engine's build and install by.

``run/engine.build_engine`` makes the device mesh (``init_device_mesh``: on every rank one
``new_group`` call per group of each dimension smaller than the world), builds each chunk on
meta, applies TP (split parameters become DTensors), FSDP2 (a unit per layer and per chunk) or
DDP, then allocates and zeroes the rank's shards; the install writes every parameter and
creates AdamW's two moments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshmorph.cost.state import fsdp_shards
from meshmorph.elastic.moves.layout import rank_tensors
from meshmorph.spec.model import ModelSpec
from meshmorph.spec.plan import Plan

ELEMENT_BYTES = 4
"""Bytes of one fp32 element (the reshape's state is fp32)."""


@dataclass(frozen=True, slots=True)
class BuildCounts:
    """One rank's share of building and filling an engine of a plan."""

    tensors: int
    """Parameter tensors the rank builds (a tied head beside its embedding counted once)."""
    tp_tensors: int
    """Of those, the tensors tensor parallelism splits (DTensors on the tp mesh)."""
    fsdp_units: int
    """``fully_shard`` calls (ZeRO 1-3 over dp > 1: one per layer and one per chunk)."""
    fsdp_tensors: int
    """Tensors FSDP2 shards (every tensor of the rank under ZeRO 1-3 over dp > 1)."""
    param_bytes: int
    """Bytes of parameters the rank allocates and zeroes (FSDP2's padding rows included)."""
    mesh_calls: int
    """``new_group`` calls the device mesh makes on this rank (every rank makes every call)."""
    mesh_groups: tuple[int, ...]
    """Sizes of the mesh groups this rank joins that connect processes (1 < size < world)."""

    @property
    def dtensors(self) -> int:
        """Tensors that are DTensors (FSDP2 shards every tensor; else TP its split ones)."""
        return self.fsdp_tensors if self.fsdp_tensors else self.tp_tensors

    @property
    def moment_bytes(self) -> int:
        """Bytes of AdamW's two moments the install creates and fills."""
        return 2 * self.param_bytes


def build_counts(model: ModelSpec, plan: Plan) -> dict[int, BuildCounts]:
    """``BuildCounts`` of every rank of ``plan`` (by rank)."""
    world = plan.world_size
    dims = [size for size in (plan.pp, plan.dp, plan.tp) if size < world]  # the mesh's dims
    calls = sum(world // size for size in dims)
    groups = tuple(size for size in dims if size > 1)
    fsdp = fsdp_shards(zero=plan.zero, dp=plan.dp)
    out = {}
    for pp_rank in range(plan.pp):
        tensors = tp_tensors = numel = 0
        units = sum(plan.stages[c].stop - plan.stages[c].start + 1
                    for c in plan.chunks_of(pp_rank)) if fsdp else 0
        for _, tensor in rank_tensors(model, plan, pp_rank):
            tensors += 1
            tp_tensors += plan.tp > 1 and tensor.tp_dim is not None
            shape = tensor.local_shape(plan.tp)
            rows = -(-shape[0] // plan.dp) if fsdp else shape[0]  # FSDP2 pads rows
            numel += rows * math.prod(shape[1:])
        counts = BuildCounts(tensors=tensors, tp_tensors=tp_tensors, fsdp_units=units,
                             fsdp_tensors=tensors if fsdp else 0,
                             param_bytes=numel * ELEMENT_BYTES, mesh_calls=calls,
                             mesh_groups=groups)
        for dp_rank in range(plan.dp):
            for tp_rank in range(plan.tp):
                out[plan.rank_of(pp_rank, dp_rank, tp_rank)] = counts
    return out
