"""Redistributing activations between two neighbouring layers whose strategies differ
(docs/layerwise.md, "Cost", has the table and the measurement).

A stage of D devices runs each layer under its own split D = tp x dp (tp innermost); a
micro-batch of the stage carries B sequences (plan dp x micro_batch), data-parallel group j
holding sequences [j B / dp, (j + 1) B / dp) on its tp ranks. Between tp's that nest (k = their
ratio, c = bytes of an activation element): growing tp all-gathers the forward's (B / dp_b) s h c
bytes over k ranks, shrinking it all-gathers the gradient's (B / dp_a) s h c, and the other
direction is a local slice; both on the link ``CostModel.group_link`` gives a group spanning the
larger tp, priced by ``comm.all_gather``. ZeRO stages do not move activations; tp's that do not
nest (2 and 3 on six devices) would need an all-to-all and are refused.

With sequence parallelism every rank holds M = B s h c / D bytes whatever its split, and a change
of tp is one all-to-all over the larger tp's group each way
(run/parallel/redistribute.py). With the smaller tp 1 each rank sends (k - 1) / k M to
k - 1 peers; otherwise some ranks keep none of their buffer and send all of M to k. The slowest
rank sets the time, peers x alpha + bytes / beta (cost/comm.py's model). ``Transition.fwd_bytes``
and ``bwd_bytes`` are the busiest rank's bytes each way ((k - 1) / k of a gathered buffer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshmorph.cost import comm
from meshmorph.spec.gpus import GPUSpec
from meshmorph.spec.plan import LayerStrategy, PlanError

if TYPE_CHECKING:
    from meshmorph.cost.model import CostModel


@dataclass(frozen=True, slots=True)
class Transition:
    """What one micro-batch pays between two neighbouring layers (module docstring's table)."""

    fwd_s: float
    """Seconds of the forward redistribution."""
    bwd_s: float
    """Seconds of the backward (gradient) redistribution."""
    fwd_collective: str
    """``none``, ``slice``, ``all_gather`` or ``all_to_all``."""
    bwd_collective: str
    """``none``, ``slice``, ``all_gather`` or ``all_to_all``."""
    group_size: int
    """Ranks in the all-gather (k), 1 when nothing moves."""
    gathered_bytes: float
    """The all-gather's gathered buffer on one rank, or the all-to-all's buffer (0 when nothing
    moves)."""
    fwd_bytes: float = 0.0
    """Bytes the busiest rank sends to, or receives from, other ranks in the forward move."""
    bwd_bytes: float = 0.0
    """Bytes the busiest rank sends to, or receives from, other ranks in the backward move."""


NONE = Transition(0.0, 0.0, "none", "none", 1, 0.0)


def activation_bytes(cost: CostModel, sequences: float, dtype: str) -> float:
    """Bytes of ``sequences`` sequences of hidden state: sequences x s x h x c."""
    scale = 2 if dtype == "fp32" else 1
    return sequences * cost.model.seq_len * cost.model.hidden_size * cost.model.dtype_bytes * scale


def transition(cost: CostModel, a: LayerStrategy, b: LayerStrategy, stage_sequences: int,
               dtype: str, gpu: GPUSpec, *, sequence_parallel: bool = False) -> Transition:
    """The redistribution from layer strategy ``a`` to the next layer's ``b`` for a micro-batch of
    ``stage_sequences`` sequences (plan dp x micro_batch) on a stage of ``gpu`` devices
    (``sequence_parallel``: the layers' activations are split along the sequence)."""
    if a.tp == b.tp:
        return NONE
    low, high = sorted((a.tp, b.tp))
    if high % low:
        raise PlanError(f"layer strategies tp {a.tp} and tp {b.tp} do not nest: redistributing "
                        "between them needs an all-to-all meshmorph does not price; choose tp's "
                        "where one divides the other")
    k = high // low
    link = cost.group_link(gpu, high)
    if sequence_parallel:  # B s h c / D on every rank, either way: one all-to-all each way
        nbytes = activation_bytes(cost, stage_sequences / (a.tp * a.dp), dtype)
        # the busiest rank's messages and bytes (module docstring): peers alpha + moved / beta
        peers, moved = (k - 1, (k - 1) / k * nbytes) if low == 1 else (k, nbytes)
        both = peers * link.latency_s + moved / link.bandwidth_bps if moved > 0 else 0.0
        return Transition(both, both, "all_to_all", "all_to_all", k, nbytes, moved, moved)
    if b.tp < a.tp:  # dp grows: slice forward, gather the gradient backward
        nbytes = activation_bytes(cost, stage_sequences / a.dp, dtype)
        return Transition(0.0, comm.all_gather(k, nbytes, link), "slice", "all_gather", k, nbytes,
                          0.0, (k - 1) / k * nbytes)
    nbytes = activation_bytes(cost, stage_sequences / b.dp, dtype)
    return Transition(comm.all_gather(k, nbytes, link), 0.0, "all_gather", "slice", k, nbytes,
                      (k - 1) / k * nbytes, 0.0)
