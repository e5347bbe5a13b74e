"""Refuse, before any process starts, a job whose steps this machine's memory cannot hold.

Each data-parallel rank builds its share of a step's batch at once (run/data.py): the token ids
of ``global_batch / dp`` sequences of ``seq_len + 1`` int64 values, about three copies of them
while a text file's windows are gathered. Each micro-batch then keeps its activations for
backward (the layers' fused counts, in fp32 where the plan computes in fp32). That lower bound,
times the ranks this machine runs, must fit the machine's physical memory; otherwise the ranks
fail in their allocator after launch, or swap for minutes before the first step.
"""

from __future__ import annotations

import os

from meshmorph.spec.model import ModelSpec, Recompute
from meshmorph.spec.plan import Plan

TOKEN_ID_COPIES = 3
"""int64 copies of a rank's step of token ids alive at once while a text file's windows are
gathered (the window offsets, the gathered bytes widened to int64, the batch)."""


def host_memory_bytes() -> float:
    """This machine's physical memory."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def rank_step_bytes(model: ModelSpec, plan: Plan) -> tuple[float, float]:
    """(token ids of a step's batch, activations of one micro-batch) one rank holds at least."""
    sequences = plan.global_batch // plan.dp
    ids = TOKEN_ID_COPIES * sequences * (plan.seq_len + 1) * 8.0
    scale = 2.0 if plan.dtype == "fp32" else 1.0  # the spec counts 16-bit activations
    kept = sum(layer.activation[Recompute.NONE].per_rank(plan.tp, plan.sequence_parallel)
               for layer in model.layers) * scale
    activations = kept * plan.micro_batch * plan.seq_len / plan.pp
    return ids, activations


def check_host_memory(model: ModelSpec, plan: Plan, nproc: int,
                      memory_bytes: float | None = None) -> None:
    """A ValueError naming the batch and the machine when ``nproc`` ranks of ``plan`` cannot
    hold their steps in this machine's memory (the module docstring's lower bound)."""
    memory = memory_bytes or host_memory_bytes()
    ids, activations = rank_step_bytes(model, plan)
    need = (ids + activations) * nproc
    if need > memory:
        gib = 2.0**30
        raise ValueError(
            f"[train] global_batch {plan.global_batch} x seq_len {plan.seq_len}: each of the "
            f"{nproc} ranks holds at least {ids / gib:,.1f} GiB of token ids for its step and "
            f"{activations / gib:,.1f} GiB of activations per micro-batch, "
            f"{need / gib:,.1f} GiB in all, more than this machine's {memory / gib:,.1f} GiB; "
            f"lower [train] global_batch or micro_batch (or seq_len)")
