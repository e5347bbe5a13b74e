"""Redistributing activations between two neighbouring layers whose strategies differ.

A stage of D devices runs each layer under its own split D = tp x dp (ranks numbered with tp
innermost, as everywhere in meshmorph). A micro-batch of the stage carries B sequences (plan dp x
micro_batch); under (tp, dp) data-parallel group j = rank // tp holds sequences
[j B / dp, (j + 1) B / dp), replicated on its tp ranks (a tensor-parallel block's output is
all-reduced, without sequence parallelism). Going from layer a = (tp_a, dp_a) to layer
b = (tp_b, dp_b), with tp's that nest (one divides the other), k = the ratio of the two tp's and
c = bytes of one activation element (16-bit, 4 under fp32):

| from a to b | forward (activation) | backward (its gradient) |
| --- | --- | --- |
| tp_b = tp_a | nothing | nothing |
| tp_b < tp_a (dp grows k x) | local slice: each rank keeps 1/k of its sequences, 0 bytes | all-gather over k ranks of the input gradient, gathered buffer (B / dp_a) s h c bytes |
| tp_b > tp_a (dp shrinks k x) | all-gather over k ranks, gathered buffer (B / dp_b) s h c bytes | local slice, 0 bytes |

Both all-gathers run among k consecutive ranks, on the link ``CostModel.group_link`` gives a
group spanning max(tp_a, tp_b) ranks, priced by ``comm.all_gather`` (ring, M = gathered
buffer). ZeRO stages do not change where activations live, so they need no transition. Two tp's
that do not nest (2 and 3 on six devices) would need an all-to-all; they are refused.

With sequence parallelism a layer's input and output are split along the sequence over its tp
ranks (a layer at tp 1 holds whole sequences), so every rank holds B s h c / D bytes whatever its
split. Between two tp's that nest each rank keeps 1/k of its buffer and trades the rest with the
k - 1 other ranks of its group: an all-to-all among k ranks, forward and again backward, priced
as (k - 1) alpha + (k - 1) / k x M / beta with M = B s h c / D (the ring all-gather's formula,
``comm.all_gather``, with the buffer a rank already holds).
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
    if sequence_parallel:  # B s h c / D on every rank, either way: trade all but 1/k of it
        nbytes = activation_bytes(cost, stage_sequences / (a.tp * a.dp), dtype)
        both = comm.all_gather(k, nbytes, link)
        return Transition(both, both, "all_to_all", "all_to_all", k, nbytes)
    if b.tp < a.tp:  # dp grows: slice forward, gather the gradient backward
        nbytes = activation_bytes(cost, stage_sequences / a.dp, dtype)
        return Transition(0.0, comm.all_gather(k, nbytes, link), "slice", "all_gather", k, nbytes)
    nbytes = activation_bytes(cost, stage_sequences / b.dp, dtype)
    return Transition(comm.all_gather(k, nbytes, link), 0.0, "all_gather", "slice", k, nbytes)
