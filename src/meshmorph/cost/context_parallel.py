"""Context parallelism: one block's ring-attention exchange and what each rank holds of a sequence
(docs/cost-model.md, "Context parallelism for long sequences", has the sources).

A plan with ``cp`` > 1 splits every sequence over cp ranks with causal load balancing (Liu et al.
2023, Ring Attention): each rank holds two chunks of ``s / (2 cp)`` tokens, an early and a late
one, so it keeps ``b s / cp`` tokens of activations and does ``1 / cp`` of every layer's work,
attention included. Keys and values go round the ring in ``cp - 1`` steps per block: forward,
this rank's K and V (``2 b (s/cp) h_kv / t`` elements) beside its queries' attention to the block
held (half an ``s/cp`` x ``s/cp`` block after the mask: ``2 b (s/cp)^2 h / t`` FLOPs); backward,
K, V and their gradients beside twice the FLOPs. A step's transfer is exposed only beyond its
block; recompute runs the forward's ring again. The receive buffers (``2 x kv_bytes``) are a
constant of the rank (cost/rank_terms.ring_buffer_bytes), not a layer's working set. The ring's
link is the node's while ``tp x cp`` ranks fit in a node (tp innermost, then cp), else the NIC's.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshmorph.cost import comm
from meshmorph.spec.model import ModelSpec


def local_tokens(micro_batch: int, seq_len: int, cp: int) -> int:
    """Tokens of one micro-batch on one context-parallel rank (two chunks of s / (2 cp) per
    sequence); ``micro_batch * seq_len`` at cp 1."""
    return micro_batch * seq_len // cp


def kv_bytes(model: ModelSpec, micro_batch: int, tp: int, cp: int, element_bytes: float) -> float:
    """Bytes of one rank's keys and values for one block: ``2 b (s/cp) h_kv / t`` elements."""
    kv_width = model.num_kv_heads * model.head_dim
    return 2.0 * local_tokens(micro_batch, model.seq_len, cp) * kv_width * element_bytes / tp


def ring_step_flops(model: ModelSpec, micro_batch: int, tp: int, cp: int) -> float:
    """Forward FLOPs of one ring step on one rank: QK^T and AV of the local queries against one
    K/V block, of which the causal, load-balanced mask leaves half: ``2 b (s/cp)^2 h / t``."""
    chunk = model.seq_len / cp
    return 2.0 * micro_batch * chunk * chunk * model.hidden_size / tp


@dataclass(frozen=True, slots=True)
class RingTime:
    """One block's ring exchange on one rank for one micro-batch."""

    fwd_transfer_s: float
    """The forward's cp - 1 K/V transfers, end to end."""
    fwd_exposed_s: float
    """What the forward's transfers add to the step: per step, the transfer beyond its block."""
    bwd_exposed_s: float
    """What the backward's transfers add (recompute's forward ring not included)."""


def ring_time(model: ModelSpec, *, micro_batch: int, tp: int, cp: int, element_bytes: float,
              flops_per_s: float, link: comm.Link) -> RingTime:
    """The ring exchange of one block (module docstring); zero at cp 1. ``flops_per_s``: the
    attention kernel's achieved rate on this rank, ``link``: the cp group's link."""
    if cp <= 1:
        return RingTime(0.0, 0.0, 0.0)
    nbytes = kv_bytes(model, micro_batch, tp, cp, element_bytes)
    transfer = comm.p2p(nbytes, link)  # send to the next rank and receive from the previous
    block = ring_step_flops(model, micro_batch, tp, cp) / flops_per_s
    steps = cp - 1
    back = comm.p2p(2 * nbytes, link)  # K, V and dK, dV
    return RingTime(
        fwd_transfer_s=steps * transfer,
        fwd_exposed_s=steps * max(transfer - block, 0.0),
        bwd_exposed_s=steps * max(back - 2 * block, 0.0),
    )
