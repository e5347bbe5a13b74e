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
ranks (a layer at tp 1 holds whole sequences), so every rank holds M = B s h c / D bytes whatever
its split. Between tp's L < H that nest (k = H / L) the runtime (run/parallel/layerwise_redistribute.py,
``redistribute_sequence``) moves it by one all-to-all over the H layout's tp group, forward and
again backward: each rank cuts its buffer into k pieces of M / k for k distinct ranks of that
group. With L = 1 one of the k is the rank itself on every rank, so each rank sends and receives
(k - 1) / k M; with L > 1 some ranks keep none of their buffer (position p keeps a piece only
when p // k = p % L) and send all k pieces, M bytes, and some receive k pieces. The slowest rank
sets the time: ``peers`` x alpha + moved / beta with (peers, moved) = (k - 1, (k - 1) / k M) for
L = 1 and (k, M) for L > 1, the alpha-beta model of cost/comm.py (with L = 1 it is the ring
all-to-all's (k - 1) alpha + (k - 1) / k M / beta).

``Transition.fwd_bytes`` and ``bwd_bytes`` are the bytes the busiest rank of the stage sends to,
or receives from, other ranks in each direction: for the all-gathers (k - 1) / k of the gathered
buffer (what every rank receives, and the ring sends), for the all-to-alls the figures above.
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
